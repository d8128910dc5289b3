"""Generation start: plan and create a generation once no pod of another one exists, bring it up, and
watch it come to Running.

| situation                                         | decision                                          |
|---------------------------------------------------|---------------------------------------------------|
| pods of another generation still exist            | wait (never two generations at once)              |
| a failure's backoff (`transition.notBefore`) runs | Ready=False Backoff, look again at notBefore      |
| no shape fits the schedulable node pools          | InsufficientCapacity (event once), look again     |
| a shape fits                                      | status first (generation N+1), then Service + pod 0 |
|                                                   | (with a Kueue queue: the first pod of each slice) |
| Kueue queue, lead pods created                    | the other pods (DNS coordinator), workersCreated  |
| pod 0 has no IP yet                               | wait                                              |
| pod 0 has an IP                                   | the other pods (coordinator address), workersCreated |
| the API server refuses a pod (admission)          | PodCreationRefused with its answer (and the fix)  |
| a worker unscheduled past scheduleTimeoutSeconds  | PodLost Unschedulable: replan                     |
| every worker Running                              | Running, Ready=True (event once); the restart time |
|                                                   | (creation to Running) in status.timings           |

The first generation restores `checkpoint.restore.step`, every later one the latest step, or the step a
rollback asks (policies/rollback.py: an edit of `checkpoint.restore.step` on a running job). A restore
that skipped unreadable steps sets CheckpointFallback (`decide_restore_fallback`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Final

from .. import api
from .. import status as st
from ..actions import (
    POLL_SECONDS,
    Action,
    CreateGeneration,
    EmitEvent,
    RequeueAfter,
    SetStatus,
    status_change,
)
from ..builders import (
    GenerationPlan,
    build_lead_pods,
    build_pods,
    build_service,
    creates_all_at_once,
    geometry_of,
    node_scoped,
)
from ..capacity import (
    LeaseWait,
    explain_shortfall,
    fingerprint,
    plan_lease_wait,
    plan_shape,
    plan_target,
    record_pools,
    shape_chips,
)
from ..observed.snapshot import Observed, RestoreReport
from ..settings import OperatorSettings
from ..spec import RESTORE_LATEST, JobSpec
from ..status import JobStatus
from . import Finding, capacity_wait, health_check, preemption, rollback, suspend

#: How soon to look again while waiting for capacity (seconds).
CAPACITY_POLL_SECONDS: Final = 15.0


def start(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings,
          actions: list[Action]) -> list[Action]:
    """The next generation (the first when `s.generation` is 0), once no pod of any generation exists."""
    now = observed.now
    first = s.generation == 0
    if observed.pods:  # never two generations at once
        return [*actions, RequeueAfter(POLL_SECONDS)]
    if spec.suspend:
        return suspend.hold(observed, s, actions)
    t = s.transition
    # A job resumed from a suspension waits as a new one does.
    waiting_phase = api.PHASE_PENDING if t is not None and t.kind == st.SUSPEND else st.phase_for(t, first=first)
    if t is not None and t.not_before is not None and now < t.not_before:
        new = replace(s, phase=waiting_phase)
        new = st.set_condition(new, api.COND_READY, False, api.BACKOFF.name, t.message, now)
        return [*actions, *status_change(observed.status, new),
                RequeueAfter(max(1.0, (t.not_before - now).total_seconds()))]
    lead = preemption.maintenance_lead(spec, s)
    lagging = plan_lease_wait(spec, observed.nodes, now, lead)
    if lagging is not None:  # a Ready node whose Lease merely lags must not shrink the job
        return wait_for_lease(observed, replace(s, phase=waiting_phase), lagging, actions)
    # After a Shrink only what the Ready nodes fit (else the job would wait for the same nodes again);
    # otherwise, with capacity.provisioning Autoscaled, the declared shape even where nodes lack.
    planned = None
    if t is not None and t.kind == st.SHRINK:
        planned = plan_shape(spec, observed.nodes, now, lead)
    if planned is None:
        planned = plan_target(spec, observed.nodes, now, lead)
    if planned is None:
        detail = explain_shortfall(spec, observed.nodes, now, lead) + health_check.describe_kept_out(observed)
        new = replace(s, phase=waiting_phase)
        new = st.set_condition(new, api.COND_READY, False, api.INSUFFICIENT_CAPACITY.name,
                               api.INSUFFICIENT_CAPACITY.format(detail=detail), now)
        changed = (s.condition(api.COND_READY) or st.Condition("", "", "", "")).reason != api.INSUFFICIENT_CAPACITY.name
        events = [EmitEvent("Warning", api.INSUFFICIENT_CAPACITY.name, api.INSUFFICIENT_CAPACITY.format(detail=detail))]
        return [*actions, *status_change(observed.status, new, *(events if changed else [])),
                RequeueAfter(CAPACITY_POLL_SECONDS)]

    generation = s.generation + 1
    restore = rollback.plan_restore(spec, s, generation)
    plan = GenerationPlan(generation, planned.shape, planned.pools, restore, s.worker_nodes,
                          live_job_uids=tuple(uid for uid, _ in observed.storage_sharers),
                          avoid_nodes=observed.nodes_to_avoid())
    hosts = geometry_of(spec, planned.shape.topology).hosts
    workers = tuple(plan.pod_name(observed.job.name, i, hosts) for i in range(planned.hosts))
    if t is None:
        phase = api.PHASE_PENDING if first else api.PHASE_RECOVERING
    elif t.kind == st.SUSPEND:
        phase = api.PHASE_PENDING
    else:
        phase = api.PHASE_RESIZING if t.kind in st.RESHAPE_KINDS else api.PHASE_RECOVERING
    pods = build_lead_pods(observed.job, spec, plan, settings)  # the rest in bring_up, outside the planning lock
    new = replace(s, phase=phase, generation=generation, shape=planned.shape, hosts=planned.hosts, pools=planned.pools,
                  restore_step=restore, restore_asked=spec.checkpoint.restore_step,
                  generation_start_time=st.truncate(now), admitted_time=None, workers_created=len(pods) == planned.hosts,
                  restarts=s.restarts + (0 if first else 1), planned_from=fingerprint(spec), transition=None,
                  worker_pods=workers)
    message = api.GENERATION_CREATED.format(generation=generation, count=planned.shape.count,
                                            topology=planned.shape.topology, hosts=planned.hosts, restore=restore)
    new = st.set_condition(new, api.COND_READY, False, api.WORKERS_STARTING.name, message, now)
    new = with_degraded(spec, new, now)
    new = st.set_condition(new, api.COND_SAVING, False, api.NOT_SAVING.name, api.NOT_SAVING.message, now)
    new, resumed = suspend.resumed(new, generation, restore, now)
    return [*actions, SetStatus(new), EmitEvent("Normal", api.GENERATION_CREATED.name, message), *resumed,
            CreateGeneration(generation, build_service(observed.job, settings), tuple(pods))]


def wait_for_lease(observed: Observed, s: JobStatus, lagging: LeaseWait, actions: list[Action]) -> list[Action]:
    """Plan again when the lagging Lease expires in full (`capacity.plan_lease_wait`); Ready=False
    `WaitingForLease` says so."""
    message = api.LEASE_LAGGING.format(generation=s.generation + 1, nodes=", ".join(lagging.nodes),
                                       until=st.format_time(lagging.until))
    new = st.set_condition(s, api.COND_READY, False, api.LEASE_LAGGING.name, message, observed.now)
    return [*actions, *status_change(observed.status, new),
            RequeueAfter(max(0.5, min(POLL_SECONDS, (lagging.until - observed.now).total_seconds())))]


def check_unscheduled(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Finding | None:
    """Workers no node takes `scheduleTimeoutSeconds` after the generation started: the capacity the
    planner saw is not there after all; replan."""
    now = observed.now
    started = s.workers_since or now
    if now - started < timedelta(seconds=settings.schedule_timeout_seconds):
        return None
    # Workers waiting for nodes that do not exist yet or for a queue's admission: capacity_wait.py's.
    waiting = capacity_wait.waiting_workers(observed, s)
    stuck = [p.name for p in observed.pods_of(s.generation) if p.node_name is None and p.phase == "Pending"
             and not p.gates and p.slice_index not in waiting]
    if not stuck:
        return None
    return Finding(st.POD_LOST, api.UNSCHEDULABLE.name, api.UNSCHEDULABLE.format(
        pod=stuck[0], generation=s.generation, seconds=settings.schedule_timeout_seconds))


def bring_up(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> list[Action]:
    """The running generation, nothing found against it: create the missing workers (pod 0 first, the
    others once its IP is known), then report Running or Starting."""
    now, g = observed.now, s.generation
    pods = observed.pods_of(g)
    names = s.pod_names(observed.job.name)
    plan = GenerationPlan(g, s.shape or spec.spec_shape, s.pools, s.restore_step or RESTORE_LATEST, s.worker_nodes,
                          tuple(names), live_job_uids=tuple(uid for uid, _ in observed.storage_sharers),
                          avoid_nodes=observed.nodes_to_avoid())
    create: list[Action] = []
    if not s.workers_created:
        have = {p.name for p in pods}
        pod0 = next((p for p in pods if p.name == names[0]), None)
        if creates_all_at_once(observed.job, spec):
            missing = [m for m in build_pods(observed.job, spec, plan, settings, coordinator_ip=None)
                       if m["metadata"]["name"] not in have]
            if missing:
                create = [CreateGeneration(g, build_service(observed.job, settings), tuple(missing))]
            s = replace(s, workers_created=True)
        elif pod0 is None:
            return [CreateGeneration(g, build_service(observed.job, settings),
                                     tuple(build_pods(observed.job, spec, plan, settings, coordinator_ip=None))),
                    RequeueAfter(POLL_SECONDS)]
        elif pod0.pod_ip is not None:
            rest = [m for m in build_pods(observed.job, spec, plan, settings, coordinator_ip=pod0.pod_ip)
                    if m["metadata"]["name"] not in have]
            create = [CreateGeneration(g, None, tuple(rest))]
            s = replace(s, workers_created=True)
        elif capacity_wait.waiting(spec, observed, s) is None:
            return [RequeueAfter(POLL_SECONDS)]
    running = sum(1 for p in pods if p.phase in ("Running", "Succeeded"))
    s = record_pools(s, pods, observed.nodes)
    old = s.condition(api.COND_READY)
    new = replace(with_degraded(spec, s, now), planned_from=fingerprint(spec))
    if running == s.hosts:
        message = api.WORKERS_RUNNING.format(generation=g, hosts=s.hosts)
        became_ready = observed.status.phase != api.PHASE_RUNNING
        new = replace(new, phase=api.PHASE_RUNNING)
        if became_ready and s.generation_start_time is not None:  # measured: sizes the maintenance lead
            new = replace(new, restart_seconds=math.ceil((now - s.generation_start_time).total_seconds()))
        if s.pod_losses and s.generation_start_time is not None and \
                now - s.generation_start_time >= timedelta(seconds=settings.pod_loss_reset_seconds):
            new = replace(new, pod_losses=0)  # it ran long enough: the run of pod-level losses is over
        new = st.set_condition(new, api.COND_READY, True, api.WORKERS_RUNNING.name, message, now)
        events = [EmitEvent("Normal", api.WORKERS_RUNNING.name, message)] if became_ready else []
        return [*create, *status_change(observed.status, new, *events)]
    reason, message = capacity_wait.waiting(spec, observed, s) or (
        api.WORKERS_STARTING.name, api.WORKERS_STARTING.format(generation=g, running=running, hosts=s.hosts))
    events = [EmitEvent("Warning" if reason == api.WAITING_FOR_CAPACITY.name else "Normal", reason, message)] \
        if reason != api.WORKERS_STARTING.name and (old is None or old.reason != reason) else []
    new = st.set_condition(new, api.COND_READY, False, reason, message, now)
    return [*create, *status_change(observed.status, new, *events), RequeueAfter(POLL_SECONDS)]


def decide_pod_refused(spec: JobSpec | None, status: JobStatus, generation: int, pod: str, detail: str,
                       now: datetime, settings: OperatorSettings) -> list[Action]:
    """The API server refused to create a worker pod (Pod Security admission, a quota, a webhook):
    Ready=False with reason PodCreationRefused, the API server's message and, when the pods mount a
    hostPath local tier, the fix; a Warning event when that message is new; try again later.
    `spec` is None when the job's spec no longer validates."""
    fix = api.HOSTPATH_FIX if spec is not None and node_scoped(spec) else ""
    message = api.POD_CREATION_REFUSED.format(generation=generation, pod=pod, detail=detail, fix=fix)
    old = status.condition(api.COND_READY)
    new = st.set_condition(status, api.COND_READY, False, api.POD_CREATION_REFUSED.name, message, now)
    events = [] if old is not None and old.reason == api.POD_CREATION_REFUSED.name and old.message == message \
        else [EmitEvent("Warning", api.POD_CREATION_REFUSED.name, message)]
    return [*status_change(status, new, *events), RequeueAfter(float(settings.refused_retry_seconds))]


def decide_restore_fallback(s: JobStatus, report: RestoreReport | None, now: datetime) -> tuple[JobStatus, list[EmitEvent]]:
    """When the workers skipped unreadable steps: the CheckpointFallback condition and one Warning event
    per new report (the condition's message is the memory, so deciding twice emits nothing new)."""
    if report is None or not report.skipped or report.step is None:
        return s, []
    skipped = "; ".join(f"step {step}: {why[:300]}" for step, why in report.skipped)
    message = api.STEPS_SKIPPED.message.format(generation=s.generation, step=report.step, skipped=skipped)
    current = s.condition(api.COND_CHECKPOINT_FALLBACK)
    if current is not None and current.status == "True" and current.message == message:
        return s, []
    new = st.set_condition(s, api.COND_CHECKPOINT_FALLBACK, True, api.STEPS_SKIPPED.name, message, now)
    return new, [EmitEvent("Warning", api.STEPS_SKIPPED.name, message)]


def with_degraded(spec: JobSpec, s: JobStatus, now: datetime) -> JobStatus:
    """The Degraded condition: True while the running shape has fewer chips than the spec's."""
    if s.shape is None:
        return s
    wanted = spec.spec_shape
    if shape_chips(spec, s.shape) < shape_chips(spec, wanted):
        return st.set_condition(s, api.COND_DEGRADED, True, api.SHRUNK.name,
                                api.SHRUNK.format(current=s.shape, wanted=wanted), now)
    return st.set_condition(s, api.COND_DEGRADED, False, api.AT_FULL_SHAPE.name,
                            api.AT_FULL_SHAPE.format(current=s.shape), now)
