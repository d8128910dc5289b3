"""A JAXJob's spec: raw dict → frozen dataclasses (parsing only; semantic checks live in validation).

`parse_spec(raw, problems)` never raises on bad input: it records each problem (field path + message)
in `problems` and fills a harmless fallback, so that validation can report every problem at once.
Call `validation.validate_spec` to get a checked `JobSpec` or an `InvalidSpecError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from .errors import SpecProblem
from .pods.podtemplate import drop_nulls

DEFAULT_FINAL_SAVE_TIMEOUT_SECONDS: Final = 300
DEFAULT_MAX_RESTARTS: Final = 20
DEFAULT_BACKOFF_SECONDS: Final = 10
#: Unknown already means ~40 s without a heartbeat; a kubelet restart (node upgrade) or a short network
#: partition usually heals within two minutes, and a false alarm costs a whole restart of every worker.
DEFAULT_NODE_LOSS_GRACE_SECONDS: Final = 120
RESTORE_LATEST: Final = "latest"
RESTORE_STEP_PATTERN: Final = re.compile(r"^(latest|none|[0-9]+)$")
LOCAL_MEDIA: Final = ("", "Memory")
LOCAL_SCOPE_NODE: Final = "Node"
LOCAL_SCOPE_POD: Final = "Pod"
LOCAL_SCOPES: Final = (LOCAL_SCOPE_NODE, LOCAL_SCOPE_POD)
DEFAULT_LOCAL_KEEP_LAST: Final = 2
#: `spec.checkpoint.keep.mode`: "max" keeps the steps with the highest metric (accuracy), "min" the lowest (loss).
KEEP_BEST_MODES: Final = ("max", "min")
#: `spec.capacity.provisioning`: plan only over the Ready nodes with free devices (the default).
PROVISIONING_READY: Final = "Ready"
#: `spec.capacity.provisioning`: the cluster adds nodes for pending pods (cluster autoscaler, node
#: auto-provisioning, flex-start): create the generation at the declared shape even without the nodes.
PROVISIONING_AUTOSCALED: Final = "Autoscaled"
PROVISIONING_MODES: Final = (PROVISIONING_READY, PROVISIONING_AUTOSCALED)
#: `spec.recovery.inPlace` (the default): after a worker failure, a hard node loss or a shrink, keep the surviving
#: pods and restart only their trainer process (docs/architecture.md, "In-place restart of the survivors").
IN_PLACE_AUTO: Final = "Auto"
#: `spec.recovery.inPlace`: every restart replaces every pod.
IN_PLACE_NEVER: Final = "Never"
IN_PLACE_MODES: Final = (IN_PLACE_AUTO, IN_PLACE_NEVER)
DEFAULT_IN_PLACE_STOP_TIMEOUT_SECONDS: Final = 30
#: `spec.recovery.healthCheck.timeoutSeconds` default: the bound of `resilax health-check` on a new pod.
DEFAULT_HEALTH_CHECK_TIMEOUT_SECONDS: Final = 120
MAX_HEALTH_CHECK_TIMEOUT_SECONDS: Final = 3600
#: `spec.recovery.hangTimeoutSeconds: 0`: no hang detection.
HANG_DETECTION_OFF: Final = 0
#: An explicit hang timeout's bounds (the trainer writes its figures about once a second).
MIN_HANG_TIMEOUT_SECONDS: Final = 10
MAX_HANG_TIMEOUT_SECONDS: Final = 86400
DEFAULT_SHRINK_AFTER_SECONDS: Final = 600
#: `spec.recovery.failureRules[*].action`: a counted worker failure (backoff; Failed past maxRestarts).
RULE_RESTART: Final = "Restart"
#: A new generation after the backoff, never counted against maxRestarts nor as a pod-level loss.
RULE_RESTART_WITHOUT_COUNTING: Final = "RestartWithoutCounting"
#: The job is Failed at once (reason FailedByRule), its workers deleted.
RULE_FAIL_JOB: Final = "FailJob"
RULE_ACTIONS: Final = (RULE_RESTART, RULE_RESTART_WITHOUT_COUNTING, RULE_FAIL_JOB)


@dataclass(frozen=True)
class SlicesSpec:
    """`spec.slices`: what one slice is, and how many."""

    accelerator: str
    topology: str
    count: int
    machine_type: str | None = None
    chips_per_host: int | None = None


@dataclass(frozen=True)
class ElasticSpec:
    """`spec.elastic`: the shapes the job may run at when capacity is short."""

    min_count: int
    max_count: int
    #: In order of preference; always starts with `spec.slices.topology`.
    topologies: tuple[str, ...]
    grow_back: bool = True


@dataclass(frozen=True)
class LocalTierSpec:
    """`spec.checkpoint.local`: the fast per-host tier."""

    medium: str = ""
    size_limit: str | None = None
    #: `Node`: a hostPath folder per job on each node (kept across generations); `Pod`: an emptyDir.
    scope: str = LOCAL_SCOPE_NODE
    #: Committed steps each host keeps in its local tier (the sidecar's local retention).
    keep_last: int = DEFAULT_LOCAL_KEEP_LAST
    #: Upload only local steps divisible by this (and requested saves); None: every local step.
    persist_every_steps: int | None = None
    #: The sidecars keep replicas of their peers' newest local steps (`peerReplicas`).
    peer_replicas: bool = True


@dataclass(frozen=True)
class EverySpec:
    steps: int | None = None
    minutes: float | None = None


@dataclass(frozen=True)
class KeepSpec:
    """`spec.checkpoint.keep`: the persistent tier's retention (resilax_ckpt.saving.retention's rules)."""

    last: int | None = None
    every_steps: int | None = None
    #: Also keep one step per this many minutes of save time (Orbax's keep_time_interval).
    every_minutes: float | None = None
    #: Keep the `best` steps with the best `metric` (passed to save(..., metrics=)), `mode` max or min.
    best: int | None = None
    metric: str | None = None
    mode: str | None = None


@dataclass(frozen=True)
class FinalSaveSpec:
    on_preemption: bool = True
    on_resize: bool = True
    timeout_seconds: int = DEFAULT_FINAL_SAVE_TIMEOUT_SECONDS


@dataclass(frozen=True)
class CheckpointSpec:
    storage: str
    local: LocalTierSpec | None = None
    every: EverySpec = EverySpec()
    keep: KeepSpec = KeepSpec()
    final_save: FinalSaveSpec = FinalSaveSpec()
    #: `latest`, `none` or a step number (decimal string); used by the first generation only.
    restore_step: str = RESTORE_LATEST
    #: Take the storage over from another live JAXJob holding it (its workers can no longer commit there).
    take_over: bool = False


@dataclass(frozen=True)
class FailureRule:
    """One of `spec.recovery.failureRules`: what a failed worker pod it matches does (policies/failure_rules.py).
    It matches when every criterion it sets holds."""

    #: RULE_RESTART, RULE_RESTART_WITHOUT_COUNTING or RULE_FAIL_JOB.
    action: str
    #: The container terminated with one of these codes (empty: any code, or none).
    exit_codes: tuple[int, ...] = ()
    #: Which container's exit code `exit_codes` reads; None: the trainer container.
    container_name: str | None = None
    #: The pod's status.reason is one of these (Evicted, NodeShutdown, ...; empty: any).
    pod_reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class HealthCheckSpec:
    """`spec.recovery.healthCheck`: a new pod runs `resilax health-check` (an init container) before its
    trainer; a host that fails is kept out of this and later generations (policies/health_check.py)."""

    enabled: bool = False
    #: The check's bound: past it the host counts as failed (`resilax health-check --timeout`).
    timeout_seconds: int = DEFAULT_HEALTH_CHECK_TIMEOUT_SECONDS


@dataclass(frozen=True)
class RecoverySpec:
    max_restarts: int = DEFAULT_MAX_RESTARTS
    backoff_seconds: int = DEFAULT_BACKOFF_SECONDS
    node_loss_grace_seconds: int = DEFAULT_NODE_LOSS_GRACE_SECONDS
    #: Save and move this long before a scheduled host maintenance; None: sized from measurements.
    maintenance_lead_seconds: int | None = None
    #: IN_PLACE_AUTO or IN_PLACE_NEVER.
    in_place: str = IN_PLACE_AUTO
    #: How long a kept pod's old trainer may take to be proven gone before the pod is replaced.
    in_place_stop_timeout_seconds: int = DEFAULT_IN_PLACE_STOP_TIMEOUT_SECONDS
    #: `failureRules`, in order: the first that matches a failed worker decides.
    failure_rules: tuple[FailureRule, ...] = ()
    #: A generation with no progress this long is hung (TrainerHung); None: automatic from the trainer's
    #: step times (policies/hang.py); HANG_DETECTION_OFF: never.
    hang_timeout_seconds: int | None = None
    #: `healthCheck`: each new pod checks its host before its trainer starts (policies/health_check.py).
    health_check: HealthCheckSpec = HealthCheckSpec()
    #: `spareSlices`: slices of the job's shape held by placeholder pods, taken at once on a loss (policies/spares.py).
    spare_slices: int = 0

    @property
    def in_place_auto(self) -> bool:
        return self.in_place == IN_PLACE_AUTO


@dataclass(frozen=True)
class CapacitySpec:
    """`spec.capacity`: where a new generation's workers may go."""

    #: PROVISIONING_READY or PROVISIONING_AUTOSCALED.
    provisioning: str = PROVISIONING_READY
    #: Autoscaled: how long workers may wait for nodes before the job shrinks to a shape the Ready nodes
    #: fit (with `elastic`); None: the default (DEFAULT_SHRINK_AFTER_SECONDS).
    shrink_after_seconds: int | None = None

    @property
    def autoscaled(self) -> bool:
        return self.provisioning == PROVISIONING_AUTOSCALED

    @property
    def shrink_after(self) -> int:
        return DEFAULT_SHRINK_AFTER_SECONDS if self.shrink_after_seconds is None else self.shrink_after_seconds


@dataclass(frozen=True)
class Shape:
    """A generation's shape: `count` slices of `topology`."""

    topology: str
    count: int

    def __str__(self) -> str:
        return f"{self.count}x[{self.topology}]"


@dataclass(frozen=True)
class CompilationCacheSpec:
    """`spec.compilationCache`: JAX's persistent compilation cache for the workers."""

    enabled: bool = True
    #: Where ("" = the default: `<local tier>/_jax_cache` with `checkpoint.local.scope: Node`, else
    #: `<checkpoint storage>/_jax_cache` for a folder or pvc:// storage; none for gs:// storage).
    path: str = ""


@dataclass(frozen=True)
class JobSpec:
    slices: SlicesSpec
    checkpoint: CheckpointSpec
    recovery: RecoverySpec = RecoverySpec()
    elastic: ElasticSpec | None = None
    capacity: CapacitySpec = CapacitySpec()
    #: `spec.suspend`: no workers (a final save first); false again starts a generation that restores.
    suspend: bool = False
    #: The worker pod template (a PodTemplateSpec as a plain dict; treat as read-only).
    template: Mapping[str, Any] = field(default_factory=dict, hash=False)
    compilation_cache: CompilationCacheSpec = CompilationCacheSpec()
    #: `spec.ttlSecondsAfterFinished`: delete the JAXJob this long after it Succeeded or Failed; None: never.
    ttl_seconds_after_finished: int | None = None

    @property
    def spec_shape(self) -> Shape:
        return Shape(self.slices.topology, self.slices.count)

    @property
    def allowed_topologies(self) -> tuple[str, ...]:
        return self.elastic.topologies if self.elastic else (self.slices.topology,)

    @property
    def count_bounds(self) -> tuple[int, int]:
        if self.elastic:
            return self.elastic.min_count, self.elastic.max_count
        return self.slices.count, self.slices.count

    def allows(self, shape: Shape) -> bool:
        low, high = self.count_bounds
        return shape.topology in self.allowed_topologies and low <= shape.count <= high


T = TypeVar("T")


class _Reader:
    """Typed reads from a raw dict that record problems instead of raising."""

    def __init__(self, problems: list[SpecProblem]) -> None:
        self.problems = problems

    def bad(self, path: str, message: str) -> None:
        self.problems.append(SpecProblem(path, message))

    def obj(self, raw: Mapping[str, Any], key: str, path: str, *, required: bool = False) -> Mapping[str, Any] | None:
        value = raw.get(key)
        if value is None:
            if required:
                self.bad(f"{path}.{key}", "is required")
            return None
        if not isinstance(value, Mapping):
            self.bad(f"{path}.{key}", f"must be an object, found {type(value).__name__}")
            return None
        return value

    def string(self, raw: Mapping[str, Any], key: str, path: str, *, required: bool = False,
               default: str | None = None) -> str | None:
        value = raw.get(key)
        if value is None:
            if required:
                self.bad(f"{path}.{key}", "is required")
            return default
        if not isinstance(value, str):
            self.bad(f"{path}.{key}", f"must be a string, found {value!r}")
            return default
        if required and not value:
            self.bad(f"{path}.{key}", "must not be empty")
        return value

    def integer(self, raw: Mapping[str, Any], key: str, path: str, *, required: bool = False,
                default: int | None = None, minimum: int | None = None) -> int | None:
        value = raw.get(key)
        if value is None:
            if required:
                self.bad(f"{path}.{key}", "is required")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.bad(f"{path}.{key}", f"must be an integer, found {value!r}")
            return default
        if minimum is not None and value < minimum:
            self.bad(f"{path}.{key}", f"must be >= {minimum}, found {value}")
            return default
        return value

    def number(self, raw: Mapping[str, Any], key: str, path: str, *, exclusive_minimum: float) -> float | None:
        value = raw.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.bad(f"{path}.{key}", f"must be a number, found {value!r}")
            return None
        if value <= exclusive_minimum:
            self.bad(f"{path}.{key}", f"must be > {exclusive_minimum:g}, found {value}")
            return None
        return float(value)

    def boolean(self, raw: Mapping[str, Any], key: str, path: str, *, default: bool) -> bool:
        value = raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.bad(f"{path}.{key}", f"must be true or false, found {value!r}")
            return default
        return value

    def strings(self, raw: Mapping[str, Any], key: str, path: str) -> tuple[str, ...] | None:
        value = raw.get(key)
        if value is None:
            return None
        if not isinstance(value, Sequence) or isinstance(value, str | bytes) or not all(
                isinstance(v, str) for v in value):
            self.bad(f"{path}.{key}", f"must be a list of strings, found {value!r}")
            return None
        return tuple(value)


def parse_spec(raw: Mapping[str, Any], problems: list[SpecProblem]) -> JobSpec:
    """Parse `spec` (the dict under the JAXJob's `spec`). Type and presence problems go to `problems`."""
    r = _Reader(problems)
    p = "spec"
    if not isinstance(raw, Mapping):
        r.bad(p, f"must be an object, found {type(raw).__name__}")
        raw = {}

    s = r.obj(raw, "slices", p, required=True) or {}
    sp = f"{p}.slices"
    slices = SlicesSpec(
        accelerator=r.string(s, "accelerator", sp, required=True, default="") or "",
        topology=r.string(s, "topology", sp, required=True, default="") or "",
        count=r.integer(s, "count", sp, default=1, minimum=1) or 1,
        machine_type=r.string(s, "machineType", sp),
        chips_per_host=r.integer(s, "chipsPerHost", sp, minimum=1),
    )

    elastic: ElasticSpec | None = None
    e = r.obj(raw, "elastic", p)
    if e is not None:
        ep = f"{p}.elastic"
        low = r.integer(e, "minCount", ep, default=1, minimum=1) or 1
        high = r.integer(e, "maxCount", ep, default=slices.count, minimum=1) or slices.count
        tops = r.strings(e, "topologies", ep) or ()
        ordered = tuple(dict.fromkeys((slices.topology, *tops)))
        elastic = ElasticSpec(low, high, ordered, r.boolean(e, "growBack", ep, default=True))

    c = r.obj(raw, "checkpoint", p, required=True) or {}
    cp = f"{p}.checkpoint"
    local: LocalTierSpec | None = None
    lt = r.obj(c, "local", cp)
    if lt is not None:
        local = LocalTierSpec(medium=r.string(lt, "medium", f"{cp}.local", default="") or "",
                              size_limit=_quantity_str(r, lt, "sizeLimit", f"{cp}.local"),
                              scope=r.string(lt, "scope", f"{cp}.local", default=LOCAL_SCOPE_NODE)
                              or LOCAL_SCOPE_NODE,
                              keep_last=_int_or(r.integer(lt, "keepLast", f"{cp}.local", minimum=1),
                                                DEFAULT_LOCAL_KEEP_LAST),
                              persist_every_steps=r.integer(lt, "persistEverySteps", f"{cp}.local", minimum=1),
                              peer_replicas=r.boolean(lt, "peerReplicas", f"{cp}.local", default=True))
    ev = r.obj(c, "every", cp) or {}
    kp = r.obj(c, "keep", cp) or {}
    fs = r.obj(c, "finalSave", cp) or {}
    rs = r.obj(c, "restore", cp) or {}
    checkpoint = CheckpointSpec(
        storage=r.string(c, "storage", cp, required=True, default="") or "",
        local=local,
        every=EverySpec(steps=r.integer(ev, "steps", f"{cp}.every", minimum=1),
                        minutes=r.number(ev, "minutes", f"{cp}.every", exclusive_minimum=0)),
        keep=KeepSpec(last=r.integer(kp, "last", f"{cp}.keep", minimum=1),
                      every_steps=r.integer(kp, "everySteps", f"{cp}.keep", minimum=1),
                      every_minutes=r.number(kp, "everyMinutes", f"{cp}.keep", exclusive_minimum=0),
                      best=r.integer(kp, "best", f"{cp}.keep", minimum=1),
                      metric=r.string(kp, "metric", f"{cp}.keep"),
                      mode=r.string(kp, "mode", f"{cp}.keep")),
        final_save=FinalSaveSpec(
            on_preemption=r.boolean(fs, "onPreemption", f"{cp}.finalSave", default=True),
            on_resize=r.boolean(fs, "onResize", f"{cp}.finalSave", default=True),
            timeout_seconds=r.integer(fs, "timeoutSeconds", f"{cp}.finalSave",
                                      default=DEFAULT_FINAL_SAVE_TIMEOUT_SECONDS, minimum=1)
            or DEFAULT_FINAL_SAVE_TIMEOUT_SECONDS),
        restore_step=_restore_step(r, rs, f"{cp}.restore"),
        take_over=r.boolean(c, "takeOver", cp, default=False),
    )

    rc = r.obj(raw, "recovery", p) or {}
    rp = f"{p}.recovery"
    hc = r.obj(rc, "healthCheck", rp) or {}
    recovery = RecoverySpec(spare_slices=r.integer(rc, "spareSlices", rp, minimum=0) or 0,
        max_restarts=_int_or(r.integer(rc, "maxRestarts", rp, minimum=0), DEFAULT_MAX_RESTARTS),
        backoff_seconds=_int_or(r.integer(rc, "backoffSeconds", rp, minimum=0), DEFAULT_BACKOFF_SECONDS),
        node_loss_grace_seconds=_int_or(r.integer(rc, "nodeLossGraceSeconds", rp, minimum=0),
                                        DEFAULT_NODE_LOSS_GRACE_SECONDS),
        maintenance_lead_seconds=r.integer(rc, "maintenanceLeadSeconds", rp, minimum=0),
        in_place=r.string(rc, "inPlace", rp, default=IN_PLACE_AUTO) or IN_PLACE_AUTO,
        in_place_stop_timeout_seconds=_int_or(r.integer(rc, "inPlaceStopTimeoutSeconds", rp, minimum=1),
                                              DEFAULT_IN_PLACE_STOP_TIMEOUT_SECONDS),
        failure_rules=_failure_rules(r, rc, rp),
        hang_timeout_seconds=r.integer(rc, "hangTimeoutSeconds", rp, minimum=0),
        health_check=HealthCheckSpec(r.boolean(hc, "enabled", f"{rp}.healthCheck", default=False), _int_or(
            r.integer(hc, "timeoutSeconds", f"{rp}.healthCheck", minimum=1), DEFAULT_HEALTH_CHECK_TIMEOUT_SECONDS)),
    )
    cap = r.obj(raw, "capacity", p) or {}
    capacity = CapacitySpec(
        provisioning=r.string(cap, "provisioning", f"{p}.capacity", default=PROVISIONING_READY) or PROVISIONING_READY,
        shrink_after_seconds=r.integer(cap, "shrinkAfterSeconds", f"{p}.capacity", minimum=0))
    # Nulls anywhere in the template are absent (as the API server treats them): no reader trips on one.
    template = drop_nulls(r.obj(raw, "template", p, required=True) or {})
    cc, ccp = r.obj(raw, "compilationCache", p) or {}, f"{p}.compilationCache"
    compilation_cache = CompilationCacheSpec(enabled=r.boolean(cc, "enabled", ccp, default=True),
                                             path=r.string(cc, "path", ccp, default="") or "")
    return JobSpec(slices=slices, checkpoint=checkpoint, recovery=recovery, elastic=elastic, capacity=capacity,
                   suspend=r.boolean(raw, "suspend", p, default=False), template=template,
                   compilation_cache=compilation_cache,
                   ttl_seconds_after_finished=r.integer(raw, "ttlSecondsAfterFinished", p, minimum=0))


def _int_or(value: int | None, default: int) -> int:
    return default if value is None else value


def _restore_step(r: _Reader, raw: Mapping[str, Any], path: str) -> str:
    value = raw.get("step")
    if value is None:
        return RESTORE_LATEST
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if isinstance(value, str) and RESTORE_STEP_PATTERN.match(value):
        return value
    r.bad(f"{path}.step", f"must be 'latest', 'none' or a step number, found {value!r}")
    return RESTORE_LATEST


def _failure_rules(r: _Reader, raw: Mapping[str, Any], path: str) -> tuple[FailureRule, ...]:
    value = raw.get("failureRules")
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        r.bad(f"{path}.failureRules", f"must be a list of rules, found {value!r}")
        return ()
    out = []
    for i, item in enumerate(value):
        ip = f"{path}.failureRules[{i}]"
        if not isinstance(item, Mapping):
            r.bad(ip, f"must be an object, found {item!r}")
            continue
        codes = item.get("exitCodes") or []
        if not isinstance(codes, Sequence) or isinstance(codes, str | bytes) or not all(
                isinstance(c, int) and not isinstance(c, bool) for c in codes):
            r.bad(f"{ip}.exitCodes", f"must be a list of integers, found {codes!r}")
            codes = []
        out.append(FailureRule(action=r.string(item, "action", ip, required=True, default="") or "",
                               exit_codes=tuple(codes), container_name=r.string(item, "containerName", ip),
                               pod_reasons=r.strings(item, "podReasons", ip) or ()))
    return tuple(out)


QUANTITY_PATTERN: Final = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


def _quantity_str(r: _Reader, raw: Mapping[str, Any], key: str, path: str) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str) or not QUANTITY_PATTERN.match(text):
        r.bad(f"{path}.{key}", f"{value!r} is not a storage quantity; use e.g. 512Mi, 64Gi, 1T")
        return None
    return text
