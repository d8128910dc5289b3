"""Start and stop background processes, each in its own process group, so nothing is left behind."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (another program may bind it before the caller
    does: start servers through `on_free_port`, which retries that race)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class PortTaken(Exception):
    """What a start-up raises when the port `free_port()` found was bound by another program before
    it: the harness's race on a shared machine, not a fault of what is started."""


def on_free_port(start: Callable[[int], T], attempts: int = 3) -> T:
    """`start(port)` on a port free right now; when it raises PortTaken, again on another port, at
    most `attempts` times in all (the last PortTaken propagates)."""
    for attempt in range(attempts):
        try:
            return start(free_port())
        except PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None,
          cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """Start `argv` in a new session (its own process group), stdout and stderr appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True)


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def kill_session(sid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send `sig` to every live process of the session `sid` (a container's: its process was started
    with `start_new_session`, so the session is its pid), as a cgroup kill reaches every process of a
    container, also those in process groups of their own (a supervisor's children, `resilax run`).
    Returns the pids signalled."""
    hit = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.getsid(pid) != sid or not alive(pid):
                continue
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue
        hit.append(pid)
    return hit


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) succeeds for zombies too: look for a live member
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid and alive(int(entry)):
                    return True
            except ProcessLookupError:
                continue
    return False


def stop_group(pgid: int, timeout: float = 10.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """SIGTERM the process group `pgid`, wait up to `timeout`, then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc is not None:
                proc.poll()
            if not group_alive(pgid):
                break
            time.sleep(0.1)
        else:
            continue
        break
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1)


def stop_process_group(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM the process group of `proc`, then SIGKILL what is left after `timeout`."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
