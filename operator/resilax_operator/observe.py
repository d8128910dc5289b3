"""The I/O side of one reconcile: observe the world, decide (pure), execute the actions in order.

1. `observe`: the JAXJob, its pods and Services, the nodes, the live pods of others (capacity) — all
   read from the watch cache (cache.py), no LIST — plus the sidecars' answers to an open final save
   request and pod 0's `/v1/state` → `reconcile.Observed`.
2. `reconcile.decide_raw` (or `decide_cleanup` on deletion).
3. `execute`: each action through `k8s.Kube`, in order, stopping at the first failure (the exception
   propagates; the next reconcile decides again from what is then observed). A status equal to the
   one the job has is not written; what the operator writes goes into the cache at once.

Everything here is synchronous; handlers.py calls `reconcile_job` from a kopf daemon thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from . import api, metrics
from . import status as st
from .builders import JobRef, build_pod_name, build_service_name, build_token_secret_name
from .cache import WorldCache
from .errors import InvalidSpecError
from .k8s import Kube, KubeError, SidecarError
from .reconcile import (
    Action,
    CreateGeneration,
    DeleteGeneration,
    EmitEvent,
    Observed,
    RequestFinalSave,
    RequeueAfter,
    SaveOutcome,
    SetStatus,
    build_observed,
    decide_cleanup,
    decide_pod_refused,
    decide_raw,
    parse_restore_report,
    parse_save_outcome,
    parse_sidecar_state,
    status_body,
)
from .settings import OperatorSettings
from .spec import JobSpec
from .validation import validate_spec

Logger = logging.Logger | logging.LoggerAdapter[Any]

#: Longest wait between two reconciles of one job, whatever the actions say (seconds).
MAX_REQUEUE_SECONDS = 5.0
#: Grace period of the surviving workers of a generation that lost a node. Their final save is a
#: collective with a dead peer and cannot finish, so the pod's full grace (finalSave.timeoutSeconds
#: + margin) only delays the next generation; they still get SIGTERM and a few seconds.
HARD_LOSS_GRACE_SECONDS = 5
#: Grace period of a pod whose trainer has already exited, when the job has no local tier: its sidecar
#: has nothing left to save or upload, but without the trainer's liveness lock (docs/sidecar.md, open
#: points) it would wait for an answer until its own grace (finalSave.timeoutSeconds) runs out.
TRAINER_GONE_GRACE_SECONDS = 2
#: After a final save with stop, the trainers exit (75) by themselves within moments. A pod deleted
#: before that gets SIGTERM and its sidecar waits for a save answer that never comes; so a planned
#: teardown leaves a pod whose trainer still runs alone for up to this long (seconds).
STOPPING_TRAINER_WAIT_SECONDS = 15.0
#: API answers to a pod create that retrying at once will not change (admission refused it).
REFUSED_STATUSES = frozenset({400, 403, 422})
PLANNED_KINDS = frozenset({st.PREEMPTION, st.RESIZE, st.GROW_BACK, st.WORKER_STOPPED})

_lock = threading.Lock()
#: pod uid → when a planned teardown first found its trainer still running (monotonic seconds).
_waiting_since: dict[str, float] = {}


@dataclass(frozen=True)
class World:
    """What one reconcile read: the raw bodies (to execute against) and the parsed snapshot."""

    job: Mapping[str, Any]
    pods: tuple[Mapping[str, Any], ...]
    observed: Observed


def now_utc() -> datetime:
    return datetime.now(UTC)


def job_ref(job: Mapping[str, Any]) -> JobRef:
    meta = job.get("metadata") or {}
    return JobRef(str(meta.get("name", "")), str(meta.get("namespace", "")), str(meta.get("uid", "")))


def _pod_ip(pod: Mapping[str, Any]) -> str | None:
    return (pod.get("status") or {}).get("podIP") or None


def _annotation(pod: Mapping[str, Any], key: str) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(key)


def observe(kube: Kube, cache: WorldCache, job: Mapping[str, Any], settings: OperatorSettings, logger: Logger,
            now: datetime | None = None) -> World:
    ref = job_ref(job)
    pods = cache.pods_of(ref.namespace, ref.name)
    services = cache.services_of(ref.namespace, ref.name)
    nodes = cache.all_nodes()
    others = cache.device_pods()
    status = st.parse_status(job.get("status"))
    outcomes = observe_save_outcomes(kube, status, pods, settings, logger)
    checkpoint = restore = None
    if status.generation > 0:
        pod0 = next((p for p in pods if (p.get("metadata") or {}).get("name")
                     == build_pod_name(ref.name, status.generation, 0, 0)), None)
        if pod0 is not None and _pod_ip(pod0) and (pod0.get("status") or {}).get("phase") == "Running":
            try:
                state = kube.sidecar("GET", str(_pod_ip(pod0)), settings.sidecar_port, "/v1/state")
                checkpoint = parse_sidecar_state(state, now or now_utc())
                restore = parse_restore_report(state)
                metrics.record_worker_state(ref, status.generation, state)
            except SidecarError as e:
                logger.debug("no checkpoint state from %s: %s", build_pod_name(ref.name, status.generation, 0, 0), e)
    observed = build_observed(job, now=now or now_utc(), pods=pods, services=services, nodes=nodes,
                              other_pods=others, save_outcomes=outcomes, checkpoint=checkpoint, restore=restore)
    return World(job, tuple(pods), observed)


def observe_save_outcomes(kube: Kube, status: st.JobStatus, pods: Sequence[Mapping[str, Any]],
                          settings: OperatorSettings, logger: Logger) -> tuple[SaveOutcome, ...]:
    """The sidecars' answers to the open final save request: the first committed, else the first failed."""
    t = status.transition
    if t is None or not t.saving or not t.save_request_id:
        return ()
    found: list[SaveOutcome] = []
    for pod in pods:
        value = _annotation(pod, api.ANNOTATION_SAVE_REQUEST) or ""
        request_id, _, sidecar_id = value.partition("=")
        ip = _pod_ip(pod)
        if request_id != t.save_request_id or not sidecar_id or not ip:
            continue
        try:
            answer = kube.sidecar("GET", ip, settings.sidecar_port, f"/v1/save/{sidecar_id}")
        except SidecarError as e:
            logger.debug("save %s not readable from %s: %s", sidecar_id, pod["metadata"]["name"], e)
            continue
        outcome = parse_save_outcome(t.save_request_id, answer)
        if outcome is not None:
            found.append(outcome)
    committed = [o for o in found if o.committed and o.error is None]
    return (committed[0],) if committed else tuple(found[:1])


def execute(kube: Kube, cache: WorldCache, world: World, actions: Sequence[Action], settings: OperatorSettings,
            logger: Logger) -> float:
    """Run the actions in order; the first failure propagates. Returns the seconds until the next look."""
    job, ref = world.job, job_ref(world.job)
    wait = MAX_REQUEUE_SECONDS
    status_before = world.observed.status
    for action in actions:
        if isinstance(action, SetStatus):
            body = status_body(action)
            if body != st.build_status(status_before):  # written only when it changes
                cache.remember(kube.patch_job_status(ref.namespace, ref.name, body))
            metrics.record_status(ref, status_before, action.status, world.observed.now)
            status_before = action.status
        elif isinstance(action, CreateGeneration):
            kube.ensure_token_secret(ref)
            if action.service is not None:
                cache.remember(kube.create(action.service))
            created = []
            for manifest in action.pods:
                name = str(manifest["metadata"]["name"])
                try:
                    made = kube.create(manifest)
                    if made is not None:
                        cache.remember(made)
                        created.append(name)
                except KubeError as e:
                    if e.status not in REFUSED_STATUSES:
                        raise
                    # Admission (Pod Security, quota, a webhook) said no: report it and try again later.
                    if created:
                        logger.info("generation %d: created %s", action.generation, ", ".join(created))
                    refused = decide_pod_refused(_spec_or_none(job), status_before, action.generation, name,
                                                 e.api_message, world.observed.now, settings)
                    world = World(world.job, world.pods, replace(world.observed, status=status_before))
                    return execute(kube, cache, world, refused, settings, logger)
            if created:
                logger.info("generation %d: created %s", action.generation, ", ".join(created))
        elif isinstance(action, DeleteGeneration):
            delete_generation(kube, world, action, logger)
        elif isinstance(action, RequestFinalSave):
            request_final_save(kube, world, action, settings, logger)
        elif isinstance(action, EmitEvent):
            log = logger.warning if action.type == "Warning" else logger.info
            log("%s: %s", action.reason, action.message)
            kube.create_event(job, action.type, action.reason, action.message, world.observed.now)
        elif isinstance(action, RequeueAfter):
            wait = min(wait, action.seconds)
    return max(0.5, wait)


def _spec_or_none(job: Mapping[str, Any]) -> JobSpec | None:
    try:
        return validate_spec(job.get("spec") or {})
    except InvalidSpecError:
        return None


def delete_generation(kube: Kube, world: World, action: DeleteGeneration, logger: Logger) -> None:
    ref = job_ref(world.job)
    local_tier = bool(((world.job.get("spec") or {}).get("checkpoint") or {}).get("local"))
    gone = []
    for pod in world.pods:
        meta = pod.get("metadata") or {}
        if (meta.get("labels") or {}).get(api.LABEL_GENERATION) != str(action.generation):
            continue
        name = str(meta.get("name"))
        force = name in action.force_pods
        if meta.get("deletionTimestamp") and not force:
            continue  # already going; deleting again changes nothing
        if not force and action.reason in PLANNED_KINDS and _trainer_running(pod) and _still_waiting(meta):
            continue  # it is stopping by itself after its final save; the next reconcile deletes it
        grace = None
        if not force and action.reason == st.NODE_LOSS:
            grace = HARD_LOSS_GRACE_SECONDS
        elif not force and not local_tier and _trainer_exited(pod):
            grace = TRAINER_GONE_GRACE_SECONDS
        kube.delete_pod(ref.namespace, name, force=force, grace_seconds=grace)
        gone.append(name + (" (force)" if force else ""))
    kube.delete_service(ref.namespace, build_service_name(ref.name, action.generation))
    if gone:
        logger.info("generation %d (%s): deleting %s", action.generation, action.reason, ", ".join(gone))


def _trainer_state(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    containers = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
    trainer = api.TRAINER_CONTAINER if api.TRAINER_CONTAINER in containers else (containers[0] if containers else None)
    return next(((cs.get("state") or {}) for cs in (pod.get("status") or {}).get("containerStatuses") or []
                 if cs.get("name") == trainer), {})


def _trainer_exited(pod: Mapping[str, Any]) -> bool:
    return bool(_trainer_state(pod).get("terminated"))


def _trainer_running(pod: Mapping[str, Any]) -> bool:
    return bool(_trainer_state(pod).get("running"))


def _still_waiting(meta: Mapping[str, Any]) -> bool:
    uid, now = str(meta.get("uid", "")), time.monotonic()
    with _lock:
        for key in [k for k, t in _waiting_since.items() if now - t > 10 * STOPPING_TRAINER_WAIT_SECONDS]:
            del _waiting_since[key]
        first = _waiting_since.setdefault(uid, now)
    return now - first < STOPPING_TRAINER_WAIT_SECONDS


def request_final_save(kube: Kube, world: World, action: RequestFinalSave, settings: OperatorSettings,
                       logger: Logger) -> None:
    """POST /v1/save (stop) to each named pod's sidecar not yet asked, then annotate the pod."""
    ref = job_ref(world.job)
    wanted = set(action.pods)
    asked = errors = 0
    token: str | None = None
    for pod in world.pods:
        meta = pod.get("metadata") or {}
        name = str(meta.get("name"))
        if name not in wanted:
            continue
        if (_annotation(pod, api.ANNOTATION_SAVE_REQUEST) or "").startswith(action.request_id + "="):
            asked += 1
            continue
        ip = _pod_ip(pod)
        if not ip:
            continue
        token = token or kube.ensure_token_secret(ref)
        try:
            answer = kube.sidecar("POST", ip, settings.sidecar_port, "/v1/save",
                                  {"reason": action.reason, "stop": True}, token=token)
        except SidecarError as e:
            errors += 1
            logger.warning("final save request to %s failed: %s", name, e)
            continue
        kube.annotate_pod(ref.namespace, name, {api.ANNOTATION_SAVE_REQUEST: f"{action.request_id}={answer.get('id')}"})
        asked += 1
        logger.info("final save (%s) requested from %s: sidecar request %s", action.reason, name, answer.get("id"))
    if asked == 0 and errors:
        raise SidecarError(f"no sidecar of generation {action.generation} took the final save request")


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
    actions = decide_raw(job.get("spec") or {}, world.observed, settings)
    return execute(kube, cache, world, actions, settings, logger)


def cleanup_job(kube: Kube, cache: WorldCache, job: Mapping[str, Any], settings: OperatorSettings,
                logger: Logger) -> None:
    """On deletion: force-delete pods no kubelet will confirm; the garbage collector does the rest.
    The token Secret has an owner reference too; deleting it here spares a garbage-collector round."""
    world = observe(kube, cache, job, settings, logger)
    execute(kube, cache, world, decide_cleanup(world.observed, settings), settings, logger)
    ref = job_ref(job)
    kube.delete_secret(ref.namespace, build_token_secret_name(ref.name))
    kube.forget_token(ref.uid)
    metrics.forget_job(ref)
