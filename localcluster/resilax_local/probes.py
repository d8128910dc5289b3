"""Container probes (startup, readiness, liveness) as the kubelet runs them: exec in the container's
mount namespace (`nsenter`), httpGet and tcpSocket against the pod IP.

`ProbeState` keeps one probe's schedule and consecutive counts; `run_probe` runs one check.
"""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

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
