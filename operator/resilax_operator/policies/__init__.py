"""The operator's policies (pure), one file each; reconcile.py dispatches to them.

On a running generation the checks run in this order and the first that finds something decides
(`reconcile.WATCH`):

| policy             | finds                                                   | then                          |
|--------------------|---------------------------------------------------------|-------------------------------|
| node_loss          | a worker's node down while many nodes are (the guard)   | Degraded NodeLossGuard, wait  |
| node_loss          | a worker's node down past nodeLossGraceSeconds, or gone | NodeLoss: force, no save      |
| preemption         | a preemption/maintenance notice on a worker's node      | Preemption: final save        |
| queue_eviction     | a queue (Kueue) stopped the pod group (TerminationTarget) | QueueEviction: not counted; the workers save on SIGTERM |
| suspend            | spec.suspend                                            | Suspend: final save, no workers |
| node_loss          | a worker's node down within its grace                   | Degraded, wait                |
| health_check       | a new pod's host failed its health check                | node kept out; PodLost HealthCheckFailed |
| resize             | a spec edit the running shape no longer fits            | Resize                        |
| failure_rules      | a failed worker a spec.recovery.failureRules rule matches | its action: WorkerFailure (counted or not) or Failed |
| worker_exit        | a worker stopped (75), failed, lost, gone; all done     | WorkerStopped/Failure/PodLost |
| hang               | no progress past the hang timeout (a stopped trainer, a stuck collective) | TrainerHung: not counted |
| capacity_wait      | workers waited for new nodes past shrinkAfterSeconds    | Shrink to what Ready nodes fit |
| generation_start   | workers no node takes within scheduleTimeoutSeconds     | PodLost: replan               |
| container_waiting  | a container stuck waiting (image, config, crash loop)   | ContainerWaiting; past the timeout Failed or WorkerFailure |
| rollback           | spec.checkpoint.restore.step edited to another step     | Rollback: final save, the next generation restores that step |
| resize             | a spec edit to a larger shape; capacity came back       | Resize / GrowBack: final save |

Which spec they all decide on is invalid_edit.py's: the job's own when it validates, else the last
valid one the status kept (status.lastValidSpec), with InvalidSpec naming the problems.

A finding starts a transition (transition.py: record it, final_save.py, tear the generation down);
once no pod of it is left, generation_start.py plans and creates the next one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from ..actions import Action, EmitEvent


@dataclass(frozen=True)
class Finding:
    """A check found that the running generation must be replaced (`transition.begin` records it)."""

    #: The transition's kind (status.PREEMPTION, NODE_LOSS, ...).
    kind: str
    #: The Ready condition's reason (a constant of api.py) and its message.
    reason: str
    message: str
    #: Type of the Event announcing it.
    event_type: str = "Warning"
    #: Counted against recovery.maxRestarts (the worker's own failure).
    failure: bool = False
    #: The next generation starts no earlier than this (backoff).
    not_before: datetime | None = None
    #: Events after the announcing one.
    events: tuple[EmitEvent, ...] = field(default=())


#: What a check on the running generation returns: a finding (replace the generation), the actions
#: to take instead (wait, complete), or None (nothing to say; the next check runs).
Verdict = Finding | list[Action] | None
