"""A lower-priority JAXJob as a spare (spare_jobs.py): suspended with its own final save when this job
would otherwise wait for capacity, resumed once this job runs at its declared shape again.

| observed (the status the decision leaves)                                    | decision |
|-------------------------------------------------------------------------------|----------|
| this job was suspended for a job that is gone (`Observed.lent_to_gone`)       | resume this job (its own spec.suspend false) |
| waiting for capacity (Ready False InsufficientCapacity), none lent yet, a spare job Running | suspend the first by name (`resilax.dev/suspended-for`: this job), SpareJobSuspended |
| waiting, one already lent                                                     | nothing: its final save and its pods' end free the nodes |
| Running at the declared shape, no transition; or finished, or suspended       | resume every job lent to it, SpareJobResumed |

Not for a job in a Kueue queue (the queue preempts by priority itself). The lent job's own decisions do
the rest (policies/suspend.py: final save, no workers; on resume it waits for capacity as a new one).
"""

from __future__ import annotations

from .. import api
from ..actions import Action, EmitEvent, SetStatus, SuspendSpareJob
from ..generation import kueue_queue
from ..observed.snapshot import Observed
from ..spec import JobSpec
from ..status import JobStatus


def waiting_for_capacity(s: JobStatus) -> bool:
    ready = s.condition(api.COND_READY)
    return (s.phase in (api.PHASE_PENDING, api.PHASE_RECOVERING, api.PHASE_RESIZING) and ready is not None
            and ready.status == "False" and ready.reason == api.INSUFFICIENT_CAPACITY.name)


def decide(spec: JobSpec, observed: Observed, s: JobStatus) -> list[Action]:
    """The spare jobs to suspend or resume for status `s` (the status this decision leaves)."""
    me = observed.job
    out: list[Action] = []
    if observed.lent_to_gone:
        out.append(SuspendSpareJob(me.name, me.uid, False, ""))
        out.append(EmitEvent("Normal", api.SPARE_JOB_RESUMED.name, api.SPARE_JOB_RESUMED.format(
            job=me.name, why=f"JAXJob {observed.lent_to_gone} it was lent to is gone")))
    lent = [j for j in observed.spare_jobs if j.lent and j.suspended]
    done = s.phase in api.TERMINAL_PHASES or spec.suspend or bool(kueue_queue(me, spec))
    if waiting_for_capacity(s) and not done:
        donors = [j for j in observed.spare_jobs if not j.suspended and j.phase == api.PHASE_RUNNING]
        if not lent and donors:
            d = donors[0]
            out.append(SuspendSpareJob(d.name, d.uid, True, me.name))
            out.append(EmitEvent("Normal", api.SPARE_JOB_SUSPENDED.name, api.SPARE_JOB_SUSPENDED.format(
                generation=s.generation + 1, job=d.name, name=me.name)))
        return out
    full = (s.phase == api.PHASE_RUNNING and s.transition is None and s.shape == spec.spec_shape)
    if full or done:
        why = "this job runs at its declared shape" if full else f"this job is {s.phase}"
        for j in lent:
            out.append(SuspendSpareJob(j.name, j.uid, False, ""))
            out.append(EmitEvent("Normal", api.SPARE_JOB_RESUMED.name, api.SPARE_JOB_RESUMED.format(job=j.name, why=why)))
    return out


def with_spare_jobs(actions: list[Action], spec: JobSpec, observed: Observed) -> list[Action]:
    """`actions` and, last, the spare jobs' suspensions and resumptions the status they leave calls for."""
    s = next((a.status for a in actions if isinstance(a, SetStatus)), observed.status)
    return [*actions, *decide(spec, observed, s)]
