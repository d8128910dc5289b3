"""Run one pod as local processes, the way a kubelet runs it in containers.

A `PodWorker` thread owns one pod bound to one of the agent's nodes. It
1. prepares the pod: an IP of the cluster's pod block (`status.podIP`, pod_network.py), its volumes as host folders, its folder of logs;
2. starts init containers in order (a native sidecar — an init container with `restartPolicy: Always` —
   counts as started once its process runs, and keeps running beside the main containers);
3. starts the main containers, restarts containers by the pod's `restartPolicy` (with the kubelet's
   crash-loop backoff, shortened: `podspec.Backoff`),
   sets the pod's phase, conditions and container statuses through the status subresource;
4. when the pod completes, reports the container that ended it, then stops the sidecars (reverse
   order), then writes the terminal phase (the kubelet's order);
5. when the pod is deleted, terminates it like the kubelet: SIGTERM to the main containers, wait up to
   the grace period (the deletion's, `termination.plan_grace`), SIGKILL, then the sidecars in reverse
   order, then the final status and a delete with grace period 0;
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

This module is the worker's loop and the pod's lifecycle (prepare, start order, restart rules,
termination); what it emulates of the kubelet lives beside it: `podhost.py` (what the worker needs of
the node agent, the node states), `volumes.py` (volumes and hostPath roots), `containers.py` (the
container runtime: a container's process and record), `waiting.py` (image pulls, config errors,
crash-loop backoff), `probes.py` (probes and kills for failed ones), `termination.py` (preStop,
SIGTERM, grace, SIGKILL) and `pod_status.py` (the status subresource's content).
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import KubeAPIError
from . import containers, images, podspec, probes, termination, volumes, waiting
from .containers import ContainerRun, image_mounts, image_paths
from .pod_status import (
    NODE_SHUTDOWN_MESSAGE,
    NODE_SHUTDOWN_REASON,
    Condition,
    build_status,
)
from .podhost import NodeState, Pod, PodHost, now_rfc3339
from .volumes import PrepareError

log = logging.getLogger(__name__)



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
        self.next_refresh = time.monotonic() + volumes.REFRESH_SECONDS  # configMap/secret volumes read again
        self.conditions: dict[str, Condition] = {}
        self.last_status: str | None = None
        self.grace: int | None = None
        """The grace period in force once this pod's termination started (termination.plan_grace)."""
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
        elif kind == "deleted":  # with the final object (the grace of the DELETE), or none after a relist
            if payload is not None and payload["metadata"]["uid"] == self.uid and self._newer(payload):
                self.pod = payload
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
        if self.gone:
            self._terminate(self._plan_grace(), api=False)
            return
        if api and self.shutdown_grace is not None:
            self._shut_down(self.shutdown_grace)
            return
        if api and self.pod["metadata"].get("deletionTimestamp"):
            self._terminate(self._plan_grace(), api=True)
            return
        if self.volumes is None and time.monotonic() >= self.next_prepare:
            self._prepare()
        self._reap()
        if self.volumes is not None and self.terminal is None:
            if api and time.monotonic() >= self.next_refresh:
                self.next_refresh = time.monotonic() + volumes.REFRESH_SECONDS
                volumes.refresh_volumes(self.host, self.pod, self.volumes, self._lookup)
            self._probe()
            self._advance(api)
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
                self.host.publish_hosts(self.uid, self.pod_ip, podspec.dns_names(self.pod))
            self.start_time = now_rfc3339()
            self.pod.setdefault("status", {})["podIP"] = self.pod_ip
            self.pod["status"]["hostIP"] = self.host.node_ip(self.node)
            self._post_status()  # the pod IP is known before the containers start, as on a kubelet
        try:
            self._own_status()
            self.volumes = volumes.build_volumes(self.host, self.pod, self.dir, self._lookup, self.memory_dirs)
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
            **self.host.node_env(self.node),
        }

    def _start(self, c: ContainerRun) -> None:
        assert self.volumes is not None
        self._own_status()
        entry = waiting.ensure_image(self.host, self.pod, c, self.image_backoff)
        if entry is None:
            return
        try:
            env = podspec.build_env(self.pod, c.spec, self._lookup, self._base_env())
            argv = podspec.command_line(c.spec, env)
        except ValueError as e:
            waiting.set_waiting(self.host, self.pod, c, waiting.CREATE_CONFIG_ERROR, str(e),
                             time.monotonic() + waiting.RETRY_SECONDS)
            return
        refused = podspec.verify_run_as_non_root(self.pod, c.spec, *images.image_user(entry.user))
        if refused:
            waiting.set_waiting(self.host, self.pod, c, waiting.CREATE_CONFIG_ERROR, refused,
                             time.monotonic() + waiting.RETRY_SECONDS)
            return
        mounts = []
        for m in c.spec.get("volumeMounts") or []:
            if m["name"] not in self.volumes:
                waiting.set_waiting(self.host, self.pod, c, waiting.CREATE_CONFIG_ERROR, f"volume {m['name']!r} not found",
                                 time.monotonic() + waiting.RETRY_SECONDS)
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
        proc = containers.launch(c, self.dir, argv, env, mounts, podspec.hostname(self.pod))

        def waiter() -> None:
            proc.wait()
            self.notify("wake")

        threading.Thread(target=waiter, daemon=True).start()
        self.host.emit_event(self.pod, "Started", f"Started container {c.name}", container=c.name)
        log.info("pod %s/%s: started container %s (pid %d) on %s", self.namespace, self.name, c.name,
                 proc.pid, self.node)

    def _reap(self) -> None:
        for c in self.containers:
            code = containers.reap(c, self.uid)
            if code is not None:
                log.info("pod %s/%s: container %s exited with %d", self.namespace, self.name, c.name, code)

    def _advance(self, api: bool) -> None:
        policy = self.pod["spec"].get("restartPolicy", "Always")
        for c in self.containers:
            if c.kind == "main":
                break
            if c.kind == "sidecar":
                if not c.running():
                    if not c.ever_started:
                        if c.restart_at is None or time.monotonic() >= c.restart_at:
                            self._start(c)
                    elif waiting.crash_loop_due(self.host, self.pod, c):
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
                self._finish("Failed", api)
                return
            if waiting.crash_loop_due(self.host, self.pod, c):
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
            if c.terminated is not None and podspec.should_restart(policy, c.terminated["exitCode"]) and waiting.crash_loop_due(self.host, self.pod, c):
                self._start(c)
        done = all(c.ever_started and c.terminated is not None
                   and not podspec.should_restart(policy, c.terminated["exitCode"]) for c in mains)
        if done:
            failed = any(c.terminated is not None and c.terminated["exitCode"] != 0 for c in mains)
            self._finish("Failed" if failed else "Succeeded", api)

    def _probe(self) -> None:
        probes.probe_due(self.host, self.pod, self.containers, self.pod_ip, self._label)

    def _finish(self, phase: str, api: bool) -> None:
        """The pod reached a terminal phase. As the kubelet: its status shows why at once (the container
        that ended it, terminated; the phase not yet terminal, which its status manager writes only once
        no container runs), then its sidecars stop (reverse order, within the pod's grace), then the
        terminal phase; the pod is kept for the record."""
        if api:
            try:
                self._post_status()
            except Exception as e:  # the final status says it all: stopping does not wait for the API
                log.warning("pod %s/%s: status before stopping failed: %r", self.namespace, self.name, e)
        termination.stop_in_order([c for c in self.containers if c.kind != "main"], self.pod_ip,
                                  time.monotonic() + self._plan_grace(), self._label)
        self._reap()
        self.terminal = phase
        for c in self.containers:
            c.restart_at = None
        log.info("pod %s/%s: %s", self.namespace, self.name, phase)

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
        self.conditions["DisruptionTarget"] = Condition("True", now_rfc3339(), "TerminationByKubelet",
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

    def _plan_grace(self) -> int:
        self.grace = termination.plan_grace(self.grace, self.pod)
        return self.grace

    def _stop_all(self, grace: int) -> None:
        termination.stop_all(self.containers, self.pod_ip, grace, self._label)
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

    def _cleanup(self) -> None:
        self.host.publish_hosts(self.uid, "", [])
        for c in self.containers:
            c.signal(signal.SIGKILL, group=True)
        for path in self.memory_dirs:
            shutil.rmtree(path, ignore_errors=True)

    @property
    def _label(self) -> str:
        return f"{self.namespace}/{self.name}"

    # ---- status -------------------------------------------------------------------------------
    def _post_status(self) -> None:
        if self.finished and self.terminal is None:
            return
        status = build_status(self.pod, self.containers, self.conditions, pod_ip=self.pod_ip,
                              host_ip=self.host.node_ip(self.node), start_time=self.start_time,
                              initialized=self.initialized, terminal=self.terminal,
                              prepare_error=self.prepare_error, status_reason=self.status_reason)
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
