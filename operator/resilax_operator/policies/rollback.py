"""Rollback of a running job: `spec.checkpoint.restore.step` edited to a step number (by hand, or by
`kubectl resilax rollback NAME --step N`).

`status.restoreAsked` is the value the operator last acted on (written at every generation start), so
an edit is noticed once, also across operator restarts, and whatever the job was doing when it came:

| spec.checkpoint.restore.step vs status.restoreAsked               | decision                          |
|-------------------------------------------------------------------|-----------------------------------|
| the same; or restoreAsked unknown (a status from before it)       | nothing (an unknown one is recorded) |
| another step number, at or below status.checkpoint.step (or none known) | Rollback (`check`): a planned move, the current step saved first (final save, always), then the next generation restores the step asked (`plan_restore`) |
| another step number above status.checkpoint.step                  | RollbackRefused (Warning Event), recorded: the job runs on |
| `latest` or `none`                                                | recorded: the running job goes on from where it is |

A generation started for any other reason while an edit waits (a failure, a preemption) restores the
step asked too (`plan_restore`). The restore writes the rollback's branch record
(resilax_ckpt.history.timelines): the newer steps, the final save's included, stay on storage, superseded,
never deleted nor restored; status.checkpoint follows the new branch (status_fields/checkpoint.py) and the
new generation's history entry carries restoredStep and restoredFrom. A step that is not a visible
committed step is refused by the library's restore too, naming the committed steps (the generation
fails; the next one restores the latest step).
"""

from __future__ import annotations

from dataclasses import replace

from .. import api
from .. import status as st
from ..actions import Action, EmitEvent, SetStatus
from ..observed.snapshot import Observed
from ..settings import OperatorSettings
from ..spec import RESTORE_LATEST, JobSpec
from ..status import JobStatus
from . import Finding, Verdict


def asked_step(spec: JobSpec, s: JobStatus) -> int | None:
    """The step number an edit of spec.checkpoint.restore.step asks to roll back to and the operator has
    not acted on yet, or None (pure)."""
    want = spec.checkpoint.restore_step
    if not s.restore_asked or want == s.restore_asked or not want.isdigit():
        return None
    return int(want)


def refused(step: int, s: JobStatus) -> bool:
    """A rollback to `step` is refused: it is above the newest visible committed step the status knows."""
    return s.checkpoint is not None and step > s.checkpoint.step


def plan_restore(spec: JobSpec, s: JobStatus, generation: int) -> str:
    """What generation `generation` restores: the first one spec.checkpoint.restore.step; a later one the
    step a rollback asks (`asked_step`, unless `refused`), else the latest step."""
    if generation == 1:
        return spec.checkpoint.restore_step
    step = asked_step(spec, s)
    return str(step) if step is not None and not refused(step, s) else RESTORE_LATEST


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Verdict:
    """The running generation and an edit of spec.checkpoint.restore.step (the module's table)."""
    want = spec.checkpoint.restore_step
    if want == s.restore_asked:
        return None
    step = asked_step(spec, s)
    record: list[Action] = [SetStatus(replace(s, restore_asked=want))]
    if step is None:  # unknown before, or latest / none: nothing to roll back
        return record
    if refused(step, s):
        assert s.checkpoint is not None
        text = api.ROLLBACK_REFUSED.format(step=step, newest=s.checkpoint.step)
        return [*record, EmitEvent("Warning", api.ROLLBACK_REFUSED.name, text)]
    message = api.ROLLBACK_ASKED.format(step=step, generation=s.generation, next=s.generation + 1)
    return Finding(st.ROLLBACK, api.ROLLBACK_ASKED.name, message, event_type="Normal")
