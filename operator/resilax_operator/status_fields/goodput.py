"""Goodput accounting (pure: no I/O, no clock): how much of a job's wall time trained the model that
comes out of it, and where the rest went.

goodput = productive seconds / wall seconds. Every second of the wall time lands in exactly one bucket
of `BUCKETS`; the buckets sum to the wall time. One accounting, two users:
* the operator folds what it observes of each generation into `status.goodput` at every decision
  (`advance`, then `summarize`; policies/goodput_status.py collects the marks) and exports it as metrics;
* the goodput benchmark (bench/resilax_bench/goodput_model.py) feeds the same fold the marks its
  harness recorded (`account`), so the benchmark measures what the product reports.

What is known of one generation (`GenerationMarks`; epoch seconds, None: not seen):

| mark | the operator takes it from |
|---|---|
| created | status.generationStartTime (the operator created its pods) |
| running | the latest `startedAt` of the trainer containers, once all of them started |
| restore_began, restore_ended | pod 0's trainer figures (`/v1/state` `trainer`: restored_time, last_restore_seconds) |
| first_step, first_step_time | the first step the trainer reached, and when |
| last_step, last_step_time | the newest step it reached, and when (as of the operator's last look) |
| blocking_seconds | seconds its loop was blocked by saves (save_blocking_seconds) |
| detected | status.transition.since: the operator began replacing the generation |
| hang | the generation was replaced because it hung (the transition's or in-place restart's kind TrainerHung) |
| devices_share | status.shape's devices over spec.slices' (count x the topology's chips), at most 1 |
| fault | (the benchmark only: when it injected the fault) |

A generation's window runs from its start (`created`; the first generation's from the start of the
accounting) to the next generation's start (or the end). Within it, time goes, from each mark seen on:

| from | bucket |
|---|---|
| the window's start | scheduling (pods created, waiting for nodes and containers) |
| running | jax_startup (process start, jax.distributed, building the state) |
| restore_began | restore |
| restore_ended | jax_startup (the first step: its compile) |
| the first step began (first_step_time minus one typical step) | productive |
| the last step reached | hang when the generation was replaced for a hang (TrainerHung), detection when it was replaced for another reason (or a fault came), else other |
| fault, when after the last step (the trainer stopped before it: other until then) | detection |
| detected | teardown (final save if any, deleting the pods, waiting for capacity) |

A mark not seen extends the segment before it; a mark earlier than the one before it counts from that
one (a preemption's final save: the trainer steps on after `detected`, so teardown starts at its last
step). Then two corrections move time out of productive:
* checkpoint_blocking: the generation's `blocking_seconds` (at most its productive time);
* lost_steps_redone: once a later generation's first step shows where it restored (`first_step` - 1),
  the steps the last generation that trained reached beyond it, times that generation's typical step
  ((last_step_time - first_step_time - blocking) / (last_step - first_step)), at most its productive time.

Device-weighted goodput (`Goodput.device_ratio`, shown beside the plain ratio): each window's productive
seconds times its generation's `devices_share` (its devices over the devices the spec declares, at most
1), the redone seconds taken back at the share of the generation that first trained them; a job that
ran half its time on half its declared devices has ratio ~1 and device ratio ~0.75.

A suspended job (spec.suspend: no workers) pays nothing: `pause` leaves the time it was suspended out
of the wall time.

The operator's resolution: the trainer writes its figures at most once a second (also while its loop is
blocked) and the operator reads pod 0's every reconcile (<= 5 s) while it runs; once the workers' pods
end, the sidecars' last words (their termination messages: observed.sidecar.newest_trainer_report) give
the generation's last step and its time, so the last training counts as productive and lost_steps is
exact (unless every sidecar of the generation died with its node); times in the status have whole seconds. Until a generation is replaced, the time
since its last step seen is `other` (at most a reconcile's worth while it trains).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Final

PRODUCTIVE: Final = "productive"
BUCKETS: Final = ("productive", "checkpoint_blocking", "lost_steps_redone", "detection", "hang", "teardown",
                  "scheduling", "jax_startup", "restore", "other")


def _zero() -> dict[str, float]:
    return dict.fromkeys(BUCKETS, 0.0)


@dataclass(frozen=True)
class GenerationMarks:
    """What was seen of one generation (epoch seconds; None: not seen). See the module's table."""

    generation: int
    created: float | None = None
    running: float | None = None
    restore_began: float | None = None
    restore_ended: float | None = None
    first_step: int | None = None
    first_step_time: float | None = None
    last_step: int | None = None
    last_step_time: float | None = None
    blocking_seconds: float = 0.0
    detected: float | None = None
    fault: float | None = None
    #: Replaced because it hung (TrainerHung): the time from its last step to `detected` is `hang`.
    hang: bool = False
    #: Its devices over the devices the spec declares (at most 1; below 1 at a shrunk shape): the weight
    #: of its productive time in the device-weighted figure.
    devices_share: float = 1.0

    @property
    def begins(self) -> float | None:
        """The window's start: the first mark seen."""
        return next((t for t in (self.created, self.running, self.restore_began, self.restore_ended,
                                 self.first_step_time) if t is not None), None)

    @property
    def trained(self) -> bool:
        return self.first_step is not None and self.first_step_time is not None

    @property
    def step_seconds(self) -> float:
        """The generation's typical step: its stepping time less the saves' blocking, per step (0
        until it reached two steps)."""
        if (self.first_step is None or self.last_step is None or self.first_step_time is None
                or self.last_step_time is None or self.last_step <= self.first_step):
            return 0.0
        span = self.last_step_time - self.first_step_time - self.blocking_seconds
        return max(0.0, span) / (self.last_step - self.first_step)


@dataclass(frozen=True)
class Carry:
    """The last generation that trained, until a later one shows where it restored (lost steps)."""

    step: int  # the newest step it reached
    step_seconds: float  # its typical step
    productive: float  # its productive seconds (the most its lost steps can take back)
    devices_share: float = 1.0  # its GenerationMarks.devices_share


@dataclass(frozen=True)
class Ledger:
    """The accounting so far: the closed windows' buckets, and the open generation's marks."""

    start: float
    closed: Mapping[str, float] = field(default_factory=_zero)
    closed_until: float = 0.0
    lost_steps: int = 0
    carry: Carry | None = None
    current: GenerationMarks | None = None
    #: The closed windows' productive seconds, each weighted by its generation's devices_share.
    closed_device_productive: float = 0.0


@dataclass(frozen=True)
class Goodput:
    """The breakdown at one time."""

    wall_seconds: float
    buckets: Mapping[str, float]
    lost_steps: int
    generations: int
    #: Productive seconds, each weighted by its generation's devices over the declared devices (None: as
    #: productive, every generation at the declared shape).
    device_productive: float | None = None

    @property
    def ratio(self) -> float:
        return self.buckets[PRODUCTIVE] / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def device_ratio(self) -> float:
        """Device-weighted goodput: a second trained at half the declared devices counts half."""
        weighted = self.buckets[PRODUCTIVE] if self.device_productive is None else self.device_productive
        return weighted / self.wall_seconds if self.wall_seconds > 0 else 0.0


def begin(start: float) -> Ledger:
    """An empty ledger whose wall time starts at `start`."""
    return Ledger(start=start, closed=_zero(), closed_until=start)


def _split(acc: dict[str, float], start: float, end: float, first: str,
           marks: Iterable[tuple[float | None, str]]) -> None:
    """Add [start, end] to `acc`: `first` until the first mark seen, then each mark's bucket until the
    next one seen (a mark not seen is skipped; one out of order is moved into [previous mark, end])."""
    t, bucket = start, first
    for when, after in marks:
        if when is None:
            continue
        when = min(max(when, t), end)
        acc[bucket] += max(0.0, when - t)
        t, bucket = when, after
    acc[bucket] += max(0.0, end - t)


def _window(g: GenerationMarks, carry: Carry | None, start: float, end: float,
            replaced: bool) -> tuple[dict[str, float], int, Carry | None, float]:
    """The buckets of `g`'s window [start, end], the steps its restore lost, the carry after it and its
    device-weighted productive seconds (its own at its share, less the redone ones at the carry's).
    `replaced`: a later generation exists (the time after its last step was the fault's)."""
    acc = _zero()
    step_s = g.step_seconds
    first_began = None if g.first_step_time is None else g.first_step_time - step_s
    fault_after = g.fault if g.fault is not None and (g.last_step_time is None or g.fault >= g.last_step_time) \
        else None
    after_last = "other" if fault_after is not None or not (replaced or g.detected is not None) \
        else "hang" if g.hang else "detection"
    _split(acc, start, end, "scheduling", [
        (g.created, "scheduling"), (g.running, "jax_startup"), (g.restore_began, "restore"),
        (g.restore_ended, "jax_startup"), (first_began, PRODUCTIVE), (g.last_step_time, after_last),
        (fault_after, "detection"), (g.detected, "teardown")])
    blocking = min(max(0.0, g.blocking_seconds), acc[PRODUCTIVE])
    acc[PRODUCTIVE] -= blocking
    acc["checkpoint_blocking"] += blocking
    own = acc[PRODUCTIVE]
    weighted = own * g.devices_share
    lost = 0
    if g.trained and carry is not None:
        assert g.first_step is not None
        lost = max(0, carry.step - (g.first_step - 1))
        # the lost steps' time comes out of the earlier generation's productive time (counted before)
        redone = min(carry.productive, lost * carry.step_seconds)
        acc["lost_steps_redone"] += redone
        acc[PRODUCTIVE] -= redone
        weighted -= redone * carry.devices_share
        carry = None
    if g.trained and g.last_step is not None:
        carry = Carry(g.last_step, step_s, own, g.devices_share)
    return acc, lost, carry, weighted


def advance(ledger: Ledger | None, marks: GenerationMarks, start: float | None = None) -> Ledger:
    """The ledger with `marks` of the current generation: the same generation as the ledger's current
    one replaces its marks; a newer one closes the current window at the new one's start. `start`: where
    the wall time starts when `ledger` is None (default: the generation's start)."""
    if ledger is None:
        begun = start if start is not None else marks.begins
        if begun is None:
            raise ValueError(f"generation {marks.generation}: no start time (created) to account from")
        return replace(begin(begun), current=marks)
    cur = ledger.current
    if cur is None or cur.generation == marks.generation:
        return replace(ledger, current=marks)
    if marks.generation < cur.generation:
        raise ValueError(f"generation {marks.generation} is older than the ledger's current {cur.generation}")
    until = max(ledger.closed_until, marks.begins if marks.begins is not None else ledger.closed_until)
    acc, lost, carry, weighted = _window(cur, ledger.carry, ledger.closed_until, until, replaced=True)
    closed = {b: ledger.closed.get(b, 0.0) + acc[b] for b in BUCKETS}
    return Ledger(start=ledger.start, closed=closed, closed_until=until, lost_steps=ledger.lost_steps + lost,
                  carry=carry, current=marks, closed_device_productive=ledger.closed_device_productive + weighted)


def pause(ledger: Ledger, since: float, until: float) -> Ledger:
    """The ledger with [since, until] left out of the wall time (a suspended job: no workers, nothing
    paid): the current window closes at `since`, the accounting resumes at `until` with no current
    generation (the next `advance` opens one; the carry waits for its restore)."""
    if until <= since:
        return ledger
    closed, lost, carry = dict(ledger.closed), ledger.lost_steps, ledger.carry
    weighted = ledger.closed_device_productive
    end = max(since, ledger.closed_until)
    if ledger.current is not None:
        acc, window_lost, carry, window_weighted = _window(ledger.current, ledger.carry, ledger.closed_until, end,
                                                           replaced=True)
        closed = {b: closed.get(b, 0.0) + acc[b] for b in BUCKETS}
        lost += window_lost
        weighted += window_weighted
    gap = max(0.0, until - end)
    return Ledger(start=ledger.start + gap, closed=closed, closed_until=end + gap, lost_steps=lost, carry=carry,
                  current=None, closed_device_productive=weighted)


def summarize(ledger: Ledger, end: float) -> Goodput:
    """The breakdown from the ledger's start to `end` (the open window counted up to `end`)."""
    buckets = dict(ledger.closed)
    lost = ledger.lost_steps
    weighted = ledger.closed_device_productive
    generations = 0
    if ledger.current is not None:
        acc, window_lost, _, window_weighted = _window(ledger.current, ledger.carry, ledger.closed_until,
                                                       max(end, ledger.closed_until), replaced=False)
        buckets = {b: buckets.get(b, 0.0) + acc[b] for b in BUCKETS}
        lost += window_lost
        weighted += window_weighted
        generations = 1
    wall = max(0.0, max(end, ledger.closed_until) - ledger.start)
    return Goodput(wall, buckets, lost, generations, weighted)


def account(start: float, end: float, generations: Iterable[GenerationMarks]) -> Goodput:
    """The breakdown of a whole recorded run: every generation folded in order (as the operator folds
    them one at a time). Generations without any mark are skipped."""
    ledger = begin(start)
    count = 0
    for g in sorted(generations, key=lambda g: g.generation):
        if g.begins is None and g.last_step_time is None:
            continue
        ledger = advance(ledger, g)
        count += 1
    out = summarize(ledger, end)
    return replace(out, generations=count)
