"""Preemption: a disruption notice on a node hosting a worker replaces the generation while its workers
can still save. GKE's signals, and when each is acted on:

| node of a worker                                               | decision                              |
|----------------------------------------------------------------|---------------------------------------|
| taint cloud.google.com/impending-node-termination              | Preemption now (final save if onPreemption) |
| taint cloud.google.com/maintenance-window-started              | Preemption now                        |
| label cloud.google.com/active-node-maintenance=ONGOING (or true) | Preemption now                      |
| label cloud.google.com/scheduled-maintenance-time, now ≥ time − lead | Preemption (the move starts within the lead) |
| label cloud.google.com/scheduled-maintenance-time, further ahead | MaintenanceScheduled=True (event once); keep running |
| label cloud.google.com/scheduled-maintenance-time, not a time  | Preemption now (the time is unknown)  |
| none                                                           | nothing (MaintenanceScheduled=False)  |

The lead (`maintenance_lead`) is `recovery.maintenanceLeadSeconds`, else sized from what the operator
measured of this job (status.timings): twice the last committed final save plus the last restart
(`finalSave.timeoutSeconds` and `DEFAULT_RESTART_SECONDS` until measured), at least
`MIN_MAINTENANCE_LEAD_SECONDS`. A node within the lead of its maintenance also stays out of the next
generation's plan (`ObservedNode.schedulable`); further ahead it may still be used. The final save and
the teardown are transition.py's and final_save.py's.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Final

from .. import api
from .. import status as st
from ..actions import EmitEvent
from ..observed.snapshot import Observed
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus
from . import Finding

#: The restart time assumed until one was measured (seconds): pods scheduled, images pulled, restore.
DEFAULT_RESTART_SECONDS: Final = 120
#: The default lead is never shorter than this (seconds).
MIN_MAINTENANCE_LEAD_SECONDS: Final = 120


def maintenance_lead(spec: JobSpec, s: JobStatus) -> timedelta:
    """How long before a scheduled host maintenance the job saves and moves (see the module docstring)."""
    if spec.recovery.maintenance_lead_seconds is not None:
        return timedelta(seconds=spec.recovery.maintenance_lead_seconds)
    save = s.final_save_seconds if s.final_save_seconds is not None else spec.checkpoint.final_save.timeout_seconds
    restart = s.restart_seconds if s.restart_seconds is not None else DEFAULT_RESTART_SECONDS
    return timedelta(seconds=max(MIN_MAINTENANCE_LEAD_SECONDS, 2 * (save + restart)))


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Finding | None:
    """The first worker (by pod name) whose node carries a notice that means "now" (or a scheduled
    maintenance within the lead)."""
    lead = maintenance_lead(spec, s)
    for p in observed.pods_of(s.generation):
        node = observed.node(p.node_name)
        notice = node.notice(observed.now, lead) if node is not None else None
        if node is not None and notice is not None:
            return Finding(st.PREEMPTION, api.PREEMPTION_NOTICE.name, api.PREEMPTION_NOTICE.format(
                node=node.name, generation=s.generation, notice=notice))
    return None


def record_scheduled(spec: JobSpec, observed: Observed, s: JobStatus) -> tuple[JobStatus, list[EmitEvent]]:
    """The MaintenanceScheduled condition: True naming the worker node with the earliest scheduled host
    maintenance and when the job will move; an Event when its message changes (the condition is the
    memory, so deciding twice emits nothing new)."""
    now, lead = observed.now, maintenance_lead(spec, s)
    earliest: tuple[datetime, str] | None = None
    for p in observed.pods_of(s.generation):
        node = observed.node(p.node_name)
        when = node.maintenance_time() if node is not None else None
        if node is not None and when is not None and (earliest is None or (when, node.name) < earliest):
            earliest = (when, node.name)
    old = s.condition(api.COND_MAINTENANCE)
    if earliest is None:
        if old is None or old.status == "False":
            return s, []
        return st.set_condition(s, api.COND_MAINTENANCE, False, api.NO_MAINTENANCE.name, api.NO_MAINTENANCE.message,
                                now), []
    when, name = earliest
    message = api.MAINTENANCE_SCHEDULED.format(node=name, generation=s.generation, time=st.format_time(when),
                                               move_at=st.format_time(when - lead),
                                               lead=int(lead.total_seconds()))
    if old is not None and old.status == "True" and old.message == message:
        return s, []
    new = st.set_condition(s, api.COND_MAINTENANCE, True, api.MAINTENANCE_SCHEDULED.name, message, now)
    return new, [EmitEvent("Normal", api.MAINTENANCE_SCHEDULED.name, message)]
