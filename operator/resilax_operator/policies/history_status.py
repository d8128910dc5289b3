"""status.history kept up to date (pure): one entry per generation (status_fields/history.py), derived from the status
transitions the operator already writes, after the policies and the goodput accounting decided
(`reconcile.decide`).

Write budget: the history never causes a status write of its own. `with_history` updates it only inside
a decision that writes the status anyway (a SetStatus that changes something besides the history);
what it saw meanwhile waits for that write. Deciding twice gives the same history (a pure function of the
stored status and what the decision observed).

| the decision's status (old -> new)                          | the history                                      |
|-------------------------------------------------------------|--------------------------------------------------|
| a generation the history has no entry for (start, shape)   | a new entry; the one before it ends at its start if nothing ended it |
| its shape or pools change while it runs (record_pools)      | the entry follows                                |
| `transition` of generation G begins                          | G ends: end = transition.since, endReason = the finding's Event reason (transition.reason; Suspended for a suspend) |
| `inPlace` from G begins (generation G+1 written at once)    | G ends as above (inPlace.reason); G+1's entry has inPlace: true |
| phase Succeeded or Failed                                   | the current generation ends now, endReason = the Ready condition's reason (Completed, MaxRestartsExceeded, ...) |
| pod 0's restore report of generation G (`/v1/state` restore) | G's restoredStep and restoredFrom                |
| the goodput marks of G (first and newest step seen)          | G's firstStep and lastStep                       |
| pod 0's newest committed step, from G's first step to the newest it reached | added to G's checkpoints (the newest 20) |
| the goodput ledger: G's window open, or closed by G+1        | G's goodput (the window's seconds by bucket; a window whose productive time is less than the earlier lost steps it redid shows 0 productive, the rest in lostStepsRedone) |
| a later generation restored step R (or first stepped at R+1) | lostSteps of the last generation before it that stepped = its last step - R |
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime
from typing import Final

from .. import api
from .. import status as st
from ..actions import Action, SetStatus
from ..observed.snapshot import Observed
from ..status import JobStatus
from ..status_fields import goodput as gp
from ..status_fields.history import MAX_CHECKPOINTS, MAX_ENTRIES, RESTORE_SOURCES, HistoryEntry, clip_message
from .goodput_status import observed_marks

#: A transition's Event reason when the status does not name it (a transition begun by an older operator).
KIND_REASONS: Final = {
    st.PREEMPTION: api.PREEMPTION_NOTICE.name, st.NODE_LOSS: api.NODE_LOST.name, st.POD_LOST: api.POD_LOST.name,
    st.WORKER_FAILURE: api.WORKER_FAILED.name, st.WORKER_STOPPED: api.WORKER_STOPPED.name,
    st.RESIZE: api.SPEC_RESIZED.name, st.GROW_BACK: api.GROW_BACK.name, st.SHRINK: api.CAPACITY_TIMEOUT.name,
    st.SUSPEND: api.SUSPENDED.name, st.ROLLBACK: api.ROLLBACK_ASKED.name,
}


def with_history(actions: list[Action], observed: Observed) -> list[Action]:
    """`actions` with status.history brought up to date in the decision's status write, if it makes one."""
    index = next((i for i, a in enumerate(actions) if isinstance(a, SetStatus)), None)
    if index is None:
        return actions
    s = actions[index].status  # type: ignore[union-attr]
    o = observed.status
    if st.build_status(replace(s, history=o.history)) == st.build_status(o):
        return actions  # nothing else changes: no write, and the history waits for one
    history = record(observed, s)
    if history == s.history:
        return actions
    out = list(actions)
    out[index] = SetStatus(replace(s, history=history))
    return out


def record(observed: Observed, s: JobStatus) -> tuple[HistoryEntry, ...]:
    """The history for the status `s` a decision writes (see the module's table)."""
    o = observed.status
    entries = list(o.history)
    for status in (o, s):
        entries = _started(entries, status)
    entries = [_ended(e, o, s, observed.now) for e in entries]
    entries = _closed_by_successor(entries)
    entries = [_observed_facts(e, observed) if e.generation == o.generation else e for e in entries]
    entries = _goodput(entries, o, s)
    return tuple(_lost_steps(entries)[-MAX_ENTRIES:])


def _started(entries: list[HistoryEntry], s: JobStatus) -> list[HistoryEntry]:
    """The entry of `s.generation` added (or, while it runs, its shape and pools brought up to date)."""
    g, start = s.generation, s.generation_start_time
    if g <= 0 or start is None or (entries and entries[-1].generation > g):
        return entries
    topology, count = (s.shape.topology, s.shape.count) if s.shape is not None else ("", 0)
    in_place = s.in_place is not None and s.in_place.generation == g
    if entries and entries[-1].generation == g:
        last = entries[-1]
        if not last.open:
            return entries
        return [*entries[:-1], replace(last, start=start, topology=topology, count=count, hosts=s.hosts,
                                       pools=s.pools, in_place=last.in_place or in_place)]
    return [*entries, HistoryEntry(g, start, topology, count, s.hosts, s.pools, in_place)]


def _reason(kind: str, reason: str) -> str:
    if kind == st.SUSPEND:
        return api.SUSPENDED.name
    return reason or KIND_REASONS.get(kind, kind)


def _ended(e: HistoryEntry, o: JobStatus, s: JobStatus, now: datetime) -> HistoryEntry:
    """`e` ended, when the status says so: a transition or an in-place restart away from it, or the job's end."""
    if not e.open:
        return e
    for status in (s, o):
        t = status.transition
        if t is not None and t.generation == e.generation:
            return replace(e, end=t.since, end_reason=_reason(t.kind, t.reason), end_message=clip_message(t.message))
        ip = status.in_place
        if ip is not None and ip.from_generation == e.generation:
            return replace(e, end=ip.since, end_reason=_reason(ip.kind, ip.reason),
                           end_message=clip_message(ip.message))
    if s.phase in api.TERMINAL_PHASES and e.generation == s.generation:
        ready = s.condition(api.COND_READY)
        default = "Completed" if s.phase == api.PHASE_SUCCEEDED else "Failed"
        return replace(e, end=st.truncate(now), end_reason=ready.reason if ready is not None and ready.reason
                       else default, end_message=clip_message(ready.message if ready is not None else ""))
    return e


def _closed_by_successor(entries: list[HistoryEntry]) -> list[HistoryEntry]:
    """An entry still open when a later one exists ended at the later one's start (no reason known)."""
    return [replace(e, end=entries[i + 1].start) if e.open and i + 1 < len(entries) else e
            for i, e in enumerate(entries)]


def _observed_facts(e: HistoryEntry, observed: Observed) -> HistoryEntry:
    """What pod 0 of the generation the stored status names reported: its restore, its first and newest
    step (the goodput marks), its newest committed step."""
    o = observed.status
    r = observed.restore
    if r is not None and r.step is not None and (r.generation == e.generation
                                                 or (r.generation is None and not e.in_place)):
        e = replace(e, restored_step=r.step,
                    restored_from=r.source if r.source in RESTORE_SOURCES else e.restored_from)
    known = o.goodput.ledger.current if o.goodput is not None else None
    marks = observed_marks(observed, o, known)
    if marks is not None and marks.generation == e.generation:
        e = replace(e, first_step=marks.first_step if marks.first_step is not None else e.first_step,
                    last_step=marks.last_step if marks.last_step is not None else e.last_step)
    c = observed.checkpoint
    # A step it committed: one it reached. A newer step a sidecar still names (a listing from before its
    # generation's rollback wrote the branch record) belongs to the abandoned timeline, never to it.
    if c is not None and c.committed and e.first_step is not None and c.step >= e.first_step \
            and e.last_step is not None and c.step <= e.last_step and c.step not in e.checkpoints:
        e = replace(e, checkpoints=tuple(sorted((*e.checkpoints, c.step)))[-MAX_CHECKPOINTS:])
    return e


def _shown(window: dict[str, float]) -> tuple[tuple[str, float], ...]:
    """A window's seconds as an entry shows them: keys of status.goodput.breakdown, 0.1 s, none negative
    (productive time less than the earlier lost steps it redid: the rest shows in lostStepsRedone)."""
    w = {b: max(0.0, v) for b, v in window.items()}
    if window.get(gp.PRODUCTIVE, 0.0) < 0:
        w["lost_steps_redone"] = max(0.0, window.get("lost_steps_redone", 0.0) + window[gp.PRODUCTIVE])
    return tuple(sorted((st.BREAKDOWN_KEYS[b], round(v, 1)) for b, v in w.items() if b in st.BREAKDOWN_KEYS))


def _goodput(entries: list[HistoryEntry], o: JobStatus, s: JobStatus) -> list[HistoryEntry]:
    """Each generation's goodput window: the current one's as of now, the one the decision closed whole."""
    record = s.goodput
    if record is None:
        return entries
    ledger, before = record.ledger, o.goodput.ledger if o.goodput is not None else None
    windows: dict[int, dict[str, float]] = {}
    if before is not None and before.current is not None and (
            ledger.current is None or ledger.current.generation != before.current.generation):
        windows[before.current.generation] = {b: ledger.closed.get(b, 0.0) - before.closed.get(b, 0.0)
                                              for b in gp.BUCKETS}
    if ledger.current is not None:
        total = gp.summarize(ledger, record.as_of.timestamp()).buckets
        windows[ledger.current.generation] = {b: total[b] - ledger.closed.get(b, 0.0) for b in gp.BUCKETS}
    return [replace(e, goodput=_shown(windows[e.generation])) if e.generation in windows else e for e in entries]


def _lost_steps(entries: list[HistoryEntry]) -> list[HistoryEntry]:
    """lostSteps of each generation that stepped: its last step less the step the next generation that
    shows where it restored restored (its restoredStep, else its first step - 1); kept until that shows."""
    out = list(entries)
    for i, e in enumerate(entries):
        if e.last_step is None:
            continue
        for later in entries[i + 1:]:
            point = later.restored_step if later.restored_step is not None else (
                later.first_step - 1 if later.first_step is not None else None)
            if point is not None:
                out[i] = replace(e, lost_steps=max(0, e.last_step - point))
                break
    return out
