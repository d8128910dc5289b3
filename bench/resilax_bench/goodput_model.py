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
  running, the trainer's restore done.

How wall time is split (every second lands in exactly one bucket; the buckets sum to the wall time):
* a step's own time is the gap from the previous step of the same generation to its record, capped at
  the generation's median step gap; the excess is `checkpoint_blocking` (the trainer blocks only on
  saves between two steps);
* a step counts toward the final model when no later generation trained that step again (a later
  generation restored from an earlier step): those steps' own time is `productive`, the others'
  is `lost_steps_redone`;
* the gap between generations (from the previous generation's last step, or the fault if that came
  later, to the new generation's first step) is split at the marks seen, in order:
  fault -> `detection` -> detected -> `teardown` -> pods created -> `scheduling` -> pods running ->
  `jax_startup` -> restore done -> `restore` -> the new generation's first step began. A mark not seen
  extends the segment before it (no restore line: start-up runs to the first step); time between the
  last step and a fault that came later is `other` (training had stopped for another reason);
* before the first generation's first step (from the job applied): `scheduling` until its pods run,
  then `jax_startup`, `restore`; after the last step: `other`.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from resilax_local.timeline import Fault, LossRecord

KILL, PREEMPT, RESTORE = "kill-node", "preempt-node", "restore-node"
BUCKETS = ("productive", "checkpoint_blocking", "lost_steps_redone", "detection", "teardown", "scheduling",
           "jax_startup", "restore", "other")


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

    detected: float | None = None  # the operator reacted (a transition/phase change or its event)
    pods_created: float | None = None  # the first pod of the generation was created
    pods_running: float | None = None  # every pod of the generation was Running (containers started)
    restored: float | None = None  # the trainer finished its restore (process 0's restore line)


@dataclass(frozen=True)
class Goodput:
    wall_seconds: float
    buckets: Mapping[str, float]
    final_step: int
    steps_trained: int  # step records, counting redone ones
    steps_lost: int  # step records whose step a later generation trained again
    generations: int
    faults: int

    @property
    def goodput(self) -> float:
        return self.buckets["productive"] / self.wall_seconds if self.wall_seconds > 0 else 0.0


@dataclass
class _Acc:
    b: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))

    def add(self, bucket: str, seconds: float) -> None:
        self.b[bucket] += max(0.0, seconds)


def _split_gap(acc: _Acc, start: float, end: float, first: str,
               marks: Sequence[tuple[float | None, str]]) -> None:
    """Split [start, end]: `first` until the first mark seen, then each mark's bucket until the next
    mark seen (marks: (time or None, bucket from that time on), in order; a mark not seen extends the
    segment before it; a mark out of order is clamped into [previous mark, end])."""
    t, bucket = start, first
    for when, after in marks:
        if when is None:
            continue
        when = min(max(when, t), end)
        acc.add(bucket, when - t)
        t, bucket = when, after
    acc.add(bucket, end - t)


def compute_goodput(records: Sequence[LossRecord], faults: Sequence[Fault], start: float, end: float,
                    marks: Mapping[int, GenerationMarks] | None = None) -> Goodput:
    """Goodput of the run from `start` (job applied) to `end` (measurement stopped); see the module doc."""
    if end <= start:
        raise GoodputInputError(f"end ({end!r}) must be after start ({start!r})")
    marks = marks or {}
    recs = sorted((r for r in records if start <= r.time <= end), key=lambda r: (r.time, r.generation, r.step))
    acc = _Acc()
    hard = sorted(f.time for f in faults if f.kind in (KILL, PREEMPT))
    if not recs:
        acc.add("other", end - start)
        return Goodput(end - start, acc.b, 0, 0, 0, 0, len(hard))
    by_gen: dict[int, list[LossRecord]] = {}
    for r in recs:
        by_gen.setdefault(r.generation, []).append(r)
    gens = sorted(by_gen, key=lambda g: by_gen[g][0].time)
    first_step = {g: min(r.step for r in by_gen[g]) for g in gens}
    lost = 0
    for n, g in enumerate(gens):
        rs = by_gen[g]
        gaps = [b.time - a.time for a, b in pairwise(rs)]
        median = statistics.median(gaps) if gaps else 0.0
        later_restart = min((first_step[h] for h in gens[n + 1:]), default=None)
        for i, r in enumerate(rs):
            counts = later_restart is None or r.step < later_restart
            lost += 0 if counts else 1
            if i == 0:
                own, excess = median, 0.0  # the first step's compute: one typical step of this generation
            else:
                gap = r.time - rs[i - 1].time
                own, excess = min(gap, median), max(0.0, gap - median)
            acc.add("productive" if counts else "lost_steps_redone", own)
            acc.add("checkpoint_blocking", excess)
        m = marks.get(g, GenerationMarks())
        first_compute = rs[0].time - median
        if n == 0:
            _split_gap(acc, start, first_compute, "scheduling",
                       [(m.pods_running, "jax_startup"), (m.restored, "restore")])
            continue
        prev_last = by_gen[gens[n - 1]][-1].time
        fault = max((t for t in hard if prev_last <= t <= first_compute), default=None)
        if fault is not None:
            acc.add("other", fault - prev_last)
            gap_start = fault
        else:
            gap_start = prev_last
        _split_gap(acc, gap_start, first_compute, "detection",
                   [(m.detected, "teardown"), (m.pods_created, "scheduling"), (m.pods_running, "jax_startup"),
                    (m.restored, "restore")])
    acc.add("other", end - recs[-1].time)
    # the first step's "own" time was taken from before its record: keep the sum equal to the wall time
    total = sum(acc.b.values())
    acc.b["other"] += (end - start) - total
    final = by_gen[gens[-1]][-1].step
    return Goodput(end - start, acc.b, final, len(recs), lost, len(gens), len(hard))
