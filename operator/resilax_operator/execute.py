"""The I/O side, part 2: carry out a decision's actions, and the reconcile loop's one turn.

`reconcile_job`: observe (observed/observe.py) → decide (reconcile.py, pure) → `execute`. Each action goes
through `k8s.Kube`, in order, stopping at the first failure (the exception propagates; the next
reconcile decides again from what is then observed). Nothing here decides: how and when each pod is
deleted, what a refused pod means, when to look again, all come from the decision. A status equal to
the one the job has is not written; what the operator writes goes into the cache at once.

Synchronous; handlers.py calls `reconcile_job` and `cleanup_job` from kopf's threads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import kopf

from . import api, metrics
from . import status as st
from .actions import (
    Action,
    CreateGeneration,
    CreateProbes,
    CreateSpares,
    DeleteGeneration,
    DeleteJob,
    DeleteProbes,
    DeleteSpares,
    EmitEvent,
    EnsureTokenSecret,
    PatchWorkerPods,
    PublishFreshness,
    RequestFinalSave,
    RequeueAfter,
    SetStatus,
    StartTrainers,
    StopTrainers,
    SuspendSpareJob,
)
from .errors import NameConflictError, ResilaxOperatorError
from .generation import build_generation_service_name, build_token_secret_name
from .k8s import Kube, KubeError, SidecarCall, SidecarError, ask_sidecars
from .observed import spare_jobs
from .observed.cache import WorldCache
from .observed.observe import Logger, World, forget_trainer, job_ref, observe
from .ownership import owner_uid
from .policies import goodput_status
from .reconcile import decide_cleanup, decide_name_conflict, decide_pod_refused, decide_raw
from .settings import OperatorSettings

#: Longest wait between two reconciles of one job, whatever the actions say (seconds).
MAX_REQUEUE_SECONDS = 5.0
#: API answers to a pod create that retrying at once will not change (admission refused it).
REFUSED_STATUSES = frozenset({400, 403, 422})


class PodRefusedError(ResilaxOperatorError, PermissionError):
    """The API server refused to create a worker pod (admission: Pod Security, a quota, a webhook)."""

    def __init__(self, generation: int, pod: str, detail: str, status: st.JobStatus) -> None:
        self.generation, self.pod, self.detail = generation, pod, detail
        #: The job's status as the actions executed so far left it.
        self.status = status
        super().__init__(f"generation {generation}: creating {pod} refused: {detail}")


class NameTakenError(ResilaxOperatorError, FileExistsError):
    """Creating (or checking) an object of the job found one of its name that the job does not own."""

    def __init__(self, conflict: NameConflictError, status: st.JobStatus, *, creating: bool) -> None:
        self.conflict = conflict
        #: The job's status as the actions executed so far left it.
        self.status = status
        #: Found while creating the generation's workers (they are not all created), not while checking.
        self.creating = creating
        super().__init__(str(conflict))


def reconcile_job(kube: Kube, cache: WorldCache, namespace: str, name: str, settings: OperatorSettings,
                  logger: Logger) -> float | None:
    """One reconcile of one JAXJob; the seconds until the next one (None: the job is gone).
    Reads the cache; only a job the cache has not seen yet is read from the API."""
    job = cache.job(namespace, name) or kube.get_job(namespace, name)
    if job is None:
        return None
    if (job.get("metadata") or {}).get("deletionTimestamp"):
        cleanup_job(kube, cache, job, settings, logger)
        return MAX_REQUEUE_SECONDS
    world = observe(kube, cache, job, settings, logger)
    metrics.record_checkpoint(world.observed)
    if world.pods:
        check_token_secret(kube, world, logger)
    spec = job.get("spec") or {}
    actions = decide_raw(spec, world.observed, settings)
    try:
        if any(isinstance(a, CreateGeneration) and a.generation > world.observed.status.generation for a in actions):
            # One job at a time plans a new generation's node pools and reserves them in the cache (its lead
            # pods counted as pending there), so the next plan sees them taken: jobs started together never
            # pick the same free pool. The writes (status, Event, Secret, pods) run outside the lock; the
            # reservation ends once the created pods are in the cache (or the writes failed).
            with cache.planning:
                job = cache.job(namespace, name) or job
                spec = job.get("spec") or {}
                world = observe(kube, cache, job, settings, logger)
                actions = decide_raw(spec, world.observed, settings)
                reserved = cache.reserve([p for a in actions if isinstance(a, CreateGeneration) for p in a.pods])
            try:
                return execute(kube, cache, world, actions, settings, logger)
            finally:
                cache.release(reserved)
        return execute(kube, cache, world, actions, settings, logger)
    except PodRefusedError as e:
        world = replace(world, observed=replace(world.observed, status=e.status))
        refused = decide_pod_refused(spec, world.observed, e.generation, e.pod, e.detail, settings)
        return execute(kube, cache, world, refused, settings, logger)
    except NameTakenError as e:
        world = replace(world, observed=replace(world.observed, status=e.status))
        taken = decide_name_conflict(world.observed, e.conflict, settings, creating=e.creating)
        return execute(kube, cache, world, taken, settings, logger)


def check_token_secret(kube: Kube, world: World, logger: Logger) -> None:
    """While the job has pods: its token Secret, read again every TOKEN_RECHECK_SECONDS (a cached copy
    before that); a deleted Secret is created again with a new token, which rotates it (docs/sidecar.md,
    "Auth"). A Secret the job does not own, or the API's trouble, is left to the actions that need the
    token (EnsureTokenSecret, CreateGeneration): logged here, never fatal to the reconcile."""
    try:
        kube.ensure_token_secret(job_ref(world.job))
    except (NameConflictError, KubeError, kopf.TemporaryError) as e:
        logger.warning("token secret of %s: %s", job_ref(world.job).name, e)


def cleanup_job(kube: Kube, cache: WorldCache, job: Mapping[str, Any], settings: OperatorSettings,
                logger: Logger) -> None:
    """On deletion: force-delete pods no kubelet will confirm; the garbage collector does the rest.
    The token Secret has an owner reference too; deleting it here spares a garbage-collector round."""
    world = observe(kube, cache, job, settings, logger)
    execute(kube, cache, world, decide_cleanup(world.observed), settings, logger)
    ref = job_ref(job)
    kube.delete_owned_secret(ref.namespace, build_token_secret_name(ref.name), ref.uid)
    kube.forget_token(ref.uid)
    metrics.forget_job(ref)
    forget_trainer(ref)


def execute(kube: Kube, cache: WorldCache, world: World, actions: Sequence[Action], settings: OperatorSettings,
            logger: Logger) -> float:
    """Run the actions in order; the first failure propagates (a refused pod as `PodRefusedError`).
    Returns the seconds until the next look."""
    job, ref = world.job, job_ref(world.job)
    wait = MAX_REQUEUE_SECONDS
    status_before = world.observed.status
    # the status as stored: the cache holds the operator's own last write (a decision made after an
    # earlier one of this reconcile, decide_pod_refused's, comes after a write world.job predates)
    stored = (cache.job(ref.namespace, ref.name) or job).get("status") or {}
    for action in actions:
        if isinstance(action, SetStatus):
            patch = st.build_status_patch(stored, action.status)
            if patch:  # written only when it changes, and only what changed
                written = kube.patch_job_status(ref.namespace, ref.name, patch)
                cache.remember(written)
                stored = (written or {}).get("status") or st.merge_patch({}, st.build_status(action.status))
            metrics.record_status(ref, status_before, action.status, world.observed.now)
            status_before = action.status
        elif isinstance(action, CreateGeneration):
            create_generation(kube, cache, world, action, status_before, logger)
        elif isinstance(action, EnsureTokenSecret | RequestFinalSave | StopTrainers | StartTrainers):
            try:  # these read the token Secret: one the job does not own is a conflict, its token unused
                call_sidecars(kube, world, action, settings, logger)
            except NameConflictError as e:
                raise NameTakenError(e, status_before, creating=False) from e
        elif isinstance(action, DeleteGeneration):
            delete_generation(kube, cache, world, action, settings, logger)
        elif isinstance(action, PatchWorkerPods):
            patch_worker_pods(kube, cache, world, action, logger)
        elif isinstance(action, PublishFreshness):
            publish_freshness(kube, cache, world, action)
        elif isinstance(action, CreateProbes | DeleteProbes):
            change_probes(kube, cache, world, action, logger)
        elif isinstance(action, CreateSpares | DeleteSpares):
            change_spares(kube, cache, world, action, logger)
        elif isinstance(action, SuspendSpareJob):
            made = kube.suspend_job(ref.namespace, action.name, action.uid, action.suspend, {
                spare_jobs.ANNOTATION_SUSPENDED_FOR: action.lent_to or None})
            cache.remember(made)
            logger.info("spare job %s: spec.suspend %s (%s)", action.name, action.suspend,
                        f"lent to {action.lent_to}" if action.lent_to else "resumed")
        elif isinstance(action, EmitEvent):
            log = logger.warning if action.type == "Warning" else logger.info
            log("%s: %s", action.reason, action.message)
            kube.create_event(job, action.type, action.reason, action.message, world.observed.now)
        elif isinstance(action, DeleteJob):
            logger.info("deleting the JAXJob: %s", action.reason)
            kube.delete_job(ref.namespace, ref.name, action.uid)
        elif isinstance(action, RequeueAfter):
            wait = min(wait, action.seconds)
    metrics.record_goodput(ref, goodput_status.current(world.observed, status_before))
    return max(0.5, wait)


def call_sidecars(kube: Kube, world: World, action: EnsureTokenSecret | RequestFinalSave | StopTrainers | StartTrainers,
                  settings: OperatorSettings, logger: Logger) -> None:
    """The actions that need the job's token Secret (EnsureTokenSecret only checks it)."""
    if isinstance(action, EnsureTokenSecret):
        kube.ensure_token_secret(job_ref(world.job), check=True)
    elif isinstance(action, RequestFinalSave):
        request_final_save(kube, world, action, settings, logger)
    else:
        call_trainers(kube, world, action, settings, logger)


def create_generation(kube: Kube, cache: WorldCache, world: World, action: CreateGeneration,
                      status: st.JobStatus, logger: Logger) -> None:
    """The token Secret (read, re-created if gone), the Service (if given) and each pod; an existing
    object the job owns is success, one it does not own stops everything (`NameTakenError`)."""
    ref = job_ref(world.job)
    created = []
    try:
        kube.ensure_token_secret(ref, check=True)
        known = None if action.service is None else cache.service(ref.namespace, action.service["metadata"]["name"])
        if action.service is not None and (known is None or owner_uid(known) != ref.uid):  # else: it is there
            cache.remember(kube.create_owned(action.service, ref.uid)[0])
        for manifest in action.pods:
            name = str(manifest["metadata"]["name"])
            try:
                made, fresh = kube.create_owned(manifest, ref.uid)
            except KubeError as e:
                if e.status in REFUSED_STATUSES:
                    raise PodRefusedError(action.generation, name, e.api_message, status) from e
                raise
            cache.remember(made)
            if fresh:
                created.append(name)
    except NameConflictError as e:
        raise NameTakenError(e, status, creating=True) from e
    finally:
        if created:
            logger.info("generation %d: created %s", action.generation, ", ".join(created))


def delete_generation(kube: Kube, cache: WorldCache, world: World, action: DeleteGeneration,
                      settings: OperatorSettings, logger: Logger) -> None:
    """Each pod as its `PodDeletion` says (one whose `not_before` is still ahead stays), then the Service
    if the job owns it. A pod the API no longer has leaves the cache at once (the watch says so too;
    should the cache ever hold a ghost, the next decision does not wait on it). With `action.lost`, the
    pods deleted now with a grace are then told which processes are lost (`tell_lost_peers`)."""
    ref = job_ref(world.job)
    uids = {p.name: p.uid for p in world.observed.pods}  # the job's own, as observed
    gone = []
    graced = []
    for d in action.pods:
        if d.not_before is not None and world.observed.now < d.not_before:
            continue  # its trainer may still stop by itself; the decision looks again
        if d.name not in uids:
            logger.warning("generation %d: not deleting %s: not a pod of this job's", action.generation, d.name)
            continue
        # the pod observed, not another created under its name since (a precondition on its uid)
        if not kube.delete_pod(ref.namespace, d.name, force=d.force, grace_seconds=d.grace_seconds,
                               uid=uids[d.name]):
            cache.forget_pod(ref.namespace, d.name)
            continue
        gone.append(d.name + (" (force)" if d.force else ""))
        if not d.force:
            graced.append(d.name)
    if action.generation in world.observed.services:  # its own (observed.assemble_observed): never another's
        kube.delete_service(ref.namespace, build_generation_service_name(ref.name, action.generation))
    if gone:
        logger.info("generation %d (%s): deleting %s", action.generation, action.reason, ", ".join(gone))
    if action.lost and graced:
        tell_lost_peers(kube, world, action, graced, settings, logger)


def tell_lost_peers(kube: Kube, world: World, action: DeleteGeneration, pods: Sequence[str],
                    settings: OperatorSettings, logger: Logger) -> None:
    """POST /v1/peers/lost `{"generation", "processes": action.lost}` to the sidecars of `pods` (just
    deleted with a grace), with the job's token: a final upload that waits for a lost process's marker
    stops waiting (docs/sidecar.md, SIGTERM). After the deletes, so a sidecar slow to answer never delays
    them. Best effort: a pod not told waits out its grace, as before; nothing is raised."""
    ref = job_ref(world.job)
    ips = {str((p.get("metadata") or {}).get("name")): (p.get("status") or {}).get("podIP") for p in world.pods}
    body = {"generation": action.generation, "processes": list(action.lost)}
    calls = [SidecarCall(name, str(ips[name]), "POST", "/v1/peers/lost", body) for name in pods if ips.get(name)]
    if not calls:
        return
    try:
        token = kube.ensure_token_secret(ref)
    except (NameConflictError, KubeError) as e:
        logger.warning("generation %d: lost processes %s not told to %s: %s", action.generation, list(action.lost),
                       ", ".join(c.pod for c in calls), e)
        return
    for name, answer in ask_sidecars(kube, calls, settings.sidecar_port, token=token).items():
        if isinstance(answer, SidecarError):  # a sidecar on its way out may be gone already
            logger.info("generation %d: %s not told that processes %s are lost: %s", action.generation, name,
                        list(action.lost), answer)
            continue
        logger.info("generation %d: told %s that processes %s are lost", action.generation, name, list(action.lost))


def request_final_save(kube: Kube, world: World, action: RequestFinalSave, settings: OperatorSettings,
                       logger: Logger) -> None:
    """POST /v1/save (stop) to each named pod's sidecar not yet asked, then annotate the pod."""
    ref = job_ref(world.job)
    wanted = set(action.pods)
    asked = errors = 0
    calls = []
    for pod in world.pods:
        meta = pod.get("metadata") or {}
        name = str(meta.get("name"))
        if name not in wanted:
            continue
        annotation = (meta.get("annotations") or {}).get(api.ANNOTATION_SAVE_REQUEST) or ""
        if annotation.startswith(action.request_id + "="):
            asked += 1
            continue
        ip = (pod.get("status") or {}).get("podIP")
        if ip:
            calls.append(SidecarCall(name, ip, "POST", "/v1/save", {"reason": action.reason, "stop": True}))
    token = kube.ensure_token_secret(ref) if calls else None
    for name, answer in ask_sidecars(kube, calls, settings.sidecar_port, token=token).items():
        if isinstance(answer, SidecarError):
            errors += 1
            logger.warning("final save request to %s failed: %s", name, answer)
            continue
        kube.annotate_pod(ref.namespace, name, {api.ANNOTATION_SAVE_REQUEST: f"{action.request_id}={answer.get('id')}"})
        asked += 1
        logger.info("final save (%s) requested from %s: sidecar request %s", action.reason, name, answer.get("id"))
    if asked == 0 and errors:
        raise SidecarError(f"no sidecar of generation {action.generation} took the final save request")


def patch_worker_pods(kube: Kube, cache: WorldCache, world: World, action: PatchWorkerPods, logger: Logger) -> None:
    """Re-label and re-annotate the kept pods (a pod gone is skipped: the next decision drops it)."""
    ref = job_ref(world.job)
    for name, labels, notes in action.pods:
        made = kube.patch_pod_metadata(ref.namespace, name, dict(labels), dict(notes))
        if made is not None:
            cache.remember(made)
    logger.info("generation %d: kept %s", action.generation, ", ".join(name for name, _, _ in action.pods))


def publish_freshness(kube: Kube, cache: WorldCache, world: World, action: PublishFreshness) -> None:
    """The checkpoint freshness annotations onto the job and the named pods (each of the uid observed)."""
    ref = job_ref(world.job)
    uids = {p.name: p.uid for p in world.observed.pods}
    targets = [("jaxjob", ref.name, ref.uid, action.job)] if action.job else []
    targets += [("pod", name, uids[name], notes) for name, notes in action.pods if uids.get(name)]
    for kind, name, uid, notes in targets:
        made = kube.annotate_owned(kind, ref.namespace, name, uid, dict(notes))
        if made is not None:
            cache.remember(made)


def change_probes(kube: Kube, cache: WorldCache, world: World, action: CreateProbes | DeleteProbes,
                  logger: Logger) -> None:
    """Create or delete grow-back probe pods (a name another owner holds is logged and left alone)."""
    ref = job_ref(world.job)
    if isinstance(action, DeleteProbes):
        uids = {p.name: p.uid for p in world.observed.probes}
        for name in action.names:
            kube.delete_pod(ref.namespace, name, force=True, uid=uids.get(name, ""))
        logger.info("grow-back probes deleted: %s", ", ".join(action.names))
        return
    for manifest in action.pods:
        try:
            made, _ = kube.create_owned(manifest, ref.uid)
        except NameConflictError as e:
            logger.warning("grow-back probe not created: %s", e)
            continue
        cache.remember(made)
    logger.info("grow-back probes created: %s", ", ".join(m["metadata"]["name"] for m in action.pods))


def change_spares(kube: Kube, cache: WorldCache, world: World, action: CreateSpares | DeleteSpares,
                  logger: Logger) -> None:
    """Create or delete spare placeholder pods. A deletion is forced (grace 0: a placeholder holds only
    a place) and leaves the cache at once, so the workers created next find the nodes free. A create the
    API refuses, or a name another owner holds, is logged and left (the status shows the spare not ready)."""
    ref = job_ref(world.job)
    if isinstance(action, DeleteSpares):
        uids = {p.name: p.uid for p in world.observed.spares}
        for name in action.names:
            kube.delete_pod(ref.namespace, name, force=True, uid=uids.get(name, ""))
            cache.forget_pod(ref.namespace, name)
        logger.info("spare placeholders deleted (%s): %s", action.reason, ", ".join(action.names))
        return
    made_names = []
    for manifest in action.pods:
        try:
            made, _ = kube.create_owned(manifest, ref.uid)
        except (NameConflictError, KubeError) as e:
            logger.warning("spare placeholder %s not created: %s", manifest["metadata"]["name"], e)
            continue
        cache.remember(made)
        made_names.append(str(manifest["metadata"]["name"]))
    if made_names:
        logger.info("spare placeholders created: %s", ", ".join(made_names))


def call_trainers(kube: Kube, world: World, action: StopTrainers | StartTrainers, settings: OperatorSettings,
                  logger: Logger) -> None:
    """POST /v1/trainer/stop or /v1/trainer/start to each named pod's sidecar, with the job's token. An
    error is logged and left to the decision (it asks again, or its deadline drops the pod)."""
    ref = job_ref(world.job)
    if isinstance(action, StopTrainers):
        path = "/v1/trainer/stop"
        bodies = {p: {"generation": action.generation, "reason": action.reason, "stacks": action.stacks}
                  for p in action.pods}
    else:
        path = "/v1/trainer/start"
        bodies = {p: {"generation": action.generation, "env": dict(env)} for p, env in action.pods}
    ips = {str((p.get("metadata") or {}).get("name")): (p.get("status") or {}).get("podIP") for p in world.pods}
    token = kube.ensure_token_secret(ref)
    calls = []
    for name, body in bodies.items():
        ip = ips.get(name)
        if not ip:
            logger.warning("%s to %s: the pod has no IP", path, name)
            continue
        calls.append(SidecarCall(name, ip, "POST", path, body))
    for name, answer in ask_sidecars(kube, calls, settings.sidecar_port, token=token).items():
        if isinstance(answer, SidecarError):
            logger.warning("%s (generation %d) to %s failed: %s", path, action.generation, name, answer)
            continue
        logger.info("%s (generation %d) sent to %s", path, action.generation, name)
