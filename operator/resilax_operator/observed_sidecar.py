"""What the sidecars and trainers report that a decision sees (pure): a final save's outcome, the
restore report, the trainer's figures, the newest checkpoint; parsed from the sidecar's answers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

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


@dataclass(frozen=True)
class HostFigures:
    """One worker's trainer figures as its sidecar last reported them (`trainer` in `/v1/state`,
    resilax_ckpt.trainer_metrics; epoch seconds): what the hang and straggler policies read."""

    generation: int | None = None
    step: int | None = None
    #: When the loop first reached `step`.
    step_time: float | None = None
    #: The last write of the figures (every second, also while the loop is blocked; stale: stopped).
    heartbeat: float | None = None
    phase: str = ""
    phase_since: float | None = None
    #: This host's own median step time (less the request barrier's wait); None during warm-up.
    step_seconds: float | None = None
    step_seconds_p99: float | None = None
    save_seconds_p99: float | None = None
    last_restore_seconds: float = 0.0


def _num(raw: Mapping[str, Any], key: str) -> float | None:
    value = raw.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _whole(raw: Mapping[str, Any], key: str) -> int | None:
    value = raw.get(key)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def parse_host_figures(body: Mapping[str, Any]) -> HostFigures | None:
    """`trainer` of a sidecar's `GET /v1/state` → HostFigures (None if absent or not a mapping)."""
    raw = body.get("trainer")
    if not isinstance(raw, Mapping):
        return None
    phase = raw.get("phase")
    return HostFigures(generation=_whole(raw, "generation"), step=_whole(raw, "step"), step_time=_num(raw, "step_time"),
                       heartbeat=_num(raw, "heartbeat"), phase=phase if isinstance(phase, str) else "",
                       phase_since=_num(raw, "phase_since"), step_seconds=_num(raw, "step_seconds"),
                       step_seconds_p99=_num(raw, "step_seconds_p99"), save_seconds_p99=_num(raw, "save_seconds_p99"),
                       last_restore_seconds=_num(raw, "last_restore_seconds") or 0.0)


#: A heartbeat (written every second, also while the loop is blocked) older than this: the process stopped.
HEARTBEAT_STALE_SECONDS: Final = 10.0
#: observe.py asks every worker once pod 0 made no step for this long (or 3 of its p99 steps, if longer).
SUSPECT_SECONDS: Final = 10.0


def worth_asking_every_host(pod0: HostFigures | None, now: float) -> bool:
    """Whether pod 0's figures look stalled enough that every worker's sidecar is worth asking (its
    heartbeat stale, or no step for SUSPECT_SECONDS or 3 of its p99 steps, whichever is longer)."""
    if pod0 is None:
        return False
    if pod0.heartbeat is not None and now - pod0.heartbeat > HEARTBEAT_STALE_SECONDS:
        return True
    since = max((t for t in (pod0.step_time, pod0.phase_since) if t is not None), default=None)
    if since is None:
        return False
    return now - since >= max(SUSPECT_SECONDS, 3 * (pod0.step_seconds_p99 or 0.0))


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
