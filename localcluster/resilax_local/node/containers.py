"""The container runtime of the local node agent: each container is a process group started through
`python -m resilax_local.launch <spec>` (a private mount namespace with the pod's volumes bound at their
`mountPath`, the "image" being this Python and the project), and its record (`ContainerRun`: process,
restarts, last termination, probe states) as the kubelet's container status needs it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from ..processes import kill_session
from . import podspec
from .podhost import now_rfc3339
from .probes import ProbeState

#: The kubelet's default `terminationMessagePath` and the most of a termination message it keeps.
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
MAX_TERMINATION_MESSAGE = 4096


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
    termination_log: Path | None = None
    """The host file bound at its `terminationMessagePath` for its current run (its last words)."""

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
        if group and sig == signal.SIGKILL:
            kill_session(self.proc.pid)  # also the process groups a supervisor started


def image_paths() -> list[str]:
    """The "image" every container runs: this Python (the virtualenv and the interpreter it was made
    from) and, for a checkout, the project folder its editable install points into."""
    paths = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    project = Path(__file__).resolve().parents[3]
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


def termination_message(path: Path | None) -> str:
    """What a container wrote to its termination log (the kubelet keeps the first MAX_TERMINATION_MESSAGE
    bytes; policy File: nothing written, no message)."""
    if path is None:
        return ""
    try:
        with path.open("rb") as f:
            return f.read(MAX_TERMINATION_MESSAGE).decode(errors="replace")
    except OSError:
        return ""


def container_id(uid: str, c: ContainerRun) -> str:
    return f"resilax://{uid}/{c.name}/{c.restart_count}"


def launch(c: ContainerRun, pod_dir: Path, argv: list[str], env: dict[str, str], mounts: list[dict[str, Any]],
           hostname: str) -> subprocess.Popen[bytes]:
    """Start `c`'s next run (its restart count bumped when it ran before): the launch spec under
    `<pod_dir>/specs/`, the output appended to `<pod_dir>/logs/<container>/<restart>.log`; its probes
    start afresh. Returns the process (the caller watches it exit)."""
    if c.ever_started:
        c.restart_count += 1
    log_dir = pod_dir / "logs" / c.name
    log_dir.mkdir(parents=True, exist_ok=True)
    spec_path = pod_dir / "specs" / f"{c.name}-{c.restart_count}.json"
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    # The kubelet's termination message: a fresh file per run at terminationMessagePath, read at its exit.
    c.termination_log = pod_dir / "termination" / f"{c.name}-{c.restart_count}.log"
    c.termination_log.parent.mkdir(parents=True, exist_ok=True)
    c.termination_log.write_bytes(b"")
    c.termination_log.chmod(0o666)  # as the kubelet makes it: writable by a container's non-root user
    mounts = [*mounts, {"source": str(c.termination_log), "read_only": False,
                        "target": c.spec.get("terminationMessagePath") or TERMINATION_MESSAGE_PATH}]
    spec_path.write_text(json.dumps({"argv": argv, "env": env, "cwd": c.spec.get("workingDir") or "/",
                                     "hostname": hostname, "mounts": mounts}, indent=1))
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
    return c.proc


def reap(c: ContainerRun, uid: str) -> int | None:
    """Record the exit of `c`'s process if it exited (its `terminated` state) and kill what it left
    (its children go with it, as with a pid namespace); its exit code, None while it runs."""
    if c.proc is None or c.proc.poll() is None:
        return None
    code = c.proc.returncode
    exit_code = 128 - code if code < 0 else code
    c.terminated = {
        "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
        "startedAt": c.started_at, "finishedAt": now_rfc3339(),
        "containerID": container_id(uid, c),
    }
    if code < 0:
        c.terminated["signal"] = -code
    message = termination_message(c.termination_log)
    if message:
        c.terminated["message"] = message
    c.finished_at = time.monotonic()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(c.proc.pid, signal.SIGKILL)
    kill_session(c.proc.pid)  # the container's end takes its whole session, as a cgroup kill does
    c.proc = None
    return exit_code
