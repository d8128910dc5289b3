"""Goodput under a failure schedule, computed from what a run recorded (pure: no I/O, no clock).

Two pure pieces the goodput benchmark (`resilax_bench.goodput`) drives:

* `build_schedule(seed, ...)`: the seeded failure schedule (hard node losses every ~`kill_every`
  seconds with jitter, one preemption notice in place of the second loss, each followed by the node's
  return after `restore_after` seconds, which lets the job grow back). The same seed gives the same
  schedule, so both variants of one run (Resilax, restart-from-persistent) face the same faults.
* `compute_goodput(...)`: goodput = time of the steps that count toward the final model / wall time,
  and where the rest of the wall time went. Inputs are process 0's step records (`LossRecord`: step,
  generation, wall time; resilax_local.timeline), the faults injected, and per generation the times the
  harness saw from the API and the trainer: the operator's reaction (detected), the new pods created,
  running, the trainer's restore began and ended.

The breakdown is the operator's own accounting (`resilax_operator.goodput`: the buckets, how a
generation's window is split at its marks, checkpoint blocking and lost steps), fed with what the
harness saw instead of what the operator sees: each step's time from the loss lines (a generation's
checkpoint blocking = the excess of its step gaps over their median), the injected fault's time (the
time from the last step to a later fault is `other`, from the fault to the reaction `detection`), pod
times from the API, the restore from process 0's restore line. See that module for the table.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from resilax_local.timeline import Fault, JobSnapshot, LossRecord, TimelineEvent
from resilax_operator import goodput
from resilax_operator.goodput import BUCKETS

KILL, PREEMPT, RESTORE = "kill-node", "preempt-node", "restore-node"
__all__ = ["BUCKETS", "KILL", "PREEMPT", "RESTORE", "GenerationMarks", "Goodput", "GoodputInputError", "PlannedFault",
           "build_generation_marks", "build_schedule", "compute_goodput", "find_reaction"]


class GoodputInputError(ValueError):
    """A schedule or a run record that cannot be measured (names the field and the value)."""


@dataclass(frozen=True)
class PlannedFault:
    """One fault of the schedule, `at` seconds after the job started training."""

    at: float
    kind: str  # KILL, PREEMPT or RESTORE
    victim: int  # which fault this is (a RESTORE names the fault whose node returns)


def build_schedule(seed: int, duration: float, kill_every: float = 300.0, restore_after: float = 90.0,
                   jitter: float = 0.2, preempt_index: int = 1) -> tuple[PlannedFault, ...]:
    """Faults at ~`kill_every` s (± `jitter` of it, from `seed`), the first at ~`kill_every`; fault
    number `preempt_index` (0-based) is a preemption notice instead of a hard loss; every fault's node
    returns `restore_after` s later (grow-back). Faults that would return after `duration` are left out,
    so every fault's recovery and grow-back happen within the run."""
    for name, value in (("duration", duration), ("kill_every", kill_every), ("restore_after", restore_after)):
        if value <= 0:
            raise GoodputInputError(f"{name} must be > 0 seconds, got {value!r}")
    if not 0 <= jitter < 0.5:
        raise GoodputInputError(f"jitter must be in [0, 0.5), got {jitter!r}")
    if restore_after >= kill_every * (1 - 2 * jitter):
        raise GoodputInputError(f"restore_after ({restore_after!r}) must be shorter than the shortest gap "
                                f"between faults, kill_every * (1 - 2 * jitter) = {kill_every * (1 - 2 * jitter)!r}")
    rng = random.Random(seed)
    out: list[PlannedFault] = []
    i = 0
    while True:
        at = (i + 1) * kill_every + rng.uniform(-jitter, jitter) * kill_every
        if at + restore_after > duration:
            break
        out.append(PlannedFault(round(at, 1), PREEMPT if i == preempt_index else KILL, i))
        out.append(PlannedFault(round(at + restore_after, 1), RESTORE, i))
        i += 1
    return tuple(sorted(out, key=lambda f: f.at))


@dataclass(frozen=True)
class GenerationMarks:
    """What the harness saw of one generation's start (epoch seconds; None: not seen)."""

    detected: float | None = None  # the operator reacted to replace the generation BEFORE this one
    pods_created: float | None = None  # the first pod of the generation was created
    pods_running: float | None = None  # every pod of the generation was Running (containers started)
    restored: float | None = None  # the trainer finished its restore (process 0's restore line)
    restore_began: float | None = None  # the trainer began its restore (the restore line's `began`)


@dataclass(frozen=True)
class Goodput:
    wall_seconds: float
    buckets: Mapping[str, float]
    final_step: int
    steps_trained: int  # step records, counting redone ones
    steps_lost: int  # steps a later generation trained again (the operator's accounting's count)
    generations: int  # generations that trained
    faults: int

    @property
    def goodput(self) -> float:
        return self.buckets["productive"] / self.wall_seconds if self.wall_seconds > 0 else 0.0


def _blocking(rs: Sequence[LossRecord]) -> float:
    """A generation's checkpoint blocking: the excess of its step gaps over their median."""
    gaps = [b.time - a.time for a, b in pairwise(rs)]
    if not gaps:
        return 0.0
    median = statistics.median(gaps)
    return sum(max(0.0, g - median) for g in gaps)


def build_generation_marks(records: Sequence[LossRecord], faults: Sequence[Fault], end: float,
                           marks: Mapping[int, GenerationMarks]) -> list[goodput.GenerationMarks]:
    """The operator accounting's marks of each generation, from what the harness recorded."""
    by_gen: dict[int, list[LossRecord]] = {}
    for r in sorted(records, key=lambda r: (r.time, r.step)):
        by_gen.setdefault(r.generation, []).append(r)
    hard = sorted(f.time for f in faults if f.kind in (KILL, PREEMPT))
    gens = sorted(set(by_gen) | set(marks))
    out: list[goodput.GenerationMarks] = []
    for n, g in enumerate(gens):
        m = marks.get(g, GenerationMarks())
        nxt = marks.get(gens[n + 1], GenerationMarks()) if n + 1 < len(gens) else None
        rs = by_gen.get(g, [])
        began = m.pods_created or m.pods_running or (rs[0].time if rs else None)
        nxt_rs = by_gen.get(gens[n + 1], []) if nxt is not None else []
        nxt_begins = (nxt.pods_created or nxt.pods_running or (nxt_rs[0].time if nxt_rs else None)) \
            if nxt is not None else None
        window_end = nxt_begins if nxt_begins is not None else end
        after = rs[-1].time if rs else began
        fault = max((t for t in hard if after is not None and after <= t <= window_end), default=None)
        out.append(goodput.GenerationMarks(
            generation=g, created=m.pods_created, running=m.pods_running, restore_began=m.restore_began,
            restore_ended=m.restored, first_step=rs[0].step if rs else None, first_step_time=rs[0].time if rs else None,
            last_step=rs[-1].step if rs else None, last_step_time=rs[-1].time if rs else None,
            blocking_seconds=_blocking(rs), detected=nxt.detected if nxt is not None else None, fault=fault))
    return out


#: The operator's Event of an in-place restart (policies/inplace.py): "RestartingInPlace: generation N: ...".
IN_PLACE_REASON = "RestartingInPlace"


def pod_marks(generation: int, created: float | None, running: float | None,
              events: Iterable[TimelineEvent]) -> tuple[float | None, float | None]:
    """A generation's pods' `created` and `running` marks (the earliest creation, the latest container
    start). A generation started in place keeps pods created and started for an earlier one: its pods
    count from its RestartingInPlace Event (a new pod's own times when later)."""
    prefix = f"{IN_PLACE_REASON}: generation {generation}:"
    start = min((e.time for e in events if e.text.startswith(prefix)), default=None)
    if start is None:
        return created, running
    return (start if created is None or created < start else created,
            start if running is None or running < start else running)


#: Job Events that announce a wait, not the move to a new generation (the operator's accounting starts
#: detection's end at the transition too): not a reaction.
WAITING_REASONS = ("PeerLost", "NodeNotReady", "NodeLossGuard", "MaintenanceScheduled")


def find_reaction(previous: int, steps: Sequence[float], started: float | None, until: float | None,
                  snapshots: Sequence[JobSnapshot], events: Iterable[TimelineEvent]) -> float | None:
    """When the operator began replacing generation `previous`: the first job snapshot not Running (or
    on a newer generation), or the first job Event other than a wait's (`WAITING_REASONS`), from
    `previous`'s first step (`steps`: its step times; without steps, `started`) up to one second after
    the next generation's pods were created (`until`; the API's times have whole seconds). From the
    first step, not the last: a preemption's or a grow-back's reaction comes before the last step (the
    trainers step on to their final save); a later reaction (to the next fault) is not this one's."""
    since = min(steps) if steps else started
    if since is None:
        return None
    end = until + 1.0 if until is not None else float("inf")
    reacted = [s.time for s in snapshots if since <= s.time <= end
               and (s.phase != "Running" or (s.generation or 0) > previous)]
    reacted += [e.time for e in events if since <= e.time <= end and not e.text.startswith(WAITING_REASONS)]
    return min(reacted, default=None)


def compute_goodput(records: Sequence[LossRecord], faults: Sequence[Fault], start: float, end: float,
                    marks: Mapping[int, GenerationMarks] | None = None) -> Goodput:
    """Goodput of the run from `start` (job applied) to `end` (measurement stopped); see the module doc."""
    if end <= start:
        raise GoodputInputError(f"end ({end!r}) must be after start ({start!r})")
    recs = [r for r in records if start <= r.time <= end]
    hard = [f for f in faults if f.kind in (KILL, PREEMPT)]
    gens = build_generation_marks(recs, faults, end, marks or {})
    if not recs:
        return Goodput(end - start, {**dict.fromkeys(BUCKETS, 0.0), "other": end - start}, 0, 0, 0, 0, len(hard))
    result = goodput.account(start, end, gens)
    final = max(recs, key=lambda r: r.time).step
    return Goodput(result.wall_seconds, result.buckets, final, len(recs), result.lost_steps,
                   len({r.generation for r in recs}), len(hard))
