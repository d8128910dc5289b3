"""What the sidecars and trainers report that a decision sees (pure): a final save's outcome, the
restore report, the trainer's figures, the newest checkpoint; parsed from the sidecar's answers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from . import status as st
from .status import CheckpointInfo


@dataclass(frozen=True)
class SaveOutcome:
    """A final save result a sidecar reported ($RESILAX_CONTROL_DIR/results/<id>.json)."""

    request_id: str
    step: int | None = None
    committed: bool = False
    error: str | None = None


@dataclass(frozen=True)
class RestoreReport:
    """The trainer's restore of the newest step (`restore` in the sidecar's `/v1/state`)."""

    step: int | None
    #: (step, why) of each newer committed step it could not read and skipped.
    skipped: tuple[tuple[int, str], ...] = ()
    #: The generation whose trainer restored (None: a trainer of an older library that does not say).
    generation: int | None = None
    #: Where the processes read it: "local", "peer" or "persistent", the farthest tier any process
    #: needed ("" when not reported).
    source: str = ""


@dataclass(frozen=True)
class TrainerReport:
    """The figures pod 0's trainer last reported for one generation (`trainer` in its sidecar's
    `/v1/state`, resilax_ckpt.trainer_metrics; epoch seconds). The I/O side keeps the last one it read,
    so a pod 0 that died leaves what it said last."""

    generation: int
    step: int | None = None
    step_time: float | None = None
    first_step: int | None = None
    first_step_time: float | None = None
    save_blocking_seconds: float = 0.0
    restores: int = 0
    last_restore_seconds: float = 0.0
    restored_time: float | None = None


def parse_save_outcome(request_id: str, body: Mapping[str, Any]) -> SaveOutcome | None:
    """The sidecar's `GET /v1/save/{id}` answer → SaveOutcome for the operator's `request_id`
    (None while it is pending)."""
    state = body.get("status")
    if state == "pending":
        return None
    step = body.get("step")
    return SaveOutcome(request_id, None if step is None else int(step), bool(body.get("committed")),
                       body.get("error") or (None if state == "committed" else f"save {state}"))


def parse_restore_report(body: Mapping[str, Any]) -> RestoreReport | None:
    """`restore` of the sidecar's `GET /v1/state` → RestoreReport (None if absent or malformed)."""
    raw = body.get("restore")
    if not isinstance(raw, Mapping):
        return None
    try:
        step = None if raw.get("step") is None else int(raw["step"])
        skipped = tuple((int(s["step"]), str(s.get("reason", ""))) for s in raw.get("skipped") or [])
        generation = None if raw.get("generation") is None else int(raw["generation"])
    except (KeyError, TypeError, ValueError):
        return None
    return RestoreReport(step, skipped, generation, str(raw.get("source") or ""))


def parse_sidecar_state(body: Mapping[str, Any], now: datetime) -> CheckpointInfo | None:
    """The sidecar's `GET /v1/state` answer → the newest checkpoint it knows (persisted beats local).
    `time` is when the operator first saw the step (the status keeps the first time it saw it)."""
    persisted, local = body.get("newest_persisted_step"), body.get("newest_local_step")
    if persisted is not None:
        return CheckpointInfo(int(persisted), st.truncate(now), True, "persistent")
    if local is not None:
        return CheckpointInfo(int(local), st.truncate(now), True, "local")
    return None


def parse_trainer_report(body: Mapping[str, Any], generation: int) -> TrainerReport | None:
    """`trainer` of the sidecar's `GET /v1/state` (pod 0 of `generation`) → TrainerReport (None if
    absent or malformed)."""
    raw = body.get("trainer")
    if not isinstance(raw, Mapping):
        return None

    def num(key: str) -> float | None:
        value = raw.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    def whole(key: str) -> int | None:
        value = raw.get(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    return TrainerReport(generation=generation, step=whole("step"), step_time=num("step_time"),
                         first_step=whole("first_step"), first_step_time=num("first_step_time"),
                         save_blocking_seconds=num("save_blocking_seconds") or 0.0, restores=whole("restores") or 0,
                         last_restore_seconds=num("last_restore_seconds") or 0.0, restored_time=num("restored_time"))
