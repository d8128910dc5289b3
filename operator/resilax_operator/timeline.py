"""A job's generations on a time axis, from `status.history` (pure: no API, no matplotlib, no files).

`status.history` (docs/jaxjob-reference.md) holds the last 50 generations, oldest first; the current one
has no `end`. From it this module builds:
- `parse_history`: the entries as frozen `Generation`s (an entry without a generation number or a
  parseable start is left out: the view shows what it can, it never fails on one odd entry);
- `build_gantt`: the text Gantt `kubectl resilax timeline` prints, with faults and checkpoints;
- `build_plot`: the figures `--png` draws (timeline_plot.py) and the web page lays out (timeline_page.py).

Where a step happened in time is not in the history, only each generation's first and last step. The
views place the first step after the generation's start-up (its `scheduling + jaxStartup + restore`
goodput seconds) and the last one at its end (now for the current one), and a checkpoint by its step
between the two: a straight line, good enough to see where the saves fell, not a measurement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise
from typing import Any, Final

#: Reasons a generation ends without anything going wrong (the user or the job asked for it).
PLANNED_REASONS: Final = frozenset({"Completed", "Resized", "SpecResized", "GrowBack", "Suspended", "Suspending",
                                    "Resumed"})
#: Reasons that announce the end ahead of time: the job saves and moves on, nothing is lost.
NOTICE_REASONS: Final = frozenset({"PreemptionNotice", "MaintenanceScheduled"})
#: How an end is drawn: a fault (X), a notice (!), planned (]), still running (>).
END_GLYPHS: Final = {"fault": "X", "notice": "!", "planned": "]", "running": ">"}
#: The goodput buckets spent before a generation's first step (its start-up).
STARTUP_BUCKETS: Final = ("scheduling", "jaxStartup", "restore")
GANTT_WIDTH: Final = 60


def parse_time(raw: Any) -> datetime | None:
    """An RFC 3339 time (`2026-12-04T12:00:00Z`) as an aware datetime; None when absent or malformed."""
    if not isinstance(raw, str) or not raw:
        return None
    try:
        parsed = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _int(raw: Any) -> int | None:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else None


@dataclass(frozen=True)
class Generation:
    """One entry of status.history."""

    generation: int
    start: datetime
    end: datetime | None
    count: int | None
    topology: str
    hosts: int | None
    pools: tuple[str, ...] = ()
    in_place: bool = False
    end_reason: str | None = None
    end_message: str = ""
    restored_step: int | None = None
    restored_from: str | None = None
    first_step: int | None = None
    last_step: int | None = None
    lost_steps: int = 0
    goodput: Mapping[str, float] | None = None
    checkpoints: tuple[int, ...] = ()

    @property
    def shape(self) -> str:
        """`2 x 2x4 (4 hosts)`, as `kubectl resilax status` shows it."""
        return f"{self.count} x {self.topology} ({self.hosts} hosts)"

    @property
    def end_kind(self) -> str:
        """running, planned, notice or fault (END_GLYPHS)."""
        if self.end is None:
            return "running"
        if self.end_reason in PLANNED_REASONS:
            return "planned"
        if self.end_reason in NOTICE_REASONS:
            return "notice"
        return "fault"

    @property
    def restored(self) -> str:
        """`400 (persistent)`, `400`, or `fresh`."""
        if self.restored_step is None:
            return "fresh"
        return f"{self.restored_step} ({self.restored_from})" if self.restored_from else str(self.restored_step)

    @property
    def steps(self) -> str:
        """`401-700`, `401-` or `-`."""
        if self.first_step is None:
            return "-"
        return f"{self.first_step}-{'' if self.last_step is None else self.last_step}"

    def finish(self, now: datetime) -> datetime:
        """Its end, or `now` while it runs (never before its start)."""
        return max(self.end or now, self.start)

    def startup_seconds(self, now: datetime) -> float:
        """The start-up before its first step (STARTUP_BUCKETS of its goodput), at most its duration."""
        spent = sum(float((self.goodput or {}).get(b) or 0.0) for b in STARTUP_BUCKETS)
        return min(max(spent, 0.0), (self.finish(now) - self.start).total_seconds())

    def goodput_ratio(self) -> float | None:
        """Productive seconds over all its seconds; None without goodput figures."""
        buckets = {k: float(v or 0.0) for k, v in (self.goodput or {}).items()}
        total = sum(buckets.values())
        return buckets.get("productive", 0.0) / total if total > 0 else None


def parse_entry(raw: Mapping[str, Any]) -> Generation | None:
    """One raw entry (docs/jaxjob-reference.md, status.history); None without a generation or start."""
    generation, start = _int(raw.get("generation")), parse_time(raw.get("start"))
    if generation is None or start is None:
        return None
    shape: Mapping[str, Any] = raw["shape"] if isinstance(raw.get("shape"), Mapping) else {}
    goodput: Mapping[str, Any] = raw["goodput"] if isinstance(raw.get("goodput"), Mapping) else {}
    return Generation(
        generation=generation, start=start, end=parse_time(raw.get("end")),
        count=_int(shape.get("count")), topology=str(shape.get("topology") or "?"), hosts=_int(shape.get("hosts")),
        pools=tuple(str(p) for p in raw.get("pools") or ()), in_place=raw.get("inPlace") is True,
        end_reason=str(raw["endReason"]) if raw.get("endReason") else None,
        end_message=str(raw.get("endMessage") or ""),
        restored_step=_int(raw.get("restoredStep")),
        restored_from=str(raw["restoredFrom"]) if raw.get("restoredFrom") else None,
        first_step=_int(raw.get("firstStep")), last_step=_int(raw.get("lastStep")),
        lost_steps=_int(raw.get("lostSteps")) or 0,
        goodput={str(k): float(v) for k, v in goodput.items() if isinstance(v, int | float)},
        checkpoints=tuple(sorted(s for s in (raw.get("checkpoints") or ()) if _int(s) is not None)),
    )


def parse_history(job: Mapping[str, Any]) -> list[Generation]:
    """The job's status.history as Generations, by generation number."""
    raw = ((job.get("status") or {}).get("history")) or []
    parsed = [parse_entry(e) for e in raw if isinstance(e, Mapping)]
    return sorted((g for g in parsed if g is not None), key=lambda g: g.generation)


def format_seconds(seconds: float) -> str:
    """`42s`, `7m03s`, `2h05m` (the Gantt's durations)."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


# ---- positions: seconds since the first generation started -------------------------------------------


@dataclass(frozen=True)
class Bar:
    """One generation on the time axis (seconds since the first generation started)."""

    generation: int
    label: str
    start: float
    first_step_at: float
    end: float
    end_kind: str
    end_reason: str | None
    end_message: str
    first_step: int | None
    last_step: int | None
    restored: str
    checkpoints: tuple[tuple[int, float], ...]
    """(step, seconds) of each checkpoint committed in it, placed by its step (module docstring)."""


@dataclass(frozen=True)
class TimelinePlot:
    """What the picture and the page draw: the bars, the span of the axis, and the gaps between generations
    (from one generation's end to the next one's first step: the time a fault or resize cost)."""

    title: str
    origin: datetime
    span: float
    bars: tuple[Bar, ...]
    gaps: tuple[tuple[float, float, str], ...]


def step_time(bar_start: float, bar_end: float, first: int | None, last: int | None, step: int) -> float:
    """Where `step` falls between a generation's first step (at `bar_start`) and its last (at `bar_end`)."""
    if first is None or last is None or last <= first:
        return bar_end
    fraction = min(max((step - first) / (last - first), 0.0), 1.0)
    return bar_start + fraction * (bar_end - bar_start)


def build_plot(title: str, generations: Sequence[Generation], now: datetime) -> TimelinePlot:
    """The bars and gaps of `generations` (oldest first) as of `now`."""
    if not generations:
        return TimelinePlot(title, now, 0.0, (), ())
    origin = generations[0].start
    bars = []
    for g in generations:
        start = (g.start - origin).total_seconds()
        end = (g.finish(now) - origin).total_seconds()
        first_at = start + g.startup_seconds(now)
        saves = tuple((s, step_time(first_at, end, g.first_step, g.last_step, s)) for s in g.checkpoints)
        bars.append(Bar(g.generation, g.shape, start, first_at, end, g.end_kind, g.end_reason, g.end_message,
                        g.first_step, g.last_step, g.restored, saves))
    gaps = tuple((before.end, after.first_step_at, before.end_reason or "?")
                 for before, after in pairwise(bars) if after.first_step_at > before.end)
    return TimelinePlot(title, origin, max(b.end for b in bars), tuple(bars), gaps)


# ---- the text Gantt --------------------------------------------------------------------------------


def _column(seconds: float, span: float, width: int) -> int:
    return min(width - 1, max(0, int(seconds / span * width))) if span > 0 else 0


def build_bar_row(bar: Bar, span: float, width: int = GANTT_WIDTH) -> str:
    """One generation's row: `.` start-up, `=` training, `+` a checkpoint, the end glyph (END_GLYPHS)."""
    cells = [" "] * width
    first, last = _column(bar.start, span, width), _column(bar.end, span, width)
    training = _column(bar.first_step_at, span, width)
    for i in range(first, last + 1):
        cells[i] = "." if i < training else "="
    for _, at in bar.checkpoints:
        cells[_column(at, span, width)] = "+"
    cells[last] = END_GLYPHS[bar.end_kind]
    return "".join(cells)


def build_gantt(name: str, generations: Sequence[Generation], now: datetime, width: int = GANTT_WIDTH) -> list[str]:
    """`kubectl resilax timeline`: a header, one row per generation, the legend, then each end's reason
    and message (the faults) and the checkpoints of each generation."""
    if not generations:
        return [f"{name}: no history yet (status.history is filled by the operator from its first generation on)"]
    plot = build_plot(name, generations, now)
    span = plot.span
    lines = [f"{name}: {len(generations)} generation{'s' * (len(generations) != 1)} over {format_seconds(span)}, "
             f"from {plot.origin.strftime('%Y-%m-%d %H:%M:%S')}Z",
             f"{'GEN':>4}  {'SHAPE':<20} {'STEPS':<13} {'RESTORED':<18} |0{format_seconds(span):>{width - 1}}| END"]
    for g, bar in zip(generations, plot.bars, strict=True):
        end = "running" if g.end is None else f"{g.end_reason or '?'} after {format_seconds(bar.end - bar.start)}"
        lines.append(f"{g.generation:>4}  {g.shape:<20} {g.steps:<13} {g.restored:<18} "
                     f"|{build_bar_row(bar, span, width)}| {end}")
    lines.append("      . start-up (scheduling, JAX start, restore)  = training  + checkpoint  "
                 "X fault  ! notice  ] planned end  > running")
    for g in generations:
        notes = []
        if g.end is not None:
            notes.append(f"{END_GLYPHS[g.end_kind]} {g.end_reason or '?'} at {g.end.strftime('%H:%M:%S')}Z"
                         + (f": {g.end_message}" if g.end_message else "")
                         + (f" ({g.lost_steps} steps lost)" if g.lost_steps else ""))
        if g.checkpoints:
            notes.append(f"checkpoints: {', '.join(str(s) for s in g.checkpoints)}")
        ratio = g.goodput_ratio()
        if ratio is not None:
            notes.append(f"goodput {100 * ratio:.0f}%")
        if g.in_place:
            notes.append("restarted in place")
        if notes:
            lines.append(f"{g.generation:>4}  " + "; ".join(notes))
    return lines
