"""A job's generations on a time axis, from `status.history` (pure: no API, no matplotlib, no files).

`status.history` (docs/jaxjob-reference.md) holds the last 50 generations, oldest first; the current one
has no `end`. From it this module builds:
- `parse_history`: the entries as status_fields/history.py's `HistoryEntry`s (an unreadable entry is left out: the
  view shows what it can, it never fails on one odd entry);
- `build_gantt`: the text Gantt `kubectl resilax timeline` prints, with faults and checkpoints;
- `build_plot`: the figures `--png` draws (kubectl/timeline_plot.py) and the web page lays out (kubectl/timeline_page.py).

Where a step happened in time is not in the history, only each generation's first and last step. The
views place the first step after the generation's start-up (its `scheduling + jaxStartup + restore`
goodput seconds) and the last one at its end (now for the current one), and a checkpoint by its step
between the two: a straight line, good enough to see where the saves fell, not a measurement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from itertools import pairwise
from typing import Any, Final

from ..status_fields.history import HistoryEntry, parse_entry

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


def shape_text(e: HistoryEntry) -> str:
    """`2 x 2x4 (4 hosts)`, as `kubectl resilax status` shows a shape."""
    return f"{e.count} x {e.topology or '?'} ({e.hosts} hosts)"


def end_kind(e: HistoryEntry) -> str:
    """running, planned, notice or fault (END_GLYPHS)."""
    if e.end is None:
        return "running"
    if e.end_reason in PLANNED_REASONS:
        return "planned"
    if e.end_reason in NOTICE_REASONS:
        return "notice"
    return "fault"


def restored_text(e: HistoryEntry) -> str:
    """`400 (persistent)`, `400`, or `fresh`."""
    if e.restored_step is None:
        return "fresh"
    return f"{e.restored_step} ({e.restored_from})" if e.restored_from else str(e.restored_step)


def steps_text(e: HistoryEntry) -> str:
    """`401-700`, `401-` or `-`."""
    if e.first_step is None:
        return "-"
    return f"{e.first_step}-{'' if e.last_step is None else e.last_step}"


def finish(e: HistoryEntry, now: datetime) -> datetime:
    """Its end, or `now` while it runs (never before its start)."""
    return max(e.end or now, e.start)


def startup_seconds(e: HistoryEntry, now: datetime) -> float:
    """The start-up before its first step (STARTUP_BUCKETS of its goodput), at most its duration."""
    buckets = dict(e.goodput)
    spent = sum(float(buckets.get(b) or 0.0) for b in STARTUP_BUCKETS)
    return min(max(spent, 0.0), (finish(e, now) - e.start).total_seconds())


def goodput_ratio(e: HistoryEntry) -> float | None:
    """Productive seconds over all the seconds of its window; None without goodput figures."""
    buckets = dict(e.goodput)
    total = sum(buckets.values())
    return buckets.get("productive", 0.0) / total if total > 0 else None


def parse_history(job: Mapping[str, Any]) -> list[HistoryEntry]:
    """The job's status.history (history.parse_entry), by generation number; an unreadable entry is
    left out (the view shows what it can, it never fails on one odd entry)."""
    raw = ((job.get("status") or {}).get("history")) or []
    entries = []
    for item in raw if isinstance(raw, list) else []:
        if not isinstance(item, Mapping):
            continue
        with contextlib.suppress(KeyError, TypeError, ValueError):
            entries.append(parse_entry(item))
    return sorted(entries, key=lambda e: e.generation)


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


def build_plot(title: str, generations: Sequence[HistoryEntry], now: datetime) -> TimelinePlot:
    """The bars and gaps of `generations` (oldest first) as of `now`."""
    if not generations:
        return TimelinePlot(title, now, 0.0, (), ())
    origin = generations[0].start
    bars = []
    for g in generations:
        start = (g.start - origin).total_seconds()
        end = (finish(g, now) - origin).total_seconds()
        first_at = start + startup_seconds(g, now)
        saves = tuple((s, step_time(first_at, end, g.first_step, g.last_step, s)) for s in g.checkpoints)
        bars.append(Bar(g.generation, shape_text(g), start, first_at, end, end_kind(g), g.end_reason or None,
                        g.end_message, g.first_step, g.last_step, restored_text(g), saves))
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


def build_gantt(name: str, generations: Sequence[HistoryEntry], now: datetime, width: int = GANTT_WIDTH) -> list[str]:
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
        lines.append(f"{g.generation:>4}  {shape_text(g):<20} {steps_text(g):<13} {restored_text(g):<18} "
                     f"|{build_bar_row(bar, span, width)}| {end}")
    lines.append("      . start-up (scheduling, JAX start, restore)  = training  + checkpoint  "
                 "X fault  ! notice  ] planned end  > running")
    for g in generations:
        notes = []
        if g.end is not None:
            notes.append(f"{END_GLYPHS[end_kind(g)]} {g.end_reason or '?'} at {g.end.strftime('%H:%M:%S')}Z"
                         + (f": {g.end_message}" if g.end_message else "")
                         + (f" ({g.lost_steps} steps lost)" if g.lost_steps else ""))
        if g.checkpoints:
            notes.append(f"checkpoints: {', '.join(str(s) for s in g.checkpoints)}")
        ratio = goodput_ratio(g)
        if ratio is not None:
            notes.append(f"goodput {100 * ratio:.0f}%")
        if g.in_place:
            notes.append("restarted in place")
        if notes:
            lines.append(f"{g.generation:>4}  " + "; ".join(notes))
    return lines
