"""A finished job (pure): the `Completed` and `Failed` conditions, and `spec.ttlSecondsAfterFinished`.

| the status the decision writes                    | conditions                                        |
|---------------------------------------------------|---------------------------------------------------|
| phase Succeeded                                   | Completed=True, reason Completed (`kubectl wait --for=condition=Completed`) |
| phase Failed                                      | Failed=True, the Ready condition's reason and message (why it failed) |
| any other phase, the condition True from before   | False, reason SpecFixed (a job failed only for its spec starts once it is fixed) |

`with_outcome` runs on every status a decision writes (reconcile.decide), so the policies that end a
job set only the phase and Ready, and the conditions follow in the same write. `check_ttl` runs on a
finished job: once `ttlSecondsAfterFinished` passed since the condition turned True (its
lastTransitionTime), the JAXJob is deleted (its uid as precondition; the finalizer and the owner
references remove its objects; checkpoints stay), else the next look is at that time (≤ 5 s anyway).
"""

from __future__ import annotations

from datetime import datetime

from .. import api
from .. import status as st
from ..actions import Action, DeleteJob, EmitEvent, RequeueAfter, SetStatus
from ..observed.snapshot import Observed
from ..spec import JobSpec
from ..status import JobStatus


def with_outcome(s: JobStatus, now: datetime) -> JobStatus:
    """`s` with Completed and Failed following its phase (the table above)."""
    ready = s.condition(api.COND_READY)
    reason, message = (ready.reason, ready.message) if ready is not None else (s.phase, s.phase)
    if s.phase == api.PHASE_SUCCEEDED:
        return st.set_condition(s, api.COND_COMPLETED, True, api.COMPLETED.name, message, now)
    if s.phase == api.PHASE_FAILED:
        return st.set_condition(s, api.COND_FAILED, True, reason, message, now)
    for type_ in (api.COND_COMPLETED, api.COND_FAILED):
        old = s.condition(type_)
        if old is not None and old.status == "True":
            s = st.set_condition(s, type_, False, api.SPEC_FIXED.name, api.SPEC_FIXED.message, now)
    return s


def with_outcomes(actions: list[Action], now: datetime) -> list[Action]:
    """Every SetStatus of a decision through `with_outcome`."""
    return [SetStatus(with_outcome(a.status, now)) if isinstance(a, SetStatus) else a for a in actions]


def finished_at(s: JobStatus) -> datetime | None:
    """When the job finished: its Completed or Failed condition's lastTransitionTime (None: running)."""
    type_ = {api.PHASE_SUCCEEDED: api.COND_COMPLETED, api.PHASE_FAILED: api.COND_FAILED}.get(s.phase)
    cond = s.condition(type_) if type_ else None
    return cond.last_transition_time if cond is not None and cond.status == "True" else None


def check_ttl(spec: JobSpec, observed: Observed, s: JobStatus) -> list[Action]:
    """A finished job past `ttlSecondsAfterFinished`: delete it; before that, look again then."""
    ttl = spec.ttl_seconds_after_finished
    since = finished_at(s)
    if ttl is None or since is None:
        return []
    age = (observed.now - since).total_seconds()
    if age < ttl:
        return [RequeueAfter(ttl - age)]
    text = api.TTL_EXPIRED.format(seconds=int(age), ttl=ttl)
    return [EmitEvent("Normal", api.TTL_EXPIRED.name, text), DeleteJob(observed.job.uid, text)]

