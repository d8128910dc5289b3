"""Suspend: `spec.suspend: true` stops the job without ending it, the contract JobSet, the Kubeflow
TrainJob and Kueue share (a queue admits a suspended job by setting `suspend: false`).

| spec.suspend | the job                                           | decision                                  |
|--------------|---------------------------------------------------|-------------------------------------------|
| true         | a generation runs                                 | Suspend transition (`check`): final save when `finalSave.onPreemption`, then teardown (transition.py) |
| true         | no worker left (or none started yet)              | phase Suspended, Suspended=True, Ready=False Suspended (event once) (`hold`) |
| false        | Suspended                                         | the next generation restores the latest step; Suspended=False Resumed (event) (generation_start.py) |

While suspended the Suspend transition stays in the status, so its backoff and pod-loss counters are
those of before, and resuming is just the start of the next generation.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from .. import api
from .. import status as st
from ..actions import Action, EmitEvent, RequeueAfter, status_change
from ..observed.snapshot import Observed
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus
from . import Finding

#: How soon to look again while suspended (a spec change wakes the operator at once anyway).
SUSPENDED_POLL_SECONDS = 30.0


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Finding | None:
    """spec.suspend on a running generation: replace it by nothing (after a final save)."""
    if not spec.suspend:
        return None
    return Finding(st.SUSPEND, api.SUSPENDING.name, api.SUSPENDING.format(generation=s.generation),
                   event_type="Normal")


def hold(observed: Observed, s: JobStatus, actions: list[Action]) -> list[Action]:
    """No worker is left and spec.suspend holds: report Suspended and start nothing."""
    now = observed.now
    step = s.checkpoint.step if s.checkpoint is not None else "none"
    message = api.SUSPENDED.format(step=step)
    old = s.condition(api.COND_SUSPENDED)
    new = replace(s, phase=api.PHASE_SUSPENDED)
    new = st.set_condition(new, api.COND_SUSPENDED, True, api.SUSPENDED.name, message, now)
    new = st.set_condition(new, api.COND_READY, False, api.SUSPENDED.name, message, now)
    events = [] if old is not None and old.status == "True" else [EmitEvent("Normal", api.SUSPENDED.name, message)]
    return [*actions, *status_change(observed.status, new, *events), RequeueAfter(SUSPENDED_POLL_SECONDS)]


def resumed(s: JobStatus, generation: int, restore: str, now: datetime) -> tuple[JobStatus, list[EmitEvent]]:
    """The status of a new generation started after a suspension (Suspended=False, Resumed) and its
    event; unchanged when the job was not suspended."""
    old = s.condition(api.COND_SUSPENDED)
    if old is None or old.status != "True":
        return s, []
    what = {"latest": "the newest committed step", "none": "nothing (checkpoint.restore.step: none)"}.get(
        restore, f"step {restore}")
    message = api.RESUMED.format(generation=generation, restore=what)
    new = st.set_condition(s, api.COND_SUSPENDED, False, api.RESUMED.name, message, now)
    return new, [EmitEvent("Normal", api.RESUMED.name, message)]
