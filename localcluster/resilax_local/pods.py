"""Run one pod as local processes, the way a kubelet runs it in containers.

A `PodWorker` thread owns one pod bound to one of the agent's nodes. It
1. prepares the pod: a loopback IP (`status.podIP`), its volumes as host folders, its folder of logs;
2. starts init containers in order (a native sidecar — an init container with `restartPolicy: Always` —
   counts as started once its process runs, and keeps running beside the main containers);
3. starts the main containers, restarts containers by the pod's `restartPolicy` (with the kubelet's
   crash-loop backoff, shortened: `podspec.Backoff`),
   sets the pod's phase, conditions and container statuses through the status subresource;
4. when the pod completes, stops the sidecars (reverse order);
5. when the pod is deleted, terminates it like the kubelet: SIGTERM to the main containers, wait up to
   the grace period, SIGKILL, then the sidecars in reverse order, then the final status and a delete
   with grace period 0;
6. when its node shuts down gracefully (`("shutdown", grace)`), terminates it the same way within the
   shutdown's grace and leaves it as the kubelet's shutdown manager does: phase Failed, reason
   `Terminated`, condition `DisruptionTarget` (`TerminationByKubelet`), not deleted.

Before a container starts, its image goes through the agent's registry table (images.py: ErrImagePull,
ImagePullBackOff, InvalidImageName, ErrImageNeverPull) and its effective securityContext through the
kubelet's runAsNonRoot check against the image's user (CreateContainerConfigError).

Each container is `python -m resilax_local.launch <spec>`, which enters a private mount namespace, binds
the volumes at their `mountPath` and execs the container's command (so the pid is the command's).
While the node is killed the worker does nothing; while it is partitioned it keeps its processes but
neither reads nor writes the API. On restore the agent resyncs it from the API.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import hashlib
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from . import images, podspec
from .errors import KubeAPIError
from .kubeapi import KubeClient
from .probes import ProbeState, run_probe

log = logging.getLogger(__name__)

Pod = dict[str, Any]


class NodeState:
    READY = "Ready"
    KILLED = "Killed"
    PARTITIONED = "Partitioned"
    SHUTTING_DOWN = "ShuttingDown"
    """Graceful node shutdown in progress: the kubelet still runs, renews the Lease and writes the API."""


#: What the kubelet's shutdown manager writes on the pods it stops (pkg/kubelet/nodeshutdown).
NODE_SHUTDOWN_REASON = "Terminated"
NODE_SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
NODE_SHUTDOWN_REJECTED_REASON = "NodeShutdown"
NODE_SHUTDOWN_REJECTED_MESSAGE = "Pod was rejected as the node is shutting down."


class PodHost(Protocol):
    """What a pod worker needs from the node agent."""

    client: KubeClient
    run_dir: Path
    apiserver_port: int

    def node_state(self, node: str) -> str: ...

    def node_ip(self, node: str) -> str: ...

    def host_path(self, node: str, path: str) -> Path: ...

    def allocate_pod_ip(self) -> str: ...

    def forget(self, uid: str) -> None: ...

    def publish_hosts(self, uid: str, ip: str, names: list[str]) -> None: ...

    def emit_event(self, pod: Pod, reason: str, message: str, warning: bool = False,
                   container: str | None = None) -> None: ...

    def image_entry(self, ref: images.ImageRef) -> images.ImageEntry: ...

    @property
    def hosts_file(self) -> Path: ...


#: Memory-medium volumes live under this tmpfs folder (`emptyDir` per pod uid, hostPath per cluster and node).
MEMORY_ROOT = Path("/dev/shm/resilax-local")
SHM = PurePosixPath("/dev/shm")


def memory_root(run_dir: Path) -> Path:
    """This cluster's tmpfs folder for hostPath volumes under /dev/shm (one per run folder)."""
    digest = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return MEMORY_ROOT / f"cluster-{digest}"


def map_host_path(run_dir: Path, node: str, path: str) -> Path:
    """Where a hostPath `path` of a pod on `node` lives: all fake nodes are one machine, so each node
    gets its own root, `<run_dir>/nodes/<node>/root/<path>` (two nodes never share files; removing the
    node removes them), or `<memory_root>/nodes/<node>/<path below /dev/shm>` for a path on /dev/shm
    (tmpfs, as on the node)."""
    pure = PurePosixPath(path)
    if not pure.is_absolute() or ".." in pure.parts:
        raise ValueError(f"hostPath {path!r}: must be an absolute path without '..'")
    if pure == SHM or SHM in pure.parents:
        return memory_root(run_dir) / "nodes" / node / pure.relative_to(SHM)
    return run_dir / "nodes" / node / "root" / pure.relative_to("/")


def node_roots(run_dir: Path, node: str) -> list[Path]:
    """The folders that hold `node`'s hostPath volumes (disk and tmpfs)."""
    return [run_dir / "nodes" / node, memory_root(run_dir) / "nodes" / node]


def image_paths() -> list[str]:
    """The "image" every container runs: this Python (the virtualenv and the interpreter it was made
    from) and, for a checkout, the project folder its editable install points into."""
    paths = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    project = Path(__file__).resolve().parents[2]
    if (project / "pyproject.toml").is_file():
        paths.add(str(project))
    return sorted(paths)


def image_mounts(volume_targets: list[str], image: list[str]) -> list[dict[str, Any]]:
    """Read-only binds that keep the image visible where a volume would hide it: a container of the
    chart's operator mounts an emptyDir at /tmp, which hides a checkout under /tmp (and its Python
    then cannot import the project). A real image lives in its own root filesystem; here it is
    re-bound over the volume, each image path under (or at) a volume's mountPath."""
    hidden = []
    for path in image:
        pure = PurePosixPath(path)
        if any(pure == PurePosixPath(t) or PurePosixPath(t) in pure.parents for t in volume_targets):
            hidden.append({"source": path, "target": path, "read_only": True})
    return hidden


def now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


CREATE_CONFIG_ERROR = "CreateContainerConfigError"
CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"
#: How soon a container that could not be created (config error, image not present) is tried again.
RETRY_SECONDS = 2.0
#: How long ErrImagePull shows before ImagePullBackOff (the kubelet's next sync of the pod).
ERR_IMAGE_PULL_SECONDS = 1.0


class PrepareError(Exception):
    """The pod cannot start yet (a ConfigMap, Secret or key is missing); retried like the kubelet does."""


@dataclass
class ContainerRun:
    """One container's process and history."""

    spec: dict[str, Any]
    kind: str  # "init", "sidecar" or "main"
    proc: subprocess.Popen[bytes] | None = None
    restart_count: int = 0
    ever_started: bool = False
    started_at: str | None = None
    terminated: dict[str, Any] | None = None
    last_terminated: dict[str, Any] | None = None
    restart_at: float | None = None
    """When to try starting it again (after a crash-loop backoff, an image pull backoff, a config error)."""
    finished_at: float | None = None
    """`time.monotonic()` when its last run exited (the crash-loop backoff counts from it)."""
    backoff: podspec.Backoff = field(default_factory=lambda: podspec.Backoff(podspec.CRASH_BACKOFF_INITIAL,
                                                                             podspec.CRASH_BACKOFF_MAX))
    waiting_reason: str = "PodInitializing"
    waiting_message: str = ""
    env: dict[str, str] = field(default_factory=dict)
    startup: ProbeState | None = None
    readiness: ProbeState | None = None
    liveness: ProbeState | None = None
    startup_passed_once: bool = False

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def is_started(self) -> bool:
        """Running, and past its startup probe if it has one."""
        return self.running() and (self.startup is None or self.startup.passed)

    def is_ready(self) -> bool:
        """Started, and passing its readiness probe if it has one."""
        return self.is_started() and (self.readiness is None or self.readiness.passed)

    def probe_times(self) -> list[float]:
        if not self.running():
            return []
        return [p.next_at for p in (self.startup, self.readiness, self.liveness) if p is not None]

    def signal(self, sig: int, group: bool = False) -> None:
        if self.proc is None:
            return
        try:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class _Condition:
    status: str
    since: str
    reason: str | None = None
    message: str | None = None


@dataclass
class PodWorker:
    host: PodHost
    pod: Pod
    events: queue.Queue[tuple[str, Any]] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        meta = self.pod["metadata"]
        self.uid: str = meta["uid"]
        self.namespace: str = meta["namespace"]
        self.name: str = meta["name"]
        self.node: str = self.pod["spec"]["nodeName"]
        spec = self.pod["spec"]
        self.containers: list[ContainerRun] = [
            ContainerRun(c, "sidecar" if podspec.is_sidecar(c) else "init") for c in spec.get("initContainers") or []
        ] + [ContainerRun(c, "main") for c in spec["containers"]]
        self.dir = self.host.run_dir / "pods" / self.namespace / f"{self.name}-{self.uid[:8]}"
        self.pod_ip: str | None = None
        self.volumes: dict[str, Path] | None = None
        self.memory_dirs: list[Path] = []
        self.start_time: str | None = None
        self.initialized = False
        self.terminal: str | None = None
        self.gone = False
        self.finished = False
        self.prepare_error: str | None = None
        self.next_prepare = 0.0
        self.conditions: dict[str, _Condition] = {}
        self.last_status: str | None = None
        self.shutdown_grace: int | None = None
        """Set by a graceful node shutdown: the grace period the shutdown manager gives this pod."""
        self.status_reason: str | None = None
        self.image_backoff: dict[str, podspec.Backoff] = {}
        """Pull backoff per image of this pod (the kubelet keys it by pod uid and image)."""
        self.thread = threading.Thread(target=self._run, name=f"pod-{self.namespace}/{self.name}", daemon=True)

    # ---- called from the agent's threads -------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def notify(self, kind: str, payload: Any = None) -> None:
        """`("pod", obj)` on a change, `("deleted", None)` when the object is gone, `("resync", None)`."""
        self.events.put((kind, payload))

    def kill_now(self) -> None:
        """SIGKILL every process of the pod at once (the node died)."""
        for c in self.containers:
            c.signal(signal.SIGKILL, group=True)

    def processes(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.containers if c.proc is not None and c.running()}

    # ---- the worker's own thread ---------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        try:
            while not self.finished:
                state = self.host.node_state(self.node)
                if state == NodeState.KILLED:
                    self._wait(1.0)
                    continue
                try:
                    self._drain_events()
                    self._sync(api=state in (NodeState.READY, NodeState.SHUTTING_DOWN))
                    failures = 0
                except Exception as e:  # the API server busy or restarting: keep the pod, try again
                    failures += 1
                    log.log(logging.ERROR if failures % 20 == 1 else logging.DEBUG,
                            "pod %s/%s: sync failed (%d in a row), retrying: %r", self.namespace, self.name,
                            failures, e, exc_info=failures == 1)
                    self._wait(min(5.0, 0.5 * failures))
                    continue
                if not self.finished:
                    self._wait(self._next_wake())
        finally:
            self._cleanup()
            self.host.forget(self.uid)

    def _wait(self, timeout: float) -> None:
        try:
            item = self.events.get(timeout=max(0.05, timeout))
        except queue.Empty:
            return
        self._handle(*item)

    def _next_wake(self) -> float:
        pending = [c.restart_at for c in self.containers if c.restart_at is not None]
        pending += [t for c in self.containers for t in c.probe_times()]
        if self.volumes is None:
            pending.append(self.next_prepare)
        if not pending:
            return 2.0
        return max(0.05, min(min(pending) - time.monotonic(), 2.0))

    def _drain_events(self) -> None:
        while True:
            try:
                kind, payload = self.events.get_nowait()
            except queue.Empty:
                return
            self._handle(kind, payload)

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "pod" and payload["metadata"]["uid"] == self.uid:
            if self._newer(payload):
                self.pod = payload
        elif kind == "deleted":
            self.gone = True
        elif kind == "shutdown":
            self.shutdown_grace = int(payload)
        elif kind == "resync":
            try:
                fresh = self.host.client.get(f"/api/v1/namespaces/{self.namespace}/pods/{self.name}")
            except KubeAPIError as e:
                if e.status != 404:
                    raise
                self.gone = True
            else:
                if fresh["metadata"]["uid"] == self.uid:
                    self.pod = fresh
                else:
                    self.gone = True

    def _newer(self, pod: Pod) -> bool:
        """Whether `pod` is at least as new as what we hold (watch events can trail our own writes)."""
        try:
            return int(pod["metadata"]["resourceVersion"]) >= int(self.pod["metadata"]["resourceVersion"])
        except (KeyError, ValueError):
            return True

    def _own_status(self) -> None:
        """The addresses this worker gave the pod, whatever the copy we hold says (for the downward API)."""
        if self.pod_ip is None:
            return
        status = self.pod.setdefault("status", {})
        host_ip = self.host.node_ip(self.node)
        status.update({"podIP": self.pod_ip, "podIPs": [{"ip": self.pod_ip}], "hostIP": host_ip,
                       "hostIPs": [{"ip": host_ip}]})

    def _sync(self, api: bool) -> None:
        meta = self.pod["metadata"]
        if self.gone:
            grace = int(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
            self._terminate(grace, api=False)
            return
        if api and self.shutdown_grace is not None:
            self._shut_down(self.shutdown_grace)
            return
        if api and meta.get("deletionTimestamp"):
            grace = int(meta.get("deletionGracePeriodSeconds", self.pod["spec"].get("terminationGracePeriodSeconds", 30)))
            self._terminate(grace, api=True)
            return
        if self.volumes is None and time.monotonic() >= self.next_prepare:
            self._prepare()
        self._reap()
        if self.volumes is not None and self.terminal is None:
            self._probe()
            self._advance()
        if api:
            self._post_status()

    # ---- preparing ------------------------------------------------------------------------------
    def _lookup(self, kind: str, name: str) -> dict[str, Any] | None:
        try:
            return self.host.client.get(f"/api/v1/namespaces/{self.namespace}/{kind}/{name}")
        except KubeAPIError as e:
            if e.status == 404:
                return None
            raise

    def _prepare(self) -> None:
        if self.pod_ip is None:
            if self.pod["spec"].get("hostNetwork"):
                self.pod_ip = self.host.node_ip(self.node)  # the node's address, as with hostNetwork
            else:
                self.pod_ip = self.host.allocate_pod_ip()
                self.host.publish_hosts(self.uid, self.pod_ip, self.dns_names())
            self.start_time = now_rfc3339()
            self.pod.setdefault("status", {})["podIP"] = self.pod_ip
            self.pod["status"]["hostIP"] = self.host.node_ip(self.node)
            self._post_status()  # the pod IP is known before the containers start, as on a kubelet
        try:
            self.volumes = self._build_volumes()
            self.prepare_error = None
        except PrepareError as e:
            if self.prepare_error != str(e):
                self.host.emit_event(self.pod, "FailedMount", str(e), warning=True)
            self.prepare_error = str(e)
            self.next_prepare = time.monotonic() + 2.0
            # As the kubelet: a volume it cannot mount keeps every container in its start-up state (the
            # reason is only in the FailedMount event), retried until the object appears; no timeout.
            starting = "PodInitializing" if self.pod["spec"].get("initContainers") else "ContainerCreating"
            for c in self.containers:
                c.waiting_reason, c.waiting_message = starting, ""

    def _build_volumes(self) -> dict[str, Path]:
        self._own_status()
        volumes: dict[str, Path] = {}
        root = self.dir / "volumes"
        for vol in self.pod["spec"].get("volumes") or []:
            name = vol["name"]
            path = root / name
            if "emptyDir" in vol:
                if (vol["emptyDir"] or {}).get("medium") == "Memory":
                    path = MEMORY_ROOT / self.uid / name
                    self.memory_dirs.append(path.parent)
                path.mkdir(parents=True, exist_ok=True)
            elif "hostPath" in vol:
                try:
                    path = self.host.host_path(self.node, str(vol["hostPath"]["path"]))
                except ValueError as e:
                    raise PrepareError(f"volume {name!r}: {e}") from e
                kind = vol["hostPath"].get("type", "")
                if kind in ("Directory", "File") and not path.exists():
                    raise PrepareError(f"volume {name!r}: hostPath {vol['hostPath']['path']} does not exist on "
                                       f"node {self.node} ({path}) and its type is {kind}")
                if kind == "DirectoryOrCreate":
                    path.mkdir(parents=True, exist_ok=True)
                elif kind == "FileOrCreate":
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.touch()
            elif "persistentVolumeClaim" in vol:
                path = self.host.run_dir / "pvcs" / self.namespace / vol["persistentVolumeClaim"]["claimName"]
                path.mkdir(parents=True, exist_ok=True)
            elif "configMap" in vol or "secret" in vol or "downwardAPI" in vol or "projected" in vol:
                try:
                    files = self._projected_files(vol)
                except PrepareError as e:
                    raise PrepareError(f'MountVolume.SetUp failed for volume "{name}" : {e}') from e
                path.mkdir(parents=True, exist_ok=True)
                mode = self._default_mode(vol)
                for rel, (content, file_mode) in files.items():
                    target = path / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(content)
                    target.chmod(file_mode if file_mode is not None else mode)
            else:
                kinds = ", ".join(k for k in vol if k != "name")
                raise PrepareError(f"volume {name!r}: type {kinds} is not supported by the local node agent")
            volumes[name] = path
        return volumes

    @staticmethod
    def _default_mode(vol: dict[str, Any]) -> int:
        for key in ("configMap", "secret", "downwardAPI", "projected"):
            if key in vol and vol[key] and "defaultMode" in vol[key]:
                return int(vol[key]["defaultMode"])
        return 0o644

    def _projected_files(self, vol: dict[str, Any]) -> dict[str, tuple[bytes, int | None]]:
        """Files of a configMap/secret/downwardAPI/projected volume: relative path -> (bytes, mode)."""
        sources: list[dict[str, Any]]
        if "projected" in vol:
            sources = (vol["projected"] or {}).get("sources") or []
        else:
            sources = [{k: v for k, v in vol.items() if k != "name"}]
        files: dict[str, tuple[bytes, int | None]] = {}
        for source in sources:
            if "serviceAccountToken" in source:
                sat = source["serviceAccountToken"]
                files[sat["path"]] = (self._request_token(sat).encode(), 0o600)
            for key, kind, name_key in (("configMap", "configmaps", "name"), ("secret", "secrets", "secretName")):
                if key not in source:
                    continue
                ref = source[key] or {}
                obj_name = str(ref.get(name_key) or ref.get("name"))
                obj = self._lookup(kind, obj_name)
                if obj is None:
                    if ref.get("optional"):
                        continue
                    raise PrepareError(f"{kind[:-1]} {obj_name!r} not found")
                raw = self._raw_data(obj, kind)
                items = ref.get("items")
                if items:
                    for item in items:
                        if item["key"] not in raw:
                            if ref.get("optional"):
                                continue
                            raise PrepareError(f"key {item['key']!r} not in {kind[:-1]} {obj_name!r}")
                        files[item["path"]] = (raw[item["key"]], item.get("mode"))
                else:
                    for k, v in raw.items():
                        files[k] = (v, None)
            if "downwardAPI" in source:
                for item in (source["downwardAPI"] or {}).get("items") or []:
                    if "fieldRef" in item:
                        value = podspec.field_value(self.pod, item["fieldRef"]["fieldPath"])
                    else:
                        ref = item["resourceFieldRef"]
                        container = next((c.spec for c in self.containers if c.name == ref.get("containerName")),
                                         self.containers[-1].spec)
                        value = podspec.resource_value(container, ref["resource"], ref.get("divisor"))
                    files[item["path"]] = (value.encode(), item.get("mode"))
        return files

    @staticmethod
    def _raw_data(obj: dict[str, Any], kind: str) -> dict[str, bytes]:
        if kind == "secrets":
            return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return out

    def _request_token(self, sat: dict[str, Any]) -> str:
        """A bound service-account token through the TokenRequest API, as the kubelet asks for it."""
        account = self.pod["spec"].get("serviceAccountName") or "default"
        spec: dict[str, Any] = {
            "expirationSeconds": int(sat.get("expirationSeconds", 3600)),
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.name, "uid": self.uid},
        }
        if sat.get("audience"):
            spec["audiences"] = [sat["audience"]]
        try:
            answer = self.host.client.create(
                f"/api/v1/namespaces/{self.namespace}/serviceaccounts/{account}/token",
                {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
        except KubeAPIError as e:
            raise PrepareError(f"token for service account {account!r}: {e}") from e
        return str(answer["status"]["token"])

    # ---- running --------------------------------------------------------------------------------
    def _base_env(self) -> dict[str, str]:
        venv_bin = str(Path(sys.executable).parent)
        port = str(self.host.apiserver_port)
        return {
            "PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root", "HOSTNAME": self.name, "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
            "KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port, "KUBERNETES_PORT": f"tcp://127.0.0.1:{port}",
            "RESILAX_LOCAL_CLUSTER": str(self.host.run_dir),
        }

    def _wait_for(self, c: ContainerRun, reason: str, message: str, retry_at: float, event: bool = True) -> None:
        """The container cannot start now: it waits with `reason` (a `Failed` event `Error: ...` when the
        message is new, as the kubelet's startContainer reports it) and is tried again at `retry_at`."""
        if event and (c.waiting_reason, c.waiting_message) != (reason, message):
            text = message if reason == CREATE_CONFIG_ERROR else reason
            self.host.emit_event(self.pod, "Failed", f"Error: {text}", warning=True, container=c.name)
        c.waiting_reason, c.waiting_message = reason, message
        c.restart_at = retry_at

    def _ensure_image(self, c: ContainerRun) -> images.ImageEntry | None:
        """The kubelet's EnsureImageExists against the local registry (images.py): the image's entry when
        it is present or pulled now; None while the container waits (InvalidImageName, ErrImageNeverPull,
        ErrImagePull, then ImagePullBackOff until the pull backoff of that image ends)."""
        image = str(c.spec.get("image") or "")
        now = time.monotonic()
        try:
            ref = images.parse_reference(image)
        except images.InvalidImageError as e:
            if c.waiting_reason != "InvalidImageName":
                self.host.emit_event(self.pod, "InspectFailed", str(e), warning=True, container=c.name)
            self._wait_for(c, "InvalidImageName", str(e), now + RETRY_SECONDS)
            return None
        entry = self.host.image_entry(ref)
        error = images.pull_error(ref, entry)
        policy = c.spec.get("imagePullPolicy") or images.default_pull_policy(ref)
        if error is None and policy != "Always":  # served images are present on every node
            self.host.emit_event(self.pod, "Pulled", f'Container image "{image}" already present on machine',
                                 container=c.name)
            return entry
        if policy == "Never":
            message = f'Container image "{image}" is not present with pull policy of Never'
            if c.waiting_reason != "ErrImageNeverPull":
                self.host.emit_event(self.pod, "ErrImageNeverPull", message, warning=True, container=c.name)
            self._wait_for(c, "ErrImageNeverPull", message, now + RETRY_SECONDS)
            return None
        backoff = self.image_backoff.setdefault(
            image, podspec.Backoff(podspec.IMAGE_BACKOFF_INITIAL, podspec.IMAGE_BACKOFF_MAX))
        if backoff.last_update is not None and backoff.in_backoff_since(backoff.last_update, now):
            message = f'Back-off pulling image "{image}"'
            if c.waiting_reason != "ImagePullBackOff":
                self.host.emit_event(self.pod, "BackOff", message, container=c.name)
            self._wait_for(c, "ImagePullBackOff", message, backoff.last_update + backoff.delay)
            return None
        self.host.emit_event(self.pod, "Pulling", f'Pulling image "{image}"', container=c.name)
        if error is None:
            self.host.emit_event(self.pod, "Pulled", f'Successfully pulled image "{image}" in 0s', container=c.name)
            return entry
        backoff.next(now)
        self.host.emit_event(self.pod, "Failed", f'Failed to pull image "{image}": {error}', warning=True,
                             container=c.name)
        # ErrImagePull stays in the status until the next sync (a second here), then ImagePullBackOff
        self._wait_for(c, "ErrImagePull", error, now + min(ERR_IMAGE_PULL_SECONDS, backoff.delay))
        return None

    def _start(self, c: ContainerRun) -> None:
        assert self.volumes is not None
        self._own_status()
        entry = self._ensure_image(c)
        if entry is None:
            return
        try:
            env = podspec.build_env(self.pod, c.spec, self._lookup, self._base_env())
            argv = podspec.command_line(c.spec, env)
        except ValueError as e:
            self._wait_for(c, CREATE_CONFIG_ERROR, str(e), time.monotonic() + RETRY_SECONDS)
            return
        refused = podspec.verify_run_as_non_root(self.pod, c.spec, *images.image_user(entry.user))
        if refused:
            self._wait_for(c, CREATE_CONFIG_ERROR, refused, time.monotonic() + RETRY_SECONDS)
            return
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            if m["name"] not in self.volumes:
                self._wait_for(c, CREATE_CONFIG_ERROR, f"volume {m['name']!r} not found",
                               time.monotonic() + RETRY_SECONDS)
                return
            source = self.volumes[m["name"]]
            if m.get("subPath"):
                source = source / m["subPath"]
                if not source.exists():
                    source.mkdir(parents=True, exist_ok=True)
            mounts.append({"source": str(source), "target": m["mountPath"], "read_only": bool(m.get("readOnly"))})
        mounts += image_mounts([m["target"] for m in mounts], image_paths())
        if not self.pod["spec"].get("hostNetwork"):
            mounts.append({"source": str(self.host.hosts_file), "target": "/etc/hosts", "read_only": True})
        if c.ever_started:
            c.restart_count += 1
        log_dir = self.dir / "logs" / c.name
        log_dir.mkdir(parents=True, exist_ok=True)
        spec_path = self.dir / "specs" / f"{c.name}-{c.restart_count}.json"
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(json.dumps({"argv": argv, "env": env, "cwd": c.spec.get("workingDir") or "/",
                                         "hostname": self.hostname(), "mounts": mounts}, indent=1))
        with (log_dir / f"{c.restart_count}.log").open("ab") as out:
            c.proc = subprocess.Popen([sys.executable, "-m", "resilax_local.launch", str(spec_path)],
                                      stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                      env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                                      start_new_session=True)
        c.ever_started = True
        c.started_at = now_rfc3339()
        c.env = env
        spec = c.spec
        c.startup = ProbeState(spec["startupProbe"]) if spec.get("startupProbe") else None
        c.readiness = ProbeState(spec["readinessProbe"]) if spec.get("readinessProbe") else None
        c.liveness = ProbeState(spec["livenessProbe"]) if spec.get("livenessProbe") else None
        if c.startup is None:
            c.startup_passed_once = True
        c.last_terminated = c.terminated or c.last_terminated
        c.terminated = None
        c.restart_at = None
        c.waiting_reason, c.waiting_message = "", ""
        proc = c.proc
        def waiter() -> None:
            proc.wait()
            self.notify("wake")

        threading.Thread(target=waiter, daemon=True).start()
        self.host.emit_event(self.pod, "Started", f"Started container {c.name}", container=c.name)
        log.info("pod %s/%s: started container %s (pid %d) on %s", self.namespace, self.name, c.name,
                 proc.pid, self.node)

    def _reap(self) -> None:
        for c in self.containers:
            if c.proc is None or c.proc.poll() is None:
                continue
            code = c.proc.returncode
            exit_code = 128 - code if code < 0 else code
            c.terminated = {
                "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                "startedAt": c.started_at, "finishedAt": now_rfc3339(),
                "containerID": self._container_id(c),
            }
            if code < 0:
                c.terminated["signal"] = -code
            c.finished_at = time.monotonic()
            # leftovers of the container (its children) go with it, as with a pid namespace
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGKILL)
            c.proc = None
            log.info("pod %s/%s: container %s exited with %d", self.namespace, self.name, c.name, exit_code)

    def _container_id(self, c: ContainerRun) -> str:
        return f"resilax://{self.uid}/{c.name}/{c.restart_count}"

    def _due(self, c: ContainerRun) -> bool:
        """Whether an exited container may start again now: the kubelet's crash-loop backoff (`doBackOff`).
        The first restart is immediate; a container that exits again within the backoff waits with
        CrashLoopBackOff (`back-off 2s restarting failed container=NAME pod=NAME_NS(UID)`, a BackOff
        event) until `finished + delay`; each restart doubles the delay (podspec.Backoff)."""
        now = time.monotonic()
        if c.waiting_reason != CRASH_LOOP_BACK_OFF and c.restart_at is not None and now < c.restart_at:
            return False  # an image or config retry is pending
        finished = c.finished_at if c.finished_at is not None else now
        if c.backoff.in_backoff_since(finished, now):
            until = finished + c.backoff.delay
            if c.restart_at != until:
                self.host.emit_event(
                    self.pod, "BackOff",
                    f"Back-off restarting failed container {c.name} in pod {podspec.format_pod(self.pod)}",
                    warning=True, container=c.name)
            c.waiting_reason = CRASH_LOOP_BACK_OFF
            c.waiting_message = (f"back-off {podspec.go_duration(c.backoff.delay)} restarting failed "
                                 f"container={c.name} pod={podspec.format_pod(self.pod)}")
            c.restart_at = until
            return False
        c.backoff.next(now)
        return True

    def _advance(self) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for c in self.containers:
            if c.kind == "main":
                break
            if c.kind == "sidecar":
                if not c.running():
                    if not c.ever_started:
                        if c.restart_at is None or time.monotonic() >= c.restart_at:
                            self._start(c)
                    elif self._due(c):
                        self._start(c)
                if not c.startup_passed_once:
                    return  # later init containers wait until this sidecar has started (startup probe)
                continue
            if c.running():
                return
            if c.terminated is None:
                if c.restart_at is None or time.monotonic() >= c.restart_at:
                    self._start(c)
                return
            if c.terminated["exitCode"] == 0:
                continue
            if policy == "Never":
                self._finish("Failed")
                return
            if self._due(c):
                self._start(c)
            return
        self.initialized = True
        mains = [c for c in self.containers if c.kind == "main"]
        for c in mains:
            if c.running():
                continue
            if not c.ever_started:
                if c.restart_at is None or time.monotonic() >= c.restart_at:
                    self._start(c)
                continue
            if c.terminated is not None and podspec.should_restart(policy, c.terminated["exitCode"]) and self._due(c):
                self._start(c)
        done = all(c.ever_started and c.terminated is not None
                   and not podspec.should_restart(policy, c.terminated["exitCode"]) for c in mains)
        if done:
            failed = any(c.terminated is not None and c.terminated["exitCode"] != 0 for c in mains)
            self._finish("Failed" if failed else "Succeeded")

    def _probe(self) -> None:
        """Run the due probes; a failed startup or liveness probe stops the container (then restart rules)."""
        now = time.monotonic()
        for c in self.containers:
            if c.proc is None or not c.running() or self.pod_ip is None:
                continue
            pid = c.proc.pid
            if c.startup is not None and not c.startup.passed:
                if c.startup.due(now):
                    c.startup.record(run_probe(c.startup.probe, c.spec, self.pod_ip, pid, c.env), now)
                    if c.startup.passed:
                        c.startup_passed_once = True
                    elif c.startup.failed:
                        self._kill_for_probe(c, "startup")
                continue
            if c.readiness is not None and c.readiness.due(now):
                c.readiness.record(run_probe(c.readiness.probe, c.spec, self.pod_ip, pid, c.env), now)
            if c.liveness is not None and c.liveness.due(now):
                c.liveness.record(run_probe(c.liveness.probe, c.spec, self.pod_ip, pid, c.env), now)
                if c.liveness.failed:
                    self._kill_for_probe(c, "liveness")

    def _kill_for_probe(self, c: ContainerRun, kind: str) -> None:
        """SIGTERM, then SIGKILL after the grace period, as the kubelet does for a failed probe."""
        log.info("pod %s/%s: container %s failed its %s probe, restarting", self.namespace, self.name, c.name, kind)
        self.host.emit_event(self.pod, "Unhealthy", f"{kind.capitalize()} probe failed", warning=True, container=c.name)
        self.host.emit_event(self.pod, "Killing", f"Container {c.name} failed {kind} probe, will be restarted",
                             container=c.name)
        assert c.proc is not None
        proc = c.proc
        c.startup = c.readiness = c.liveness = None
        c.signal(signal.SIGTERM)
        grace = float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

        def kill_late() -> None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(grace, kill_late)
        timer.daemon = True
        timer.start()

    def _finish(self, phase: str) -> None:
        """The pod reached a terminal phase: stop its sidecars (reverse order) and keep it for the record."""
        self.terminal = phase
        grace = int(self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        self._stop_in_order([c for c in self.containers if c.kind != "main"], time.monotonic() + grace)
        self._reap()
        for c in self.containers:
            c.restart_at = None
        log.info("pod %s/%s: %s", self.namespace, self.name, phase)

    def _pre_stop_then_sigterm(self, c: ContainerRun, deadline: float) -> None:
        """The container's preStop hook (exec, httpGet or sleep; bounded by the grace period), then SIGTERM."""
        hook = (c.spec.get("lifecycle") or {}).get("preStop")
        if hook and c.running() and c.proc is not None and self.pod_ip is not None:
            remaining = max(1.0, deadline - time.monotonic())
            if "sleep" in hook:
                time.sleep(min(float(hook["sleep"].get("seconds", 0)), remaining))
            else:
                run_probe({**hook, "timeoutSeconds": remaining}, c.spec, self.pod_ip, c.proc.pid, c.env)
        c.signal(signal.SIGTERM)

    def _stop_in_order(self, containers: list[ContainerRun], deadline: float) -> None:
        """SIGTERM each running container (last first), wait for it (at least 2 s), SIGKILL if needed."""
        for c in reversed(containers):
            if not c.running():
                continue
            self._pre_stop_then_sigterm(c, max(deadline, time.monotonic() + 2.0))
            self._await_exit([c], max(deadline, time.monotonic() + 2.0))

    def _await_exit(self, containers: list[ContainerRun], deadline: float) -> None:
        while time.monotonic() < deadline and any(c.running() for c in containers):
            time.sleep(0.05)
        for c in containers:
            if c.running():
                log.info("pod %s/%s: SIGKILL container %s after the grace period", self.namespace, self.name, c.name)
                c.signal(signal.SIGKILL, group=True)
                if c.proc is not None:
                    c.proc.wait()

    def _shut_down(self, override: int) -> None:
        """Graceful node shutdown (the kubelet's shutdown manager): stop the containers as for a
        deletion, within the shutdown's grace (or the pod's own, if shorter), then write the final
        status (Failed unless it had succeeded, reason Terminated, DisruptionTarget) and keep the pod."""
        grace = min(override, int(self.pod["spec"].get("terminationGracePeriodSeconds", 30)))
        log.info("pod %s/%s: node shutdown, terminating (grace %d s)", self.namespace, self.name, grace)
        for c in self.containers:
            if c.running():
                self.host.emit_event(self.pod, "Killing", f"Stopping container {c.name}", container=c.name)
        self._stop_all(grace)
        if self.terminal != "Succeeded":
            self.terminal = "Failed"
        self.status_reason = NODE_SHUTDOWN_REASON
        self.conditions["DisruptionTarget"] = _Condition("True", now_rfc3339(), "TerminationByKubelet",
                                                         NODE_SHUTDOWN_MESSAGE)
        self.finished = True
        for attempt in range(30):  # the final status must land, or the pod looks alive on a dead node
            try:
                self._post_status()
                return
            except Exception as e:
                log.warning("pod %s/%s: final status failed (attempt %d): %r", self.namespace, self.name,
                            attempt + 1, e)
                time.sleep(min(5.0, 0.5 * (attempt + 1)))

    def _stop_all(self, grace: int) -> None:
        """SIGTERM the main containers (in parallel, after their preStop hooks), SIGKILL what is left
        at the deadline, then the sidecars in reverse order within what is left of the grace."""
        deadline = time.monotonic() + grace
        for c in self.containers:
            c.restart_at = None
        mains = [c for c in self.containers if c.kind != "sidecar"]
        stoppers = [threading.Thread(target=self._pre_stop_then_sigterm, args=(c, deadline), daemon=True)
                    for c in mains if c.running()]
        for t in stoppers:  # in parallel, as the kubelet kills the containers of a pod
            t.start()
        self._await_exit(mains, deadline)
        self._stop_in_order([c for c in self.containers if c.kind == "sidecar"], deadline)
        self._reap()

    def _terminate(self, grace: int, api: bool) -> None:
        """Graceful termination as the kubelet does it, then (with `api`) the final status and delete."""
        log.info("pod %s/%s: terminating (grace %d s)", self.namespace, self.name, grace)
        if api:
            for c in self.containers:
                if c.running():
                    self.host.emit_event(self.pod, "Killing", f"Stopping container {c.name}", container=c.name)
        self._stop_all(grace)
        self.finished = True
        if not api:
            return
        if self.terminal is None:
            main_runs = [c for c in self.containers if c.kind == "main"]
            ok = all(c.terminated is not None and c.terminated["exitCode"] == 0 for c in main_runs)
            self.terminal = "Succeeded" if ok else "Failed"
        for attempt in range(30):  # the final status and delete must land, or the pod hangs in Terminating
            try:
                self._post_status()
                self.host.client.delete(f"/api/v1/namespaces/{self.namespace}/pods/{self.name}",
                                        {"gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
                return
            except KubeAPIError as e:
                if e.status in (404, 409):
                    return
                error: Exception = e
            except Exception as e:
                error = e
            log.warning("pod %s/%s: final delete failed (attempt %d): %r", self.namespace, self.name, attempt + 1, error)
            time.sleep(min(5.0, 0.5 * (attempt + 1)))

    def hostname(self) -> str:
        return str(self.pod["spec"].get("hostname") or self.name)[:63]

    def dns_names(self) -> list[str]:
        """The names cluster DNS would give this pod: `<hostname>.<subdomain>.<ns>.svc.cluster.local`
        (and its search-domain short forms) when it has a subdomain (headless Service), and its hostname."""
        hostname = self.hostname()
        subdomain = self.pod["spec"].get("subdomain")
        names = []
        if subdomain:
            base = f"{hostname}.{subdomain}.{self.namespace}"
            names = [f"{base}.svc.cluster.local", f"{base}.svc", base, f"{hostname}.{subdomain}"]
        return [*names, hostname]

    def _cleanup(self) -> None:
        self.host.publish_hosts(self.uid, "", [])
        for c in self.containers:
            c.signal(signal.SIGKILL, group=True)
        for path in self.memory_dirs:
            shutil.rmtree(path, ignore_errors=True)

    # ---- status -------------------------------------------------------------------------------
    def _set_condition(self, kind: str, value: bool, reason: str | None = None) -> None:
        """One of the conditions this worker computes (a condition set once, e.g. DisruptionTarget,
        is kept as it is)."""
        status = "True" if value else "False"
        current = self.conditions.get(kind)
        if current is None or current.status != status or current.reason != reason:
            self.conditions[kind] = _Condition(status, now_rfc3339(), reason)

    def _container_status(self, c: ContainerRun) -> dict[str, Any]:
        state: dict[str, Any]
        if c.running():
            state = {"running": {"startedAt": c.started_at}}
        elif c.terminated is not None and c.restart_at is None:
            state = {"terminated": c.terminated}
        else:
            waiting: dict[str, Any] = {"reason": c.waiting_reason or "PodInitializing"}
            if c.waiting_message:
                waiting["message"] = c.waiting_message
            state = {"waiting": waiting}
        last = c.terminated if (c.terminated is not None and c.restart_at is not None) else c.last_terminated
        out: dict[str, Any] = {
            "name": c.name, "image": c.spec.get("image", ""), "imageID": "", "state": state,
            "lastState": {"terminated": last} if last else {}, "ready": c.is_ready(),
            "restartCount": c.restart_count, "started": c.is_started(),
        }
        if c.ever_started:
            out["containerID"] = self._container_id(c)
        return out

    def _phase(self) -> str:
        if self.terminal:
            return self.terminal
        if self.initialized and any(c.ever_started for c in self.containers if c.kind == "main"):
            return "Running"
        return "Pending"

    def _post_status(self) -> None:
        if self.finished and self.terminal is None:
            return
        inits = [c for c in self.containers if c.kind != "main"]
        mains = [c for c in self.containers if c.kind == "main"]
        phase = self._phase()
        self._set_condition("PodReadyToStartContainers", self.pod_ip is not None)
        self._set_condition("Initialized", self.initialized or self.terminal is not None)
        ready = self.terminal is None and self.initialized and all(c.is_ready() for c in self.containers
                                                                  if c.kind != "init")
        reason = "PodCompleted" if self.terminal else (None if ready else "ContainersNotReady")
        self._set_condition("ContainersReady", ready, reason)
        self._set_condition("Ready", ready, reason)
        conditions = [{"type": k, "status": v.status, "lastTransitionTime": v.since,
                       "lastProbeTime": None, **({"reason": v.reason} if v.reason else {}),
                       **({"message": v.message} if v.message else {})}
                      for k, v in self.conditions.items()]
        foreign = [c for c in (self.pod.get("status") or {}).get("conditions") or [] if c["type"] not in self.conditions]
        host_ip = self.host.node_ip(self.node)
        status: dict[str, Any] = {
            "phase": phase, "hostIP": host_ip, "hostIPs": [{"ip": host_ip}],
            "conditions": foreign + conditions,
            "containerStatuses": [self._container_status(c) for c in mains],
        }
        if self.pod_ip:
            status["podIP"] = self.pod_ip
            status["podIPs"] = [{"ip": self.pod_ip}]
        if self.start_time:
            status["startTime"] = self.start_time
        if inits:
            status["initContainerStatuses"] = [self._container_status(c) for c in inits]
        if self.prepare_error:
            status["message"] = self.prepare_error
        if self.status_reason == NODE_SHUTDOWN_REASON:
            status["reason"], status["message"] = NODE_SHUTDOWN_REASON, NODE_SHUTDOWN_MESSAGE
        encoded = json.dumps(status, sort_keys=True)
        if encoded == self.last_status:
            return
        try:
            updated = self.host.client.patch(f"/api/v1/namespaces/{self.namespace}/pods/{self.name}/status",
                                             {"metadata": {"uid": self.uid}, "status": status})
        except KubeAPIError as e:
            if e.status in (404, 409):
                return
            raise
        self.last_status = encoded
        if updated.get("metadata", {}).get("uid") == self.uid and self._newer(updated):
            self.pod = updated
