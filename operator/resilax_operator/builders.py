"""Pure manifests: spec + generation plan → the generation's headless Service and one Pod per host.

Coordinator discovery (no cluster DNS needed): JAX's coordination service runs in process 0, which
listens on all interfaces. The operator creates pod 0 first (its `JAX_COORDINATOR_ADDRESS` is
`$(RESILAX_POD_IP):<port>`, its own IP through the downward API), waits until pod 0 has
`status.podIP`, then creates the other pods with that IP written into their environment. The same on
GKE and on the local cluster. `TPU_WORKER_HOSTNAMES` names the slice's pods through the headless
Service (`<pod>.<service>`): only TPU runtimes read it, and TPUs only exist on GKE, which has DNS.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Final

from . import api
from .generation import (
    GenerationPlan,
    JobRef,
    build_pod_group_name,
    build_token_secret_name,
    build_workers_service_name,
    creates_all_at_once,
    kueue_queue,
)
from .pods.podsecurity import RESTRICTED_POD, fit_root_user, merge_security_context, restricted_context
from .pods.worker_env import (
    STORAGE_MOUNT,
    TERMINATION_MESSAGE_PATH,
    build_env,
    compilation_cache_env,
    merge_env,
)
from .settings import OperatorSettings, sidecar_resources_from_json
from .spec import LOCAL_SCOPE_NODE, JobSpec
from .topology import SliceGeometry, plan_geometry

Manifest = dict[str, Any]

STORAGE_VOLUME: Final = "resilax-storage"
#: Worker variables the sidecar container does not get (it reads none of them).
SIDECAR_ENV_LEFT_OUT: Final = frozenset({"TPU_WORKER_HOSTNAMES"})
SIDECAR_RESOURCES: Final = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
LOCAL_INIT_RESOURCES: Final = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}


def geometry_of(spec: JobSpec, topology: str) -> SliceGeometry:
    return plan_geometry(spec.slices.accelerator, topology, chips_per_host=spec.slices.chips_per_host,
                         machine_type=spec.slices.machine_type)


def build_labels(job: str, generation: int) -> dict[str, str]:
    return {api.LABEL_JOB: job, api.LABEL_GENERATION: str(generation), api.LABEL_ROLE: api.ROLE_WORKER}


def build_owner_reference(job: JobRef) -> dict[str, Any]:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": job.name, "uid": job.uid,
            "controller": True, "blockOwnerDeletion": True}


def build_token_secret(job: JobRef, token: str) -> Manifest:
    """The Secret holding the bearer token that mutating sidecar calls must present (one per job)."""
    return {"apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": build_token_secret_name(job.name), "namespace": job.namespace,
                         "labels": {api.LABEL_JOB: job.name},
                         "ownerReferences": [build_owner_reference(job)]},
            "type": "Opaque", "stringData": {api.TOKEN_KEY: token}}


def build_service(job: JobRef, settings: OperatorSettings) -> Manifest:
    """The job-wide headless Service `<job>-workers` (pod DNS names on clusters that have DNS): every
    worker pod names it as its `subdomain`. It carries no generation label: it serves them all."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": build_workers_service_name(job.name), "namespace": job.namespace,
                     "labels": {api.LABEL_JOB: job.name, api.LABEL_ROLE: api.ROLE_WORKER},
                     "ownerReferences": [build_owner_reference(job)]},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {api.LABEL_JOB: job.name, api.LABEL_ROLE: api.ROLE_WORKER},
                 "ports": [{"name": "coordinator", "port": settings.coordinator_port},
                           {"name": "sidecar", "port": settings.sidecar_port}]},
    }


def build_coordinator_host(job: JobRef, plan: GenerationPlan) -> str:
    """Pod 0's DNS name through the job's headless Service (clusters with DNS, e.g. GKE)."""
    return f"{plan.pod_name(job.name, 0, 1)}.{build_workers_service_name(job.name)}"


def in_place_unavailable(job: JobRef, spec: JobSpec) -> str:
    """Why an in-place restart cannot apply to this job's pods ("" when it can, or when
    `spec.recovery.inPlace` is Never: nothing to explain)."""
    if not spec.recovery.in_place_auto:
        return ""
    if kueue_queue(job, spec):
        return "the job has a Kueue queue (its pod group cannot be re-labelled into a new one)"
    trainer = _trainer(spec.template.get("spec") or {})
    if not trainer.get("command"):
        return (f"the trainer container {trainer.get('name', '')!r} has no command (the supervisor `resilax run` "
                "wraps it; set command)")
    if trainer.get("readinessProbe"):
        return (f"the trainer container {trainer.get('name', '')!r} sets its own readinessProbe (the operator's "
                f"probe on the sidecar's {api.TRAINER_READY_PATH} is how it learns of a trainer's exit)")
    return ""


def supervised(job: JobRef, spec: JobSpec) -> bool:
    """Whether the trainer runs under the supervisor (`resilax run`): inPlace Auto and nothing against it."""
    return spec.recovery.in_place_auto and not in_place_unavailable(job, spec)


def _trainer(pod_spec: Mapping[str, Any]) -> Mapping[str, Any]:
    containers = pod_spec.get("containers") or []
    return next((c for c in containers if c.get("name") == api.TRAINER_CONTAINER), containers[0] if containers else {})


def _supervise(trainer: dict[str, Any], settings: OperatorSettings) -> None:
    """The trainer's command run by the supervisor, and the doorbell: a readinessProbe on the sidecar's
    `/v1/trainer/ready`, so a trainer's exit (which no longer ends the container) wakes the operator."""
    trainer["command"] = [*api.SUPERVISOR_COMMAND, *(trainer.get("command") or []), *(trainer.pop("args", None) or [])]
    trainer["readinessProbe"] = {"httpGet": {"path": api.TRAINER_READY_PATH, "port": settings.sidecar_port},
                                 "periodSeconds": 1, "failureThreshold": 1}


def build_pods(job: JobRef, spec: JobSpec, plan: GenerationPlan, settings: OperatorSettings, *,
               coordinator_ip: str | None) -> list[Manifest]:
    """Pod 0 alone while `coordinator_ip` is None (it is the coordinator); all pods once it is known.
    When `creates_all_at_once`: every pod at once, pod 0 with its own IP and the others with its DNS name."""
    geometry = geometry_of(spec, plan.shape.topology)
    if coordinator_ip is None and creates_all_at_once(job, spec):
        host = build_coordinator_host(job, plan)
        return [build_pod(job, spec, plan, s, h, settings, coordinator_ip=None if s == h == 0 else host)
                for s in range(plan.shape.count) for h in range(geometry.hosts)]
    if coordinator_ip is None:
        return [build_pod(job, spec, plan, 0, 0, settings, coordinator_ip=None)]
    return [build_pod(job, spec, plan, s, h, settings, coordinator_ip=coordinator_ip)
            for s in range(plan.shape.count) for h in range(geometry.hosts)]


def build_lead_pods(job: JobRef, spec: JobSpec, plan: GenerationPlan, settings: OperatorSettings) -> list[Manifest]:
    """What a new generation is created with, under the operator's planning lock (execute.py): pod 0, the
    coordinator; when `creates_all_at_once`, the first pod of every other slice too, so that the next
    job's plan sees each slice's node pool taken. The other pods come with the next decision, outside
    the lock (generation_start.bring_up): a large Kueue job no longer holds every other job's planning
    while thousands of its pods are built and created."""
    if not creates_all_at_once(job, spec):
        return build_pods(job, spec, plan, settings, coordinator_ip=None)
    host = build_coordinator_host(job, plan)
    return [build_pod(job, spec, plan, s, 0, settings, coordinator_ip=None if s == 0 else host)
            for s in range(plan.shape.count)]


def build_pod(job: JobRef, spec: JobSpec, plan: GenerationPlan, slice_index: int, host: int,
              settings: OperatorSettings, *, coordinator_ip: str | None) -> Manifest:
    """The worker pod of `host` in `slice_index`. Process 0 may pass coordinator_ip=None (its own IP)."""
    geometry = geometry_of(spec, plan.shape.topology)
    process_id = slice_index * geometry.hosts + host
    if coordinator_ip is None and process_id != 0:
        raise ValueError("only process 0 can be built before the coordinator's IP is known")
    name = plan.pod_name(job.name, process_id, geometry.hosts)
    template = copy.deepcopy(dict(spec.template))
    meta = template.get("metadata") or {}
    pod: dict[str, Any] = copy.deepcopy(dict(template.get("spec") or {}))

    labels = {**(meta.get("labels") or {}), **build_labels(job.name, plan.generation),
              api.LABEL_SLICE: str(slice_index), api.LABEL_HOST: str(host),
              api.LABEL_PROCESS: str(process_id), api.LABEL_NODE_POOL: plan.pools[slice_index]}
    annotations = {**(meta.get("annotations") or {}), api.ANNOTATION_SHAPE: str(plan.shape),
                   api.ANNOTATION_RESTORE_STEP: plan.restore_step}
    queue = kueue_queue(job, spec)
    if queue:  # Kueue's plain Pod integration admits the generation's workers as one pod group
        labels = {**labels, api.KUEUE_QUEUE_LABEL: queue,
                  api.KUEUE_POD_GROUP_LABEL: build_pod_group_name(job.name, plan.generation)}
        annotations[api.KUEUE_POD_GROUP_COUNT_ANNOTATION] = str(plan.shape.count * geometry.hosts)
        annotations[api.KUEUE_RETRIABLE_ANNOTATION] = "false"

    if supervised(job, spec):
        annotations[api.ANNOTATION_SUPERVISED] = "1"
    env = build_env(job, spec, plan, geometry, slice_index, host, settings, coordinator_ip=coordinator_ip)
    mounts = _resilax_mounts(spec)
    containers = [dict(c) for c in pod.get("containers") or []]
    trainer_i = next((i for i, c in enumerate(containers) if c.get("name") == api.TRAINER_CONTAINER), 0)
    owner = worker_owner(pod, containers[trainer_i] if containers else {}, settings)
    for i, c in enumerate(containers):
        c["securityContext"] = restricted_context(c.get("securityContext"))
        if i == trainer_i:
            c["env"] = merge_env(env, c.get("env") or [], geometry, compilation_cache_env(spec))
            c["volumeMounts"] = [*(c.get("volumeMounts") or []), *mounts]
            c["resources"] = _with_accelerator(c.get("resources") or {}, geometry)
            if supervised(job, spec):
                _supervise(c, settings)
    pod["containers"] = containers
    node_scope = node_scoped(spec)
    sidecar = build_sidecar(spec, settings, env)
    inits: list[Manifest] = [sidecar]
    if node_scope:
        # The sidecar trims and uploads the worker's files in a 0700 folder: same user as the worker.
        sidecar["securityContext"] = {**sidecar["securityContext"], "runAsUser": owner[0], "runAsGroup": owner[1]}
        inits = [build_local_init(settings, owner), sidecar]
    if spec.recovery.health_check.enabled and containers:
        inits.append(build_health_check(containers[trainer_i], spec, geometry))
    users_inits = [{**c, "securityContext": restricted_context(c.get("securityContext"))}
                   for c in pod.get("initContainers") or []]
    pod["initContainers"] = [*inits, *users_inits]
    pod["volumes"] = [*(pod.get("volumes") or []), *_resilax_volumes(job, spec, settings)]
    pod["restartPolicy"] = "Never"
    pod["hostname"] = name
    pod["subdomain"] = build_workers_service_name(job.name)
    pool = plan.pools[slice_index]
    pod["nodeSelector"] = {**(pod.get("nodeSelector") or {}), **dict(geometry.node_selector),
                           **({api.NODE_POOL_LABEL: pool} if pool else {})}
    pod["tolerations"] = [*(pod.get("tolerations") or []),
                          *({"key": k, "operator": "Exists", "effect": "NoSchedule"} for k in geometry.toleration_keys)]
    pod["affinity"] = _one_worker_per_node(pod.get("affinity"), job.name, plan.generation)
    if not pool:
        pod["affinity"] = _slice_placement(pod["affinity"], job.name, plan, slice_index)
    previous = dict(plan.worker_nodes).get(process_id)
    if previous is not None and previous not in plan.avoid_nodes:
        pod["affinity"] = _prefer_node(pod["affinity"], previous)
    if plan.avoid_nodes:
        pod["affinity"] = _require_node_expression(
            pod["affinity"], {"key": "metadata.name", "operator": "NotIn", "values": list(plan.avoid_nodes)},
            field="matchFields")
    grace = spec.checkpoint.final_save.timeout_seconds + settings.termination_margin_seconds
    pod["terminationGracePeriodSeconds"] = max(int(pod.get("terminationGracePeriodSeconds") or 0), grace)
    pod["securityContext"] = merge_security_context(RESTRICTED_POD, pod.get("securityContext") or {})
    fit_root_user(pod, dict(template.get("spec") or {}))
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": job.namespace, "labels": labels,
                         "annotations": annotations, "ownerReferences": [build_owner_reference(job)]},
            "spec": pod}


def build_sidecar(spec: JobSpec, settings: OperatorSettings, env: Sequence[Mapping[str, Any]]) -> Manifest:
    """The checkpoint sidecar: a native sidecar (init container with restartPolicy Always)."""
    return {
        "name": api.SIDECAR_CONTAINER,
        "image": settings.sidecar_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["resilax", "sidecar"],
        "restartPolicy": "Always",
        # The worker environment but the slice's host list, which only TPU runtimes read: it grows with the
        # slice (2304 names on the largest) and every cached pod would carry it twice (issue 25, item 6).
        "env": copy.deepcopy([dict(e) for e in env if e.get("name") not in SIDECAR_ENV_LEFT_OUT]),
        "ports": [{"name": "sidecar", "containerPort": settings.sidecar_port}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": settings.sidecar_port},
                           "periodSeconds": 5, "failureThreshold": 3},
        "volumeMounts": _resilax_mounts(spec),
        "resources": (sidecar_resources_from_json(settings.sidecar_resources) if settings.sidecar_resources
                      else copy.deepcopy(SIDECAR_RESOURCES)),
        "securityContext": restricted_context(None),
    }


def build_health_check(trainer: Mapping[str, Any], spec: JobSpec, geometry: SliceGeometry) -> Manifest:
    """`resilax-health-check` (spec.recovery.healthCheck): `resilax health-check` in the trainer's image,
    with its environment (the expected devices, the coordinator of the generation), resources (the
    accelerator: the kubelet hands an init container's devices on to the trainer) and security context,
    after the sidecar. Its JSON result is its termination message (the operator reads it from the pod in
    its watch cache); it exits 79 when the host failed. It mounts the pod's control folder (read-write,
    the trainer's RESILAX_CONTROL_DIR) and leaves its verdict there (`health.json`): the sidecar, SIGTERMed
    by the kubelet with the pod's whole grace once the check failed, then knows no trainer will run and
    exits at once instead of waiting for a final save. Only a new pod gets it: a kept survivor of an
    in-place restart is never rebuilt, so it is not checked again."""
    env = [dict(e) for e in trainer.get("env") or []]
    given = {str(e.get("name")): e.get("value") for e in env}
    if "RESILAX_HEALTH_PLATFORM" not in given:
        env.append({"name": "RESILAX_HEALTH_PLATFORM", "value": plan_expected_platform(geometry, given.get("JAX_PLATFORMS"))})
    container: Manifest = {
        "name": api.HEALTH_CHECK_CONTAINER,
        "image": trainer.get("image"),
        "command": ["resilax", "health-check", "--timeout", str(spec.recovery.health_check.timeout_seconds),
                    "--result", TERMINATION_MESSAGE_PATH],
        "env": env,
        "volumeMounts": [{"name": api.CONTROL_VOLUME, "mountPath": api.CONTROL_DIR}],
        "resources": copy.deepcopy(dict(trainer.get("resources") or {})),
        "securityContext": copy.deepcopy(trainer.get("securityContext")),
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "File",
    }
    for key in ("imagePullPolicy", "envFrom", "workingDir"):
        if trainer.get(key) is not None:
            container[key] = copy.deepcopy(trainer[key])
    return container


#: JAX_PLATFORMS names → the health check's platforms.
_JAX_PLATFORMS: Final = {"tpu": "tpu", "cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu"}


def plan_expected_platform(geometry: SliceGeometry, jax_platforms: str | None) -> str:
    """The platform the health check expects (RESILAX_HEALTH_PLATFORM, unless the trainer sets it): the
    first of the trainer's literal JAX_PLATFORMS when it names one (the local cluster's fake TPU slices
    run `cpu`), else the accelerator's (tpu, gpu, cpu)."""
    first = (jax_platforms or "").split(",")[0].strip().lower()
    if first in _JAX_PLATFORMS:
        return _JAX_PLATFORMS[first]
    return "tpu" if geometry.is_tpu else geometry.family


def node_scoped(spec: JobSpec) -> bool:
    """Whether the job's local tier is a folder on the node (`checkpoint.local.scope: Node`)."""
    local = spec.checkpoint.local
    return local is not None and local.scope == LOCAL_SCOPE_NODE


def build_local_tier_path(job: JobRef, spec: JobSpec, settings: OperatorSettings) -> str:
    """The node folder of a scope Node local tier: `<root>/<namespace>_<job>_<job uid>` (the uid keeps a
    deleted and recreated job of the same name away from the old one's steps)."""
    local = spec.checkpoint.local
    root = settings.local_tier_memory_root if local is not None and local.medium == "Memory" \
        else settings.local_tier_root
    return f"{root.rstrip('/')}/{job.namespace}_{job.name}_{job.uid}"


def worker_owner(pod_spec: Mapping[str, Any], trainer: Mapping[str, Any],
                 settings: OperatorSettings) -> tuple[int, int]:
    """(uid, gid) the worker writes its local tier as: the trainer's runAsUser (else the pod's, else
    the image's user, `settings.local_tier_default_uid`); the pod's fsGroup, else runAsGroup, else the uid."""
    pod_ctx = pod_spec.get("securityContext") or {}
    ctx = trainer.get("securityContext") or {}
    uid = ctx.get("runAsUser", pod_ctx.get("runAsUser", settings.local_tier_default_uid))
    gid = pod_ctx.get("fsGroup", ctx.get("runAsGroup", pod_ctx.get("runAsGroup", uid)))
    return int(uid), int(gid)


def build_local_init(settings: OperatorSettings, owner: tuple[int, int]) -> Manifest:
    """`resilax-local-init`: hands the job's node folder to the worker's user, not world-writable.
    Runs as root with every capability dropped but CHOWN and FOWNER (chmod of a file it does not own)."""
    uid, gid = owner
    script = f"chown -R {uid}:{gid} {api.LOCAL_DIR} && chmod 0700 {api.LOCAL_DIR}"
    return {
        "name": api.LOCAL_INIT_CONTAINER,
        "image": settings.sidecar_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["sh", "-c", script],
        "volumeMounts": [{"name": api.LOCAL_VOLUME, "mountPath": api.LOCAL_DIR}],
        "resources": copy.deepcopy(LOCAL_INIT_RESOURCES),
        "securityContext": {"runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False,
                            "allowPrivilegeEscalation": False, "seccompProfile": {"type": "RuntimeDefault"},
                            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}},
    }


def _prefer_node(affinity: Mapping[str, Any], node: str) -> dict[str, Any]:
    """Add a preferred (never required: the node may be gone) affinity for `node`."""
    out = copy.deepcopy(dict(affinity))
    node_affinity = out.setdefault("nodeAffinity", {})
    terms = node_affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", [])
    terms.append({"weight": 100, "preference": {"matchFields": [
        {"key": "metadata.name", "operator": "In", "values": [node]}]}})
    return out




def _with_accelerator(resources: Mapping[str, Any], geometry: SliceGeometry) -> dict[str, Any]:
    out = {k: dict(v) for k, v in resources.items() if isinstance(v, Mapping)}
    extra = geometry.resource_requests()
    if extra:
        out["requests"] = {**out.get("requests", {}), **extra}
        out["limits"] = {**out.get("limits", {}), **extra}
    return out


def _resilax_mounts(spec: JobSpec) -> list[dict[str, Any]]:
    mounts: list[dict[str, Any]] = [
        {"name": api.CONTROL_VOLUME, "mountPath": api.CONTROL_DIR},
        {"name": api.TOKEN_VOLUME, "mountPath": api.TOKEN_DIR, "readOnly": True},
    ]
    if spec.checkpoint.local is not None:
        mounts.append({"name": api.LOCAL_VOLUME, "mountPath": api.LOCAL_DIR})
    if spec.checkpoint.storage.startswith("pvc://"):
        mounts.append({"name": STORAGE_VOLUME, "mountPath": STORAGE_MOUNT})
    return mounts


def _resilax_volumes(job: JobRef, spec: JobSpec, settings: OperatorSettings) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": api.CONTROL_VOLUME, "emptyDir": {}},
        {"name": api.TOKEN_VOLUME, "secret": {"secretName": build_token_secret_name(job.name),
                                              "defaultMode": 0o444}},
    ]
    local = spec.checkpoint.local
    if local is not None and local.scope == LOCAL_SCOPE_NODE:
        volumes.append({"name": api.LOCAL_VOLUME, "hostPath": {
            "path": build_local_tier_path(job, spec, settings), "type": "DirectoryOrCreate"}})
    elif local is not None:
        empty: dict[str, Any] = {}
        if local.medium:
            empty["medium"] = local.medium
        if local.size_limit:
            empty["sizeLimit"] = local.size_limit
        volumes.append({"name": api.LOCAL_VOLUME, "emptyDir": empty})
    if spec.checkpoint.storage.startswith("pvc://"):
        claim = spec.checkpoint.storage[len("pvc://"):].partition("/")[0]
        volumes.append({"name": STORAGE_VOLUME, "persistentVolumeClaim": {"claimName": claim}})
    return volumes


def _slice_placement(affinity: Mapping[str, Any], job: str, plan: GenerationPlan, slice_index: int) -> dict[str, Any]:
    """A slice no Ready pool hosts yet (its pool is ""): all its pods on one node pool (required pod
    affinity on `cloud.google.com/gke-nodepool`; the first pod matches itself), no pod of another slice of
    the generation on that pool (anti-affinity), and none of the pools the placed slices use. JobSet's
    exclusive placement does the same, and GKE's autoscaler provisions a node pool per such group."""
    out = copy.deepcopy(dict(affinity))
    same = {api.LABEL_JOB: job, api.LABEL_GENERATION: str(plan.generation)}
    out.setdefault("podAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
        {"labelSelector": {"matchLabels": {**same, api.LABEL_SLICE: str(slice_index)}},
         "topologyKey": api.NODE_POOL_LABEL})
    out["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"].append(
        {"labelSelector": {"matchLabels": same, "matchExpressions": [
            {"key": api.LABEL_SLICE, "operator": "NotIn", "values": [str(slice_index)]}]},
         "topologyKey": api.NODE_POOL_LABEL})
    placed = sorted({p for p in plan.pools if p})
    if placed:
        out = _require_node_expression(out, {"key": api.NODE_POOL_LABEL, "operator": "NotIn", "values": placed})
    return out


def _require_node_expression(affinity: Mapping[str, Any], expression: Mapping[str, Any],
                             field: str = "matchExpressions") -> dict[str, Any]:
    """`affinity` with a required node `expression` (a label's, or `matchFields`: the node's name) in
    every node selector term (terms are ORed: each gets it)."""
    out = copy.deepcopy(dict(affinity))
    required = out.setdefault("nodeAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.setdefault("nodeSelectorTerms", [])
    if not terms:
        terms.append({})
    for term in terms:
        term.setdefault(field, []).append(copy.deepcopy(dict(expression)))
    return out


def _one_worker_per_node(affinity: Mapping[str, Any] | None, job: str, generation: int) -> dict[str, Any]:
    """Add a required anti-affinity: at most one worker of this generation per node."""
    out = copy.deepcopy(dict(affinity or {}))
    anti = out.setdefault("podAntiAffinity", {})
    terms = anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
    terms.append({"labelSelector": {"matchLabels": {api.LABEL_JOB: job, api.LABEL_GENERATION: str(generation)}},
                  "topologyKey": api.HOSTNAME_LABEL})
    return out
