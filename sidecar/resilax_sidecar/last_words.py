"""The sidecar's last words: what it knew when it exited, left in its container's termination message so
the operator can read it from the pod's status until the pod is gone (the kubelet copies the file at
`terminationMessagePath` into `state.terminated.message` when the container ends).

Why: a worker that exits ends its pod, and the sidecar with it (a native sidecar is stopped once the
trainer exited), often before the operator's next look at `/v1/state`. Its last words keep, for the
operator's accounting (docs/architecture.md, "Exact accounting"):
* the trainer's last step and when it reached it (`trainer`: the figures of resilax_ckpt.control.trainer_metrics,
  the ones the operator reads), so the steps a recovery lost are counted exactly;
* the newest committed steps (`newest_persisted_step`, `newest_local_step`) and the rollback their branch
  comes from (`branch`), so that words left before a rollback never outrank a step seen after it;
* the final save (`final_save`: the sidecar's id of the stop request it waited for, as `GET /v1/save/{id}`
  answers it), so a final save committed just before the workers exited is recorded;
* the pod's health check (`health_check`: `{"passed", "failed_part", "reason"}`), which says why the
  sidecar of a pod whose check failed made no final save (read by people, dropped first when too long).

The same keys as `/v1/state`, so the operator parses both alike. At most MAX_BYTES (the kubelet keeps
4096): figures the operator does not read are dropped first.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

log = logging.getLogger(__name__)

#: The kubelet keeps the first 4096 bytes of a termination message.
MAX_BYTES: Final = 4096
#: The trainer figures the operator reads (observed.sidecar.parse_trainer_report, parse_host_figures).
TRAINER_KEYS: Final = ("generation", "step", "step_time", "first_step", "first_step_time", "save_blocking_seconds",
                       "restores", "last_restore_seconds", "restored_time", "heartbeat", "phase")
STATE_KEYS: Final = ("generation", "process_id", "newest_persisted_step", "newest_local_step", "branch",
                     "health_check")
SAVE_KEYS: Final = ("id", "status", "step", "committed", "error")


def build_last_words(state: Mapping[str, Any], final_save: Mapping[str, Any] | None) -> str:
    """The termination message (compact JSON, at most MAX_BYTES) from a `/v1/state` answer and the final
    save's `GET /v1/save/{id}` answer (None: none was asked)."""
    words: dict[str, Any] = {k: state.get(k) for k in STATE_KEYS if state.get(k) is not None}
    trainer = state.get("trainer")
    if isinstance(trainer, Mapping):
        words["trainer"] = {k: trainer[k] for k in TRAINER_KEYS if trainer.get(k) is not None}
    if final_save is not None:
        save = {k: final_save.get(k) for k in SAVE_KEYS}
        if isinstance(save["error"], str):
            save["error"] = save["error"][:500]
        words["final_save"] = save
    text = json.dumps(words, separators=(",", ":"))
    for drop in ("health_check", "trainer", "final_save"):  # never expected: the figures are a few hundred bytes
        if len(text.encode()) <= MAX_BYTES:
            break
        words.pop(drop, None)
        text = json.dumps(words, separators=(",", ":"))
    return text


def write_last_words(path: Path | None, text: str) -> None:
    """Write the termination message in place (the kubelet's file is a bind mount: no rename); best effort."""
    if path is None:
        return
    try:
        with path.open("w") as f:
            f.write(text)
    except OSError as e:
        log.warning("cannot write the termination message to %s: %s", path, e)
