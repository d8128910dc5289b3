"""The demo's story, told from what it recorded (pure: no I/O, no clock).

The demo (`resilax_local.demo.runner`) records three things while it runs, each with wall-clock times:
  1. snapshots of the JAXJob (`parse_snapshot` of the raw body, polled),
  2. the faults it injects (`Fault`: a node killed, a node restored),
  3. the loss lines of the training job (`parse_loss_lines`: process 0's JSON lines
     `{"step", "loss", "generation", "devices", "time"}`), and the job's Kubernetes Events.
From these this module builds the timeline (`build_timeline`), the move from one generation to the next
with the steps it lost (`build_transitions`), the loss continuity check (`check_loss_continuity`), the
operator's goodput account of the job (`describe_goodput`, from the last `status.goodput` seen) and
the data of the plot (`build_plot_data`). Times in the output are seconds since the demo started.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from itertools import pairwise
from typing import Any


@dataclass(frozen=True)
class LossRecord:
    """One training step as process 0 logged it."""

    step: int
    loss: float
    generation: int
    devices: int
    time: float


@dataclass(frozen=True)
class JobSnapshot:
    """What the demo shows of a JAXJob at one moment (from its status)."""

    time: float
    phase: str
    generation: int | None = None
    topology: str | None = None
    count: int | None = None
    hosts: int | None = None
    checkpoint_step: int | None = None
    checkpoint_tier: str | None = None
    restore_step: int | None = None
    restarts: int = 0
    transition: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class Fault:
    """Something the demo did to the cluster: `kind` is `kill-node` or `restore-node`."""

    time: float
    kind: str
    node: str


@dataclass(frozen=True)
class TimelineEvent:
    time: float
    kind: str
    text: str


@dataclass(frozen=True)
class GenerationSummary:
    """The steps one generation trained, as its loss lines show."""

    generation: int
    devices: int
    first_step: int
    last_step: int
    first_time: float
    last_time: float

    @property
    def restored_step(self) -> int:
        """The step this generation started from (0: from scratch)."""
        return self.first_step - 1


@dataclass(frozen=True)
class Transition:
    """From one generation to the next: what was lost, how long the pause was, what caused it."""

    before: GenerationSummary
    after: GenerationSummary
    cause: Fault | None

    @property
    def steps_lost(self) -> int:
        """Steps trained by the old generation that the new one had to train again."""
        return max(0, self.before.last_step - self.after.restored_step)

    @property
    def pause_seconds(self) -> float:
        """From the cause (or the old generation's last step) to the new generation's first step."""
        start = self.cause.time if self.cause is not None else self.before.last_time
        return self.after.first_time - start


@dataclass(frozen=True)
class Continuity:
    """Whether the loss curve is one curve across generations."""

    max_step: int
    missing_steps: tuple[int, ...]
    recomputed_steps: tuple[int, ...]
    mismatches: tuple[tuple[int, float, float], ...]  # (step, first loss, later loss)

    @property
    def ok(self) -> bool:
        return not self.missing_steps and not self.mismatches


@dataclass(frozen=True)
class PlotSeries:
    generation: int
    devices: int
    steps: tuple[int, ...]
    losses: tuple[float, ...]
    times: tuple[float, ...]  # seconds since the start


@dataclass(frozen=True)
class PlotMarker:
    time: float  # seconds since the start
    step: float  # the newest step trained at that time
    label: str


@dataclass(frozen=True)
class PlotSpan:
    """A pause in training: from a fault (or the last step) to the next generation's first step."""

    start: float  # seconds since the start
    end: float
    restored_step: int
    label: str


@dataclass(frozen=True)
class PlotData:
    series: tuple[PlotSeries, ...]
    markers: tuple[PlotMarker, ...] = field(default=())
    spans: tuple[PlotSpan, ...] = field(default=())


# ---- parsing --------------------------------------------------------------------------------------

LOSS_KEYS = ("step", "loss", "generation", "devices", "time")


def parse_loss_lines(text: str) -> list[LossRecord]:
    """The loss records in a log: JSON lines with all of LOSS_KEYS; any other line is skipped."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if not isinstance(raw, dict) or any(k not in raw for k in LOSS_KEYS):
            continue
        try:
            out.append(LossRecord(step=int(raw["step"]), loss=float(raw["loss"]),
                                  generation=int(raw["generation"]), devices=int(raw["devices"]),
                                  time=float(raw["time"])))
        except (TypeError, ValueError):
            continue
    return out


def merge_loss_records(records: Iterable[LossRecord]) -> list[LossRecord]:
    """One record per (generation, step), the first seen, sorted by time then step."""
    seen: dict[tuple[int, int], LossRecord] = {}
    for r in records:
        seen.setdefault((r.generation, r.step), r)
    return sorted(seen.values(), key=lambda r: (r.time, r.generation, r.step))


def parse_timestamp(value: str | None) -> float | None:
    """An RFC 3339 time from the API (`2026-12-02T17:05:30Z`, with or without fractions) as epoch seconds."""
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def parse_snapshot(time: float, body: Mapping[str, Any]) -> JobSnapshot:
    """A raw JAXJob body (as the API returns it) seen at `time`."""
    status = body.get("status") or {}
    shape = status.get("shape") or {}
    checkpoint = status.get("checkpoint") or {}
    transition = status.get("transition") or {}
    message = None
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            message = condition.get("message") or condition.get("reason")
    return JobSnapshot(
        time=time, phase=str(status.get("phase") or "-"), generation=_int(status.get("generation")),
        topology=shape.get("topology"), count=_int(shape.get("count")), hosts=_int(shape.get("hosts")),
        checkpoint_step=_int(checkpoint.get("step")) if checkpoint.get("committed", True) else None,
        checkpoint_tier=checkpoint.get("tier"), restore_step=_int(status.get("restoreStep")),
        restarts=_int(status.get("restarts")) or 0, transition=transition.get("kind"), message=message)


def parse_event(body: Mapping[str, Any]) -> TimelineEvent | None:
    """A core/v1 Event about the job as a timeline event (None without a usable time)."""
    when = (parse_timestamp(body.get("eventTime")) or parse_timestamp(body.get("lastTimestamp"))
            or parse_timestamp(body.get("firstTimestamp"))
            or parse_timestamp((body.get("metadata") or {}).get("creationTimestamp")))
    if when is None:
        return None
    reason = body.get("reason") or "?"
    kind = "warning" if body.get("type") == "Warning" else "event"
    message = " ".join(str(body.get("message") or "").split())
    return TimelineEvent(when, kind, f"{reason}: {message}" if message else str(reason))


# ---- snapshots to events --------------------------------------------------------------------------

def describe_shape(s: JobSnapshot) -> str:
    if s.count is None:
        return "no shape yet"
    hosts = f", {s.hosts} hosts" if s.hosts is not None else ""
    return f"{s.count} x {s.topology}{hosts}"


def plan_snapshot_events(prev: JobSnapshot | None, cur: JobSnapshot) -> list[TimelineEvent]:
    """What changed between two snapshots of the job, as timeline events."""
    out: list[TimelineEvent] = []
    if cur.phase != "-" and (prev is None or cur.phase != prev.phase):
        why = f" ({cur.transition})" if cur.transition and cur.phase not in ("Running", "Succeeded") else ""
        out.append(TimelineEvent(cur.time, "phase", f"{prev.phase if prev else '-'} -> {cur.phase}{why}"))
    if cur.generation is not None and (prev is None or cur.generation != prev.generation):
        restore = {None: "", 0: ", from scratch"}.get(cur.restore_step, f", restore step {cur.restore_step}")
        out.append(TimelineEvent(cur.time, "generation",
                                 f"generation {cur.generation}: {describe_shape(cur)}{restore}"))
    elif prev is not None and cur.count is not None and (cur.count, cur.topology) != (prev.count, prev.topology):
        out.append(TimelineEvent(cur.time, "shape", f"shape {describe_shape(cur)}"))
    if cur.checkpoint_step is not None and (prev is None or cur.checkpoint_step != prev.checkpoint_step):
        tier = f" ({cur.checkpoint_tier})" if cur.checkpoint_tier else ""
        out.append(TimelineEvent(cur.time, "checkpoint", f"step {cur.checkpoint_step} committed{tier}"))
    return out


def plan_events(snapshots: Sequence[JobSnapshot]) -> list[TimelineEvent]:
    out: list[TimelineEvent] = []
    prev: JobSnapshot | None = None
    for s in snapshots:
        out += plan_snapshot_events(prev, s)
        prev = s
    return out


# ---- generations, transitions, continuity ---------------------------------------------------------

def build_generations(records: Iterable[LossRecord]) -> list[GenerationSummary]:
    """One summary per generation that logged a step, in order of generation."""
    by_gen: dict[int, list[LossRecord]] = {}
    for r in records:
        by_gen.setdefault(r.generation, []).append(r)
    out = []
    for gen in sorted(by_gen):
        rs = by_gen[gen]
        first = min(rs, key=lambda r: r.step)
        last = max(rs, key=lambda r: r.step)
        out.append(GenerationSummary(generation=gen, devices=first.devices, first_step=first.step,
                                     last_step=last.step, first_time=min(r.time for r in rs),
                                     last_time=max(r.time for r in rs)))
    return out


def build_transitions(generations: Sequence[GenerationSummary], faults: Sequence[Fault]) -> list[Transition]:
    """Consecutive generations; the cause is the newest fault between the old one's first step and the
    new one's first step."""
    out = []
    for before, after in pairwise(generations):
        causes = [f for f in faults if before.first_time <= f.time <= after.first_time]
        out.append(Transition(before, after, max(causes, key=lambda f: f.time) if causes else None))
    return out


def check_loss_continuity(records: Iterable[LossRecord], rel: float = 1e-3) -> Continuity:
    """Every step from 1 to the last one trained at least once, and a step trained again by a later
    generation (after a restore) has the same loss, within `rel`."""
    first: dict[int, float] = {}
    recomputed: set[int] = set()
    mismatches = []
    for r in sorted(records, key=lambda r: (r.generation, r.step)):
        if r.step not in first:
            first[r.step] = r.loss
            continue
        recomputed.add(r.step)
        if not math.isclose(first[r.step], r.loss, rel_tol=rel, abs_tol=1e-7):
            mismatches.append((r.step, first[r.step], r.loss))
    top = max(first, default=0)
    missing = tuple(s for s in range(1, top + 1) if s not in first)
    return Continuity(max_step=top, missing_steps=missing, recomputed_steps=tuple(sorted(recomputed)),
                      mismatches=tuple(mismatches))


def step_at(records: Sequence[LossRecord], time: float) -> float:
    """The newest step logged at or before `time` (0 before the first)."""
    done = [r.step for r in records if r.time <= time]
    return float(max(done)) if done else 0.0


def build_plot_data(records: Sequence[LossRecord], faults: Sequence[Fault], start: float) -> PlotData:
    """Loss against step (and step against time) per generation; a marker per fault."""
    series = []
    for g in build_generations(records):
        rs = sorted((r for r in records if r.generation == g.generation), key=lambda r: r.step)
        series.append(PlotSeries(generation=g.generation, devices=g.devices, steps=tuple(r.step for r in rs),
                                 losses=tuple(r.loss for r in rs), times=tuple(r.time - start for r in rs)))
    markers = tuple(PlotMarker(time=f.time - start, step=step_at(records, f.time), label=f"{f.kind} {f.node}")
                    for f in sorted(faults, key=lambda f: f.time))
    spans = tuple(
        PlotSpan(start=(t.cause.time if t.cause else t.before.last_time) - start, end=t.after.first_time - start,
                 restored_step=t.after.restored_step,
                 label=f"{t.pause_seconds:.0f} s, {t.before.devices}->{t.after.devices} devices, "
                       f"{t.steps_lost} steps lost")
        for t in build_transitions(build_generations(records), faults))
    return PlotData(series=tuple(series), markers=markers, spans=spans)


# ---- the text ---------------------------------------------------------------------------------------

def _rel(t: float, start: float) -> str:
    return f"{t - start:+8.1f}s"


#: status.goodput.breakdown keys, in the order the goodput section lists them, with their labels.
GOODPUT_BUCKETS = (("productive", "productive (steps that count)"), ("checkpointBlocking", "checkpoint blocking"),
                   ("lostStepsRedone", "lost steps redone"), ("detection", "detection"), ("hang", "hang"), ("teardown", "teardown"),
                   ("scheduling", "scheduling"), ("jaxStartup", "JAX start-up"), ("restore", "restore"),
                   ("other", "other"))


def describe_goodput(goodput: Mapping[str, Any] | None) -> list[str]:
    """The operator's goodput account of the job (its `status.goodput`) as lines of text."""
    if not isinstance(goodput, Mapping) or not isinstance(goodput.get("breakdown"), Mapping):
        return ["  not reported (an operator without goodput accounting, or no generation yet)"]
    wall = float(goodput.get("wallSeconds") or 0.0)
    ratio = float(goodput.get("ratio") or 0.0)
    breakdown = goodput["breakdown"]
    lines = [f"  goodput {100 * ratio:.1f}% of {wall:.0f} s since the first generation was created "
             f"(as of {goodput.get('asOf', '?')}; {goodput.get('lostSteps', 0)} steps trained again)"]
    for key, label in GOODPUT_BUCKETS:
        seconds = float(breakdown.get(key) or 0.0)
        share = f"{100 * seconds / wall:5.1f}%" if wall > 0 else "    -"
        lines.append(f"    {label:<30} {seconds:8.1f} s  {share}")
    return lines


def build_timeline(start: float, snapshots: Sequence[JobSnapshot], faults: Sequence[Fault],
                   records: Sequence[LossRecord], events: Sequence[TimelineEvent] = (),
                   notes: Sequence[TimelineEvent] = (), goodput: Mapping[str, Any] | None = None) -> list[str]:
    """The whole story as lines of text: events in time order, then generations, transitions
    (restored step, steps lost, pause), the loss continuity check and the operator's goodput account
    (`goodput`: the job's last status.goodput)."""
    items = [*plan_events(snapshots), *events, *notes]
    items += [TimelineEvent(f.time, "fault", f"{f.kind} {f.node}") for f in faults]
    generations = build_generations(records)
    for g in generations:
        where = "from scratch" if g.restored_step == 0 else f"restored step {g.restored_step}"
        items.append(TimelineEvent(g.first_time, "train",
                                   f"generation {g.generation} first step {g.first_step} on {g.devices} devices "
                                   f"({where})"))
        items.append(TimelineEvent(g.last_time, "train", f"generation {g.generation} last step {g.last_step}"))
    lines = ["Timeline (seconds since the demo started)"]
    lines += [f"{_rel(e.time, start)}  {e.kind:<10} {e.text}"
              for e in collapse_checkpoints(sorted(items, key=lambda e: e.time), start)]
    lines += ["", "Generations (from the loss lines of process 0)",
              f"  {'GEN':>3}  {'DEVICES':>7}  {'STEPS':>11}  {'RESTORED':>8}  {'FROM':>9}  {'TO':>9}"]
    for g in generations:
        lines.append(f"  {g.generation:>3}  {g.devices:>7}  {g.first_step:>5}-{g.last_step:<5}  "
                     f"{g.restored_step:>8}  {_rel(g.first_time, start)}  {_rel(g.last_time, start)}")
    lines += ["", "Transitions"]
    transitions = build_transitions(generations, faults)
    if not transitions:
        lines.append("  none")
    job_events = plan_events(snapshots)
    for t in transitions:
        cause = f"{t.cause.kind} {t.cause.node} at {_rel(t.cause.time, start).strip()}" if t.cause else "no fault"
        lines.append(f"  generation {t.before.generation} -> {t.after.generation} ({cause}): "
                     f"{t.before.devices} -> {t.after.devices} devices, last step {t.before.last_step}, "
                     f"restored {t.after.restored_step}, steps lost {t.steps_lost}, "
                     f"next step after {t.pause_seconds:.1f} s")
        split = describe_pause(t, job_events)
        if split:
            lines.append(f"    {split}")
    c = check_loss_continuity(records)
    lines += ["", "Loss continuity"]
    if c.max_step == 0:
        lines.append("  no steps logged")
    else:
        lines.append(f"  steps 1-{c.max_step}: {len(c.missing_steps)} missing, "
                     f"{len(c.recomputed_steps)} trained again after a restore, "
                     f"{len(c.mismatches)} with a different loss the second time -> "
                     f"{'one continuous curve' if c.ok else 'NOT continuous'}")
        for step, a, b in c.mismatches[:10]:
            lines.append(f"  step {step}: {a:.6g} then {b:.6g}")
        if c.missing_steps:
            lines.append(f"  missing: {_ranges(c.missing_steps)}")
    lines += ["", "Goodput (the operator's account: status.goodput)", *describe_goodput(goodput)]
    return lines


def describe_pause(t: Transition, job_events: Sequence[TimelineEvent]) -> str:
    """The pause of a transition split at what the job's status showed: the operator reacting (phase
    left Running), the new generation created, and its first step (JAX start-up, restore, compile)."""
    start = t.cause.time if t.cause is not None else t.before.last_time
    reacted = next((e.time for e in job_events if e.kind == "phase" and e.time >= start), None)
    created = next((e.time for e in job_events if e.kind == "generation"
                    and e.text.startswith(f"generation {t.after.generation}:")), None)
    if reacted is None or created is None or not start <= reacted <= created <= t.after.first_time:
        return ""
    return (f"operator reacted after {reacted - start:.1f} s, new generation created {created - reacted:.1f} s "
            f"later (old one torn down), its first step {t.after.first_time - created:.1f} s after that "
            f"(pods started, JAX start-up, restore)")


def collapse_checkpoints(events: Sequence[TimelineEvent], start: float, least: int = 3) -> list[TimelineEvent]:
    """Runs of `least` or more checkpoint events with nothing else between them become one event."""
    out: list[TimelineEvent] = []
    run: list[TimelineEvent] = []

    def flush() -> None:
        if len(run) >= least:
            first, last = run[0].text.split()[1], run[-1].text.split()[1]
            tier = run[-1].text.split("committed", 1)[1]
            out.append(TimelineEvent(run[0].time, "checkpoint",
                                     f"steps {first} to {last} committed{tier}: {len(run)} checkpoints seen, "
                                     f"the last at {_rel(run[-1].time, start).strip()}"))
        else:
            out.extend(run)
        run.clear()

    for e in events:
        if e.kind == "checkpoint":
            run.append(e)
            continue
        flush()
        out.append(e)
    flush()
    return out


def _ranges(steps: Sequence[int]) -> str:
    out: list[str] = []
    for s in steps:
        if out and out[-1].split("-")[-1] == str(s - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)
