"""Start one container: enter a private mount namespace, bind each volume at its mountPath, change to
the working directory, then exec the command (which keeps this process's pid).

Run by the node agent as `python -m resilax_local.launch <spec.json>`, where the spec is
`{"argv": [...], "env": {...}, "cwd": "...", "hostname": "...", "mounts": [{"source", "target", "read_only"}]}`.
Needs root (CAP_SYS_ADMIN) for the mount namespace, as a container runtime does.
"""

from __future__ import annotations

import ctypes
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18


def _mount(libc: ctypes.CDLL, source: str | None, target: str, flags: int) -> None:
    if libc.mount(source.encode() if source else None, target.encode(), None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def enter_volumes(mounts: list[dict[str, object]]) -> None:
    """A private mount namespace with each `source` bind-mounted at `target` (parents first)."""
    if not mounts:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)} (the node agent must run as root)")
    _mount(libc, None, "/", MS_REC | MS_PRIVATE)
    ordered = sorted(mounts, key=lambda m: len(str(m["target"])))
    # Open every source before mounting anything: a volume mounted at /tmp must not hide the source
    # of a later one that lives under /tmp (the cluster's own run folder often does).
    fds = [os.open(str(m["source"]), os.O_PATH | os.O_CLOEXEC) for m in ordered]
    try:
        for m, fd in zip(ordered, fds, strict=True):
            target = Path(str(m["target"]))
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                if not target.exists():
                    target.touch()
            _mount(libc, f"/proc/self/fd/{fd}", str(target), MS_BIND | MS_REC)
            if m.get("read_only"):
                _mount(libc, None, str(target), MS_BIND | MS_REMOUNT | MS_RDONLY)
    finally:
        for fd in fds:
            os.close(fd)


def isolation_problem() -> str | None:
    """Why this user cannot start containers here, or None; tried in a short-lived child process.

    Each container enters its own mount and UTS namespace (`enter_volumes`, `set_hostname`), which needs
    CAP_SYS_ADMIN. Without it the control plane starts fine and every pod then fails in its own log;
    `resilax local up` asks first. Called on: the machine that starts the cluster, before it starts.
    """
    probe = ("import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
             f"sys.exit(0 if libc.unshare({CLONE_NEWNS | CLONE_NEWUTS}) == 0 else ctypes.get_errno() or 1)")
    code = subprocess.run([sys.executable, "-c", probe], check=False).returncode
    if code == 0:
        return None
    reason = os.strerror(code) if code > 0 else f"the probe exited with {code}"
    return (f"cannot create a mount namespace for the pods' containers (unshare: {reason}; uid {os.geteuid()}): "
            "the local cluster's node agent runs each container as a container runtime does and needs root "
            "(CAP_SYS_ADMIN); run it as root, e.g. `sudo -E resilax local up`, or in a privileged container")


def set_hostname(name: str) -> None:
    """Own UTS namespace with the pod's hostname, as in a container (`socket.gethostname()` = the pod)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWUTS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUTS): {os.strerror(err)}")
    encoded = name.encode()
    if libc.sethostname(encoded, len(encoded)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sethostname({name!r}): {os.strerror(err)}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(args[0]).read_text())
    try:
        if spec.get("hostname"):
            set_hostname(spec["hostname"])
        enter_volumes(spec.get("mounts", []))
        cwd = spec.get("cwd") or "/"
        Path(cwd).mkdir(parents=True, exist_ok=True)
        os.chdir(cwd)
    except OSError as e:
        print(f"resilax-local: cannot set up the container: {e}", file=sys.stderr)
        return 128
    try:
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except OSError as e:
        print(f"resilax-local: cannot run {spec['argv'][0]!r}: {e}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
