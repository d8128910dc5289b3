"""The kubelet's node loop for every node of the agent: registration (the Node, its status, its Lease
in `kube-node-lease`), Lease renewals (spread over the interval for no-process nodes), and healing a
node the lifecycle controller marked Unknown while the agent was up. `build_node_status` is the status
it posts (pure): Ready, or NotReady during a graceful shutdown."""

from __future__ import annotations

import datetime as dt
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..binaries import KUBERNETES_VERSION
from ..errors import KubeAPIError
from ..kubeapi import KubeClient
from .podhost import NodeState, now_rfc3339

if TYPE_CHECKING:
    from .agent import AgentNode
    from .kubeletapi import KubeletAPI

log = logging.getLogger(__name__)

LEASE_NAMESPACE = "kube-node-lease"
REMOVED = "Removed"
REGISTERING = "Registering"
#: No-process nodes registered at once (each: create the Node, post its status, create its Lease).
REGISTER_WORKERS = 8
#: No-process Lease renewals in flight at once.
LEASE_WORKERS = 8
#: No-process pods reported at once (in a fleet each kubelet reports its own pods, so a thousand pods
#: created together were reported one after another behind the API's answers: 1,600 took ~80 s; on 8
#: lanes the last started 23 s after the last was bound). Each pod keeps to one lane, so its own events
#: stay in order.
FAKE_POD_LANES = 32


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def build_node_status(name: str, ip: str, capacity: dict[str, Any], ready_since: str, shutting_down: bool,
                      kubelet_port: int) -> dict[str, Any]:
    now = now_rfc3339()
    since = ready_since or now

    def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
        return {"type": kind, "status": status, "reason": reason, "message": message,
                "lastHeartbeatTime": now, "lastTransitionTime": since}

    return {
        "capacity": capacity, "allocatable": capacity,
        "conditions": [
            condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            condition("Ready", "False", "KubeletNotReady", "node is shutting down")
            if shutting_down else
            condition("Ready", "True", "KubeletReady", "resilax local node agent is posting ready status"),
        ],
        "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": kubelet_port}},
        "nodeInfo": {
            "machineID": name, "systemUUID": name, "bootID": ready_since,
            "kernelVersion": os.uname().release, "osImage": "resilax local node",
            "containerRuntimeVersion": "resilax-local://0.1", "kubeletVersion": KUBERNETES_VERSION,
            "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
        },
    }


class NodeHeartbeat:
    """The node agent's part that registers its nodes, posts their status and renews their Leases
    (NodeAgent runs these loops on its threads)."""

    client: KubeClient
    lock: threading.RLock
    stopping: threading.Event
    registered: threading.Event
    nodes: dict[str, AgentNode]
    kubelet_api: KubeletAPI
    registrations: ThreadPoolExecutor
    lease_pool: ThreadPoolExecutor
    lease_renew_seconds: float
    no_process_lease_seconds: float
    lease_duration_seconds: int

    def node_state(self, node: str) -> str:
        raise NotImplementedError

    def register(self, node: AgentNode) -> None:
        if node.spec.run_pods and node.ip != "127.0.0.1":
            try:
                self.kubelet_api.serve(node.ip)
            except OSError as e:
                log.warning("kubelet API for %s on %s: %s (kubectl logs will not reach it)", node.name, node.ip, e)
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": node.name, "labels": node.spec.labels},
                "spec": {"taints": list(node.spec.taints)}}
        try:
            created = self.client.create("/api/v1/nodes", body)
        except KubeAPIError as e:
            if e.status != 409:
                raise
            created = self.client.patch(f"/api/v1/nodes/{node.name}", {"metadata": {"labels": node.spec.labels}})
        node.uid = created["metadata"]["uid"]
        node.ready_since = now_rfc3339()
        self.post_node_status(node)
        self.renew_lease(node, create_first=True)

    def post_node_status(self, node: AgentNode) -> None:
        """The node's status; Ready, or NotReady with the kubelet's message during a graceful shutdown."""
        status = build_node_status(node.name, node.ip, node.spec.capacity, node.ready_since,
                                   node.state == NodeState.SHUTTING_DOWN, self.kubelet_api.port)
        self.client.patch(f"/api/v1/nodes/{node.name}/status", {"status": status})

    def renew_lease(self, node: AgentNode, create_first: bool = False) -> None:
        """Renew the node's Lease, creating it when missing; `create_first` (registration: it is usually
        missing) tries the create before the renewal, one request instead of two."""
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{node.name}"
        spec = {"holderIdentity": node.name, "leaseDurationSeconds": self.lease_duration_seconds,
                "renewTime": _micro_now()}

        def create() -> bool:
            owner = {"uid": node.uid} if node.uid else self.client.get(f"/api/v1/nodes/{node.name}")["metadata"]
            try:
                self.client.create(f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases", {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": node.name, "namespace": LEASE_NAMESPACE, "ownerReferences": [
                        {"apiVersion": "v1", "kind": "Node", "name": node.name, "uid": owner["uid"]}]},
                    "spec": spec})
            except KubeAPIError as e:
                if e.status != 409:
                    raise
                return False
            return True

        if create_first and create():
            return
        try:
            self.client.patch(path, {"spec": spec})
        except KubeAPIError as e:
            if e.status != 404:
                raise
            create()

    def _ready_nodes(self, run_pods: bool) -> list[AgentNode]:
        with self.lock:
            return [n for n in self.nodes.values() if n.state in (NodeState.READY, NodeState.SHUTTING_DOWN)
                    and n.spec.run_pods == run_pods]

    def _lease_loop(self) -> None:
        """Renew the Leases of the Ready nodes that run pods, every `lease_renew_seconds`."""
        interval = self.lease_renew_seconds
        due = time.monotonic() + interval
        while not self.stopping.wait(max(0.0, due - time.monotonic())):
            due = max(due + interval, time.monotonic())  # every `interval` from the start of each round
            for node in self._ready_nodes(run_pods=True):
                self._renew_if_ready(node)

    def _no_process_lease_loop(self) -> None:
        """Renew the no-process nodes' Leases (scale tests: thousands), each every
        `no_process_lease_seconds`, spread evenly over that interval: a steady trickle the API server
        serves beside everything else, not a burst of thousands that queues behind itself (a round of
        1,617 at once outlasted a 90 s grace on a loaded machine). At most `LEASE_WORKERS` in flight;
        when the API server cannot keep up, the round stretches and the next starts at once."""
        interval = self.no_process_lease_seconds
        slots = threading.Semaphore(LEASE_WORKERS)
        start = time.monotonic() + interval
        while not self.stopping.wait(max(0.0, start - time.monotonic())):
            ready = self._ready_nodes(run_pods=False)
            for i, node in enumerate(ready):
                at = start + i * interval / len(ready)
                if self.stopping.wait(max(0.0, at - time.monotonic())):
                    return
                slots.acquire()
                self.lease_pool.submit(self._renew_if_ready, node).add_done_callback(lambda _: slots.release())
            took = time.monotonic() - start
            if ready and took > interval * 1.25:
                log.warning("renewing %d no-process Leases took %.1f s (every %.0f s)", len(ready), took, interval)
            start = max(start + interval, time.monotonic())

    def _renew_if_ready(self, node: AgentNode) -> None:
        if self.stopping.is_set():
            return
        try:
            if self.node_state(node.name) in (NodeState.READY, NodeState.SHUTTING_DOWN):
                self.renew_lease(node)
        except Exception as e:
            log.warning("lease of %s: %s", node.name, e)

    def _node_watch_loop(self) -> None:
        """Heal like a kubelet: a node we consider Ready whose Ready condition is not True (the lifecycle
        controller set Unknown after a slow spell) gets its Ready status posted again."""
        while not self.stopping.is_set():
            try:
                listing = self.client.get("/api/v1/nodes")
                version = listing["metadata"]["resourceVersion"]
                for node in listing.get("items", []):
                    self._heal(node)
                while not self.stopping.is_set():
                    for event in self.client.watch("/api/v1/nodes", version, timeout_seconds=30):
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            raise KubeAPIError(int(obj.get("code", 500)), obj.get("message", "watch error"))
                        version = obj["metadata"]["resourceVersion"]
                        if event["type"] in ("ADDED", "MODIFIED"):
                            self._heal(obj)
            except Exception as e:
                if self.stopping.is_set():
                    return
                if not (isinstance(e, KubeAPIError) and e.status == 410):
                    log.warning("node watch: %s; listing again", e)
                    time.sleep(1.0)

    def _heal(self, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        with self.lock:
            node = self.nodes.get(name)
            if node is None or node.state != NodeState.READY:
                return
        ready = [c for c in obj.get("status", {}).get("conditions") or [] if c["type"] == "Ready"]
        if ready and ready[0]["status"] != "True":
            log.warning("node %s is %s in the API though its agent is up: posting Ready again", name,
                        ready[0]["status"])
            node.ready_since = now_rfc3339()
            self.registrations.submit(self._post_status_quietly, node)

    def _post_status_quietly(self, node: AgentNode) -> None:
        try:
            self.renew_lease(node)
            self.post_node_status(node)
        except Exception as e:
            log.warning("status of %s: %s", node.name, e)

    def _register_in_background(self, node: AgentNode) -> None:
        for attempt in range(20):
            try:
                self.register(node)
                with self.lock:
                    if node.state == REGISTERING:
                        node.state = NodeState.READY
                return
            except Exception as e:
                log.warning("registering %s (attempt %d): %s", node.name, attempt + 1, e)
                time.sleep(1.0)

    def _register_all(self) -> None:
        """Register the configured nodes; no-process ones `REGISTER_WORKERS` at a time (thousands take
        minutes one by one)."""
        with self.lock:
            nodes = list(self.nodes.values())

        def register(node: AgentNode) -> None:
            while not self.stopping.is_set():
                try:
                    self.register(node)
                    with self.lock:
                        if node.state == REGISTERING:
                            node.state = NodeState.READY
                    return
                except Exception as e:
                    log.warning("registering %s: %s", node.name, e)
                    time.sleep(1.0)

        for node in nodes:  # one at a time: the first picks the kubelet API's port for all
            if node.spec.run_pods:
                register(node)
        list(self.registrations.map(register, [n for n in nodes if not n.spec.run_pods]))
        self.registered.set()
        log.info("registered %d nodes", len(nodes))
