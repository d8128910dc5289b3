"""Goodput in the status (pure): the accounting of status_fields/goodput.py, fed with what one decision observed.

Runs once per decision, after the policies decided (`reconcile.decide`), on the status the decision
writes (or the one observed):
1. `observed_marks`: what is known of the current generation (the table of status_fields/goodput.py): created =
   status.generationStartTime; running = the latest trainer `startedAt` once every worker's trainer
   started; pod 0's trainer figures (`Observed.trainer`, of this generation): the restore's end and
   start (restored_time - last_restore_seconds), the first step and the newest step reached and when,
   the seconds saves blocked the loop; detected = status.transition.since of the transition replacing
   it; devices_share = the status's shape's devices over the spec's (`devices_share`). A mark seen once is
   kept (an operator restart, a pod 0 that stopped answering).
2. `live`: the ledger advanced with the marks of the generation the observed status names and then of
   the one the decision's status names (a new generation closes the old one's window at its creation);
   as of `Observed.now`. The wall time starts when the first generation is created.
3. `with_goodput`: status.goodput is refreshed with the decision's own status write; else written on
   its own when a mark other than the trainer's progress changed, or when the progress changed and the
   status's figures are `settings.goodput_status_seconds` old (0: never for progress alone); never for
   time passing alone (the operator's steady cost stays within one request per job per minute). The metrics read `live` at every reconcile.
   A job that Succeeded or Failed keeps the figures of the moment it ended; a Suspended one those of
   the moment it was suspended, and on resume that time is left out of the wall time.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from .. import api
from .. import status as st
from ..actions import Action, SetStatus
from ..observed.snapshot import Observed
from ..settings import OperatorSettings
from ..spec import Shape
from ..status import GoodputRecord, JobStatus
from ..status_fields import goodput as gp
from ..topology import parse_dims

#: Phases in which the accounting stands still: ended, or suspended (no workers, nothing paid; on resume
#: the suspended time is left out of the wall time, goodput.pause).
FROZEN_PHASES = frozenset({*api.TERMINAL_PHASES, api.PHASE_SUSPENDED})


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _devices(shape: Shape) -> int:
    dims = parse_dims(shape.topology) or (1,)
    return shape.count * math.prod(dims)


def devices_share(shape: Shape | None, declared: Shape | None) -> float | None:
    """A generation's devices (`shape`) over the devices the spec declares, at most 1 (None: either unknown)."""
    if shape is None or declared is None or _devices(declared) <= 0:
        return None
    return round(min(1.0, _devices(shape) / _devices(declared)), 4)


def observed_marks(observed: Observed, s: JobStatus, known: gp.GenerationMarks | None,
                   declared: Shape | None = None) -> gp.GenerationMarks | None:
    """The marks of `s.generation` (None before the first generation); `known`: the ledger's marks of
    it so far (kept where nothing newer is seen); `declared`: the spec's shape (None: keep the known share)."""
    g = s.generation
    if g <= 0 or s.generation_start_time is None:
        return None
    k = known if known is not None and known.generation == g else gp.GenerationMarks(g)
    share = devices_share(s.shape, declared)
    if share is not None:
        k = replace(k, devices_share=share)
    pods = observed.pods_of(g)
    running = k.running
    started = [p.trainer_started_at for p in pods]
    if s.hosts and len(pods) >= s.hosts and all(t is not None for t in started):
        running = max(t.timestamp() for t in started if t is not None)
    marks = replace(k, created=s.generation_start_time.timestamp(), running=_r(running))
    t = observed.trainer
    if t is not None and t.generation == g:
        if t.restores and t.restored_time is not None:
            marks = replace(marks, restore_ended=_r(t.restored_time),
                            restore_began=_r(t.restored_time - t.last_restore_seconds))
        if t.first_step is not None and t.first_step_time is not None:
            marks = replace(marks, first_step=t.first_step, first_step_time=_r(t.first_step_time))
        if t.step is not None and t.step_time is not None and (marks.last_step_time is None
                                                              or t.step_time >= marks.last_step_time):
            marks = replace(marks, last_step=t.step, last_step_time=_r(t.step_time),
                            blocking_seconds=_r(t.save_blocking_seconds) or 0.0)
    tr = s.transition
    if tr is not None and tr.generation == g and marks.detected is None:
        marks = replace(marks, detected=tr.since.timestamp())
    return marks


def hung_generation(s: JobStatus) -> int | None:
    """The generation `s` says is being replaced because it hung (a transition or an in-place restart of
    kind TrainerHung), else None."""
    if s.transition is not None and s.transition.kind == st.TRAINER_HUNG:
        return s.transition.generation
    if s.in_place is not None and s.in_place.kind == st.TRAINER_HUNG:
        return s.in_place.from_generation
    return None


def live(observed: Observed, s: JobStatus, declared: Shape | None = None) -> GoodputRecord | None:
    """The accounting as of `observed.now`, for the status `s` a decision writes (see the module doc);
    `declared`: the spec's shape (the devices the device-weighted figure counts against)."""
    record = observed.status.goodput
    ledger = record.ledger if record is not None else None
    if ledger is not None and record is not None and observed.status.phase == api.PHASE_SUSPENDED:
        # resuming: the time since the suspension's figures is left out (no workers, nothing paid)
        ledger = gp.pause(ledger, record.as_of.timestamp(), st.truncate(observed.now).timestamp())
    for status in (observed.status, s):
        hung = hung_generation(status)
        if ledger is not None and ledger.current is not None and ledger.current.generation == hung \
                and not ledger.current.hang:
            ledger = replace(ledger, current=replace(ledger.current, hang=True))
        known = ledger.current if ledger is not None else None
        marks = observed_marks(observed, status, known, declared)
        if marks is None or (known is not None and marks.generation < known.generation):
            continue
        ledger = gp.advance(ledger, marks)
    if ledger is None:
        return None
    return GoodputRecord(ledger, st.truncate(observed.now))


def current(observed: Observed, s: JobStatus) -> GoodputRecord | None:
    """The figures to report now for status `s` (the metrics): `live`, or, once the job ended, what
    its status kept."""
    if s.phase in FROZEN_PHASES and observed.status.phase == s.phase:
        return s.goodput
    return live(observed, s)


def _without_progress(record: GoodputRecord | None) -> dict[str, Any] | None:
    """status.goodput's ledger less what changes while a generation trains (its progress) and the
    figures computed from it."""
    if record is None:
        return None
    cur = record.ledger.current
    if cur is not None:
        cur = replace(cur, last_step=None, last_step_time=None, blocking_seconds=0.0)
    return st.build_goodput(GoodputRecord(replace(record.ledger, current=cur), record.as_of))["ledger"]


def with_goodput(actions: list[Action], observed: Observed, settings: OperatorSettings,
                 declared: Shape | None = None) -> list[Action]:
    """`actions` with status.goodput brought up to date where due (see the module doc); `declared`: the
    spec's shape."""
    index = next((i for i, a in enumerate(actions) if isinstance(a, SetStatus)), None)
    s = actions[index].status if index is not None else observed.status  # type: ignore[union-attr]
    if s.phase in FROZEN_PHASES and observed.status.phase == s.phase:
        return actions  # the job ended (or is suspended): its accounting stopped then
    record = live(observed, s, declared)
    if record is None:
        return actions
    if index is not None:
        out = list(actions)
        out[index] = SetStatus(replace(s, goodput=record))
        return out
    old = observed.status.goodput
    if old is None or _without_progress(old) != _without_progress(record):
        return [SetStatus(replace(s, goodput=record)), *actions]
    # only the trainer's progress changed (or nothing but the time): written at most every
    # goodput_status_seconds, and never for time alone (a job whose trainer reports nothing costs no writes)
    stale = settings.goodput_status_seconds > 0 and (
        record.as_of - old.as_of).total_seconds() >= settings.goodput_status_seconds
    if stale and st.build_goodput(old)["ledger"] != st.build_goodput(record)["ledger"]:
        return [SetStatus(replace(s, goodput=record)), *actions]
    return actions
