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
from dataclasses import dataclass
from typing import Any, Final

from . import api
from .settings import OperatorSettings, sidecar_resources_from_json
from .spec import LOCAL_SCOPE_NODE, JobSpec, Shape
from .topology import SliceGeometry, plan_geometry

Manifest = dict[str, Any]

#: `RESILAX_INIT_TIMEOUT_SECONDS` of workers that may wait for the others' nodes or admission (capacity
#: Autoscaled, Kueue): the operator, not JAX's 5-minute default, decides how long a generation waits.
WAITING_INIT_TIMEOUT_SECONDS: Final = 86400
STORAGE_MOUNT: Final = "/var/run/resilax/storage"
STORAGE_VOLUME: Final = "resilax-storage"
SIDECAR_RESOURCES: Final = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
LOCAL_INIT_RESOURCES: Final = {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}


@dataclass(frozen=True)
class JobRef:
    """The JAXJob object that owns what the builders make."""

    name: str
    namespace: str
    uid: str
    #: The JAXJob's `kueue.x-k8s.io/queue-name` label ("" without one).
    queue: str = ""


@dataclass(frozen=True)
class GenerationPlan:
    """One generation: its number, shape, the node pool each slice runs on, and the step to restore."""

    generation: int
    shape: Shape
    #: pools[i] is the node pool (value of cloud.google.com/gke-nodepool) of slice i; len == shape.count.
    #: "" (capacity.provisioning Autoscaled): no Ready pool hosts slice i yet; its pods go to whichever
    #: node pool the cluster provides, all on one pool and none on another slice's (`_slice_placement`).
    pools: tuple[str, ...]
    restore_step: str = "latest"
    #: Worker process index → the node it last ran on (status.workerNodes): a preferred node affinity.
    worker_nodes: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        if len(self.pools) != self.shape.count:
            raise ValueError(f"generation {self.generation}: {len(self.pools)} pools for {self.shape.count} slices")


def geometry_of(spec: JobSpec, topology: str) -> SliceGeometry:
    return plan_geometry(spec.slices.accelerator, topology, chips_per_host=spec.slices.chips_per_host,
                         machine_type=spec.slices.machine_type)


def build_service_name(job: str, generation: int) -> str:
    return f"{job}-g{generation}"


def build_pod_name(job: str, generation: int, slice_index: int, host: int) -> str:
    return f"{job}-g{generation}-s{slice_index}-h{host}"


def build_token_secret_name(job: str) -> str:
    return f"{job}-resilax-token"


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


def build_service(job: JobRef, plan: GenerationPlan, settings: OperatorSettings) -> Manifest:
    """The generation's headless Service (pod DNS names on clusters that have DNS)."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": build_service_name(job.name, plan.generation), "namespace": job.namespace,
                     "labels": build_labels(job.name, plan.generation),
                     "ownerReferences": [build_owner_reference(job)]},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {api.LABEL_JOB: job.name, api.LABEL_GENERATION: str(plan.generation)},
                 "ports": [{"name": "coordinator", "port": settings.coordinator_port},
                           {"name": "sidecar", "port": settings.sidecar_port}]},
    }


def kueue_queue(job: JobRef, spec: JobSpec) -> str:
    """The Kueue LocalQueue of the job's workers: the JAXJob's `kueue.x-k8s.io/queue-name` label, else the
    template's; "" for none."""
    labels = (spec.template.get("metadata") or {}).get("labels") or {}
    return job.queue or str(labels.get(api.KUEUE_QUEUE_LABEL) or "")


def creates_all_at_once(job: JobRef, spec: JobSpec) -> bool:
    """Whether a generation's pods are all created together, the coordinator named by DNS
    (`<pod 0>.<service>`), instead of pod 0 first and the others with its IP. For a Kueue queue: Kueue
    creates the pod group's Workload only once it sees all of its pods, and gates each until then."""
    return bool(kueue_queue(job, spec))


def build_coordinator_host(job: JobRef, generation: int) -> str:
    """Pod 0's DNS name through the generation's headless Service (clusters with DNS, e.g. GKE)."""
    return f"{build_pod_name(job.name, generation, 0, 0)}.{build_service_name(job.name, generation)}"


def build_pods(job: JobRef, spec: JobSpec, plan: GenerationPlan, settings: OperatorSettings, *,
               coordinator_ip: str | None) -> list[Manifest]:
    """Pod 0 alone while `coordinator_ip` is None (it is the coordinator); all pods once it is known.
    When `creates_all_at_once`: every pod at once, pod 0 with its own IP and the others with its DNS name."""
    geometry = geometry_of(spec, plan.shape.topology)
    if coordinator_ip is None and creates_all_at_once(job, spec):
        host = build_coordinator_host(job, plan.generation)
        return [build_pod(job, spec, plan, s, h, settings, coordinator_ip=None if s == h == 0 else host)
                for s in range(plan.shape.count) for h in range(geometry.hosts)]
    if coordinator_ip is None:
        return [build_pod(job, spec, plan, 0, 0, settings, coordinator_ip=None)]
    return [build_pod(job, spec, plan, s, h, settings, coordinator_ip=coordinator_ip)
            for s in range(plan.shape.count) for h in range(geometry.hosts)]


def build_pod(job: JobRef, spec: JobSpec, plan: GenerationPlan, slice_index: int, host: int,
              settings: OperatorSettings, *, coordinator_ip: str | None) -> Manifest:
    """The worker pod of `host` in `slice_index`. Process 0 may pass coordinator_ip=None (its own IP)."""
    geometry = geometry_of(spec, plan.shape.topology)
    process_id = slice_index * geometry.hosts + host
    if coordinator_ip is None and process_id != 0:
        raise ValueError("only process 0 can be built before the coordinator's IP is known")
    name = build_pod_name(job.name, plan.generation, slice_index, host)
    service = build_service_name(job.name, plan.generation)
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
        labels = {**labels, api.KUEUE_QUEUE_LABEL: queue, api.KUEUE_POD_GROUP_LABEL: service}
        annotations[api.KUEUE_POD_GROUP_COUNT_ANNOTATION] = str(plan.shape.count * geometry.hosts)

    env = build_env(job, spec, plan, geometry, slice_index, host, settings, coordinator_ip=coordinator_ip)
    mounts = _resilax_mounts(spec)
    containers = [dict(c) for c in pod.get("containers") or []]
    trainer_i = next((i for i, c in enumerate(containers) if c.get("name") == api.TRAINER_CONTAINER), 0)
    owner = worker_owner(pod, containers[trainer_i] if containers else {}, settings)
    for i, c in enumerate(containers):
        c["securityContext"] = _restricted(c.get("securityContext"))
        if i == trainer_i:
            c["env"] = _merge_env(env, c.get("env") or [], geometry)
            c["volumeMounts"] = [*(c.get("volumeMounts") or []), *mounts]
            c["resources"] = _with_accelerator(c.get("resources") or {}, geometry)
    pod["containers"] = containers
    node_scope = node_scoped(spec)
    sidecar = build_sidecar(spec, settings, env)
    inits: list[Manifest] = [sidecar]
    if node_scope:
        # The sidecar trims and uploads the worker's files in a 0700 folder: same user as the worker.
        sidecar["securityContext"] = {**sidecar["securityContext"], "runAsUser": owner[0], "runAsGroup": owner[1]}
        inits = [build_local_init(settings, owner), sidecar]
    pod["initContainers"] = [*inits, *(pod.get("initContainers") or [])]
    pod["volumes"] = [*(pod.get("volumes") or []), *_resilax_volumes(job, spec, settings)]
    pod["restartPolicy"] = "Never"
    pod["hostname"] = name
    pod["subdomain"] = service
    pool = plan.pools[slice_index]
    pod["nodeSelector"] = {**(pod.get("nodeSelector") or {}), **dict(geometry.node_selector),
                           **({api.NODE_POOL_LABEL: pool} if pool else {})}
    pod["tolerations"] = [*(pod.get("tolerations") or []),
                          *({"key": k, "operator": "Exists", "effect": "NoSchedule"} for k in geometry.toleration_keys)]
    pod["affinity"] = _one_worker_per_node(pod.get("affinity"), job.name, plan.generation)
    if not pool:
        pod["affinity"] = _slice_placement(pod["affinity"], job.name, plan, slice_index)
    previous = dict(plan.worker_nodes).get(process_id)
    if previous is not None:
        pod["affinity"] = _prefer_node(pod["affinity"], previous)
    grace = spec.checkpoint.final_save.timeout_seconds + settings.termination_margin_seconds
    pod["terminationGracePeriodSeconds"] = max(int(pod.get("terminationGracePeriodSeconds") or 0), grace)
    pod["securityContext"] = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"},
                              **(pod.get("securityContext") or {})}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": job.namespace, "labels": labels,
                         "annotations": annotations, "ownerReferences": [build_owner_reference(job)]},
            "spec": pod}


def build_env(job: JobRef, spec: JobSpec, plan: GenerationPlan, geometry: SliceGeometry, slice_index: int,
              host: int, settings: OperatorSettings, *, coordinator_ip: str | None) -> list[dict[str, Any]]:
    """The worker environment of docs/architecture.md, in dependency order ($(VAR) refers upwards)."""
    process_id = slice_index * geometry.hosts + host
    coordinator = "$(RESILAX_POD_IP)" if coordinator_ip is None else coordinator_ip
    c = spec.checkpoint
    every_seconds = "" if c.every.minutes is None else str(max(1, round(c.every.minutes * 60)))
    env: list[dict[str, Any]] = [
        {"name": "RESILAX_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "RESILAX_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "RESILAX_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        _var("JAX_COORDINATOR_ADDRESS", f"{_host(coordinator)}:{settings.coordinator_port}"),
        # Bind to the pod's own IP, not all interfaces: on the local cluster every pod is a process on
        # one host with its own loopback address, so two coordinators (or sidecars) must not share a port.
        _var("JAX_COORDINATOR_BIND_ADDRESS", f"$(RESILAX_POD_IP):{settings.coordinator_port}"),
        _var("JAX_NUM_PROCESSES", plan.shape.count * geometry.hosts),
        _var("JAX_PROCESS_ID", process_id),
        _var("RESILAX_NUM_SLICES", plan.shape.count),
        _var("RESILAX_SLICE_ID", slice_index),
        _var("RESILAX_HOSTS_PER_SLICE", geometry.hosts),
        _var("RESILAX_DEVICES_PER_HOST", geometry.chips_per_host),
        _var("RESILAX_JOB_NAME", job.name),
        _var("RESILAX_NAMESPACE", job.namespace),
        _var("RESILAX_GENERATION", plan.generation),
        _var("RESILAX_JOB_UID", job.uid),
        _var("RESILAX_CHECKPOINT_DIR", storage_dir(c.storage)),
        _var("RESILAX_LOCAL_DIR", api.LOCAL_DIR if c.local is not None else ""),
        _var("RESILAX_CONTROL_DIR", api.CONTROL_DIR),
        _var("RESILAX_SAVE_EVERY_STEPS", "" if c.every.steps is None else c.every.steps),
        _var("RESILAX_SAVE_EVERY_SECONDS", every_seconds),
        _var("RESILAX_KEEP_LAST", "" if c.keep.last is None else c.keep.last),
        _var("RESILAX_KEEP_EVERY_STEPS", "" if c.keep.every_steps is None else c.keep.every_steps),
        _var("RESILAX_LOCAL_KEEP_LAST", "" if c.local is None else c.local.keep_last),
        _var("RESILAX_PERSIST_EVERY_STEPS",
             "" if c.local is None or c.local.persist_every_steps is None else c.local.persist_every_steps),
        _var("RESILAX_RESTORE_STEP", plan.restore_step),
        _var("RESILAX_SIDECAR_PORT", settings.sidecar_port),
        _var("RESILAX_SIDECAR_HOST", "$(RESILAX_POD_IP)"),
        _var("RESILAX_SIDECAR_TOKEN_FILE", f"{api.TOKEN_DIR}/{api.TOKEN_KEY}"),
        _var("RESILAX_SIDECAR_GRACE_SECONDS", c.final_save.timeout_seconds),
    ]
    if spec.capacity.autoscaled or kueue_queue(job, spec):
        env.append(_var("RESILAX_INIT_TIMEOUT_SECONDS", WAITING_INIT_TIMEOUT_SECONDS))
    if geometry.is_tpu:
        service = build_service_name(job.name, plan.generation)
        hostnames = ",".join(f"{build_pod_name(job.name, plan.generation, slice_index, h)}.{service}"
                             for h in range(geometry.hosts))
        env += [_var("TPU_WORKER_ID", host), _var("TPU_WORKER_HOSTNAMES", hostnames)]
        if plan.shape.count > 1:
            env += [_var("MEGASCALE_COORDINATOR_ADDRESS", f"{_host(coordinator)}:{settings.megascale_port}"),
                    _var("MEGASCALE_PORT", settings.megascale_port),
                    _var("MEGASCALE_NUM_SLICES", plan.shape.count),
                    _var("MEGASCALE_SLICE_ID", slice_index)]
    return env


def storage_dir(storage: str) -> str:
    """`RESILAX_CHECKPOINT_DIR` for a `spec.checkpoint.storage`: pvc:// becomes the mounted path."""
    if storage.startswith("pvc://"):
        _, _, sub = storage[len("pvc://"):].partition("/")
        return f"{STORAGE_MOUNT}/{sub}".rstrip("/")
    return storage


def build_sidecar(spec: JobSpec, settings: OperatorSettings, env: Sequence[Mapping[str, Any]]) -> Manifest:
    """The checkpoint sidecar: a native sidecar (init container with restartPolicy Always)."""
    return {
        "name": api.SIDECAR_CONTAINER,
        "image": settings.sidecar_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["resilax", "sidecar"],
        "restartPolicy": "Always",
        "env": copy.deepcopy([dict(e) for e in env]),
        "ports": [{"name": "sidecar", "containerPort": settings.sidecar_port}],
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": settings.sidecar_port},
                           "periodSeconds": 5, "failureThreshold": 3},
        "volumeMounts": _resilax_mounts(spec),
        "resources": (sidecar_resources_from_json(settings.sidecar_resources) if settings.sidecar_resources
                      else copy.deepcopy(SIDECAR_RESOURCES)),
        "securityContext": _restricted(None),
    }


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


def _host(ip: str) -> str:
    """An IP for `host:port`: IPv6 literals in brackets."""
    return f"[{ip}]" if ":" in ip else ip


def _var(name: str, value: object) -> dict[str, Any]:
    return {"name": name, "value": str(value)}


def _merge_env(ours: list[dict[str, Any]], theirs: Sequence[Mapping[str, Any]],
               geometry: SliceGeometry) -> list[dict[str, Any]]:
    """Ours first (so theirs may refer to $(RESILAX_...)) and ours win; on CPU the XLA_FLAGS and
    JAX_CPU_COLLECTIVES_IMPLEMENTATION defaults only when the user sets none."""
    names = {e["name"] for e in ours}
    user_names = {e.get("name") for e in theirs}
    extra: list[dict[str, Any]] = []
    if geometry.family == "cpu":
        if "XLA_FLAGS" not in user_names:
            extra.append(_var("XLA_FLAGS", f"--xla_force_host_platform_device_count={geometry.chips_per_host}"))
        if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in user_names:
            extra.append(_var("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo"))
    kept = [dict(e) for e in theirs if e.get("name") not in names]
    return copy.deepcopy([*ours, *extra, *kept])


def _restricted(context: Mapping[str, Any] | None) -> dict[str, Any]:
    """Restricted Pod Security defaults for a container, keeping what the user set."""
    out: dict[str, Any] = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                           "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    out.update(context or {})
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
        expression = {"key": api.NODE_POOL_LABEL, "operator": "NotIn", "values": placed}
        required = out.setdefault("nodeAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
        terms = required.setdefault("nodeSelectorTerms", [])
        if not terms:
            terms.append({})
        for term in terms:  # terms are ORed: each gets the exclusion
            term.setdefault("matchExpressions", []).append(dict(expression))
    return out


def _one_worker_per_node(affinity: Mapping[str, Any] | None, job: str, generation: int) -> dict[str, Any]:
    """Add a required anti-affinity: at most one worker of this generation per node."""
    out = copy.deepcopy(dict(affinity or {}))
    anti = out.setdefault("podAntiAffinity", {})
    terms = anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
    terms.append({"labelSelector": {"matchLabels": {api.LABEL_JOB: job, api.LABEL_GENERATION: str(generation)}},
                  "topologyKey": api.HOSTNAME_LABEL})
    return out
