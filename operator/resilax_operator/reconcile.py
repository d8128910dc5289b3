"""The operator's decisions (pure): spec + observed world → actions. State-driven, not change-driven.

This module only dispatches; each rule lives in its own file under policies/ (see policies/__init__.py
for the table). The I/O side calls it once per reconcile:

1. observed/observe.py builds `Observed` (observed/snapshot.py) from the watch cache and the sidecars' answers.
2. `actions = decide_raw(job["spec"], observed, settings)` (`decide_cleanup` on deletion).
3. execute.py carries out each action (actions.py) in order, stopping at the first failure; the next
   reconcile decides again from what it then observes.

Rules every decision keeps, whatever the observed state:
- Never two generations at once: a generation is created only when no pod of this job exists.
- A status that names a new generation (or a transition) is written before acting on it; the status
  records the workers as all created (`workersCreated`) only after creating them, so an operator that
  dies between two actions resumes from the status and the cluster.
- At most one `SetStatus` per decision (`actions.collapse`).
- Deciding twice on the same observed state gives the same actions; time is `Observed.now`, never read.
- Nothing waits in memory: grace periods and "not before" times are derived from the status and the
  cluster and carried in the actions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Final

from . import api
from . import status as st
from .actions import Action, DeleteGeneration, EmitEvent, PodDeletion, SetStatus, collapse, status_change
from .capacity import plan_worker_nodes
from .errors import InvalidSpecError, NameConflictError
from .observed.snapshot import Observed
from .policies import (
    Finding,
    Verdict,
    capacity_wait,
    container_waiting,
    failure_rules,
    finished,
    freshness,
    generation_start,
    goodput_status,
    grow_back_probe,
    hang,
    health_check,
    history_status,
    inplace,
    invalid_edit,
    name_conflict,
    node_loss,
    preemption,
    queue_eviction,
    recovery_wait,
    resize,
    rollback,
    spare_jobs,
    spares,
    straggler,
    suspend,
    transition,
    worker_exit,
)
from .settings import OperatorSettings
from .spec import JobSpec
from .status import JobStatus, SpecRecord
from .validation import validate_spec

Check = Callable[[JobSpec, Observed, JobStatus, OperatorSettings], Verdict]

#: The checks on a running generation, in order; the first that finds something decides.
WATCH: Final[tuple[Check, ...]] = (
    node_loss.check_guard,               # many nodes down at once: a blip, wait
    node_loss.check_lost,                # a worker's node gone, or down past its grace
    preemption.check,                    # a notice on a worker's node
    queue_eviction.check,                # a queue (Kueue) stopped the pod group: not a failure
    suspend.check,                       # spec.suspend: final save, no workers
    node_loss.check_not_ready,           # a worker's node down within its grace: wait
    health_check.check,                  # a new pod's host failed its health check: kept out, PodLost
    resize.check_incompatible,           # the spec no longer allows the running shape
    failure_rules.check,                 # a failed worker a spec.recovery.failureRules rule matches
    worker_exit.check,                   # stopped, failed, lost, deleted; or all done
    hang.check,                          # no progress past the hang timeout: TrainerHung, not counted
    capacity_wait.check,                 # workers waited for new nodes past shrinkAfterSeconds: shrink
    generation_start.check_unscheduled,  # workers no node takes
    container_waiting.check,             # a container stuck waiting (image, config, crash loop)
    rollback.check,                      # spec.checkpoint.restore.step edited: final save, restore that step
    resize.check,                        # a larger shape: spec edit or capacity back
)


def decide_raw(raw_spec: Mapping[str, Any], observed: Observed, settings: OperatorSettings) -> list[Action]:
    """Validate the spec, then `decide` (policies/invalid_edit.py): a valid spec is recorded in
    status.lastValidSpec; an invalid one sets InvalidSpec and the job runs on under the last valid spec
    (a job that never ran is Failed until the spec is fixed)."""
    try:
        spec = validate_spec(raw_spec, name=observed.job.name, settings=settings)
    except InvalidSpecError as e:
        last = invalid_edit.last_valid(observed, settings)
        if last is None:
            return invalid_edit.decide_without_spec(e, observed)
        return decide(last, observed, settings, invalid=e)
    return decide(spec, observed, settings, record=invalid_edit.record(raw_spec, observed))


def decide(spec: JobSpec, observed: Observed, settings: OperatorSettings, *, record: SpecRecord | None = None,
           invalid: InvalidSpecError | None = None) -> list[Action]:
    """The actions that move the cluster toward what `spec` wants, given `observed`; the Completed and
    Failed conditions following the phase (policies/finished.py), status.goodput and status.history
    brought up to date (policies/goodput_status.py, policies/history_status.py), and the checkpoint
    freshness annotations published (policies/freshness.py), the Autoscaled grow-back's probe pods
    kept as the status calls for (policies/grow_back_probe.py), the spare slices' placeholders held,
    taken and replenished (policies/spares.py), lower-priority jobs lent as spares suspended and resumed
    (policies/spare_jobs.py), and a long recovery told what it waits for (policies/recovery_wait.py).
    `record`: `spec` as status.lastValidSpec keeps it; `invalid`: the problems of the job's own spec,
    when `spec` is the last valid one."""
    observed = spares.mark_spare_nodes(observed)  # the planner takes the pools the job's spares hold last
    actions = decide_policies(spec, observed, settings, record=record, invalid=invalid)
    actions = finished.with_outcomes(goodput_status.with_goodput(actions, observed, settings, spec.spec_shape),
                                     observed.now)
    actions = freshness.with_freshness(history_status.with_history(actions, observed), observed)
    actions = grow_back_probe.with_probes(actions, spec, observed, settings)
    actions = spare_jobs.with_spare_jobs(spares.with_spares(actions, spec, observed, settings), spec, observed)
    return recovery_wait.with_notice(actions, observed)


def decide_policies(spec: JobSpec, observed: Observed, settings: OperatorSettings, *,
                    record: SpecRecord | None = None, invalid: InvalidSpecError | None = None) -> list[Action]:
    """The policies' decision (the dispatch below)."""
    s, now = observed.status, observed.now
    flagged = s.condition(api.COND_INVALID_SPEC)
    if invalid is None and s.phase == api.PHASE_FAILED and s.generation == 0 and flagged is not None \
            and flagged.status == "True":
        s = replace(s, phase=api.PHASE_PENDING)  # failed only for its spec, which is now fixed: start
    s = replace(s, observed_generation=observed.spec_generation,
                checkpoint=st.newer_checkpoint(s.checkpoint, observed.checkpoint))
    if record is not None:
        s = replace(s, last_valid_spec=record)
    s = name_conflict.settle(s, observed, now)
    observed = health_check.mark_kept_out(observed, s)  # every decision below sees those nodes kept out
    announced: list[EmitEvent] = []
    if invalid is None:
        s = invalid_edit.mark_valid(s, now)
    else:
        s, announced = invalid_edit.mark_kept(s, invalid, now)
    if s.phase in api.TERMINAL_PHASES:
        s = finished.with_outcome(s, now)  # a job that finished before the conditions existed gets them
        out = status_change(observed.status, s, *announced)
        if s.phase == api.PHASE_FAILED:  # a failed job keeps no workers
            for g in sorted({p.generation for p in observed.pods}):
                delete = transition.plan_delete(observed, spec, g, "job failed", settings)
                if transition.needs_delete(observed, delete):
                    out.append(delete)
        return out + finished.check_ttl(spec, observed, s)

    actions: list[Action] = [SetStatus(s), *announced] if announced else []
    fallback, events = generation_start.decide_restore_fallback(s, observed.restore, now)
    if events:
        s = fallback
        actions += [SetStatus(s), *events]
    if s.in_place is not None:  # it deletes what it does not keep itself
        return collapse(inplace.proceed(spec, observed, s, settings, actions))
    # Stray pods: any generation other than the current one must go before anything else happens.
    stray = sorted({p.generation for p in observed.pods if p.generation != s.generation}
                   | {g for g in observed.services if g != s.generation and not observed.pods_of(g)})
    for g in stray:
        actions.append(transition.plan_delete(observed, spec, g, "superseded generation", settings))

    if s.transition is not None:
        return collapse(transition.proceed(spec, observed, s, settings, actions, in_place=inplace.after_final_save))
    if s.generation == 0:
        return collapse(generation_start.start(spec, observed, s, settings, actions))
    return collapse(watch(spec, observed, s, settings, actions))


def watch(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings,
          actions: list[Action]) -> list[Action]:
    """The running generation: the first check of `WATCH` that finds something decides; else bring the
    generation up and report how it runs."""
    s = st.record_worker_nodes(s, plan_worker_nodes(s, observed.pods_of(s.generation)))
    s = health_check.record(observed, s)
    s = capacity_wait.record_admission(observed, s)
    s, events = preemption.record_scheduled(spec, observed, s)
    if events:
        actions = [*actions, SetStatus(s), *events]
    before = s
    s, events = straggler.record(observed, s, settings)
    if events or s != before:
        actions = [*actions, SetStatus(s), *events]
    for check in WATCH:
        verdict = check(spec, observed, s, settings)
        if isinstance(verdict, Finding):
            return inplace.begin_transition(spec, observed, s, settings, actions, verdict)
        if verdict is not None:
            return [*actions, *verdict]
    return [*actions, *generation_start.bring_up(spec, observed, s, settings)]


def decide_pod_refused(raw_spec: Mapping[str, Any], observed: Observed, generation: int, pod: str, detail: str,
                       settings: OperatorSettings) -> list[Action]:
    """The API server refused to create `pod` (execute.py reports it with the API's message):
    `generation_start.decide_pod_refused`, on the status as the decision left it."""
    try:
        spec: JobSpec | None = validate_spec(raw_spec, name=observed.job.name, settings=settings)
    except InvalidSpecError:
        spec = invalid_edit.last_valid(observed, settings)
    return generation_start.decide_pod_refused(spec, observed.status, generation, pod, detail, observed.now, settings)


def decide_name_conflict(observed: Observed, conflict: NameConflictError, settings: OperatorSettings, *,
                         creating: bool) -> list[Action]:
    """Creating (or checking) an object of the job found one of its name the job does not own
    (execute.py reports it): `name_conflict.decide`, on the status as the decision left it."""
    return name_conflict.decide(observed, conflict, settings, creating=creating)


def decide_cleanup(observed: Observed) -> list[Action]:
    """For the JAXJob's delete handler: the garbage collector deletes the workers gracefully, but no
    kubelet will ever confirm pods on a down node; force-delete those (checkpoints stay in storage)."""
    out: list[Action] = []
    for g in sorted({p.generation for p in observed.pods}):
        forced = [p.name for p in observed.pods_of(g) if p.node_name and (
            (node := observed.node(p.node_name)) is None or node.down_since(observed.now) is not None)]
        if forced:
            out.append(DeleteGeneration(g, "job deleted", tuple(PodDeletion(name, force=True) for name in forced)))
    return out

