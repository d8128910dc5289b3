"""Save requests to the trainer and its answers, through files in `RESILAX_CONTROL_DIR`.

The contract (docs/architecture.md, "Save requests"): a request is `requests/<id>.json` =
`{"id", "reason", "stop"}`, written to a temporary name and renamed; the trainer's checkpoint manager
answers with `results/<id>.json` = `{"id", "step", "committed", "error"}`.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resilax_ckpt.control.control_files import load_control_json
from resilax_ckpt.control.health_verdict import HealthVerdict
from resilax_ckpt.control.requests import REQUESTS_DIR, RESULTS_DIR, TRAINER_LOCK

# The file protocol's names are defined once, in the library (resilax_ckpt.control.requests). A live trainer
# holds a shared `flock` on TRAINER_LOCK; the kernel drops it when the process ends, however it ends,
# so the sidecar can tell a gone trainer from a slow one.
__all__ = ["REQUESTS_DIR", "RESULTS_DIR", "TRAINER_LOCK"]

_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,80}$")


def valid_request_id(request_id: str) -> bool:
    """Ids are short and safe as file names (no path tricks through the URL)."""
    return bool(_ID_RE.match(request_id))


def new_request_id(reason: str) -> str:
    """A unique id that sorts by time and says why: `20261202T162530-preemption-1a2b3c4d`."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return f"{stamp}-{reason}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class SaveResult:
    """The trainer's answer to one request."""

    id: str
    step: int | None
    committed: bool
    error: str | None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "step": self.step, "committed": self.committed, "error": self.error}


def write_request(control_dir: Path, request_id: str, reason: str, stop: bool) -> Path:
    """Drop a request file for the trainer (temporary name, then rename: it appears whole)."""
    folder = control_dir / REQUESTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{request_id}.json"
    tmp = folder / f".{request_id}.json.tmp"
    body = {"id": request_id, "reason": reason, "stop": stop, "time": time.time()}
    with open(tmp, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def request_pending(control_dir: Path, request_id: str) -> bool:
    """Whether the request file is still there (the trainer has not consumed it, or keeps it)."""
    return (control_dir / REQUESTS_DIR / f"{request_id}.json").exists()


def withdraw_request(control_dir: Path, request_id: str) -> None:
    """Remove a request nobody answered, so a trainer started later does not act on a stale one."""
    (control_dir / REQUESTS_DIR / f"{request_id}.json").unlink(missing_ok=True)


def read_result(control_dir: Path, request_id: str) -> SaveResult | None:
    """The trainer's answer, or None while there is none (or it is being written)."""
    path = control_dir / RESULTS_DIR / f"{request_id}.json"
    raw = load_control_json(str(path))
    if not isinstance(raw, dict):
        return None
    step = raw.get("step")
    error = raw.get("error")
    return SaveResult(
        id=request_id,
        step=int(step) if isinstance(step, int) else None,
        committed=bool(raw.get("committed")),
        error=str(error) if error else None,
    )


def trainer_alive(control_dir: Path) -> bool | None:
    """True while a trainer holds `trainer.lock`, False once none does, None when the trainer never
    made the file (a trainer that does not announce itself: the sidecar cannot tell)."""
    path = control_dir / TRAINER_LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def plan_nothing_to_save(verdict: HealthVerdict | None, alive: bool | None) -> str | None:
    """Why no trainer ever ran in this pod, so a final save has nothing to save, or None (pure).

    Only when the pod's health check failed (`verdict`: its `health.json`; the trainer container never
    starts after a failed init container) and no trainer announced itself (`alive` is None: no
    `trainer.lock`). A trainer that does not announce itself after a passed check, or in a pod without a
    check, still gets the whole wait: the sidecar cannot tell it from none."""
    if verdict is None or verdict.passed or alive is not None:
        return None
    what = f"{verdict.failed_part}: {verdict.reason}" if verdict.failed_part else (verdict.reason or "no reason given")
    return f"the health check failed ({what}) and no trainer ran in this pod: nothing to save"
