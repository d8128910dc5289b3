"""In-place restart of the survivors (docs/architecture.md, "In-place restart of the survivors").

After a worker failure, a hard node loss, a lost pod or a shrink, the surviving pods are kept (same
UIDs, nodes, local tier, warm sidecar) and only their trainer process is replaced by one of the new
generation (the supervisor `resilax run` in the trainer container, driven through the sidecar); only
the pods not kept are deleted and only the missing ones created. Invariant: no trainer of the new
generation starts while one of an older generation lives in the job (two phases, like JobSet's
barrier: stop every kept trainer and delete the other pods; only then create and start).

| step                          | decision                                                          |
|-------------------------------|-------------------------------------------------------------------|
| a finding (`begin_transition`; TrainerHung too, its trainers stopped with their stacks dumped) | `decide_mode`: in place, or today's full replacement (transition.py; `InPlaceUnavailable` event naming why when inPlace is Auto; for a planned move, only what the job's make or its pods rule out, said as it begins) |
| in place: `begin`             | status first (generation N+1, shape, pools, workerPods, inPlace Stopping), then delete the pods not kept, re-label the kept ones, stop their trainers |
| Stopping                      | re-send the stop to kept pods not proven stopped; past the deadline a kept pod not proven stopped is dropped and deleted (its slot gets a new pod); Starting once every kept pod is stopped and no other pod is left |
| Starting                      | after a failure's backoff: create pod 0 if it is new, then the other missing pods with its IP and start the kept trainers (their environment overlay); inPlace cleared once every kept pod runs the new generation and every pod exists |
| a node down, a trainer of N+1 failing, a pod deleted during it | a new finding against N+1: `begin_transition` again (in place to N+2 if eligible) |
| a planned move (grow-back, resize, preemption, rollback) once its final save is done (`after_final_save`, called by transition.py before its teardown deletes anything) | `decide_mode` over the planned kinds: in place (the trainers stopped after the save are the kept ones; the pods of noticed nodes go), else the transition's teardown as before |

Nothing is kept in memory: the status says the phase, the kept pods and which are stopped and started;
the sidecars' `trainer_process` says the rest (observed/trainer_process.py); every action repeats harmlessly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Final

from .. import api
from .. import status as st
from ..actions import (
    POLL_SECONDS,
    Action,
    CreateGeneration,
    DeleteGeneration,
    EmitEvent,
    PatchWorkerPods,
    PodDeletion,
    RequeueAfter,
    SetStatus,
    StartTrainers,
    StopTrainers,
    status_change,
)
from ..builders import GenerationPlan, build_pod, build_service, geometry_of, in_place_unavailable
from ..capacity import LeaseWait, fingerprint, plan_lease_wait, plan_shape, plan_target
from ..generation import build_pod_name
from ..observed.snapshot import Observed, ObservedPod
from ..pods.worker_env import build_generation_overlay
from ..settings import OperatorSettings
from ..spec import RESTORE_LATEST, JobSpec
from ..status import InPlace, JobStatus, KeptPod
from . import (
    Finding,
    failure_rules,
    generation_start,
    health_check,
    node_loss,
    preemption,
    rollback,
    transition,
    worker_exit,
)

#: Findings an in-place restart answers at once; a worker stopped for rescheduling stays a full replacement.
IN_PLACE_KINDS: Final = frozenset({st.NODE_LOSS, st.WORKER_FAILURE, st.POD_LOST, st.SHRINK, st.TRAINER_HUNG})
#: Planned moves: transition.py runs their final save first, then hands them here (`after_final_save`);
#: the survivors' trainers have stopped after that save, so they are kept, and only the pods of a new
#: slice (grow-back, resize) are created. A rollback changes neither nodes nor shape: every pod is kept,
#: and the next generation's environment names the step asked (`rollback.plan_restore`). A suspend has
#: no next generation.
AFTER_SAVE_KINDS: Final = frozenset({st.PREEMPTION, st.RESIZE, st.GROW_BACK, st.ROLLBACK})


@dataclass(frozen=True)
class Mode:
    """`decide_mode`'s answer: `plan` None = full replacement (`why` says why, "" for no event)."""

    plan: GenerationPlan | None = None
    kept: tuple[KeptPod, ...] = ()
    why: str = ""
    #: Neither yet: a Ready node's Lease merely lags and would change the plan (`capacity.plan_lease_wait`).
    lease_wait: LeaseWait | None = None


def begin_transition(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings,
                     actions: list[Action], finding: Finding) -> list[Action]:
    """A finding against the running generation: in place when `decide_mode` says so, else
    transition.begin (with an `InPlaceUnavailable` event when inPlace is Auto)."""
    mode = decide_mode(spec, observed, s, finding)
    if mode.lease_wait is not None:  # the finding stands: decided again once the Lease renews or expires
        return generation_start.wait_for_lease(observed, s, mode.lease_wait, actions)
    if mode.plan is None:
        # A planned move goes in place only after its final save (`after_final_save`); what rules that
        # out whatever the nodes do (the job's or its pods' make) is said now, once, with its Event.
        why = mode.why or (_unavailable(spec, observed, s) if finding.kind in AFTER_SAVE_KINDS else "")
        if why:
            event = EmitEvent("Normal", api.IN_PLACE_UNAVAILABLE.name,
                              api.IN_PLACE_UNAVAILABLE.format(generation=s.generation + 1, why=why))
            finding = replace(finding, events=(*finding.events, event))
        return transition.begin(spec, observed, replace(s, in_place=None), settings, actions, finding)
    counted = transition.account(spec, observed, s, settings, actions, finding)
    if isinstance(counted, list):
        return counted
    s, finding = counted
    return begin(spec, observed, s, settings, actions, finding, mode)


def _qualifies(observed: Observed, p: ObservedPod, lead: timedelta) -> bool:
    """A survivor: supervised, Running and not going, its trainer container not ended (the supervisor in
    it stops and starts the trainer: a pod whose container ended, as a worker killed with 137, has no one
    to do either, and kept it held the restart for inPlaceStopTimeoutSeconds), on a Ready node with no
    notice, its sidecar heard."""
    node = observed.node(p.node_name)
    return (p.supervised and p.phase == "Running" and p.deletion_timestamp is None and not p.trainer_container_ended
            and node is not None and node.ready == "True" and node.down_since(observed.now) is None
            and node.notice(observed.now, lead) is None and p.name in observed.trainer_processes)


def after_final_save(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings,
                     actions: list[Action]) -> list[Action] | None:
    """A planned transition whose final save is done (or not wanted) and whose teardown deleted nothing
    yet: in place when `decide_mode` says so (the transition's Event was said: no second one), else None.
    No `InPlaceUnavailable` here: what the job's make rules out was said when the move began
    (`begin_transition`), and a teardown for the nodes' sake is the planned move's usual way."""
    t = s.transition
    assert t is not None and not t.saving
    finding = Finding(t.kind, t.reason, t.message, event_type="Normal", not_before=t.not_before)
    mode = decide_mode(spec, observed, s, finding, kinds=AFTER_SAVE_KINDS)
    if mode.lease_wait is not None:
        return generation_start.wait_for_lease(observed, s, mode.lease_wait, actions)
    if mode.plan is None:
        return None
    return begin(spec, observed, replace(s, transition=None), settings, actions, finding, mode, announce=False)


def _unavailable(spec: JobSpec, observed: Observed, s: JobStatus) -> str:
    """Why no pod of the running generation can be kept whatever the nodes do ("" when none; inPlace
    Never: nothing to explain): the job's make (builders.in_place_unavailable) or a pod without a supervisor."""
    if not spec.recovery.in_place_auto:
        return ""
    why = in_place_unavailable(observed.job, spec)
    unsupervised = [p.name for p in observed.pods_of(s.generation) if not p.supervised]
    if not why and unsupervised:
        why = f"pod {unsupervised[0]} runs no supervisor (created before recovery.inPlace was Auto)"
    return why


def decide_mode(spec: JobSpec, observed: Observed, s: JobStatus, finding: Finding,
                kinds: frozenset[str] = IN_PLACE_KINDS) -> Mode:
    """In place or full replacement, and with which pods kept (module docstring, docs/architecture.md).
    `kinds`: the findings answered in place (planned moves only after their final save)."""
    if not spec.recovery.in_place_auto or finding.kind not in kinds:
        return Mode()
    why = _unavailable(spec, observed, s)
    pods = observed.pods_of(s.generation)
    if why or s.shape is None:
        return Mode(why=why or "the running shape is unknown")
    now, lead = observed.now, preemption.maintenance_lead(spec, s)
    if (lagging := plan_lease_wait(spec, observed.nodes, now, lead)) is not None:
        return Mode(lease_wait=lagging)
    planned = plan_shape(spec, observed.nodes, now, lead) if finding.kind == st.SHRINK else None
    planned = planned or plan_target(spec, observed.nodes, now, lead)
    if planned is None:
        return Mode(why="no shape fits the healthy capacity")
    if planned.shape.topology != s.shape.topology:
        return Mode(why=f"the new shape {planned.shape} has another slice topology than {s.shape}")
    hosts = geometry_of(spec, planned.shape.topology).hosts
    survivors = {(p.slice_index, p.host): p for p in pods if _qualifies(observed, p, lead)}
    # New slice i <- old slice j on the same pool: at the same count each slice keeps its index; when
    # shrinking, the surviving slices are renumbered in their old order (a TPU slice is atomic).
    left = Counter(planned.pools)
    old_of_new: dict[int, int] = {}
    for j in range(s.shape.count):
        pool = s.pools[j] if j < len(s.pools) else ""
        i = j if planned.shape.count == s.shape.count else len(old_of_new)
        if not pool or not left[pool] or i >= planned.shape.count or i in old_of_new \
                or not any((j, h) in survivors for h in range(hosts)):
            continue
        old_of_new[i] = j
        left[pool] -= 1
    rest = iter(sorted(left.elements(), key=list(planned.pools).index))
    pools = tuple(s.pools[old_of_new[i]] if i in old_of_new else next(rest) for i in range(planned.shape.count))
    generation = s.generation + 1
    kept, names = [], []
    for i in range(planned.shape.count):
        for h in range(hosts):
            p = survivors.get((old_of_new[i], h)) if i in old_of_new else None
            node = observed.node(p.node_name) if p is not None else None
            if p is not None and node is not None and node.pool == pools[i]:
                kept.append(KeptPod(p.name, p.uid, i * hosts + h))
                names.append(p.name)
            else:
                names.append(build_pod_name(observed.job.name, generation, i, h))
    if not kept:
        return Mode(why="no surviving pod qualifies (Running on a Ready node of the new plan, its sidecar answering)")
    # the latest step, or the one a rollback waiting for its turn asks (policies/rollback.py)
    plan = GenerationPlan(generation, planned.shape, pools, rollback.plan_restore(spec, s, generation), s.worker_nodes,
                          tuple(names), avoid_nodes=observed.nodes_to_avoid())
    return Mode(plan, tuple(kept))


def begin(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings, actions: list[Action],
          finding: Finding, mode: Mode, *, announce: bool = True) -> list[Action]:
    """Write the status of the new generation with `inPlace` Stopping, then act on it at once.
    `announce`: emit the finding's Event (False when a planned transition said it already)."""
    plan = mode.plan
    assert plan is not None
    now = observed.now
    since = st.truncate(now)
    hosts = len(plan.worker_pods)
    in_place = InPlace(plan.generation, s.generation, st.IN_PLACE_STOPPING, since,
                       since + timedelta(seconds=spec.recovery.in_place_stop_timeout_seconds), mode.kept,
                       finding.kind, finding.not_before, finding.reason, finding.message)
    phase = api.PHASE_RESIZING if finding.kind in st.RESHAPE_KINDS else api.PHASE_RECOVERING
    new = replace(s, phase=phase, generation=plan.generation, shape=plan.shape, hosts=hosts, pools=plan.pools,
                  restore_step=plan.restore_step, restore_asked=spec.checkpoint.restore_step,
                  generation_start_time=since, admitted_time=None, workers_created=False,
                  restarts=s.restarts + 1, in_place_restarts=s.in_place_restarts + 1, planned_from=fingerprint(spec),
                  transition=None, worker_pods=plan.worker_pods, in_place=in_place)
    message = api.RESTARTING_IN_PLACE.format(generation=plan.generation, cause=finding.message, kept=len(mode.kept),
                                             hosts=hosts, pods=", ".join(k.pod for k in mode.kept),
                                             replaced=hosts - len(mode.kept))
    new = st.set_condition(new, api.COND_READY, False, api.RESTARTING_IN_PLACE.name, message, now)
    new = generation_start.with_degraded(spec, new, now)
    new = st.set_condition(new, api.COND_SAVING, False, api.NOT_SAVING.name, api.NOT_SAVING.message, now)
    said = [EmitEvent(finding.event_type, finding.reason, finding.message), *finding.events] if announce else []
    head: list[Action] = [*actions, SetStatus(new), *said, EmitEvent("Normal", api.RESTARTING_IN_PLACE.name, message)]
    return head + proceed(spec, replace(observed, status=new), new, settings, [], announce=False)


def proceed(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings, actions: list[Action],
            *, announce: bool = True) -> list[Action]:
    """The in-place restart's next step (every decision while `status.inPlace` is set)."""
    ip = s.in_place
    assert ip is not None
    base = observed.status if announce else s
    by_name = {p.name: p for p in observed.pods}
    out = [*actions, *_delete_leftovers(spec, observed, ip, settings)]
    for check in (node_loss.check_guard, node_loss.check_lost):
        verdict = check(spec, observed, s, settings)
        if isinstance(verdict, Finding):
            return _again(spec, observed, s, settings, out, verdict)
        if verdict is not None:
            return [*out, *verdict]
    # Kept pods that are gone, another pod under the same name, or one whose trainer container ended (no
    # supervisor left to stop or start a trainer: `_qualifies`): their slot gets a new pod.
    kept: list[KeptPod] = []
    dropped: list[KeptPod] = []
    for k in ip.kept:
        p = by_name.get(k.pod)
        (kept if p is not None and p.deletion_timestamp is None and (not k.uid or p.uid == k.uid)
         and not p.trainer_container_ended else dropped).append(k)
    if ip.phase == st.IN_PLACE_STOPPING:
        return _stopping(spec, observed, s, settings, out, base, kept, dropped)
    return _starting(spec, observed, s, settings, out, base, kept, dropped)


def _delete_leftovers(spec: JobSpec, observed: Observed, ip: InPlace, settings: OperatorSettings) -> list[Action]:
    """Every pod of an older generation that is not kept, and the per-generation Services of old versions."""
    kept = {k.pod for k in ip.kept}
    others = replace(observed, pods=tuple(p for p in observed.pods if p.name not in kept))
    out: list[Action] = []
    for g in sorted({p.generation for p in others.pods} | set(observed.services)):
        if g == ip.generation:
            continue
        delete = transition.plan_delete(others, spec, g, ip.kind, settings)
        if transition.needs_delete(others, delete):
            out.append(delete)
    return out


def _again(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings, actions: list[Action],
           finding: Finding) -> list[Action]:
    """A fault against the generation being started: a new transition from it (generations are cheap;
    nothing half-started is reused). Kept pods not re-labelled yet are left to the leftover rule."""
    return begin_transition(spec, observed, replace(s, in_place=None), settings, actions, finding)


def _patches(observed: Observed, s: JobStatus, kept: list[KeptPod], hosts: int) -> list[Action]:
    """Re-label and re-annotate the kept pods whose labels do not say their new place yet."""
    ip = s.in_place
    assert ip is not None and s.shape is not None
    by_name = {p.name: p for p in observed.pods}
    patches = []
    for k in kept:
        p = by_name[k.pod]
        slice_index, host = divmod(k.process, hosts)
        if (p.generation, p.slice_index, p.host) == (ip.generation, slice_index, host):
            continue
        labels = {api.LABEL_GENERATION: str(ip.generation), api.LABEL_SLICE: str(slice_index),
                  api.LABEL_HOST: str(host), api.LABEL_PROCESS: str(k.process),
                  api.LABEL_NODE_POOL: s.pools[slice_index] if slice_index < len(s.pools) else ""}
        annotations = {api.ANNOTATION_SHAPE: str(s.shape), api.ANNOTATION_RESTORE_STEP: s.restore_step or RESTORE_LATEST}
        patches.append((k.pod, tuple(sorted(labels.items())), tuple(sorted(annotations.items()))))
    return [PatchWorkerPods(ip.generation, tuple(patches))] if patches else []


def _drop(observed: Observed, s: JobStatus, dropped: list[KeptPod], hosts: int,
          settings: OperatorSettings) -> tuple[JobStatus, list[Action]]:
    """Dropped kept pods: their slot named for a new pod of the generation; the pods deleted (force when
    no kubelet will confirm, else the survivors' short grace)."""
    ip = s.in_place
    assert ip is not None
    if not dropped:
        return s, []
    names = list(s.worker_pods)
    for k in dropped:
        names[k.process] = build_pod_name(observed.job.name, ip.generation, *divmod(k.process, hosts))
    by_name = {p.name: p for p in observed.pods}
    present = [by_name[k.pod] for k in dropped if k.pod in by_name]
    forced = set(node_loss.pods_to_force(observed, present, settings))
    deletions: dict[int, list[PodDeletion]] = {}
    for p in present:
        if p.name in forced or p.deletion_timestamp is None:
            deletions.setdefault(p.generation, []).append(
                PodDeletion(p.name, node_loss.SURVIVOR_GRACE_SECONDS, force=p.name in forced))
    dropped_names = {k.pod for k in dropped}
    s = replace(s, worker_pods=tuple(names),
                in_place=replace(ip, kept=tuple(k for k in ip.kept if k.pod not in dropped_names)))
    return s, [DeleteGeneration(g, "in-place restart: kept pod dropped", tuple(d)) for g, d in sorted(deletions.items())]


def _stopping(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings, out: list[Action],
              base: JobStatus, kept: list[KeptPod], dropped: list[KeptPod]) -> list[Action]:
    ip = s.in_place
    assert ip is not None and s.shape is not None
    now, g = observed.now, ip.generation
    hosts = geometry_of(spec, s.shape.topology).hosts
    processes = observed.trainer_processes
    kept = [replace(k, stopped=True) if not k.stopped and (t := processes.get(k.pod)) is not None
            and t.proven_stopped_before(g) else k for k in kept]
    events: list[EmitEvent] = []
    late = [k for k in kept if not k.stopped]
    if late and now >= ip.deadline:
        dropped = [*dropped, *late]
        kept = [k for k in kept if k.stopped]
        message = api.IN_PLACE_STOP_TIMEOUT.format(generation=g, pods=", ".join(k.pod for k in late),
                                                   seconds=spec.recovery.in_place_stop_timeout_seconds)
        events.append(EmitEvent("Warning", api.IN_PLACE_STOP_TIMEOUT.name, message))
    s = replace(s, in_place=replace(ip, kept=tuple(kept) + tuple(dropped)))
    s, deletes = _drop(observed, s, dropped, hosts, settings)
    patches = _patches(observed, s, kept, hosts)
    stop = tuple(k.pod for k in kept if not k.stopped)
    actions: list[Action] = [*out, *deletes, *patches]
    if stop:
        # a hung trainer's stacks go to its pod log first (the supervisor: py-spy, or SIGCONT + SIGUSR1)
        actions.append(StopTrainers(g, stop, f"in-place restart to generation {g}",
                                    stacks=ip.kind == st.TRAINER_HUNG))
    kept_names = {k.pod for k in kept}
    if not stop and not any(p.name not in kept_names for p in observed.pods):
        ip = s.in_place
        assert ip is not None
        s = replace(s, in_place=replace(ip, phase=st.IN_PLACE_STARTING))
        return [*actions, *status_change(base, s, *events),
                *_starting(spec, replace(observed, status=s), s, settings, [], s, kept, [])]
    wait = max(1.0, (ip.deadline - now).total_seconds()) if stop else POLL_SECONDS
    return [*actions, *status_change(base, s, *events), RequeueAfter(min(POLL_SECONDS, wait))]


def _exits(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Finding | list[Action] | None:
    """A worker of the generation being started stopped, failed or was deleted (exit codes of its own
    generation's incarnations only: observed/trainer_process.py); the failure rules first."""
    g = s.generation
    checked = health_check.check(spec, observed, s, settings)  # a new pod's host failed its check
    if checked is not None:
        return checked
    ruled = failure_rules.check(spec, observed, s, settings)
    if ruled is not None:
        return ruled
    for p in observed.pods_of(g):
        if p.exit_code == api.EXIT_CODE_STOPPED:
            return Finding(st.WORKER_STOPPED, api.WORKER_STOPPED.name,
                           api.WORKER_STOPPED.format(pod=p.name, generation=g, code=p.exit_code))
        if p.failed and p.exit_code != api.EXIT_CODE_PEER_LOST:
            if (wait := worker_exit.wait_for_abort_cause(observed, s, settings, p)) is not None:
                return wait
            detail = f"exit code {p.exit_code}" if p.exit_code is not None else "no exit code"
            return worker_exit.counted_failure(spec, observed, s, settings,
                                               api.WORKER_FAILED.format(pod=p.name, generation=g, detail=detail))
        if p.deletion_timestamp is not None:
            return Finding(st.POD_LOST, api.POD_LOST.name, api.POD_LOST.format(pod=p.name, generation=g))
    return generation_start.check_unscheduled(spec, observed, s, settings)


def _starting(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings, out: list[Action],
              base: JobStatus, kept: list[KeptPod], dropped: list[KeptPod]) -> list[Action]:
    ip = s.in_place
    assert ip is not None and s.shape is not None
    now, g = observed.now, ip.generation
    if ip.not_before is not None and now < ip.not_before:
        return [*out, RequeueAfter(max(1.0, (ip.not_before - now).total_seconds()))]
    s = health_check.record(observed, s)
    assert s.shape is not None
    verdict = _exits(spec, observed, s, settings)
    if isinstance(verdict, Finding):
        return _again(spec, observed, s, settings, out, verdict)
    if verdict is not None:
        return [*out, *verdict]
    geometry = geometry_of(spec, s.shape.topology)
    s, deletes = _drop(observed, s, dropped, geometry.hosts, settings)
    out = [*out, *deletes, *_patches(observed, s, kept, geometry.hosts)]
    by_name = {p.name: p for p in observed.pods}
    names = s.pod_names(observed.job.name)
    assert s.shape is not None
    plan = GenerationPlan(g, s.shape, s.pools, s.restore_step or RESTORE_LATEST, s.worker_nodes, tuple(names),
                          avoid_nodes=observed.nodes_to_avoid())
    kept_at = {k.process: k for k in kept}
    pod0 = by_name.get(names[0])
    if pod0 is None:
        manifest = build_pod(observed.job, spec, plan, 0, 0, settings, coordinator_ip=None)
        return [*out, *status_change(base, s), CreateGeneration(g, build_service(observed.job, settings), (manifest,)),
                RequeueAfter(POLL_SECONDS)]
    if pod0.pod_ip is None:
        return [*out, *status_change(base, s), RequeueAfter(POLL_SECONDS)]
    missing = tuple(build_pod(observed.job, spec, plan, *divmod(i, geometry.hosts), settings, coordinator_ip=pod0.pod_ip)
                    for i, name in enumerate(names) if i not in kept_at and name not in by_name)
    processes = observed.trainer_processes
    kept = [replace(k, started=True) if not k.started and (t := processes.get(k.pod)) is not None
            and (t.generation >= g or (t.assigned or 0) >= g) else k for k in kept]
    starts = tuple((k.pod, tuple(sorted(build_generation_overlay(observed.job, spec, plan, geometry, k.process, settings,
                                                                 coordinator_ip=pod0.pod_ip).items())))
                   for k in kept if not k.started)
    running = all((t := processes.get(k.pod)) is not None and t.runs(g) for k in kept)
    ip = replace(ip, kept=tuple(kept))
    s = replace(s, workers_created=True, in_place=None if running and not missing else ip)
    actions: list[Action] = [*out]
    if missing:
        actions.append(CreateGeneration(g, build_service(observed.job, settings), missing))
    if starts:
        actions.append(StartTrainers(g, starts))
    return [*actions, *status_change(base, s), RequeueAfter(POLL_SECONDS if s.in_place is not None else 1.0)]
