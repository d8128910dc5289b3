"""Save requests from outside the training loop (docs/architecture.md, "Save requests").

The sidecar or operator drops `$RESILAX_CONTROL_DIR/requests/<id>.json` =
`{"id": ..., "reason": "manual|preemption|resize", "stop": bool}`; after the agreed step is committed
(or failed) the manager writes `$RESILAX_CONTROL_DIR/results/<id>.json` =
`{"id", "step", "committed", "error"}` and removes the request file.

When the trainer stops after a final save (a request with stop, or SIGTERM, which no request file
announces) the manager writes `$RESILAX_CONTROL_DIR/stopped.json` = `{"step": N, "sigterm": bool}` once
step N is committed, so the sidecar, whose own request then finds no trainer to answer it, knows which
local step is the final one and persists it even where `persistEverySteps` would keep it local.

After a restore of the newest step the manager also writes `$RESILAX_CONTROL_DIR/restore.json` =
`{"step": N, "skipped": [{"step": M, "reason": "..."}], "generation": G, "source": "local|peer|persistent"}`:
the generation that restored, where its processes read the step (the farthest tier any of them needed;
absent when none could be restored), the step restored (None: none could be) and
the newer committed steps it had to skip because they could not be read (marked bad; with a local
tier also a local copy read from the persistent tier instead, `"tier": "local"`). The sidecar
reports it in `/v1/state` as `restore`; the operator turns skipped steps into an event.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os

from resilax_ckpt.control.control_files import load_control_json

log = logging.getLogger(__name__)

REQUESTS_DIR = "requests"
RESULTS_DIR = "results"
RESTORE_REPORT = "restore.json"
STOP_RECORD = "stopped.json"
TRAINER_LOCK = "trainer.lock"
"""A live trainer holds a shared `flock` on this file; the kernel drops it when the process dies, so
the sidecar can tell a trainer that will still answer a request from one that is gone."""


def write_restore_report(control_dir: str, report: dict[str, object]) -> None:
    """Write `restore.json` atomically (temporary name, rename). Called on: each process."""
    os.makedirs(control_dir, exist_ok=True)
    path = os.path.join(control_dir, RESTORE_REPORT)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


def read_restore_report(control_dir: str) -> dict[str, object] | None:
    """The trainer's last restore report, or None (no restore yet, or unreadable)."""
    raw = load_control_json(os.path.join(control_dir, RESTORE_REPORT))
    return raw if isinstance(raw, dict) else None


def write_stop_record(control_dir: str, step: int, sigterm: bool) -> None:
    """Record the committed final save the trainer stops after (temporary name, rename).
    Called on: each process (its own control folder)."""
    os.makedirs(control_dir, exist_ok=True)
    path = os.path.join(control_dir, STOP_RECORD)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"step": step, "sigterm": sigterm}, f)
    os.replace(tmp, path)


def read_stop_record(control_dir: str) -> int | None:
    """The step of the trainer's committed final save, or None (it has not stopped after one)."""
    raw = load_control_json(os.path.join(control_dir, STOP_RECORD))
    step = raw.get("step") if isinstance(raw, dict) else None
    return step if isinstance(step, int) else None


def clear_stop_record(control_dir: str) -> None:
    """Forget an earlier trainer's record (a new trainer starts). Called on: each process."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(control_dir, STOP_RECORD))


@dataclasses.dataclass(frozen=True)
class SaveRequest:
    id: str
    reason: str
    stop: bool
    path: str | None = None
    """The request file (None for a SIGTERM)."""


class RequestWatcher:
    """Notices request files in one control folder. Called on: each process (its own pod's folder)."""

    def __init__(self, control_dir: str) -> None:
        self._dir = os.path.join(control_dir, REQUESTS_DIR)
        self._results = os.path.join(control_dir, RESULTS_DIR)
        self._seen: set[str] = set()
        self._lock_fd: int | None = None

    def hold_trainer_lock(self) -> None:
        """Announce a live trainer: a shared flock on `trainer.lock`, held until `release()`."""
        if self._lock_fd is not None:
            return
        control_dir = os.path.dirname(self._dir)
        os.makedirs(control_dir, exist_ok=True)
        fd = os.open(os.path.join(control_dir, TRAINER_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._lock_fd = fd

    def release(self) -> None:
        """Drop the trainer lock: no more results will be written."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def poll(self) -> list[SaveRequest]:
        """New requests since the last poll (files whose name ends in .json; others are in flight)."""
        try:
            names = os.listdir(self._dir)
        except FileNotFoundError:
            return []
        found = []
        for name in sorted(names):
            if not name.endswith(".json") or name in self._seen:
                continue
            path = os.path.join(self._dir, name)
            try:
                with open(path, "rb") as f:
                    raw = json.load(f)
                request = SaveRequest(id=str(raw.get("id") or name[:-5]), reason=str(raw.get("reason", "manual")),
                                      stop=bool(raw.get("stop", False)), path=path)
            except (OSError, ValueError, AttributeError) as e:
                log.warning("ignoring unreadable save request %s: %s", path, e)
                request = SaveRequest(id=name[:-5], reason="invalid", stop=False, path=path)
            self._seen.add(name)
            found.append(request)
        return found

    def write_result(self, request: SaveRequest, step: int | None, committed: bool, error: str | None) -> None:
        os.makedirs(self._results, exist_ok=True)
        body = json.dumps({"id": request.id, "step": step, "committed": committed, "error": error}).encode()
        final = os.path.join(self._results, f"{request.id}.json")
        tmp = f"{final}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, final)
        if request.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(request.path)
            self._seen.discard(os.path.basename(request.path))
