"""What the sidecars and trainers report that a decision sees (pure): a final save's outcome, the
restore report, the trainer's figures, the newest checkpoint; parsed from the sidecar's answers, and
from its last words (its termination message in the pod's status, resilax_sidecar/last_words.py: the
same keys as `/v1/state`, plus `final_save`) once it is gone."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Final

from .. import api
from .. import status as st
from ..ownership import owner_uid
from ..status_fields.checkpoint import CheckpointInfo, parse_branch


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
    `/v1/state`, resilax_ckpt.control.trainer_metrics; epoch seconds). The I/O side keeps the last one it read,
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
    resilax_ckpt.control.trainer_metrics; epoch seconds): what the hang and straggler policies read."""

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
#: observed/observe.py asks every worker once pod 0 made no step for this long (or 3 of its p99 steps, if longer).
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
    branch = parse_branch(body.get("branch"))  # the rollback its branch comes from (status_fields/checkpoint.py)
    if persisted is not None:
        return CheckpointInfo(int(persisted), st.truncate(now), True, "persistent", branch)
    if local is not None:
        return CheckpointInfo(int(local), st.truncate(now), True, "local", branch)
    return None


def parse_trainer_report(body: Mapping[str, Any], generation: int) -> TrainerReport | None:
    """`trainer` of the sidecar's `GET /v1/state` (pod 0 of `generation`) → TrainerReport (None if
    absent or malformed). Its generation is the one the figures name, else `generation`: a pod kept by an
    in-place restart reports its old incarnation's figures until the new trainer writes its own."""
    raw = body.get("trainer")
    if not isinstance(raw, Mapping):
        return None

    def num(key: str) -> float | None:
        value = raw.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    def whole(key: str) -> int | None:
        value = raw.get(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    own = whole("generation")
    return TrainerReport(generation=generation if own is None else own, step=whole("step"), step_time=num("step_time"),
                         first_step=whole("first_step"), first_step_time=num("first_step_time"),
                         save_blocking_seconds=num("save_blocking_seconds") or 0.0, restores=whole("restores") or 0,
                         last_restore_seconds=num("last_restore_seconds") or 0.0, restored_time=num("restored_time"))


@dataclass(frozen=True)
class LastWords:
    """A worker pod's sidecar's termination message (None of it while the sidecar runs), as the watch
    last showed the pod (indexes.LastWordsIndex keeps it after the pod is gone)."""

    pod: str
    generation: int
    #: The parsed message: `/v1/state`'s keys (trainer, newest_persisted_step, ...) and `final_save`.
    words: Mapping[str, Any]
    #: The pod's resilax.dev/save-request annotation ("<operator's id>=<sidecar's id>"; "" for none).
    save_request: str = ""
    #: uid of the JAXJob that controls the pod (a job of the same name before it leaves words too).
    owner_uid: str = ""

    def save_outcome(self, request_id: str) -> SaveOutcome | None:
        """The final save it reports for the operator's `request_id` (None: not that request, or pending)."""
        operator_id, _, sidecar_id = self.save_request.partition("=")
        save = self.words.get("final_save")
        if operator_id != request_id or not sidecar_id or not isinstance(save, Mapping) or save.get("id") != sidecar_id:
            return None
        try:
            return parse_save_outcome(request_id, save)
        except (TypeError, ValueError):
            return None


def parse_last_words(pod: Mapping[str, Any]) -> LastWords | None:
    """The sidecar's last words of a worker pod: its container's `terminated.message` (its current state,
    else its last one), a JSON object; None when it has none or it does not parse."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    statuses = [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]
    cs = next((c for c in statuses if c.get("name") == api.SIDECAR_CONTAINER), None)
    if cs is None:
        return None
    ended = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
    try:
        words = json.loads(ended.get("message") or "null")
        generation = int((meta.get("labels") or {}).get(api.LABEL_GENERATION) or 0)
    except ValueError:
        return None
    if not isinstance(words, Mapping) or generation <= 0:
        return None
    annotation = (meta.get("annotations") or {}).get(api.ANNOTATION_SAVE_REQUEST) or ""
    return LastWords(str(meta.get("name") or ""), generation, words, str(annotation), owner_uid(pod))


def newest_trainer_report(kept: TrainerReport | None, words: Iterable[LastWords],
                          generation: int) -> TrainerReport | None:
    """The trainer report of `generation` with its newest step: `kept` (pod 0's, as last read), brought
    forward to the furthest step any of the generation's sidecars left in its last words (every process
    steps together: the furthest is where the generation stopped). None when nothing is known."""
    best = kept if kept is not None and kept.generation == generation else None
    for w in words:
        trainer = w.words.get("trainer")
        said = trainer.get("generation") if isinstance(trainer, Mapping) else None
        if (said if isinstance(said, int) else w.generation) != generation:  # a kept pod's label may be older
            continue
        r = parse_trainer_report(w.words, generation)
        if r is None or r.step is None or r.step_time is None:
            continue
        if best is None:
            best = r
        elif best.step is None or best.step_time is None or (r.step, r.step_time) > (best.step, best.step_time):
            best = replace(best, step=r.step, step_time=r.step_time,
                           save_blocking_seconds=max(best.save_blocking_seconds, r.save_blocking_seconds))
    return best
