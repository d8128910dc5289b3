"""`LocalCluster`: the control plane plus the node agent, started, inspected, broken and stopped.

    from resilax_local import LocalCluster
    with LocalCluster(profile="default").start() as cluster:
        print(cluster.kubeconfig)             # admin kubeconfig (system:masters)
        cluster.kill_node("tpu-slice-0-h1")   # Lease stops, processes SIGKILLed
        cluster.restore_node("tpu-slice-0-h1")

With `kueue=True` (`resilax local up --kueue`), or `start_kueue()` on a running cluster, Kueue runs
beside the control plane (kueue.py): its CRDs, its webhooks, and a ClusterQueue and LocalQueue named
`resilax-local` (the LocalQueue in `default`).

A cluster lives in its run folder (default `~/.cache/resilax/clusters/<name>`): `cluster.json` (pids,
ports), `kubeconfig`, `pki/`, `etcd/`, `logs/` (one file per component and the node agent) and
`pods/<namespace>/<pod>-<uid>/` (volumes, container specs and logs). Another process attaches to a
running cluster with `LocalCluster.attach(run_dir)`: that is how the CLI's `down`, `kill-node`... work.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import urllib3

from .binaries import cache_dir, ensure_binaries
from .controlplane.kueue import Kueue, KueueState
from .controlplane.plane import ControlPlane, ControlPlaneSettings
from .errors import KubeAPIError, NotRunningError, StartError
from .kubeapi import Credentials, KubeClient, read_kubeconfig, write_kubeconfig
from .node.profiles import NodeSpec, build_cpu_node, build_profile, build_tpu_slice
from .node.volumes import map_host_path, memory_root
from .processes import alive, spawn, stop_group
from .tier_guard import refuse_in_fast_tier

log = logging.getLogger(__name__)

STATE_FILE = "cluster.json"
STOP_ORDER = ("kueue", "node-agent", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd")


def default_run_dir(name: str = "default") -> Path:
    return cache_dir() / "clusters" / name


class LocalCluster:
    """A local Kubernetes cluster in `run_dir`; see the module docstring."""

    def __init__(self, run_dir: Path | str | None = None, *, name: str = "default", profile: str = "default",
                 nodes: list[NodeSpec] | None = None, settings: ControlPlaneSettings | None = None,
                 lease_renew_seconds: float = 2.0, no_process_lease_seconds: float | None = None,
                 kueue: bool = False) -> None:
        self.run_dir = Path(run_dir) if run_dir else default_run_dir(name)
        self.profile = profile
        self.node_specs = nodes if nodes is not None else build_profile(profile)
        self.settings = settings or ControlPlaneSettings()
        self.lease_renew_seconds = lease_renew_seconds
        #: How often no-process nodes renew their Leases (default: every max(lease_renew_seconds, 5) s);
        #: thousands of them need longer, with `settings.node_monitor_grace_seconds` to match.
        self.no_process_lease_seconds = no_process_lease_seconds
        #: Start Kueue once the nodes are Ready (`start_kueue`).
        self.with_kueue = kueue
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._state: dict[str, Any] = {}
        self._http = urllib3.PoolManager(retries=False)

    # ---- life cycle ---------------------------------------------------------------------------
    def check_run_dir(self) -> None:
        """Raise StartError when the run folder holds something that is not a local cluster's (start
        wipes the folder: it never wipes one it did not make). Reads only."""
        if self.run_dir.exists() and any(self.run_dir.iterdir()) and not (self.run_dir / "pki").is_dir():
            raise StartError(f"{self.run_dir} is not empty and not a local cluster's folder: "
                             "refusing to wipe it; pick an empty or new --dir")

    def start(self, timeout: float = 240.0) -> LocalCluster:
        """Start etcd, the API server, controller manager, scheduler and the node agent; return when
        every node is Ready and schedulable. The run folder is wiped first (a fresh cluster each time)."""
        self.check_run_dir()
        refuse_in_fast_tier("a local cluster", "cluster")
        if (self.run_dir / STATE_FILE).exists():
            with contextlib.suppress(NotRunningError):
                LocalCluster.attach(self.run_dir).stop()
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        shutil.rmtree(memory_root(self.run_dir), ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        started = time.monotonic()
        deadline = started + timeout
        control_plane = ControlPlane(self.run_dir, ensure_binaries(), self.settings)
        def start_agent() -> None:
            self._procs.update(control_plane.processes)
            (self.run_dir / "agent-config.json").write_text(json.dumps({
                "kubeconfig": str(control_plane.kubeconfig), "lease_renew_seconds": self.lease_renew_seconds,
                "no_process_lease_seconds": self.no_process_lease_seconds,
                # Kubernetes pairs the two (both 40 s by default): a Lease lasts as long as the node
                # controller waits for its renewal.
                "lease_duration_seconds": self.settings.node_monitor_grace_seconds,
                "nodes": [n.to_json() for n in self.node_specs]}, indent=1))
            self._procs["node-agent"] = spawn([sys.executable, "-m", "resilax_local.node.agent", str(self.run_dir)],
                                              self.run_dir / "logs" / "node-agent.log")
            self._write_state(control_plane)

        try:
            control_plane.start(timeout=timeout, after_api=start_agent)
            self._procs.update(control_plane.processes)
            self._write_state(control_plane)
            self._wait_agent(deadline)
            self.wait_nodes_ready([n.name for n in self.node_specs], timeout=max(5.0, deadline - time.monotonic()))
            if self.with_kueue:
                self.start_kueue()
        except BaseException:
            self.stop()
            raise
        self._state["startup_seconds"] = round(time.monotonic() - started, 1)
        (self.run_dir / STATE_FILE).write_text(json.dumps(self._state, indent=1))
        log.info("local cluster up in %.1f s: %s", time.monotonic() - started, self.kubeconfig)
        return self

    def start_kueue(self, timeout: float = 180.0) -> KueueState:
        """Start Kueue on this running cluster (built on first use: minutes) and return once its webhooks
        answer and the default queue exists; when it already runs, its state."""
        current = self.kueue_state()
        if current is not None:
            return current
        kueue = Kueue(self.run_dir, self.client(), self.server)
        state = kueue.start(timeout)
        if kueue.proc is not None:
            self._procs["kueue"] = kueue.proc
        self._state["kueue"] = state.to_json()
        self._state.setdefault("pids", {})["kueue"] = state.pid
        (self.run_dir / STATE_FILE).write_text(json.dumps(self._state, indent=1))
        return state

    def kueue_state(self) -> KueueState | None:
        """The running Kueue's state (pid, version, ports), None when it does not run."""
        raw = self._state.get("kueue")
        if not raw:
            return None
        state = KueueState.from_json(raw)
        return state if alive(state.pid) else None

    def stop_kueue(self) -> None:
        """Stop Kueue and delete its webhook configurations (its CRDs and queues stay)."""
        raw = self._state.pop("kueue", None)
        self._state.get("pids", {}).pop("kueue", None)
        proc = self._procs.pop("kueue", None)
        if raw:
            kueue = Kueue(self.run_dir, self.client(), self.server)
            kueue.proc = proc
            kueue.stop(KueueState.from_json(raw).pid)
        (self.run_dir / STATE_FILE).write_text(json.dumps(self._state, indent=1))

    def _write_state(self, control_plane: ControlPlane) -> None:
        self._state = {
            "run_dir": str(self.run_dir), "profile": self.profile, "kubeconfig": str(control_plane.kubeconfig),
            "server": control_plane.server, "ports": control_plane.ports,
            "pids": {name: p.pid for name, p in self._procs.items()},
        }
        (self.run_dir / STATE_FILE).write_text(json.dumps(self._state, indent=1))

    def _wait_agent(self, deadline: float) -> None:
        agent_file = self.run_dir / "agent.json"
        while time.monotonic() < deadline:
            proc = self._procs["node-agent"]
            if proc.poll() is not None:
                tail = (self.run_dir / "logs" / "node-agent.log").read_text(errors="replace").splitlines()[-25:]
                raise StartError("the node agent exited while starting; its log ends:\n" + "\n".join(tail))
            if agent_file.exists():
                self._state["agent_port"] = json.loads(agent_file.read_text())["port"]
                if self._agent("GET", "/healthz").get("registered"):
                    return
            time.sleep(0.2)
        raise StartError(f"the node agent did not register its nodes in time; see {self.run_dir / 'logs/node-agent.log'}")

    def stop(self) -> None:
        """Stop the node agent (it kills every pod process), then the control plane; nothing is left running."""
        pids: dict[str, int] = dict(self._state.get("pids", {}))
        pids.update({name: p.pid for name, p in self._procs.items()})
        for name in STOP_ORDER:
            if name in pids:
                stop_group(pids[name], timeout=10.0, proc=self._procs.get(name))
        self._kill_leftover_pods()
        self._procs.clear()
        state_file = self.run_dir / STATE_FILE
        if state_file.exists():
            state_file.unlink()

    def _kill_leftover_pods(self) -> None:
        """Pod processes whose environment names this cluster (in case the agent died without cleaning up)."""
        marker = f"RESILAX_LOCAL_CLUSTER={self.run_dir}".encode()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if marker in environ.split(b"\0"):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry), signal.SIGKILL)

    @classmethod
    def attach(cls, run_dir: Path | str | None = None, name: str = "default") -> LocalCluster:
        """The cluster already running in `run_dir` (started by `resilax local up` or another process)."""
        directory = Path(run_dir) if run_dir else default_run_dir(name)
        state_file = directory / STATE_FILE
        if not state_file.exists():
            raise NotRunningError(f"no local cluster is running in {directory} (start one with `resilax local up`)")
        state = json.loads(state_file.read_text())
        cluster = cls(directory, profile=state.get("profile", "default"), nodes=[])
        cluster._state = state
        if not alive(state["pids"].get("kube-apiserver", -1)):
            raise NotRunningError(f"the local cluster in {directory} is not running any more (its API server is "
                                  f"gone); `resilax local down --dir {directory}` cleans up, `up` starts a new one")
        return cluster

    @classmethod
    def stop_dir(cls, run_dir: Path | str) -> None:
        """Stop whatever the cluster in `run_dir` left running (even if its API server died)."""
        state_file = Path(run_dir) / STATE_FILE
        if not state_file.exists():
            raise NotRunningError(f"no local cluster is running in {run_dir}")
        cluster = cls(run_dir, nodes=[])
        cluster._state = json.loads(state_file.read_text())
        cluster.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- access -------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (a client certificate in group system:masters)."""
        return self.run_dir / "kubeconfig"

    @property
    def server(self) -> str:
        return str(self._state["server"])

    @property
    def ca_file(self) -> Path:
        return self.run_dir / "pki" / "ca.crt"

    def client(self) -> KubeClient:
        """A small dict-based REST client with admin rights."""
        return KubeClient.from_kubeconfig(self.kubeconfig)

    def api_client(self) -> Any:
        """A `kubernetes.client.ApiClient` with admin rights."""
        import kubernetes

        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))

    def service_account_token(self, namespace: str, name: str, expiration_seconds: int = 86400) -> str:
        """A token for ServiceAccount `namespace/name` (TokenRequest API), e.g. to run the operator with its RBAC."""
        answer = self.client().create(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
             "spec": {"expirationSeconds": expiration_seconds}})
        return str(answer["status"]["token"])

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path | None = None,
                                   expiration_seconds: int = 86400) -> Path:
        """A kubeconfig that authenticates as ServiceAccount `namespace/name` (no client certificate)."""
        token = self.service_account_token(namespace, name, expiration_seconds)
        target = path or self.run_dir / f"kubeconfig-{namespace}-{name}"
        creds = Credentials(self.server, str(self.ca_file), token=token)
        return write_kubeconfig(target, creds, name=f"{namespace}-{name}")

    # ---- nodes and faults ---------------------------------------------------------------------
    def _agent(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self._state['agent_port']}{path}"
        resp = self._http.request(method, url, body=json.dumps(body or {}).encode() if method == "POST" else None,
                                  headers={"Content-Type": "application/json"}, timeout=60)
        answer: dict[str, Any] = json.loads(resp.data or b"{}")
        if resp.status >= 400:
            error = answer.get("error", {}).get("message", resp.data.decode(errors="replace"))
            raise KubeAPIError(resp.status, f"node agent {path}: {error}", answer)
        return answer

    def nodes(self) -> list[dict[str, Any]]:
        """The agent's nodes: name, state (Ready, Killed, Partitioned), ip, number of pods."""
        return list(self._agent("GET", "/nodes")["nodes"])

    def pods(self) -> list[dict[str, Any]]:
        """The pods the agent runs: namespace, name, uid, node, ip, folder, running processes (container: pid)."""
        return list(self._agent("GET", "/pods")["pods"])

    def kill_node(self, name: str) -> dict[str, Any]:
        """Hard node loss: the Lease stops, the node's pod processes are SIGKILLed, nothing answers for it.
        The node lifecycle controller marks it Unknown after the grace period; its pods hang in Terminating."""
        return self._agent("POST", f"/nodes/{name}/kill")

    def partition_node(self, name: str) -> dict[str, Any]:
        """Network partition: the Lease and all API traffic stop, the pod processes keep running (zombies)."""
        return self._agent("POST", f"/nodes/{name}/partition")

    def preempt_node(self, name: str, delay_seconds: float = 30.0, sigterm: bool = False) -> dict[str, Any]:
        """GKE preemption notice (taint + maintenance-time label) now, node killed after `delay_seconds`;
        with `sigterm`, the main containers also get SIGTERM now (graceful node shutdown)."""
        return self._agent("POST", f"/nodes/{name}/preempt", {"delay_seconds": delay_seconds, "sigterm": sigterm})

    def shutdown_node(self, name: str, grace_seconds: float = 30.0, critical_grace_seconds: float = 15.0
                      ) -> dict[str, Any]:
        """Graceful node shutdown as the kubelet runs it (a spot VM's preemption; GKE: 30 s, 15 s of them
        for system-critical pods), with no notice first: the node turns NotReady ("node is shutting
        down"), its running pods get SIGTERM and end Failed (reason `Terminated`, `DisruptionTarget`)
        within `grace - critical` seconds, then the node powers off as with `kill_node`."""
        return self._agent("POST", f"/nodes/{name}/shutdown",
                           {"grace_seconds": grace_seconds, "critical_grace_seconds": critical_grace_seconds})

    def make_node_unhealthy(self, name: str, part: str = "matmul") -> dict[str, Any]:
        """The node stays Ready, but the containers it starts from now on fail `part` of `resilax
        health-check` (devices, matmul, collective, hang); `restore_node` makes it healthy again."""
        return self._agent("POST", f"/nodes/{name}/unhealthy", {"part": part})

    def restore_node(self, name: str) -> dict[str, Any]:
        """The node is back: Lease and Ready status again, preemption notice removed, pods resynced,
        its `unhealthy` fault cleared."""
        return self._agent("POST", f"/nodes/{name}/restore")

    def add_nodes(self, nodes: list[NodeSpec]) -> list[str]:
        """Register more nodes (capacity returns); see `add_tpu_slice` and `profiles.build_*`."""
        return list(self._agent("POST", "/nodes", {"nodes": [n.to_json() for n in nodes]})["added"])

    def add_tpu_slice(self, pool: str, accelerator: str = "tpu-v5-lite-podslice", topology: str = "2x4",
                      run_pods: bool = True) -> list[str]:
        return self.add_nodes(build_tpu_slice(pool, accelerator, topology, run_pods))

    def add_cpu_node(self, name: str, run_pods: bool = True) -> list[str]:
        return self.add_nodes([build_cpu_node(name, run_pods)])

    def remove_node(self, name: str) -> dict[str, Any]:
        """Kill the node and delete its Node and Lease objects."""
        return self._agent("POST", f"/nodes/{name}/remove")

    # ---- the image registry ---------------------------------------------------------------------
    def set_images(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Add or replace rows of the node agent's image registry table (resilax_local.node.images): e.g.
        `{"image": "example.com/app:1", "pullable": False}` (a pull fails: ErrImagePull, ImagePullBackOff)
        or `{"image": "example.com/root-app", "user": "0"}` (runs as root: with runAsNonRoot the
        container waits with CreateContainerConfigError). Returns the whole table."""
        return list(self._agent("POST", "/images", {"images": entries})["images"])

    def images(self) -> list[dict[str, Any]]:
        """The image registry table (rows set by `set_images`; every other image is served, non-root)."""
        return list(self._agent("GET", "/images")["images"])

    def wait_nodes_ready(self, names: list[str], timeout: float = 120.0) -> None:
        """Wait until each node is Ready and free of the not-ready/unreachable taints: one LIST, then a
        watch from its resourceVersion (listed again only if the watch ends early or expires)."""
        client = self.client()
        deadline = time.monotonic() + timeout
        pending = set(names)
        while pending and (left := deadline - time.monotonic()) > 0:
            listed = client.get("/api/v1/nodes")
            pending -= {n["metadata"]["name"] for n in listed.get("items", []) if _node_ready(n)}
            if not pending:
                return
            with contextlib.suppress(KubeAPIError):  # 410 Gone and the like: list again
                for event in client.watch("/api/v1/nodes", str(listed["metadata"]["resourceVersion"]),
                                          timeout_seconds=max(1, int(left))):
                    if event.get("type") == "ERROR":
                        break
                    if event.get("type") in ("ADDED", "MODIFIED") and _node_ready(event["object"]):
                        pending.discard(event["object"]["metadata"]["name"])
                    if not pending or time.monotonic() >= deadline:
                        break
        if pending:
            raise StartError(f"nodes not Ready after {timeout:.0f} s: {', '.join(sorted(pending))}")

    def node_path(self, node: str, path: str | Path) -> Path:
        """Where hostPath `path` of pods on `node` lives on this machine (each fake node has its own
        root; a removed node's folders are deleted with it)."""
        return map_host_path(self.run_dir, node, str(path))

    # ---- logs -----------------------------------------------------------------------------------
    def pod_dir(self, namespace: str, pod: str) -> Path:
        """The newest folder of pod `namespace/pod` (pods of the same name get one folder per uid)."""
        candidates = sorted((self.run_dir / "pods" / namespace).glob(f"{pod}-????????"),
                            key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise FileNotFoundError(f"no pod {namespace}/{pod} has run on this cluster ({self.run_dir / 'pods'})")
        return candidates[-1]

    def logs(self, namespace: str, pod: str, container: str | None = None, previous: bool = False) -> str:
        """A container's log (the current run, or the one before with `previous`)."""
        directory = self.pod_dir(namespace, pod) / "logs"
        containers = sorted(p.name for p in directory.iterdir()) if directory.exists() else []
        if container is None:
            if not containers:  # not started yet: a log not written yet, as for a named container
                raise FileNotFoundError(f"no logs yet for {namespace}/{pod}")
            if len(containers) != 1:
                raise ValueError(f"pod {namespace}/{pod} has containers {containers}: name one")
            container = containers[0]
        runs = sorted((directory / container).glob("*.log"), key=lambda p: int(p.stem))
        if not runs:
            raise FileNotFoundError(f"no logs for container {container!r} of {namespace}/{pod}; have {containers}")
        if previous:
            if len(runs) < 2:
                raise FileNotFoundError(f"container {container!r} of {namespace}/{pod} has not restarted")
            return runs[-2].read_text(errors="replace")
        return runs[-1].read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        """Pids and liveness of each process, the kubeconfig, the nodes."""
        pids = self._state.get("pids", {})
        out: dict[str, Any] = {
            "run_dir": str(self.run_dir), "kubeconfig": str(self.kubeconfig), "server": self._state.get("server"),
            "processes": {name: {"pid": pid, "alive": alive(pid)} for name, pid in pids.items()},
        }
        try:
            out["nodes"] = self.nodes()
        except Exception as e:
            out["nodes_error"] = str(e)
        return out


def read_credentials(run_dir: Path) -> Credentials:
    return read_kubeconfig(run_dir / "kubeconfig")


def _node_ready(node: dict[str, Any]) -> bool:
    """Ready=True and neither the not-ready nor the unreachable taint."""
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node.get("status", {}).get("conditions", []))
    blocked = any(t["key"] in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
                  for t in node.get("spec", {}).get("taints") or [])
    return ready and not blocked
