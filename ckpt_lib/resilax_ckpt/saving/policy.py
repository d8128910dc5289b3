"""Pure decisions: when to save (the periodic policy). Which steps retention deletes: retention.py."""

from __future__ import annotations


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

