"""Helpers for tests against a local cluster: bounded waits on conditions, pods and nodes.

Waiting is always for a condition with a generous bound, never a sleep and an assert on time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import KubeAPIError
from .kubeapi import KubeClient

T = TypeVar("T")


def wait_for(predicate: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.25, message: str = "") -> T:
    """Call `predicate` until it returns something truthy (returned) or `timeout` passes (TimeoutError).

    KubeAPIError and FileNotFoundError (a log not written yet) from the predicate count as "not yet";
    the last one is reported.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except (KubeAPIError, FileNotFoundError) as e:
            last = e
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{message or 'condition'} not met within {timeout:.0f} s (last: {last!r})")
        time.sleep(interval)


def get_pod(client: KubeClient, namespace: str, name: str) -> dict[str, Any] | None:
    """The pod, or None when it does not exist."""
    try:
        return client.get(f"/api/v1/namespaces/{namespace}/pods/{name}")
    except KubeAPIError as e:
        if e.status == 404:
            return None
        raise


def create_pod(client: KubeClient, namespace: str, manifest: dict[str, Any]) -> dict[str, Any]:
    body = {"apiVersion": "v1", "kind": "Pod", **manifest}
    return client.create(f"/api/v1/namespaces/{namespace}/pods", body)


def wait_for_pod_phase(client: KubeClient, namespace: str, name: str, phases: str | tuple[str, ...],
                       timeout: float = 60.0) -> dict[str, Any]:
    """Wait until the pod's phase is one of `phases`; returns the pod."""
    wanted = (phases,) if isinstance(phases, str) else phases

    def check() -> dict[str, Any] | None:
        pod = get_pod(client, namespace, name)
        return pod if pod and pod.get("status", {}).get("phase") in wanted else None

    return wait_for(check, timeout, message=f"pod {namespace}/{name} in phase {'/'.join(wanted)}")


def wait_for_pod_gone(client: KubeClient, namespace: str, name: str, timeout: float = 60.0) -> None:
    wait_for(lambda: get_pod(client, namespace, name) is None, timeout, message=f"pod {namespace}/{name} gone")


def container_status(pod: dict[str, Any], container: str) -> dict[str, Any] | None:
    status = pod.get("status", {})
    for entry in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or []):
        if entry["name"] == container:
            return dict(entry)
    return None


def force_delete_pod(client: KubeClient, namespace: str, name: str) -> None:
    """`kubectl delete --force --grace-period=0`: remove the object without waiting for a kubelet."""
    try:
        client.delete(f"/api/v1/namespaces/{namespace}/pods/{name}", {"gracePeriodSeconds": 0})
    except KubeAPIError as e:
        if e.status != 404:
            raise


def node_condition(node: dict[str, Any], kind: str = "Ready") -> str | None:
    """The status ('True', 'False', 'Unknown') of a node condition."""
    for condition in node.get("status", {}).get("conditions") or []:
        if condition["type"] == kind:
            return str(condition["status"])
    return None


def node_taints(node: dict[str, Any]) -> list[dict[str, Any]]:
    return list(node.get("spec", {}).get("taints") or [])


def wait_for_node(client: KubeClient, name: str, predicate: Callable[[dict[str, Any]], bool],
                  timeout: float = 60.0, message: str = "") -> dict[str, Any]:
    """Wait until `predicate(node)` holds; returns the node."""
    def check() -> dict[str, Any] | None:
        node = client.get(f"/api/v1/nodes/{name}")
        return node if predicate(node) else None

    return wait_for(check, timeout, message=message or f"node {name}")
