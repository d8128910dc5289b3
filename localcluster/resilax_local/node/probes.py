"""Container probes (startup, readiness, liveness) as the kubelet runs them: exec in the container's
mount namespace (`nsenter`), httpGet and tcpSocket against the pod IP.

`ProbeState` keeps one probe's schedule and consecutive counts; `run_probe` runs one check;
`probe_due` runs a pod's due probes and `kill_for_probe` stops a container whose startup or liveness
probe failed (then the pod's restart rules apply).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .containers import ContainerRun
    from .podhost import Pod, PodHost

log = logging.getLogger(__name__)

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _port(value: Any, container: dict[str, Any]) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(value, int) or str(value).isdigit():
        return int(value)
    for port in container.get("ports") or []:
        if port.get("name") == value:
            return int(port["containerPort"])
    raise ValueError(f"container {container['name']!r} has no port named {value!r}")


def run_probe(probe: dict[str, Any], container: dict[str, Any], pod_ip: str, pid: int, env: dict[str, str]) -> bool:
    """One check of `probe` (a Kubernetes Probe) for the container running as `pid`; True on success."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "exec" in probe:
            argv = ["nsenter", f"--target={pid}", "--mount", "--", *probe["exec"]["command"]]
            return subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=timeout, check=False).returncode == 0
        if "httpGet" in probe:
            get = probe["httpGet"]
            host = get.get("host") or pod_ip
            url = f"{get.get('scheme', 'HTTP').lower()}://{host}:{_port(get['port'], container)}{get.get('path', '/')}"
            request = urllib.request.Request(url, headers={h["name"]: h["value"] for h in get.get("httpHeaders") or []})
            with _NO_PROXY.open(request, timeout=timeout) as resp:
                return 200 <= resp.status < 400
        if "tcpSocket" in probe:
            tcp = probe["tcpSocket"]
            with socket.create_connection((tcp.get("host") or pod_ip, _port(tcp["port"], container)), timeout=timeout):
                return True
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return False
    return False  # grpc probes are not supported: never succeed, so the gap shows


@dataclass
class ProbeState:
    """One probe of one container run: when it is due next and its consecutive results."""

    probe: dict[str, Any]
    started_at: float = field(default_factory=time.monotonic)
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    passed: bool = False

    def __post_init__(self) -> None:
        self.next_at = self.started_at + float(self.probe.get("initialDelaySeconds", 0))

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def record(self, ok: bool, now: float) -> None:
        """Count a result; `passed` follows successThreshold / failureThreshold."""
        self.next_at = now + float(self.probe.get("periodSeconds", 10))
        if ok:
            self.successes += 1
            self.failures = 0
            if self.successes >= int(self.probe.get("successThreshold", 1)):
                self.passed = True
        else:
            self.failures += 1
            self.successes = 0
            if self.failures >= int(self.probe.get("failureThreshold", 3)):
                self.passed = False

    @property
    def failed(self) -> bool:
        return self.failures >= int(self.probe.get("failureThreshold", 3))


def probe_due(host: PodHost, pod: Pod, containers: list[ContainerRun], pod_ip: str | None, label: str) -> None:
    """Run the due probes; a failed startup or liveness probe stops the container (then restart rules)."""
    now = time.monotonic()
    for c in containers:
        if c.proc is None or not c.running() or pod_ip is None:
            continue
        pid = c.proc.pid
        if c.startup is not None and not c.startup.passed:
            if c.startup.due(now):
                c.startup.record(run_probe(c.startup.probe, c.spec, pod_ip, pid, c.env), now)
                if c.startup.passed:
                    c.startup_passed_once = True
                elif c.startup.failed:
                    kill_for_probe(host, pod, c, "startup", label)
            continue
        if c.readiness is not None and c.readiness.due(now):
            c.readiness.record(run_probe(c.readiness.probe, c.spec, pod_ip, pid, c.env), now)
        if c.liveness is not None and c.liveness.due(now):
            c.liveness.record(run_probe(c.liveness.probe, c.spec, pod_ip, pid, c.env), now)
            if c.liveness.failed:
                kill_for_probe(host, pod, c, "liveness", label)


def kill_for_probe(host: PodHost, pod: Pod, c: ContainerRun, kind: str, label: str) -> None:
    """SIGTERM, then SIGKILL after the grace period, as the kubelet does for a failed probe."""
    log.info("pod %s: container %s failed its %s probe, restarting", label, c.name, kind)
    host.emit_event(pod, "Unhealthy", f"{kind.capitalize()} probe failed", warning=True, container=c.name)
    host.emit_event(pod, "Killing", f"Container {c.name} failed {kind} probe, will be restarted",
                    container=c.name)
    assert c.proc is not None
    proc = c.proc
    c.startup = c.readiness = c.liveness = None
    c.signal(signal.SIGTERM)
    grace = float(pod["spec"].get("terminationGracePeriodSeconds", 30))

    def kill_late() -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(grace, kill_late)
    timer.daemon = True
    timer.start()
