"""A transition: how a generation is replaced, whatever found that it must be (the other policies).

1. `begin`: record the transition in the status (kind, message, the final save request if
   final_save.py wants one, the backoff) with Ready=False and an Event, then act on it at once. A
   pod-level loss (PodLost, WorkerStopped) counts in `status.podLosses`: the first starts the next
   generation at once, the n-th waits podLossBackoffSeconds x 2^(n-2) (capped), past maxPodLosses
   the job is Failed (PodLossesExceeded); a generation Running podLossResetSeconds clears the count.
2. `proceed` (every later decision, also after an operator restart: the status is the memory):
   while the final save runs, final_save.py; then a planned move may go on in place (`in_place`, given
   by the dispatcher: inplace.after_final_save, before the teardown deleted anything); else tear the
   generation down (`plan_delete`); once none of its pods is left, generation_start.py starts the next one.

How each pod of a generation is deleted (`plan_delete`):

| the pod                                                  | deletion                                   |
|----------------------------------------------------------|--------------------------------------------|
| on a down or gone node, or Terminating far past its grace | force (gracePeriodSeconds=0)              |
| already Terminating                                      | left alone                                 |
| NodeLoss, WorkerFailure, TrainerHung, or a worker exited 76 (a peer process gone) or unreachable (PodLost while trainer_process.unreachable_workers names one): a surviving worker; Shrink (never all ran) | grace node_loss.SURVIVOR_GRACE_SECONDS (its final save cannot finish) |
| its trainer exited, no local tier                        | grace TRAINER_GONE_GRACE_SECONDS           |
| its trainer never started (unscheduled, a failed health check) | grace TRAINER_GONE_GRACE_SECONDS      |
| planned teardown, its trainer still running              | not before teardownSince + STOPPING_TRAINER_WAIT_SECONDS |
| TrainerHung, supervised (its stacks are dumped first)    | that grace, not before teardownSince + HANG_STACKS_SECONDS |
| otherwise                                                | the pod's own grace (SIGTERM: the workers save) |

The processes on a down or gone node are named in `DeleteGeneration.lost`: the executor tells the
sidecars of the pods it deletes with a grace (`POST /v1/peers/lost`), so a survivor's final upload that
waits for a dead process's marker ends at once, not at SIGKILL (docs/architecture.md, "A lost peer's
survivors go at once").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Final

from .. import api
from .. import status as st
from ..actions import (
    POLL_SECONDS,
    Action,
    DeleteGeneration,
    EmitEvent,
    PodDeletion,
    RequeueAfter,
    SetStatus,
    StopTrainers,
    status_change,
)
from ..observed.snapshot import Observed
from ..observed.trainer_process import unreachable_workers
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus, Transition
from . import Finding, final_save, generation_start, node_loss

#: Grace period of a pod whose trainer has already exited, when the job has no local tier: its sidecar
#: has nothing left to save or upload, but without the trainer's liveness lock (docs/sidecar.md, open
#: points) it would wait for an answer until its own grace (finalSave.timeoutSeconds) runs out.
TRAINER_GONE_GRACE_SECONDS: Final = 2
#: After a final save with stop, the trainers exit (75) by themselves within moments. A pod deleted
#: before that gets SIGTERM and its sidecar waits for a save answer that never comes; so a planned
#: teardown leaves a pod whose trainer still runs alone for up to this long after it began (seconds).
STOPPING_TRAINER_WAIT_SECONDS: Final = 15
#: Transitions whose generation lost a worker process for good (its node, its own failure): the
#: survivors' final save would be a collective with it and cannot finish, so they get
#: node_loss.SURVIVOR_GRACE_SECONDS, not their full grace (as when a worker exited 76: a peer is gone);
#: a Shrink's generation never all ran, so it has no save to make either; a hung one cannot finish one.
PEER_GONE_KINDS: Final = frozenset({st.NODE_LOSS, st.WORKER_FAILURE, st.SHRINK, st.TRAINER_HUNG})
#: Transitions the operator chose (not forced on it): their workers may stop by themselves.
PLANNED_KINDS: Final = frozenset({st.PREEMPTION, st.RESIZE, st.GROW_BACK, st.WORKER_STOPPED, st.SUSPEND,
                                  st.ROLLBACK})
#: Transitions that are pod-level losses (not the worker's own failure, not a node's; a hang too): they back off
#: exponentially (`pod_loss_backoff`) and fail the job past `max_pod_losses` in a row.
POD_LOSS_KINDS: Final = frozenset({st.POD_LOST, st.WORKER_STOPPED, st.TRAINER_HUNG})
#: A hung generation replaced in full: its supervised trainers are first asked to stop with their stacks
#: dumped to the pod log (the supervisor takes ~2 s), and their pods deleted no sooner than this after.
HANG_STACKS_SECONDS: Final = 5


def begin(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings, actions: list[Action],
          finding: Finding) -> list[Action]:
    """Record a transition away from the current generation, then act on it."""
    counted = account(spec, observed, s, settings, actions, finding)
    if isinstance(counted, list):
        return counted
    s, finding = counted
    now, g = observed.now, s.generation
    save = final_save.wanted(spec, finding.kind) and any(p.phase == "Running" for p in observed.pods_of(g))
    since = st.truncate(now)
    t = Transition(kind=finding.kind, generation=g, since=since, message=finding.message,
                   save_request_id=f"{observed.job.name}-g{g}-{finding.kind.lower()}" if save else None,
                   save_deadline=since + timedelta(seconds=spec.checkpoint.final_save.timeout_seconds) if save else None,
                   not_before=finding.not_before, teardown_since=None if save else since, reason=finding.reason)
    new = replace(s, transition=t, phase=st.phase_for(t, first=False))
    new = st.set_condition(new, api.COND_READY, False, finding.reason, finding.message, now)
    head: list[Action] = [*actions, SetStatus(new), EmitEvent(finding.event_type, finding.reason, finding.message),
                          *finding.events]
    supervised = tuple(p.name for p in observed.pods_of(g) if p.supervised and p.phase == "Running")
    if finding.kind == st.TRAINER_HUNG and supervised:
        head.append(StopTrainers(g + 1, supervised, f"generation {g} hung: stacks, then replaced", stacks=True))
    # Act on the recorded transition right away, as the next decision would.
    return head + proceed(spec, replace(observed, status=new), new, settings, [], announce=False)


def account(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings, actions: list[Action],
            finding: Finding) -> tuple[JobStatus, Finding] | list[Action]:
    """Count a finding (a failure against maxRestarts; a pod-level loss in a row, with its backoff):
    the status and finding to go on with, or the actions that fail the job (too many pod losses)."""
    now, g = observed.now, s.generation
    if finding.failure:
        s = replace(s, failures=s.failures + 1)
    if finding.kind in POD_LOSS_KINDS and not finding.failure:
        losses = s.pod_losses + 1
        if losses > settings.max_pod_losses:
            text = api.POD_LOSSES_EXCEEDED.format(losses=losses, reset=settings.pod_loss_reset_seconds,
                                                  max_losses=settings.max_pod_losses, detail=finding.message)
            failed = replace(s, phase=api.PHASE_FAILED, pod_losses=losses)
            failed = st.set_condition(failed, api.COND_READY, False, api.POD_LOSSES_EXCEEDED.name, text, now)
            return [*actions, SetStatus(failed), EmitEvent("Warning", api.POD_LOSSES_EXCEEDED.name, text),
                    plan_delete(observed, spec, g, "job failed", settings)]
        s = replace(s, pod_losses=losses)
        delay = pod_loss_backoff(losses, settings)
        if delay:
            until = st.truncate(now) + timedelta(seconds=delay)
            event = EmitEvent("Warning", api.POD_LOSS_BACKOFF.name, api.POD_LOSS_BACKOFF.format(
                losses=losses, max_losses=settings.max_pod_losses, until=st.format_time(until)))
            finding = replace(finding, not_before=until, events=(*finding.events, event))
    return s, finding


def pod_loss_backoff(losses: int, settings: OperatorSettings) -> int:
    """Seconds before the next generation after the `losses`-th pod-level loss in a row: none for the
    first, then podLossBackoffSeconds doubling each time, capped."""
    if losses <= 1:
        return 0
    return min(settings.pod_loss_backoff_max_seconds, settings.pod_loss_backoff_seconds * 2 ** (losses - 2))


#: inplace.after_final_save's signature: the actions of an in-place restart, or None (tear down).
InPlaceHandOff = Callable[[JobSpec, Observed, JobStatus, OperatorSettings, list[Action]], list[Action] | None]


def proceed(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings,
            actions: list[Action], *, announce: bool = True, in_place: InPlaceHandOff | None = None) -> list[Action]:
    """The recorded transition's next step: final save, in place (`in_place`), teardown, or the next
    generation."""
    t = s.transition
    assert t is not None
    g = t.generation
    pods = observed.pods_of(g)
    base = observed.status if announce else s

    if t.saving:
        step = final_save.progress(spec, observed, s, settings, base)
        if isinstance(step, list):
            return [*actions, *step]
        s, event = step
        actions = [*actions, SetStatus(s), event]
    else:
        new = replace(s, phase=st.phase_for(t, first=False))
        new = st.set_condition(new, api.COND_SAVING, False, api.NOT_SAVING.name, api.NOT_SAVING.message, observed.now)
        actions = [*actions, *status_change(base, new)]
        s = new
    t = s.transition
    assert t is not None

    if in_place is not None and t.kind in PLANNED_KINDS and pods and all(p.deletion_timestamp is None for p in pods):
        handed = in_place(spec, replace(observed, status=s), s, settings, actions)
        if handed is not None:
            return handed

    if pods or g in observed.services:
        delete = plan_delete(observed, spec, g, t.kind, settings, t.teardown_since or t.since)
        if needs_delete(observed, delete):
            actions = [*actions, delete]
        if pods:
            return [*actions, RequeueAfter(POLL_SECONDS)]
    return generation_start.start(spec, replace(observed, status=s), s, settings, actions)


def plan_delete(observed: Observed, spec: JobSpec, generation: int, reason: str, settings: OperatorSettings,
                teardown_since: datetime | None = None) -> DeleteGeneration:
    """Delete `generation`: each pod as the table in this module's docstring says."""
    pods = observed.pods_of(generation)
    forced = set(node_loss.pods_to_force(observed, pods, settings))
    on_lost = set(node_loss.pods_on_lost_nodes(observed, pods, settings))
    # a worker no one hears (WorkerUnreachable): the others' final save would be a collective with it
    peer_gone = any(p.exit_code == api.EXIT_CODE_PEER_LOST for p in pods) or (
        reason == st.POD_LOST and bool(unreachable_workers(observed)))
    out = []
    for p in pods:
        if p.name in forced:
            out.append(PodDeletion(p.name, force=True))
            continue
        if p.deletion_timestamp is not None:
            continue  # already going; deleting again changes nothing
        grace = None
        if reason in PEER_GONE_KINDS or peer_gone:
            grace = node_loss.SURVIVOR_GRACE_SECONDS
        elif (spec.checkpoint.local is None and p.trainer_exited) or p.trainer_never_started:
            # nothing of its own to save: its sidecar would wait out finalSave.timeoutSeconds for an answer
            # no trainer gives (a failed health check held the next generation 300 s by default)
            grace = TRAINER_GONE_GRACE_SECONDS
        not_before = None
        if reason in PLANNED_KINDS and p.trainer_running and teardown_since is not None:
            not_before = teardown_since + timedelta(seconds=STOPPING_TRAINER_WAIT_SECONDS)
        elif reason == st.TRAINER_HUNG and p.supervised and teardown_since is not None:
            not_before = teardown_since + timedelta(seconds=HANG_STACKS_SECONDS)  # its stacks first
        out.append(PodDeletion(p.name, grace, not_before=not_before))
    lost = tuple(sorted({p.process for p in pods if p.name in on_lost and p.process is not None}))
    return DeleteGeneration(generation, reason, tuple(out), lost=lost)


def needs_delete(observed: Observed, action: DeleteGeneration) -> bool:
    """Whether `action` changes anything: a pod to delete, or the generation's Service."""
    return bool(action.pods) or action.generation in observed.services
