"""The Events a kubelet writes (about a pod: Started, Killing, BackOff, Unhealthy, ...; about a node:
NodeShutdown), as bodies for `POST .../events`. Pure: the node agent sends them in the background."""

from __future__ import annotations

from typing import Any

from .podhost import Pod, now_rfc3339


def build_pod_event(pod: Pod, reason: str, message: str, warning: bool = False,
                    container: str | None = None) -> dict[str, Any]:
    meta = pod["metadata"]
    node = (pod.get("spec") or {}).get("nodeName", "")
    now = now_rfc3339()
    involved = {"kind": "Pod", "apiVersion": "v1", "namespace": meta["namespace"], "name": meta["name"],
                "uid": meta["uid"]}
    if container:
        kind = "initContainers" if any(c["name"] == container for c in pod["spec"].get("initContainers") or []) \
            else "containers"
        involved["fieldPath"] = f"spec.{kind}{{{container}}}"
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": involved, "reason": reason, "message": message,
        "type": "Warning" if warning else "Normal", "source": {"component": "kubelet", "host": node},
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        "reportingComponent": "kubelet", "reportingInstance": node,
    }


def build_node_event(node: str, reason: str, message: str) -> dict[str, Any]:
    now = now_rfc3339()
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{node}.", "namespace": "default"},
        "involvedObject": {"kind": "Node", "apiVersion": "v1", "name": node, "uid": node},
        "reason": reason, "message": message, "type": "Normal",
        "source": {"component": "kubelet", "host": node}, "firstTimestamp": now, "lastTimestamp": now,
        "count": 1, "reportingComponent": "kubelet", "reportingInstance": node,
    }
