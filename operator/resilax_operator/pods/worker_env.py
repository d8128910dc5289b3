"""Pure: the worker environment of docs/architecture.md, split into what a pod keeps for life and what
each generation sets (`build_generation_env`). One place computes both the new pod's environment and the
overlay an in-place restart hands a kept pod's supervisor (`build_generation_overlay`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Final

from .. import api
from ..generation import GenerationPlan, JobRef, build_workers_service_name, kueue_queue
from ..settings import OperatorSettings
from ..spec import LOCAL_SCOPE_NODE, JobSpec
from ..topology import SliceGeometry

#: `RESILAX_INIT_TIMEOUT_SECONDS` of workers that may wait for the others' nodes or admission (capacity
#: Autoscaled, Kueue): the operator, not JAX's 5-minute default, decides how long a generation waits.
WAITING_INIT_TIMEOUT_SECONDS: Final = 86400
STORAGE_MOUNT: Final = "/var/run/resilax/storage"
#: Pod 0's own IP through the downward API (a new pod 0 does not know it before it exists).
OWN_IP: Final = "$(RESILAX_POD_IP)"


def build_generation_env(job: JobRef, spec: JobSpec, plan: GenerationPlan, geometry: SliceGeometry,
                         slice_index: int, host: int, settings: OperatorSettings, *,
                         coordinator_ip: str | None) -> dict[str, str]:
    """The variables that change with the generation, by name. `coordinator_ip` None: this is a new pod
    0, which names itself (`$(RESILAX_POD_IP)`); an overlay for a kept pod always gets a literal IP."""
    process_id = slice_index * geometry.hosts + host
    coordinator = OWN_IP if coordinator_ip is None else coordinator_ip
    env = {
        "JAX_COORDINATOR_ADDRESS": f"{_host(coordinator)}:{settings.coordinator_port}",
        "JAX_NUM_PROCESSES": str(plan.shape.count * geometry.hosts),
        "JAX_PROCESS_ID": str(process_id),
        "RESILAX_NUM_SLICES": str(plan.shape.count),
        "RESILAX_SLICE_ID": str(slice_index),
        "RESILAX_HOSTS_PER_SLICE": str(geometry.hosts),
        "RESILAX_GENERATION": str(plan.generation),
        "RESILAX_RESTORE_STEP": plan.restore_step,
        "RESILAX_LIVE_JOB_UIDS": ",".join(plan.live_job_uids),
    }
    if geometry.is_tpu:
        service = build_workers_service_name(job.name)
        env["TPU_WORKER_ID"] = str(host)
        env["TPU_WORKER_HOSTNAMES"] = slice_hostnames(job, plan, slice_index, geometry.hosts, service)
        if plan.shape.count > 1:
            env["MEGASCALE_COORDINATOR_ADDRESS"] = f"{_host(coordinator)}:{settings.megascale_port}"
            env["MEGASCALE_PORT"] = str(settings.megascale_port)
            env["MEGASCALE_NUM_SLICES"] = str(plan.shape.count)
            env["MEGASCALE_SLICE_ID"] = str(slice_index)
    return env


#: The last slice's TPU_WORKER_HOSTNAMES: (plan, job, slice, hosts, value). The builders make a slice's
#: pods one after another, so one entry serves them all (a race between threads only recomputes).
_last_hostnames: tuple[GenerationPlan, str, int, int, str] | None = None


def slice_hostnames(job: JobRef, plan: GenerationPlan, slice_index: int, hosts: int, service: str) -> str:
    """`TPU_WORKER_HOSTNAMES` of a slice: `<pod>.<service>` of each of its hosts. Built once per slice and
    the same string shared by its pods: built per pod, a slice's names cost O(hosts²) time and memory
    (the largest slice has 2304 hosts: 5 million names, issue 25, item 6)."""
    global _last_hostnames
    last = _last_hostnames
    if last is not None and last[0] is plan and last[1:4] == (job.name, slice_index, hosts):
        return last[4]
    value = ",".join(f"{plan.pod_name(job.name, slice_index * hosts + h, hosts)}.{service}" for h in range(hosts))
    _last_hostnames = (plan, job.name, slice_index, hosts, value)
    return value


def build_generation_overlay(job: JobRef, spec: JobSpec, plan: GenerationPlan, geometry: SliceGeometry,
                             process_id: int, settings: OperatorSettings, *, coordinator_ip: str) -> dict[str, str]:
    """The environment a kept pod's supervisor overlays on the pod's own for the trainer of `plan`'s
    generation (`POST /v1/trainer/start`): literal values only."""
    return build_generation_env(job, spec, plan, geometry, process_id // geometry.hosts, process_id % geometry.hosts,
                                settings, coordinator_ip=coordinator_ip)


def build_env(job: JobRef, spec: JobSpec, plan: GenerationPlan, geometry: SliceGeometry, slice_index: int,
              host: int, settings: OperatorSettings, *, coordinator_ip: str | None) -> list[dict[str, Any]]:
    """The worker environment of docs/architecture.md, in dependency order ($(VAR) refers upwards)."""
    g = build_generation_env(job, spec, plan, geometry, slice_index, host, settings, coordinator_ip=coordinator_ip)
    c = spec.checkpoint
    every_seconds = "" if c.every.minutes is None else str(max(1, round(c.every.minutes * 60)))
    env: list[dict[str, Any]] = [
        {"name": "RESILAX_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "RESILAX_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "RESILAX_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        _var("JAX_COORDINATOR_ADDRESS", g["JAX_COORDINATOR_ADDRESS"]),
        # Bind to the pod's own IP, not all interfaces: on the local cluster every pod is a process on
        # one host with its own loopback address, so two coordinators (or sidecars) must not share a port.
        _var("JAX_COORDINATOR_BIND_ADDRESS", f"{OWN_IP}:{settings.coordinator_port}"),
        _var("JAX_NUM_PROCESSES", g["JAX_NUM_PROCESSES"]),
        _var("JAX_PROCESS_ID", g["JAX_PROCESS_ID"]),
        _var("RESILAX_NUM_SLICES", g["RESILAX_NUM_SLICES"]),
        _var("RESILAX_SLICE_ID", g["RESILAX_SLICE_ID"]),
        _var("RESILAX_HOSTS_PER_SLICE", g["RESILAX_HOSTS_PER_SLICE"]),
        _var("RESILAX_DEVICES_PER_HOST", geometry.chips_per_host),
        _var("RESILAX_JOB_NAME", job.name),
        _var("RESILAX_NAMESPACE", job.namespace),
        _var("RESILAX_GENERATION", g["RESILAX_GENERATION"]),
        _var("RESILAX_JOB_UID", job.uid),
        _var("RESILAX_CHECKPOINT_DIR", storage_dir(c.storage)),
        _var("RESILAX_LOCAL_DIR", api.LOCAL_DIR if c.local is not None else ""),
        _var("RESILAX_CONTROL_DIR", api.CONTROL_DIR),
        _var("RESILAX_SAVE_EVERY_STEPS", "" if c.every.steps is None else c.every.steps),
        _var("RESILAX_SAVE_EVERY_SECONDS", every_seconds),
        _var("RESILAX_KEEP_LAST", "" if c.keep.last is None else c.keep.last),
        _var("RESILAX_KEEP_EVERY_STEPS", "" if c.keep.every_steps is None else c.keep.every_steps),
        _var("RESILAX_KEEP_EVERY_SECONDS", "" if c.keep.every_minutes is None else f"{c.keep.every_minutes * 60:g}"),
        _var("RESILAX_KEEP_BEST", "" if c.keep.best is None else c.keep.best),
        _var("RESILAX_KEEP_BEST_METRIC", c.keep.metric or ""),
        _var("RESILAX_KEEP_BEST_MODE", c.keep.mode or ""),
        _var("RESILAX_LOCAL_KEEP_LAST", "" if c.local is None else c.local.keep_last),
        _var("RESILAX_PERSIST_EVERY_STEPS",
             "" if c.local is None or c.local.persist_every_steps is None else c.local.persist_every_steps),
        _var("RESILAX_PEER_REPLICAS", "" if c.local is None else "true" if c.local.peer_replicas else "false"),
        _var("RESILAX_RESTORE_STEP", g["RESILAX_RESTORE_STEP"]),
        _var("RESILAX_LIVE_JOB_UIDS", g["RESILAX_LIVE_JOB_UIDS"]),
        _var("RESILAX_TAKE_OVER", "true" if c.take_over else ""),
        _var("RESILAX_SIDECAR_PORT", settings.sidecar_port),
        _var("RESILAX_SIDECAR_HOST", OWN_IP),
        _var("RESILAX_SIDECAR_TOKEN_FILE", f"{api.TOKEN_DIR}/{api.TOKEN_KEY}"),
        _var("RESILAX_SIDECAR_GRACE_SECONDS", c.final_save.timeout_seconds),
        _var("RESILAX_SIDECAR_LOG_FORMAT", settings.sidecar_log_format),
        # the sidecar's last words (the trainer's last step, the final save) outlive it in the pod's status
        _var("RESILAX_SIDECAR_TERMINATION_LOG", TERMINATION_MESSAGE_PATH),
    ]
    if spec.capacity.autoscaled or kueue_queue(job, spec):
        env.append(_var("RESILAX_INIT_TIMEOUT_SECONDS", WAITING_INIT_TIMEOUT_SECONDS))
    env += [_var(name, g[name]) for name in ("TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS",
                                             "MEGASCALE_PORT", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID") if name in g]
    return env


#: The kubelet's default terminationMessagePath (the API server sets it on every container that names none).
TERMINATION_MESSAGE_PATH: Final = "/dev/termination-log"
#: The compilation cache's folder name under the local tier or the checkpoint storage: ours by name,
#: never a step (readers and the sidecar's retention skip it, as any name that is not a step).
COMPILATION_CACHE_FOLDER: Final = "_jax_cache"


def compilation_cache_env(spec: JobSpec) -> dict[str, str]:
    """JAX's persistent compilation cache for the workers (`spec.compilationCache`): its folder and
    `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0` (JAX's default of 1 s would skip small programs).
    Default folder: `<local tier>/_jax_cache` with a scope Node local tier (outlives the pods, fast),
    else `<checkpoint storage>/_jax_cache` for a folder or pvc:// storage; gs:// storage only through an
    explicit `path` (JAX needs `etils[epath]` and gcsfs for it in the worker image). {} for none."""
    cc = spec.compilation_cache
    if not cc.enabled:
        return {}
    local = spec.checkpoint.local
    folder = cc.path
    if not folder and local is not None and local.scope == LOCAL_SCOPE_NODE:
        folder = f"{api.LOCAL_DIR}/{COMPILATION_CACHE_FOLDER}"
    if not folder and not spec.checkpoint.storage.startswith("gs://"):
        folder = f"{storage_dir(spec.checkpoint.storage).rstrip('/')}/{COMPILATION_CACHE_FOLDER}"
    if not folder:
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": folder, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def storage_dir(storage: str) -> str:
    """`RESILAX_CHECKPOINT_DIR` for a `spec.checkpoint.storage`: pvc:// becomes the mounted path."""
    if storage.startswith("pvc://"):
        _, _, sub = storage[len("pvc://"):].partition("/")
        return f"{STORAGE_MOUNT}/{sub}".rstrip("/")
    return storage


def merge_env(ours: list[dict[str, Any]], theirs: Sequence[Mapping[str, Any]],
              geometry: SliceGeometry, defaults: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Ours first (so theirs may refer to $(RESILAX_...)) and ours win; `defaults` (the compilation
    cache's) and, on CPU, the XLA_FLAGS and JAX_CPU_COLLECTIVES_IMPLEMENTATION defaults only when the
    user sets none."""
    names = {e["name"] for e in ours}
    user_names = {e.get("name") for e in theirs}
    extra: list[dict[str, Any]] = [_var(k, v) for k, v in (defaults or {}).items() if k not in user_names]
    if geometry.family == "cpu":
        if "XLA_FLAGS" not in user_names:
            extra.append(_var("XLA_FLAGS", f"--xla_force_host_platform_device_count={geometry.chips_per_host}"))
        if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in user_names:
            extra.append(_var("JAX_CPU_COLLECTIVES_IMPLEMENTATION", "gloo"))
    kept = [dict(e) for e in theirs if e.get("name") not in names]
    return copy.deepcopy([*ours, *extra, *kept])


def _host(ip: str) -> str:
    """An IP for `host:port`: IPv6 literals in brackets."""
    return f"[{ip}]" if ":" in ip else ip


def _var(name: str, value: object) -> dict[str, Any]:
    return {"name": name, "value": str(value)}
