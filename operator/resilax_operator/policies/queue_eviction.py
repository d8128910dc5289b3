"""Queue eviction: Kueue stopped the running generation's pod group (preempted it for a workload of
higher priority, or evicted it), which is the queue's decision, not a failure of the job.

Kueue stops a pod group by setting the condition `TerminationTarget` (reason `WorkloadEvicted`, its
message naming the preemptor) on each pod, then deleting the pods: the workers get SIGTERM, agree on
one step and save it (the checkpoint library's SIGTERM handling), and exit. The group is marked
`retriable-in-group: false` (builders.py), so Kueue finishes its Workload once every pod ended and
frees its quota; the operator's next generation is a new pod group that queues again.

| the running generation's workers                         | decision                                     |
|----------------------------------------------------------|----------------------------------------------|
| any pod with TerminationTarget=True (a queue stopped it) | QueueEviction: not counted (neither `failures` nor `podLosses`), no backoff; no final save request (the workers already save on SIGTERM); the pods Kueue has not deleted yet get their own grace; then the next generation (WaitingForAdmission until Kueue admits it) |
| none                                                     | nothing (the next check runs)                |

The check runs before worker_exit's: a worker that exits 75 after its SIGTERM save, or a pod deleted
by Kueue, is then never read as a pod-level loss (which backs off and fails the job after
`max_pod_losses` in a row) or a worker's failure.
"""

from __future__ import annotations

from .. import api
from .. import status as st
from ..generation import build_pod_group_name
from ..observed.snapshot import Observed
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus
from . import Finding


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Finding | None:
    """The first worker (by pod name) a queue stopped; None when none was."""
    for p in observed.pods_of(s.generation):
        if p.queue_stop is not None:
            return Finding(st.QUEUE_EVICTION, api.QUEUE_EVICTED.name, api.QUEUE_EVICTED.format(
                generation=s.generation, group=build_pod_group_name(observed.job.name, s.generation),
                detail=p.queue_stop), event_type="Normal")
    return None
