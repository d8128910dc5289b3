"""Pure decisions: when to save (periodic policy) and which steps retention deletes."""

from __future__ import annotations

from collections.abc import Iterable


def decide_periodic_save(step: int, last_saved_step: int | None, last_save_time: float | None,
                         now: float, every_steps: int | None, every_seconds: float | None) -> bool:
    """Whether the periodic policy saves `step` (whichever of steps or seconds comes first)."""
    if last_saved_step is not None and step <= last_saved_step:
        return False
    if every_steps is not None and step % every_steps == 0:
        return True
    if every_seconds is not None:
        if last_save_time is None:
            return False
        return now - last_save_time >= every_seconds
    return False


def plan_retention(steps: Iterable[int], keep_last: int | None, keep_every_steps: int | None,
                   protected: Iterable[int] = ()) -> list[int]:
    """The committed steps to delete. Keeps the newest `keep_last`, every multiple of
    `keep_every_steps`, the `protected` ones (e.g. being restored) and always the newest step."""
    ordered = sorted(set(steps))
    if keep_last is None or not ordered:
        return []
    keep = set(ordered[-keep_last:]) | {ordered[-1]} | set(protected)
    if keep_every_steps is not None:
        keep |= {s for s in ordered if s % keep_every_steps == 0}
    return [s for s in ordered if s not in keep]
