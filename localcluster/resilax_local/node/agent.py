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

Run as `python -m resilax_local.node.agent <run_dir>` (reads `<run_dir>/agent-config.json`).

This module is the agent's state, its nodes' registration and Leases, and the pod watch; beside it:
`node_status.py` (a node's status), `node_faults.py` (the faults above), `control_api.py` (the HTTP
API), `kube_events.py` (the Events it writes) and pods.py (one pod's processes).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from ..controlplane.pki import CertificateAuthority
from ..errors import KubeAPIError
from ..kubeapi import KubeClient
from . import images, node_faults
from .control_api import build_handler
from .kube_events import build_pod_event
from .kubeletapi import KubeletAPI
from .node_status import FAKE_POD_LANES, LEASE_WORKERS, REGISTER_WORKERS, REGISTERING, REMOVED, NodeHeartbeat
from .pod_network import add_pod_address, claim_pod_block, hold_octet, release_pod_block
from .pod_status import (
    NODE_SHUTDOWN_REJECTED_MESSAGE,
    NODE_SHUTDOWN_REJECTED_REASON,
    build_fake_running_status,
)
from .podhost import NodeState
from .pods import PodWorker
from .profiles import NodeSpec
from .volumes import map_host_path, memory_root, node_roots

log = logging.getLogger(__name__)



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
    health_fault: str = ""
    """The `unhealthy` fault: the part of `resilax health-check` this node's containers fail
    (RESILAX_HEALTH_FAULT), "" for none; `restore` clears it."""

    @property
    def name(self) -> str:
        return self.spec.name


class NodeAgent(NodeHeartbeat):
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
        # Each cluster takes one octet, alone (pod_network.hold_octet): its nodes are 127.o.0.n, its pods
        # 240.o.1.0 up (pod_network.py: an address the API server's pod proxy accepts), or 127.o.1.0 up
        # where none can be added.
        self.octet, lock = hold_octet(random.Random(os.getpid() ^ int(time.time())).randrange)
        self.octet_lock: int | None = lock
        self.pod_block = claim_pod_block(self.octet)
        self.next_pod_index = 256
        self.next_node_index = 0
        self.host_entries: dict[str, tuple[str, list[str]]] = {}
        self.events = ThreadPoolExecutor(max_workers=1, thread_name_prefix="events")
        self.registrations = ThreadPoolExecutor(max_workers=REGISTER_WORKERS, thread_name_prefix="register")
        self.lease_pool = ThreadPoolExecutor(max_workers=LEASE_WORKERS, thread_name_prefix="lease")
        self.fake_pod_lanes = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"fake-pods-{i}")
                               for i in range(FAKE_POD_LANES)]
        serving = CertificateAuthority(run_dir / "pki").issue("kubelet", "resilax-local-kubelet", server=True,
                                                             hosts=("127.0.0.1",))
        self.kubelet_api = KubeletAPI(run_dir, serving.cert, serving.key, self._container_running,
                                      self._waiting_containers)
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

    def node_env(self, node: str) -> dict[str, str]:
        """What this node adds to every container's environment: its `unhealthy` fault, if any."""
        with self.lock:
            n = self.nodes.get(node)
            return {"RESILAX_HEALTH_FAULT": n.health_fault} if n is not None and n.health_fault else {}

    def node_ip(self, node: str) -> str:
        with self.lock:
            n = self.nodes.get(node)
            return n.ip if n else "127.0.0.1"

    def host_path(self, node: str, path: str) -> Path:
        return map_host_path(self.run_dir, node, path)

    def allocate_pod_ip(self) -> str:
        """A process pod's address, put on the loopback interface so that its processes bind it."""
        ip = self._next_pod_ip()
        add_pod_address(self.pod_block, ip)
        return ip

    def _next_pod_ip(self) -> str:
        with self.lock:
            while self.next_pod_index % 256 in (0, 255):  # skip .0 and .255
                self.next_pod_index += 1
            i = self.next_pod_index
            self.next_pod_index += 1
        if i >= 65535:
            raise RuntimeError(f"out of pod IPs in this cluster's {self.pod_block.cidr}")
        return self.pod_block.address(i)

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
        body = build_pod_event(pod, reason, message, warning, container)

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

    def _waiting_containers(self, namespace: str, pod: str) -> dict[str, str] | None:
        """Each container of pod `namespace/pod` with its waiting reason ("" once it ran), None when
        this agent runs no such pod."""
        with self.lock:
            workers = [w for w in self.workers.values() if w.namespace == namespace and w.name == pod]
        if not workers:
            return None
        return {c.name: "" if c.ever_started else (c.waiting_reason or "PodInitializing")  # as its status says
                for c in workers[-1].containers}

    def update_node(self, name: str, change: Any) -> None:
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
    def node_record(self, name: str) -> AgentNode:
        with self.lock:
            if name not in self.nodes:
                raise KeyError(f"node {name!r} is not one of this agent's nodes: {', '.join(self.nodes)}")
            return self.nodes[name]

    def workers_on(self, name: str) -> list[PodWorker]:
        with self.lock:
            return [w for w in self.workers.values() if w.node == name]

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

    def remove_node(self, name: str) -> dict[str, Any]:
        node_faults.kill_node(self, name)
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
        if fake:  # outside the lock and the watch: it talks to the API server; one lane per pod keeps its order
            self.fake_pod_lanes[zlib.crc32(uid.encode()) % len(self.fake_pod_lanes)].submit(
                self._fake_pod, kind, pod, node)
            return
        with self.lock:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker:
                    worker.notify("deleted", pod)
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
            status = build_fake_running_status(pod, self._next_pod_ip(), node.ip)  # no process binds it
            self.client.patch(f"{path}/status", {"status": status})
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
                     "health_fault": n.health_fault or None,
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
        for lane in self.fake_pod_lanes:
            lane.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(memory_root(self.run_dir), ignore_errors=True)  # the nodes' tmpfs folders
        release_pod_block(self.pod_block)
        lock, self.octet_lock = self.octet_lock, None  # (stop runs twice: on SIGTERM, then as main returns)
        if lock is not None:
            os.close(lock)  # the octet is free for the next cluster once its addresses are gone


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    run_dir = Path(args[0])
    config = json.loads((run_dir / "agent-config.json").read_text())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s")
    agent = NodeAgent(run_dir, Path(config["kubeconfig"]), [NodeSpec.from_json(n) for n in config["nodes"]],
                      lease_renew_seconds=float(config.get("lease_renew_seconds", 3.0)),
                      lease_duration_seconds=int(config.get("lease_duration_seconds", 40)),
                      no_process_lease_seconds=config.get("no_process_lease_seconds"))
    server = ThreadingHTTPServer(("127.0.0.1", 0), build_handler(agent))
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
