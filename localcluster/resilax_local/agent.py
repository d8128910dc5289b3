"""The node agent: one process that plays the kubelet for every fake node of a local cluster.

It registers the nodes, renews their Leases in `kube-node-lease`, watches the pods bound to them and
runs each one as local processes (`pods.PodWorker`), or, on nodes in no-process mode, only pretends to
(status Running, deletion confirmed at once: enough for scale tests of hundreds of nodes).

Faults are taken at run time through a small HTTP API on 127.0.0.1 (its port is in `<run_dir>/agent.json`):
- `POST /nodes/<name>/kill`: stop the Lease and SIGKILL the node's pods' processes;
- `POST /nodes/<name>/partition`: stop the Lease and all API traffic for the node; processes keep running;
- `POST /nodes/<name>/preempt` `{"delay_seconds": 30, "sigterm": false}`: the GKE preemption notice
  (taint `cloud.google.com/impending-node-termination`, label `cloud.google.com/scheduled-maintenance-time`),
  then a kill after the delay;
- `POST /nodes/<name>/shutdown` `{"grace_seconds": 30, "critical_grace_seconds": 15}`: graceful node shutdown
  as the kubelet's shutdown manager does it (a spot VM's preemption, with GKE's 30/15 s): the node turns
  NotReady ("node is shutting down") with a `NodeShutdown` event; its pods are terminated within
  `grace - critical` (system-critical pods within `critical`), end Failed with reason `Terminated` and a
  `DisruptionTarget` condition, and are not deleted; then the node powers off (as `kill`);
- `POST /nodes/<name>/restore`: the node is back (Lease, Ready status, notice removed, pods resynced);
- `POST /nodes` `{"nodes": [NodeSpec JSON, ...]}`: register more nodes; `POST /nodes/<name>/remove`: delete one.
- `POST /images` `{"images": [{"image": "repo[:tag]", "pullable": false, "error": "...", "user": "0"}, ...]}`:
  add or replace rows of the image registry table (images.py: what a pull gets, which user an image runs as).
- `GET /nodes`, `GET /pods`, `GET /images`, `GET /healthz`.

Run as `python -m resilax_local.agent <run_dir>` (reads `<run_dir>/agent-config.json`).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import random
import shutil
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from . import images
from .binaries import KUBERNETES_VERSION
from .errors import KubeAPIError
from .kubeapi import KubeClient
from .kubeletapi import KubeletAPI
from .pki import CertificateAuthority
from .pods import (
    NODE_SHUTDOWN_REJECTED_MESSAGE,
    NODE_SHUTDOWN_REJECTED_REASON,
    NodeState,
    PodWorker,
    map_host_path,
    memory_root,
    node_roots,
    now_rfc3339,
)
from .profiles import NodeSpec

log = logging.getLogger(__name__)

IMPENDING_TERMINATION_TAINT = "cloud.google.com/impending-node-termination"
MAINTENANCE_TIME_LABEL = "cloud.google.com/scheduled-maintenance-time"
LEASE_NAMESPACE = "kube-node-lease"
#: Pods at or above this priority are system-critical for graceful node shutdown (system-node-critical
#: and system-cluster-critical; the kubelet's `shutdownGracePeriodCriticalPods` applies to them).
CRITICAL_PRIORITY = 2_000_000_000
REMOVED = "Removed"
REGISTERING = "Registering"
#: No-process nodes registered at once (each: create the Node, post its status, create its Lease).
REGISTER_WORKERS = 8
#: No-process Lease renewals in flight at once.
LEASE_WORKERS = 8


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class AgentNode:
    spec: NodeSpec
    ip: str
    state: str = NodeState.READY
    ready_since: str = ""
    kill_timer: threading.Timer | None = None
    uid: str = ""
    shutdown_token: int = 0
    """Bumped by each shutdown and restore: a shutdown thread whose token is stale stops."""

    @property
    def name(self) -> str:
        return self.spec.name


class NodeAgent:
    """Registers and heartbeats the nodes, runs their pods, takes fault commands."""

    def __init__(self, run_dir: Path, kubeconfig: Path, nodes: list[NodeSpec], lease_renew_seconds: float = 3.0,
                 lease_duration_seconds: int = 40, no_process_lease_seconds: float | None = None) -> None:
        self.run_dir = run_dir
        self.client = KubeClient.from_kubeconfig(kubeconfig)
        self.apiserver_port = urlparse(self.client.creds.server).port or 443
        self.lease_renew_seconds = lease_renew_seconds
        self.no_process_lease_seconds = no_process_lease_seconds or max(lease_renew_seconds, 5.0)
        self.lease_duration_seconds = lease_duration_seconds
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.registered = threading.Event()
        self.workers: dict[str, PodWorker] = {}
        self.fake_running: set[str] = set()
        self.finished_uids: set[str] = set()
        # Each cluster takes one 127.<octet>.0.0/16 for its nodes (127.o.0.n) and pods (127.o.1.0 up).
        self.octet = random.Random(os.getpid() ^ int(time.time())).randrange(32, 250)
        self.next_pod_index = 256
        self.next_node_index = 0
        self.host_entries: dict[str, tuple[str, list[str]]] = {}
        self.events = ThreadPoolExecutor(max_workers=1, thread_name_prefix="events")
        self.registrations = ThreadPoolExecutor(max_workers=REGISTER_WORKERS, thread_name_prefix="register")
        self.lease_pool = ThreadPoolExecutor(max_workers=LEASE_WORKERS, thread_name_prefix="lease")
        serving = CertificateAuthority(run_dir / "pki").issue("kubelet", "resilax-local-kubelet", server=True,
                                                             hosts=("127.0.0.1",))
        self.kubelet_api = KubeletAPI(run_dir, serving.cert, serving.key, self._container_running)
        self.registry = images.Registry()
        self.nodes: dict[str, AgentNode] = {}
        for spec in nodes:
            self._add_node_record(spec).state = REGISTERING  # Ready (Lease renewed) once registered
        self.publish_hosts("", "", [])

    # ---- PodHost -----------------------------------------------------------------------------
    def node_state(self, node: str) -> str:
        with self.lock:
            n = self.nodes.get(node)
            return n.state if n else REMOVED

    def node_ip(self, node: str) -> str:
        with self.lock:
            n = self.nodes.get(node)
            return n.ip if n else "127.0.0.1"

    def host_path(self, node: str, path: str) -> Path:
        return map_host_path(self.run_dir, node, path)

    def allocate_pod_ip(self) -> str:
        with self.lock:
            while self.next_pod_index % 256 in (0, 255):  # skip .0 and .255
                self.next_pod_index += 1
            i = self.next_pod_index
            self.next_pod_index += 1
        if i >= 65535:
            raise RuntimeError("out of pod IPs in this cluster's 127.x.0.0/16")
        return f"127.{self.octet}.{i // 256}.{i % 256}"

    @property
    def hosts_file(self) -> Path:
        return self.run_dir / "hosts"

    def publish_hosts(self, uid: str, ip: str, names: list[str]) -> None:
        """Add (or with no `ip`, remove) a pod's names in the cluster-wide hosts file that every pod sees
        as /etc/hosts: the local stand-in for cluster DNS of pods behind headless Services."""
        with self.lock:
            if ip:
                self.host_entries[uid] = (ip, names)
            else:
                self.host_entries.pop(uid, None)
            lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
            lines += [f"{ip}\t{' '.join(names)}" for ip, names in self.host_entries.values()]
            text = "\n".join(lines) + "\n"
            # rewritten in place: pods bind-mount this very inode
            with self.hosts_file.open("r+" if self.hosts_file.exists() else "w") as f:
                f.write(text)
                f.truncate()

    def emit_event(self, pod: dict[str, Any], reason: str, message: str, warning: bool = False,
                   container: str | None = None) -> None:
        """A kubelet-style Event about the pod (Started, Killing, BackOff, Unhealthy, ...), sent in the background."""
        meta = pod["metadata"]
        node = (pod.get("spec") or {}).get("nodeName", "")
        now = now_rfc3339()
        involved = {"kind": "Pod", "apiVersion": "v1", "namespace": meta["namespace"], "name": meta["name"],
                    "uid": meta["uid"]}
        if container:
            kind = "initContainers" if any(c["name"] == container for c in pod["spec"].get("initContainers") or []) \
                else "containers"
            involved["fieldPath"] = f"spec.{kind}{{{container}}}"
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": involved, "reason": reason, "message": message,
            "type": "Warning" if warning else "Normal", "source": {"component": "kubelet", "host": node},
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
            "reportingComponent": "kubelet", "reportingInstance": node,
        }

        def send() -> None:
            try:
                self.client.create(f"/api/v1/namespaces/{meta['namespace']}/events", body)
            except Exception as e:
                log.debug("event %s for %s/%s: %s", reason, meta["namespace"], meta["name"], e)

        self.events.submit(send)

    def image_entry(self, ref: images.ImageRef) -> images.ImageEntry:
        with self.lock:
            return self.registry.lookup(ref)

    def set_images(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """Add or replace rows of the image registry table (raises ValueError naming a bad field)."""
        parsed = [images.ImageEntry.from_json(e) if isinstance(e, dict) else images.ImageEntry.from_json({"image": e})
                  for e in entries]
        with self.lock:
            self.registry.set(parsed)
            return {"images": [e.to_json() for e in self.registry.entries()]}

    def describe_images(self) -> dict[str, Any]:
        with self.lock:
            return {"images": [e.to_json() for e in self.registry.entries()]}

    def forget(self, uid: str) -> None:
        with self.lock:
            self.workers.pop(uid, None)
            self.finished_uids.add(uid)

    # ---- nodes --------------------------------------------------------------------------------
    def _add_node_record(self, spec: NodeSpec) -> AgentNode:
        with self.lock:
            self.next_node_index += 1
            index = self.next_node_index
            node = AgentNode(spec, f"127.{self.octet}.0.{index}" if index < 255 else "127.0.0.1")
            self.nodes[spec.name] = node
            return node

    def _container_running(self, namespace: str, pod: str, container: str) -> bool:
        with self.lock:
            workers = [w for w in self.workers.values() if w.namespace == namespace and w.name == pod]
        return any(container in w.processes() for w in workers)

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
        now = now_rfc3339()
        since = node.ready_since or now

        def condition(kind: str, status: str, reason: str, message: str) -> dict[str, str]:
            return {"type": kind, "status": status, "reason": reason, "message": message,
                    "lastHeartbeatTime": now, "lastTransitionTime": since}

        status = {
            "capacity": node.spec.capacity, "allocatable": node.spec.capacity,
            "conditions": [
                condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
                condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                condition("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                condition("Ready", "False", "KubeletNotReady", "node is shutting down")
                if node.state == NodeState.SHUTTING_DOWN else
                condition("Ready", "True", "KubeletReady", "resilax local node agent is posting ready status"),
            ],
            "addresses": [{"type": "InternalIP", "address": node.ip}, {"type": "Hostname", "address": node.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_api.port}},
            "nodeInfo": {
                "machineID": node.name, "systemUUID": node.name, "bootID": node.ready_since,
                "kernelVersion": os.uname().release, "osImage": "resilax local node",
                "containerRuntimeVersion": "resilax-local://0.1", "kubeletVersion": KUBERNETES_VERSION,
                "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64",
            },
        }
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

    def _update_node(self, name: str, change: Any) -> None:
        """Read-modify-write a Node (labels, taints) with optimistic concurrency."""
        for _ in range(10):
            node = self.client.get(f"/api/v1/nodes/{name}")
            patch = change(node)
            if patch is None:
                return
            patch.setdefault("metadata", {})["resourceVersion"] = node["metadata"]["resourceVersion"]
            try:
                self.client.patch(f"/api/v1/nodes/{name}", patch)
                return
            except KubeAPIError as e:
                if e.status != 409:
                    raise
        raise RuntimeError(f"node {name}: too many conflicting updates")

    # ---- faults ---------------------------------------------------------------------------------
    def _node(self, name: str) -> AgentNode:
        with self.lock:
            if name not in self.nodes:
                raise KeyError(f"node {name!r} is not one of this agent's nodes: {', '.join(self.nodes)}")
            return self.nodes[name]

    def _workers_on(self, name: str) -> list[PodWorker]:
        with self.lock:
            return [w for w in self.workers.values() if w.node == name]

    def kill_node(self, name: str) -> dict[str, Any]:
        node = self._node(name)
        with self.lock:
            node.state = NodeState.KILLED
            if node.kill_timer:
                node.kill_timer.cancel()
                node.kill_timer = None
        killed = 0
        for worker in self._workers_on(name):
            killed += len(worker.processes())
            worker.kill_now()
        log.warning("node %s killed (%d processes)", name, killed)
        return {"node": name, "state": node.state, "killed_processes": killed}

    def partition_node(self, name: str) -> dict[str, Any]:
        node = self._node(name)
        with self.lock:
            node.state = NodeState.PARTITIONED
        log.warning("node %s partitioned", name)
        return {"node": name, "state": node.state}

    def preempt_node(self, name: str, delay_seconds: float = 30.0, sigterm: bool = False) -> dict[str, Any]:
        node = self._node(name)
        when = int(time.time() + delay_seconds)

        def add_notice(obj: dict[str, Any]) -> dict[str, Any]:
            taints = [t for t in obj["spec"].get("taints") or [] if t["key"] != IMPENDING_TERMINATION_TAINT]
            taints.append({"key": IMPENDING_TERMINATION_TAINT, "value": "true", "effect": "NoSchedule"})
            return {"metadata": {"labels": {MAINTENANCE_TIME_LABEL: str(when)}}, "spec": {"taints": taints}}

        self._update_node(name, add_notice)
        if sigterm:
            for worker in self._workers_on(name):
                for c in worker.containers:
                    if c.kind == "main":
                        c.signal(signal.SIGTERM)
        with self.lock:
            if node.kill_timer:
                node.kill_timer.cancel()
            node.kill_timer = threading.Timer(delay_seconds, self.kill_node, args=(name,))
            node.kill_timer.daemon = True
            node.kill_timer.start()
        log.warning("node %s: preemption notice, killed in %.0f s", name, delay_seconds)
        return {"node": name, "state": node.state, "scheduled_maintenance_time": when}

    def shutdown_node(self, name: str, grace_seconds: float = 30.0, critical_grace_seconds: float = 15.0
                      ) -> dict[str, Any]:
        """Graceful node shutdown, as the kubelet's shutdown manager (GracefulNodeShutdown) runs it
        when the machine is told to power off (a spot VM's preemption: GKE gives 30 s, 15 of them to
        system-critical pods): no taint or label warns anyone first. The node turns NotReady at once
        and gets a `NodeShutdown` event; the pods that are still running are terminated (SIGTERM, then
        SIGKILL after min(their own grace, `grace - critical`); system-critical pods after the others,
        within `critical`), end Failed with reason `Terminated` and a `DisruptionTarget` condition and
        stay; then the node powers off (`kill_node`). Returns at once; the shutdown runs behind."""
        node = self._node(name)
        if not 0 <= critical_grace_seconds <= grace_seconds:
            raise ValueError(f"critical_grace_seconds {critical_grace_seconds} must be between 0 and "
                             f"grace_seconds {grace_seconds}")
        with self.lock:
            if node.state != NodeState.READY:
                raise ValueError(f"node {name} is {node.state}: only a Ready node can shut down")
            node.state = NodeState.SHUTTING_DOWN
            node.ready_since = now_rfc3339()
            node.shutdown_token += 1
            token = node.shutdown_token
        self._emit_node_event(node, "NodeShutdown", "Shutdown manager detected shutdown event")
        self.post_node_status(node)
        active = [w for w in self._workers_on(name) if w.terminal is None and not w.finished]
        critical = [w for w in active if int(w.pod["spec"].get("priority") or 0) >= CRITICAL_PRIORITY]
        regular = [w for w in active if w not in critical]
        groups = [(regular, grace_seconds - critical_grace_seconds), (critical, critical_grace_seconds)]
        threading.Thread(target=self._run_shutdown, args=(node, token, groups), name=f"shutdown-{name}",
                         daemon=True).start()
        log.warning("node %s: graceful shutdown (%d pods, grace %.0f s, critical %.0f s)", name, len(active),
                    grace_seconds, critical_grace_seconds)
        return {"node": name, "state": node.state, "pods": len(active)}

    def _run_shutdown(self, node: AgentNode, token: int, groups: list[tuple[list[PodWorker], float]]) -> None:
        def current() -> bool:
            with self.lock:
                return node.shutdown_token == token and node.state == NodeState.SHUTTING_DOWN

        for workers, seconds in groups:
            if not workers or not current():
                continue
            for worker in workers:
                worker.notify("shutdown", int(seconds))
            deadline = time.monotonic() + seconds + 2.0  # the workers' own SIGKILL comes at `seconds`
            while time.monotonic() < deadline and current() and not all(w.finished for w in workers):
                time.sleep(0.1)
        if current():
            log.warning("node %s: shutdown done, powering off", node.name)
            self.kill_node(node.name)

    def _emit_node_event(self, node: AgentNode, reason: str, message: str) -> None:
        now = now_rfc3339()
        body = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{node.name}.", "namespace": "default"},
            "involvedObject": {"kind": "Node", "apiVersion": "v1", "name": node.name, "uid": node.name},
            "reason": reason, "message": message, "type": "Normal",
            "source": {"component": "kubelet", "host": node.name}, "firstTimestamp": now, "lastTimestamp": now,
            "count": 1, "reportingComponent": "kubelet", "reportingInstance": node.name,
        }

        def send() -> None:
            try:
                self.client.create("/api/v1/namespaces/default/events", body)
            except Exception as e:
                log.debug("event %s for node %s: %s", reason, node.name, e)

        self.events.submit(send)

    def restore_node(self, name: str) -> dict[str, Any]:
        node = self._node(name)
        with self.lock:
            if node.kill_timer:
                node.kill_timer.cancel()
                node.kill_timer = None
            node.shutdown_token += 1
            if node.state == NodeState.SHUTTING_DOWN:
                node.state = NodeState.KILLED  # powered off before it comes back

        def remove_notice(obj: dict[str, Any]) -> dict[str, Any] | None:
            taints = obj["spec"].get("taints") or []
            kept = [t for t in taints if t["key"] != IMPENDING_TERMINATION_TAINT]
            labels = obj["metadata"].get("labels") or {}
            if len(kept) == len(taints) and MAINTENANCE_TIME_LABEL not in labels:
                return None
            return {"metadata": {"labels": {MAINTENANCE_TIME_LABEL: None}}, "spec": {"taints": kept}}

        self.register(node)
        self._update_node(name, remove_notice)
        with self.lock:
            node.state = NodeState.READY
        for worker in self._workers_on(name):
            worker.notify("resync")
        for pod in self.client.get("/api/v1/pods", fieldSelector=f"spec.nodeName={name}").get("items", []):
            self.dispatch("ADDED", pod)
        log.warning("node %s restored", name)
        return {"node": name, "state": node.state}

    def add_nodes(self, specs: list[NodeSpec]) -> dict[str, Any]:
        """Register more nodes, in the background (`REGISTER_WORKERS` at a time)."""
        added = []
        for spec in specs:
            with self.lock:
                existing = self.nodes.get(spec.name)
                node = existing if existing and existing.state != REMOVED else self._add_node_record(spec)
                node.spec = spec
                node.state = REGISTERING
            self.registrations.submit(self._register_in_background, node)
            added.append(spec.name)
        return {"added": added}

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

    def remove_node(self, name: str) -> dict[str, Any]:
        self.kill_node(name)
        with self.lock:
            node = self.nodes.pop(name)
            node.state = REMOVED
        for root in node_roots(self.run_dir, name):  # a lost node loses its disks (hostPath volumes)
            shutil.rmtree(root, ignore_errors=True)
        try:  # its Lease goes with it (owner reference, garbage collector)
            self.client.delete(f"/api/v1/nodes/{name}")
        except KubeAPIError as e:
            if e.status != 404:
                raise
        return {"removed": name}

    # ---- pods ---------------------------------------------------------------------------------
    def dispatch(self, kind: str, pod: dict[str, Any]) -> None:
        node_name = (pod.get("spec") or {}).get("nodeName")
        uid = pod["metadata"]["uid"]
        with self.lock:
            node = self.nodes.get(node_name or "")
            if node is None or node.state not in (NodeState.READY, NodeState.SHUTTING_DOWN):
                return
            shutting_down = node.state == NodeState.SHUTTING_DOWN
            fake = not node.spec.run_pods
        if fake:
            self._fake_pod(kind, pod, node)  # outside the lock: it talks to the API server
            return
        with self.lock:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker:
                    worker.notify("deleted")
                return
            if worker:
                worker.notify("pod", pod)
                return
            if uid in self.finished_uids:
                return
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp"):
                self.finished_uids.add(uid)
                return
            if shutting_down:  # the kubelet admits no pod while the node shuts down
                self.finished_uids.add(uid)
                worker = None
            else:
                worker = PodWorker(self, pod)
                self.workers[uid] = worker
        if worker is None:
            self._reject(pod)
            return
        worker.start()

    def _reject(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        try:
            self.client.patch(f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
                              {"metadata": {"uid": meta["uid"]}, "status": {
                                  "phase": "Failed", "reason": NODE_SHUTDOWN_REJECTED_REASON,
                                  "message": NODE_SHUTDOWN_REJECTED_MESSAGE}})
        except KubeAPIError as e:
            if e.status not in (404, 409):
                log.warning("rejecting pod %s/%s: %s", meta["namespace"], meta["name"], e)

    def _fake_pod(self, kind: str, pod: dict[str, Any], node: AgentNode) -> None:
        """No-process mode: report the pod Running at once; confirm its deletion at once."""
        meta = pod["metadata"]
        uid = meta["uid"]
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        if kind == "DELETED":
            self.fake_running.discard(uid)
            return
        try:
            if meta.get("deletionTimestamp"):
                self.client.delete(path, {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})
                return
            if uid in self.fake_running:
                return
            self.fake_running.add(uid)
            now = now_rfc3339()
            ip = self.allocate_pod_ip()
            containers = [{"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": True,
                           "restartCount": 0, "started": True, "state": {"running": {"startedAt": now}}}
                          for c in pod["spec"]["containers"]]
            conditions = [{"type": t, "status": "True", "lastTransitionTime": now}
                          for t in ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")]
            foreign = [c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"]
            self.client.patch(f"{path}/status", {"status": {
                "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": node.ip,
                "hostIPs": [{"ip": node.ip}], "startTime": now, "conditions": foreign + conditions,
                "containerStatuses": containers}})
        except KubeAPIError as e:
            if e.status not in (404, 409):
                log.warning("fake pod %s/%s: %s", meta["namespace"], meta["name"], e)

    def _watch_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                listing = self.client.get("/api/v1/pods", fieldSelector="spec.nodeName!=")
                version = listing["metadata"]["resourceVersion"]
                seen = set()
                for pod in listing.get("items", []):
                    seen.add(pod["metadata"]["uid"])
                    self.dispatch("ADDED", pod)
                with self.lock:
                    vanished = [w for uid, w in self.workers.items() if uid not in seen]
                for worker in vanished:
                    if self.node_state(worker.node) == NodeState.READY:
                        worker.notify("deleted")
                while not self.stopping.is_set():
                    for event in self.client.watch("/api/v1/pods", version, timeout_seconds=30,
                                                   fieldSelector="spec.nodeName!="):
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            raise KubeAPIError(int(obj.get("code", 500)), obj.get("message", "watch error"))
                        version = obj["metadata"]["resourceVersion"]
                        if event["type"] != "BOOKMARK":
                            self.dispatch(event["type"], obj)
                        if self.stopping.is_set():
                            return
            except Exception as e:
                if self.stopping.is_set():
                    return
                if not (isinstance(e, KubeAPIError) and e.status == 410):
                    log.warning("pod watch: %s; listing again", e)
                    time.sleep(1.0)

    # ---- status for the CLI ------------------------------------------------------------------------
    def describe_nodes(self) -> list[dict[str, Any]]:
        with self.lock:
            return [{"name": n.name, "state": n.state, "ip": n.ip, "run_pods": n.spec.run_pods,
                     "kill_pending": n.kill_timer is not None and n.kill_timer.is_alive(),
                     "pods": sum(1 for w in self.workers.values() if w.node == n.name)} for n in self.nodes.values()]

    def describe_pods(self) -> list[dict[str, Any]]:
        with self.lock:
            workers = list(self.workers.values())
        return [{"namespace": w.namespace, "name": w.name, "uid": w.uid, "node": w.node, "ip": w.pod_ip,
                 "dir": str(w.dir), "processes": w.processes()} for w in workers]

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        threading.Thread(target=self._register_all, name="register", daemon=True).start()
        threading.Thread(target=self._lease_loop, name="leases", daemon=True).start()
        threading.Thread(target=self._no_process_lease_loop, name="leases-no-process", daemon=True).start()
        threading.Thread(target=self._node_watch_loop, name="node-watch", daemon=True).start()
        threading.Thread(target=self._watch_loop, name="pod-watch", daemon=True).start()

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

    def stop(self) -> None:
        """Stop heartbeats and kill every pod process (the cluster is going away)."""
        self.stopping.set()
        with self.lock:
            workers = list(self.workers.values())
            for node in self.nodes.values():
                if node.kill_timer:
                    node.kill_timer.cancel()
        for worker in workers:
            worker.kill_now()
        shutil.rmtree(memory_root(self.run_dir), ignore_errors=True)  # the nodes' tmpfs folders


def _handler(agent: NodeAgent) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            log.debug("control: " + format, *args)

        def _answer(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._answer(200, {"registered": agent.registered.is_set()})
            elif self.path == "/nodes":
                self._answer(200, {"nodes": agent.describe_nodes()})
            elif self.path == "/pods":
                self._answer(200, {"pods": agent.describe_pods()})
            elif self.path == "/images":
                self._answer(200, agent.describe_images())
            else:
                self._answer(404, {"error": {"code": 404, "message": f"no such path {self.path}"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}") if length else {}
            parts = [p for p in self.path.split("/") if p]
            try:
                if parts == ["nodes"]:
                    result = agent.add_nodes([NodeSpec.from_json(n) for n in body.get("nodes", [])])
                elif parts == ["images"]:
                    result = agent.set_images(list(body.get("images", [])))
                elif len(parts) == 3 and parts[0] == "nodes":
                    name, action = parts[1], parts[2]
                    actions = {
                        "kill": lambda: agent.kill_node(name),
                        "partition": lambda: agent.partition_node(name),
                        "restore": lambda: agent.restore_node(name),
                        "remove": lambda: agent.remove_node(name),
                        "preempt": lambda: agent.preempt_node(name, float(body.get("delay_seconds", 30)),
                                                              bool(body.get("sigterm", False))),
                        "shutdown": lambda: agent.shutdown_node(name, float(body.get("grace_seconds", 30)),
                                                                float(body.get("critical_grace_seconds", 15))),
                    }
                    if action not in actions:
                        raise KeyError(f"unknown action {action!r}; valid: {', '.join(actions)}")
                    result = actions[action]()
                else:
                    raise KeyError(f"no such path {self.path}")
            except KeyError as e:
                self._answer(404, {"error": {"code": 404, "message": str(e.args[0])}})
                return
            except ValueError as e:
                self._answer(409, {"error": {"code": 409, "message": str(e)}})
                return
            except Exception as e:
                log.exception("control %s", self.path)
                self._answer(500, {"error": {"code": 500, "message": str(e)}})
                return
            self._answer(200, result)

    return Handler


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    run_dir = Path(args[0])
    config = json.loads((run_dir / "agent-config.json").read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
    agent = NodeAgent(run_dir, Path(config["kubeconfig"]), [NodeSpec.from_json(n) for n in config["nodes"]],
                      lease_renew_seconds=float(config.get("lease_renew_seconds", 3.0)),
                      no_process_lease_seconds=config.get("no_process_lease_seconds"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(agent))
    server.daemon_threads = True

    def shutdown(signum: int, frame: object) -> None:
        agent.stop()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    agent.start()
    state = {"pid": os.getpid(), "port": server.server_address[1]}
    tmp = run_dir / "agent.json.tmp"
    tmp.write_text(json.dumps(state))
    tmp.rename(run_dir / "agent.json")
    log.info("node agent serving control API on 127.0.0.1:%d", state["port"])
    server.serve_forever(poll_interval=0.5)
    agent.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
