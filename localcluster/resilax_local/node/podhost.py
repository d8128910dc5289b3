"""What a pod worker (pods.py) needs from its node agent (agent.py), and the node's states as the
worker sees them."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any, Protocol

from ..kubeapi import KubeClient
from . import images

Pod = dict[str, Any]


class NodeState:
    READY = "Ready"
    KILLED = "Killed"
    PARTITIONED = "Partitioned"
    SHUTTING_DOWN = "ShuttingDown"
    """Graceful node shutdown in progress: the kubelet still runs, renews the Lease and writes the API."""


class PodHost(Protocol):
    """What a pod worker needs from the node agent."""

    client: KubeClient
    run_dir: Path
    apiserver_port: int

    def node_state(self, node: str) -> str: ...

    def node_ip(self, node: str) -> str: ...

    def node_env(self, node: str) -> dict[str, str]: ...

    def host_path(self, node: str, path: str) -> Path: ...

    def allocate_pod_ip(self) -> str: ...

    def forget(self, uid: str) -> None: ...

    def publish_hosts(self, uid: str, ip: str, names: list[str]) -> None: ...

    def emit_event(self, pod: Pod, reason: str, message: str, warning: bool = False,
                   container: str | None = None) -> None: ...

    def image_entry(self, ref: images.ImageRef) -> images.ImageEntry: ...

    @property
    def hosts_file(self) -> Path: ...


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
