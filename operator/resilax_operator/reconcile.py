"""The operator's decisions (pure): spec + observed world → actions. State-driven, not change-driven.

The I/O side (k8s.py, handlers.py) calls `decide_raw` from a kopf timer (and from event handlers for
speed) with an `Observed` snapshot, then executes the returned actions **in order**, stopping at the
first one that fails (the next call decides again from what is then observed):

1. Build `Observed` (see its fields) from the JAXJob, its pods (label `resilax.dev/job=<name>`), the
   generations' Services, the nodes, the final-save outcomes the sidecars report, and `now`.
2. `actions = decide_raw(job.spec, observed, settings)`.
3. Execute each action (see each class for its exact meaning); all are idempotent.

What the I/O side observes (`build_observed` turns the raw API bodies into `Observed`; the parsers
it uses are `parse_pod`, `parse_node`, `count_devices_in_use`, `status.parse_status`; the sidecars'
answers go through `parse_save_outcome` and `parse_sidecar_state`):
- `job`: name, namespace, uid; `status`: `parse_status(body["status"])`; `spec_generation`:
  metadata.generation.
- `pods`: every pod labelled `resilax.dev/job=<name>` in the namespace (any generation), `parse_pod`.
- `services`: generations (label `resilax.dev/generation`) of Services labelled with the job.
- `nodes`: every Node, `parse_node(node, count_devices_in_use(all pods, job)[node name])`.
- `save_outcomes`: while `status.transition.saveRequestId` is set and not `saveDone`, the sidecars'
  answers for it (see `RequestFinalSave`).
- `checkpoint`: `parse_sidecar_state` of pod 0's sidecar `GET /v1/state` (optional).
- `now`: the current time (timezone-aware UTC).

How it executes the actions (in order; stop at the first failure):
- `SetStatus`: merge-patch the status subresource with `status_body(action)` (it contains every field,
  None for absent ones).
- `CreateGeneration`: create the Service (if given) and each pod; AlreadyExists is success. Before the
  first generation, make sure the token Secret `builders.build_token_secret(job, <random token>)` exists.
- `DeleteGeneration`: delete the generation's Service and pods (label selector job + generation);
  pods named in `force_pods` with gracePeriodSeconds=0; NotFound is success.
- `RequestFinalSave`: see the class. `EmitEvent`: an Event on the JAXJob.
- `RequeueAfter`: run the next decision within that many seconds (a timer at least that often).
On deletion of the JAXJob, execute `decide_cleanup(observed, settings)`.

Rules the decisions keep, whatever the observed state:
- Never two generations at once: `CreateGeneration(N+1)` only when no pod of this job exists at all.
- A status that names a new generation (or a transition) is written before acting on it, and the
  status records the workers as all created (`workersCreated`) only after creating them, so an
  operator that dies between two actions resumes from the status and the cluster.
- At most one `SetStatus` per decision (the full status, not a diff).
- Deciding twice on the same observed state gives the same actions.
- Time is injected (`Observed.now`), never read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, Final

from . import api
from . import status as st
from .builders import (
    GenerationPlan,
    JobRef,
    Manifest,
    build_pod_name,
    build_pods,
    build_service,
    geometry_of,
    node_scoped,
)
from .errors import InvalidSpecError
from .settings import OperatorSettings
from .spec import RESTORE_LATEST, JobSpec, Shape
from .status import CheckpointInfo, JobStatus, Transition
from .topology import SliceGeometry
from .validation import validate_spec

#: How soon to look again while waiting for something that has no event of its own (seconds).
POLL_SECONDS: Final = 5.0
#: How soon to look again while waiting for capacity.
CAPACITY_POLL_SECONDS: Final = 15.0
#: Pod status reasons that mean the node or the cluster ended the pod, not the worker: not counted
#: against recovery.maxRestarts.
POD_FAILURE_REASONS: Final = frozenset({"Evicted", "NodeShutdown", "Terminated", "NodeAffinity", "Preempting",
                                        "UnexpectedAdmissionError", "OutOfpods", "OutOfcpu", "OutOfmemory"})


# ---------------------------------------------------------------- observed world


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"


@dataclass(frozen=True)
class ObservedNode:
    """A node, as the planner and the failure detection need it."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    taints: tuple[Taint, ...] = ()
    #: Status of the node's Ready condition: "True", "False" or "Unknown".
    ready: str = "True"
    #: lastTransitionTime of the Ready condition.
    ready_since: datetime | None = None
    unschedulable: bool = False
    #: Allocatable extended resources (google.com/tpu, nvidia.com/gpu) as integers.
    allocatable: Mapping[str, int] = field(default_factory=dict, hash=False)
    #: Requests of those resources by pods that are NOT this job's (not terminated).
    in_use_by_others: Mapping[str, int] = field(default_factory=dict, hash=False)

    @property
    def pool(self) -> str | None:
        return self.labels.get(api.NODE_POOL_LABEL)

    def notice(self) -> str | None:
        """The preemption/maintenance notice on this node, if any."""
        for t in self.taints:
            if t.key == api.IMPENDING_TERMINATION_TAINT:
                return f"taint {t.key}"
        if api.SCHEDULED_MAINTENANCE_LABEL in self.labels:
            return f"label {api.SCHEDULED_MAINTENANCE_LABEL}={self.labels[api.SCHEDULED_MAINTENANCE_LABEL]}"
        return None

    def down_since(self, now: datetime) -> datetime | None:
        """When the node stopped being Ready (or got the unreachable taint); None while it is Ready."""
        if self.ready != "True":
            return self.ready_since or now
        if any(t.key == api.UNREACHABLE_TAINT for t in self.taints):
            return self.ready_since or now
        return None

    def schedulable(self, now: datetime) -> bool:
        return (self.down_since(now) is None and self.notice() is None and not self.unschedulable
                and not any(t.key == api.NOT_READY_TAINT for t in self.taints))


@dataclass(frozen=True)
class ObservedPod:
    """A worker pod of this job (any generation), from its labels and status."""

    name: str
    generation: int
    slice_index: int
    host: int
    #: Pending, Running, Succeeded, Failed or Unknown.
    phase: str = "Pending"
    node_name: str | None = None
    pod_ip: str | None = None
    deletion_timestamp: datetime | None = None
    #: metadata.deletionGracePeriodSeconds once deletion started.
    deletion_grace_seconds: int | None = None
    #: The trainer container's exit code once terminated (None while running or never started).
    exit_code: int | None = None
    #: The trainer container's termination reason (Error, OOMKilled, ...).
    exit_reason: str | None = None
    #: The pod's status.reason (Evicted, NodeShutdown, ...): set when the pod, not the worker, failed.
    pod_reason: str | None = None
    ready: bool = False

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


@dataclass(frozen=True)
class SaveOutcome:
    """A final save result a sidecar reported ($RESILAX_CONTROL_DIR/results/<id>.json)."""

    request_id: str
    step: int | None = None
    committed: bool = False
    error: str | None = None


@dataclass(frozen=True)
class Observed:
    """One snapshot of everything a decision needs. Built by the I/O side; never mutated."""

    now: datetime
    job: JobRef
    status: JobStatus
    #: metadata.generation of the JAXJob (recorded as status.observedGeneration).
    spec_generation: int = 0
    pods: tuple[ObservedPod, ...] = ()
    #: Generations whose headless Service exists.
    services: tuple[int, ...] = ()
    nodes: tuple[ObservedNode, ...] = ()
    save_outcomes: tuple[SaveOutcome, ...] = ()
    #: The newest checkpoint the sidecars report (None if unknown).
    checkpoint: CheckpointInfo | None = None
    #: What the current generation's restore did, from pod 0's sidecar (None if unknown).
    restore: RestoreReport | None = None

    def node(self, name: str | None) -> ObservedNode | None:
        return next((n for n in self.nodes if n.name == name), None) if name else None


# ---------------------------------------------------------------- observing (raw API bodies → Observed)

#: Extended resources the planner counts per node.
DEVICE_RESOURCES: Final = (api.TPU_RESOURCE, api.GPU_RESOURCE)


def parse_pod(raw: Mapping[str, Any]) -> ObservedPod | None:
    """A worker pod as the API returns it → ObservedPod (None if it lacks the worker labels)."""
    meta = raw.get("metadata") or {}
    labels = meta.get("labels") or {}
    try:
        generation = int(labels[api.LABEL_GENERATION])
        slice_index = int(labels[api.LABEL_SLICE])
        host = int(labels[api.LABEL_HOST])
    except (KeyError, ValueError):
        return None
    spec = raw.get("spec") or {}
    status = raw.get("status") or {}
    containers = [c.get("name") for c in spec.get("containers") or []]
    trainer = api.TRAINER_CONTAINER if api.TRAINER_CONTAINER in containers else (containers[0] if containers else None)
    exit_code = exit_reason = None
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") == trainer:
            terminated = (cs.get("state") or {}).get("terminated")
            if terminated:
                exit_code = terminated.get("exitCode")
                exit_reason = terminated.get("reason")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    grace = meta.get("deletionGracePeriodSeconds")
    return ObservedPod(
        name=str(meta.get("name", "")), generation=generation, slice_index=slice_index, host=host,
        phase=str(status.get("phase") or "Pending"), node_name=spec.get("nodeName") or None,
        pod_ip=status.get("podIP") or None, deletion_timestamp=st.parse_time(meta.get("deletionTimestamp")),
        deletion_grace_seconds=None if grace is None else int(grace),
        exit_code=None if exit_code is None else int(exit_code), exit_reason=exit_reason,
        pod_reason=status.get("reason") or None, ready=ready)


def parse_node(raw: Mapping[str, Any], in_use_by_others: Mapping[str, int] | None = None) -> ObservedNode:
    """A Node as the API returns it → ObservedNode. `in_use_by_others`: see `count_devices_in_use`."""
    meta = raw.get("metadata") or {}
    spec = raw.get("spec") or {}
    status = raw.get("status") or {}
    ready: Mapping[str, Any] = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
    allocatable = {}
    for r in DEVICE_RESOURCES:
        value = (status.get("allocatable") or {}).get(r)
        if value is not None:
            allocatable[r] = int(str(value))
    return ObservedNode(
        name=str(meta.get("name", "")), labels=dict(meta.get("labels") or {}),
        taints=tuple(Taint(str(t.get("key", "")), str(t.get("value", "") or ""), str(t.get("effect", "")))
                     for t in spec.get("taints") or []),
        ready=str(ready.get("status", "Unknown")), ready_since=st.parse_time(ready.get("lastTransitionTime")),
        unschedulable=bool(spec.get("unschedulable", False)), allocatable=allocatable,
        in_use_by_others=dict(in_use_by_others or {}))


def count_devices_in_use(raw_pods: Iterable[Mapping[str, Any]], job: str) -> dict[str, dict[str, int]]:
    """node name → device resource → amount requested by live pods that are not this job's workers."""
    out: dict[str, dict[str, int]] = {}
    for pod in raw_pods:
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        node = spec.get("nodeName")
        if not node or (meta.get("labels") or {}).get(api.LABEL_JOB) == job:
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
            resources = c.get("resources") or {}
            asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
            for r in DEVICE_RESOURCES:
                if r in asked:
                    out.setdefault(node, {})[r] = out.get(node, {}).get(r, 0) + int(str(asked[r]))
    return out


def parse_save_outcome(request_id: str, body: Mapping[str, Any]) -> SaveOutcome | None:
    """The sidecar's `GET /v1/save/{id}` answer → SaveOutcome for the operator's `request_id`
    (None while it is pending)."""
    state = body.get("status")
    if state == "pending":
        return None
    step = body.get("step")
    return SaveOutcome(request_id, None if step is None else int(step), bool(body.get("committed")),
                       body.get("error") or (None if state == "committed" else f"save {state}"))


def build_observed(job: Mapping[str, Any], *, now: datetime, pods: Iterable[Mapping[str, Any]],
                   services: Iterable[Mapping[str, Any]], nodes: Iterable[Mapping[str, Any]],
                   other_pods: Iterable[Mapping[str, Any]] = (), save_outcomes: Iterable[SaveOutcome] = (),
                   checkpoint: CheckpointInfo | None = None, restore: RestoreReport | None = None) -> Observed:
    """Observed from raw API bodies: the JAXJob, its pods and Services (label resilax.dev/job=<name>),
    all Nodes, and the pods of everything else that may hold accelerators (`other_pods`, any namespace;
    this job's pods among them are ignored)."""
    meta = job.get("metadata") or {}
    name = str(meta.get("name", ""))
    ref = JobRef(name, str(meta.get("namespace", "")), str(meta.get("uid", "")))
    job_pods = [p for p in (parse_pod(raw) for raw in pods) if p is not None]
    generations = set()
    for svc in services:
        label = ((svc.get("metadata") or {}).get("labels") or {}).get(api.LABEL_GENERATION)
        if label is not None and str(label).isdigit():
            generations.add(int(label))
    in_use = count_devices_in_use(other_pods, name)
    observed_nodes = tuple(parse_node(n, in_use.get(str((n.get("metadata") or {}).get("name", "")), {}))
                           for n in nodes)
    return Observed(now=now, job=ref, status=st.parse_status(job.get("status")),
                    spec_generation=int(meta.get("generation") or 0),
                    pods=tuple(sorted(job_pods, key=lambda p: p.name)), services=tuple(sorted(generations)),
                    nodes=tuple(sorted(observed_nodes, key=lambda n: n.name)),
                    save_outcomes=tuple(save_outcomes), checkpoint=checkpoint, restore=restore)


@dataclass(frozen=True)
class RestoreReport:
    """The trainer's restore of the newest step (`restore` in the sidecar's `/v1/state`)."""

    step: int | None
    #: (step, why) of each newer committed step it could not read and skipped.
    skipped: tuple[tuple[int, str], ...] = ()


def parse_restore_report(body: Mapping[str, Any]) -> RestoreReport | None:
    """`restore` of the sidecar's `GET /v1/state` → RestoreReport (None if absent or malformed)."""
    raw = body.get("restore")
    if not isinstance(raw, Mapping):
        return None
    try:
        step = None if raw.get("step") is None else int(raw["step"])
        skipped = tuple((int(s["step"]), str(s.get("reason", ""))) for s in raw.get("skipped") or [])
    except (KeyError, TypeError, ValueError):
        return None
    return RestoreReport(step, skipped)


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


def parse_sidecar_state(body: Mapping[str, Any], now: datetime) -> CheckpointInfo | None:
    """The sidecar's `GET /v1/state` answer → the newest checkpoint it knows (persisted beats local).
    `time` is when the operator first saw the step (the status keeps the first time it saw it)."""
    persisted, local = body.get("newest_persisted_step"), body.get("newest_local_step")
    if persisted is not None:
        return CheckpointInfo(int(persisted), st.truncate(now), True, "persistent")
    if local is not None:
        return CheckpointInfo(int(local), st.truncate(now), True, "local")
    return None


# ---------------------------------------------------------------- actions


@dataclass(frozen=True)
class SetStatus:
    """Replace the status subresource with `status_body(action)` (a JSON merge patch: None removes)."""

    status: JobStatus


@dataclass(frozen=True)
class CreateGeneration:
    """Create `service` (if given) and each pod, skipping those that already exist (409 is success)."""

    generation: int
    service: Manifest | None
    pods: tuple[Manifest, ...]


@dataclass(frozen=True)
class DeleteGeneration:
    """Delete the generation's Service and every pod labelled job=<job>, generation=<generation>
    (gracefully: the workers get SIGTERM and save); pods in `force_pods` with gracePeriodSeconds=0
    (no kubelet will confirm them). 404 is success."""

    generation: int
    reason: str
    force_pods: tuple[str, ...] = ()


@dataclass(frozen=True)
class RequestFinalSave:
    """Ask the workers of `generation` for a final save and stop. Emitted on every decision until the
    save is done, so executing it must be idempotent. With the sidecar's API (resilax_sidecar.routes):
    for each pod in `pods` that lacks the annotation `resilax.dev/save-request` starting with
    `<request_id>=`, POST `http://<podIP>:<RESILAX_SIDECAR_PORT>/v1/save` with the bearer token and
    {"reason": reason, "stop": true}, then annotate the pod `<request_id>=<the sidecar's id>`. Any one
    pod suffices (all processes agree on one step); posting to all survives a dead one. Report results
    as `Observed.save_outcomes`: GET /v1/save/<sidecar id> on annotated pods, `parse_save_outcome`
    (the first committed one, else the first failed one)."""

    generation: int
    request_id: str
    reason: str
    deadline: datetime
    pods: tuple[str, ...]


@dataclass(frozen=True)
class EmitEvent:
    """A Kubernetes Event on the JAXJob. Emitted once per transition (decisions emit it together with
    the status change that records the transition)."""

    type: str
    reason: str
    message: str


@dataclass(frozen=True)
class RequeueAfter:
    """Decide again after this many seconds at the latest (a hint for the timer)."""

    seconds: float


Action = SetStatus | CreateGeneration | DeleteGeneration | RequestFinalSave | EmitEvent | RequeueAfter


def status_body(action: SetStatus) -> dict[str, Any]:
    return st.build_status(action.status)


# ---------------------------------------------------------------- capacity and shape


@dataclass(frozen=True)
class ShapePlan:
    shape: Shape
    pools: tuple[str, ...]
    hosts: int


def plan_pools(geometry: SliceGeometry, nodes: Iterable[ObservedNode], now: datetime) -> tuple[str, ...]:
    """Node pools that can host one slice of `geometry` now: enough schedulable nodes carrying the
    slice's labels, each with free devices for one worker. Sorted by name."""
    by_pool: dict[str, int] = {}
    for n in nodes:
        if n.pool is None or not n.schedulable(now):
            continue
        if any(n.labels.get(k) != v for k, v in geometry.node_selector):
            continue
        if geometry.resource is None:
            if api.TPU_ACCELERATOR_LABEL in n.labels or api.GPU_ACCELERATOR_LABEL in n.labels:
                continue  # keep accelerator nodes for accelerator jobs
        else:
            free = n.allocatable.get(geometry.resource, 0) - n.in_use_by_others.get(geometry.resource, 0)
            if free < geometry.chips_per_host:
                continue
        by_pool[n.pool] = by_pool.get(n.pool, 0) + 1
    return tuple(sorted(p for p, count in by_pool.items() if count >= geometry.hosts))


def plan_shape(spec: JobSpec, nodes: Iterable[ObservedNode], now: datetime) -> ShapePlan | None:
    """The largest shape (total chips) within the spec's bounds that schedulable node pools can host,
    one slice per pool; ties go to the preferred topology. Without `elastic`: the spec shape or None."""
    nodes = tuple(nodes)
    low, high = spec.count_bounds
    best: tuple[tuple[int, int], ShapePlan] | None = None
    for preference, topology in enumerate(spec.allowed_topologies):
        geometry = geometry_of(spec, topology)
        pools = plan_pools(geometry, nodes, now)
        count = min(high, len(pools))
        if count < low:
            continue
        key = (geometry.chips * count, -preference)
        if best is None or key > best[0]:
            best = (key, ShapePlan(Shape(topology, count), pools[:count], geometry.hosts * count))
    return None if best is None else best[1]


def explain_shortfall(spec: JobSpec, nodes: Iterable[ObservedNode], now: datetime) -> str:
    """Why `plan_shape` found nothing, for the InsufficientCapacity message: what each allowed
    topology needs and what the schedulable nodes carrying its labels offer. When such nodes exist
    but all have fewer free devices than one host of the slice needs, and the spec left the host
    size to its default, it says which field picks smaller hosts."""
    nodes = tuple(nodes)
    low, high = spec.count_bounds
    parts = []
    for topology in spec.allowed_topologies:
        g = geometry_of(spec, topology)
        matching = [n for n in nodes if n.pool is not None and n.schedulable(now)
                    and all(n.labels.get(k) == v for k, v in g.node_selector)]
        need = f"{topology}: {low}..{high} node pools of {g.hosts} host(s)"
        if g.resource is None:
            parts.append(f"{need}; {len(matching)} schedulable nodes")
            continue
        need += f" with {g.chips_per_host} free {g.resource} each"
        most = max((n.allocatable.get(g.resource, 0) - n.in_use_by_others.get(g.resource, 0)
                    for n in matching), default=0)
        offer = f"{len(matching)} schedulable nodes with these labels, at most {most} free per node"
        hint = ""
        if (matching and most < g.chips_per_host and spec.slices.machine_type is None
                and spec.slices.chips_per_host is None):
            hint = (f" (the default is {g.chips_per_host} per host; set slices.machineType or "
                    f"slices.chipsPerHost for smaller hosts)")
        parts.append(f"{need}; {offer}{hint}")
    return f"{spec.slices.accelerator}: " + "; ".join(parts)


def shape_chips(spec: JobSpec, shape: Shape) -> int:
    return geometry_of(spec, shape.topology).chips * shape.count


def fingerprint(spec: JobSpec) -> str:
    """`<hardware>/<shape bounds>`: what the current generation was planned from."""
    s, e = spec.slices, spec.elastic
    hardware = json.dumps([s.accelerator, s.machine_type, s.chips_per_host])
    bounds = json.dumps([s.topology, s.count, None if e is None else [e.min_count, e.max_count, e.topologies]])
    return f"{_digest(hardware)}/{_digest(bounds)}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# ---------------------------------------------------------------- decisions


def decide_raw(raw_spec: Mapping[str, Any], observed: Observed, settings: OperatorSettings) -> list[Action]:
    """Validate the spec, then `decide`. An invalid spec sets InvalidSpec (and fails a job that has not
    started); a running generation is left alone."""
    try:
        spec = validate_spec(raw_spec, name=observed.job.name)
    except InvalidSpecError as e:
        return decide_invalid(e, observed)
    return decide(spec, observed, settings)


def decide_invalid(error: InvalidSpecError, observed: Observed) -> list[Action]:
    s, now = observed.status, observed.now
    message = "; ".join(str(p) for p in error.problems)
    new = st.set_condition(s, api.COND_INVALID_SPEC, True, api.SPEC_INVALID.name, message, now)
    new = replace(new, observed_generation=observed.spec_generation)
    if s.generation == 0 and s.phase not in api.TERMINAL_PHASES:
        new = replace(new, phase=api.PHASE_FAILED)
        new = st.set_condition(new, api.COND_READY, False, api.SPEC_INVALID.name, message, now)
    return _status_change(s, new, EmitEvent("Warning", api.SPEC_INVALID.name, message))


def decide(spec: JobSpec, observed: Observed, settings: OperatorSettings) -> list[Action]:
    """The actions that move the cluster toward what `spec` wants, given `observed`."""
    s = observed.status
    now = observed.now
    invalid = s.condition(api.COND_INVALID_SPEC)
    if s.phase == api.PHASE_FAILED and s.generation == 0 and invalid is not None and invalid.status == "True":
        s = replace(s, phase=api.PHASE_PENDING)  # failed only for its spec, which is now fixed: start
    s = replace(s, observed_generation=observed.spec_generation,
                checkpoint=st.newer_checkpoint(s.checkpoint, observed.checkpoint))
    s = st.set_condition(s, api.COND_INVALID_SPEC, False, api.SPEC_VALID.name, api.SPEC_VALID.message, now)
    if s.phase in api.TERMINAL_PHASES:
        out = _status_change(observed.status, s)
        if s.phase == api.PHASE_FAILED:  # a failed job keeps no workers
            for g in sorted({p.generation for p in observed.pods}):
                delete = _delete(observed, spec, g, "job failed", settings)
                if _needs_delete(observed, g, delete):
                    out.append(delete)
        return out

    actions: list[Action] = []
    fallback, events = decide_restore_fallback(s, observed.restore, now)
    if events:
        s = fallback
        actions += [SetStatus(s), *events]
    # Stray pods: any generation other than the current one must go before anything else happens.
    stray = sorted({p.generation for p in observed.pods if p.generation != s.generation}
                   | {g for g in observed.services if g != s.generation and not _pods_of(observed, g)})
    for g in stray:
        actions.append(_delete(observed, spec, g, "superseded generation", settings))

    if s.transition is not None:
        return _collapse(_continue_transition(spec, observed, s, settings, actions))
    if s.generation == 0:
        return _collapse(_start_generation(spec, observed, s, settings, actions))
    return _collapse(_watch_generation(spec, observed, s, settings, actions))


def _collapse(actions: list[Action]) -> list[Action]:
    """One SetStatus per decision: the last (most complete) status, at the place of the first, so the
    status is written before the objects it describes."""
    statuses = [a for a in actions if isinstance(a, SetStatus)]
    if len(statuses) <= 1:
        return actions
    first = actions.index(statuses[0])
    rest: list[Action] = [a for a in actions if not isinstance(a, SetStatus)]
    rest.insert(first, statuses[-1])
    return rest


def _status_change(old: JobStatus, new: JobStatus, *events: EmitEvent) -> list[Action]:
    """SetStatus (and the events that go with it) only when the status changes."""
    if st.build_status(old) == st.build_status(new):
        return []
    return [SetStatus(new), *events]


def _pods_of(observed: Observed, generation: int) -> list[ObservedPod]:
    return [p for p in observed.pods if p.generation == generation]


def _force_pods(observed: Observed, pods: Iterable[ObservedPod], spec: JobSpec,
                settings: OperatorSettings) -> tuple[str, ...]:
    """Pods no kubelet will confirm: on a node that is down or gone, or Terminating far past their grace."""
    out = []
    for p in pods:
        node = observed.node(p.node_name)
        if p.node_name and (node is None or node.down_since(observed.now) is not None):
            out.append(p.name)
        elif p.deletion_timestamp is not None:
            grace = p.deletion_grace_seconds or 0
            if observed.now >= p.deletion_timestamp + timedelta(seconds=grace + settings.stuck_terminating_seconds):
                out.append(p.name)
    return tuple(sorted(out))


def _delete(observed: Observed, spec: JobSpec, generation: int, reason: str,
            settings: OperatorSettings) -> DeleteGeneration:
    return DeleteGeneration(generation, reason, _force_pods(observed, _pods_of(observed, generation), spec, settings))


def _needs_delete(observed: Observed, generation: int, action: DeleteGeneration) -> bool:
    pods = _pods_of(observed, generation)
    return (any(p.deletion_timestamp is None for p in pods) or bool(action.force_pods)
            or generation in observed.services)


# ---- starting a generation


def _start_generation(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings,
                      actions: list[Action]) -> list[Action]:
    now = observed.now
    first = s.generation == 0
    if observed.pods:  # never two generations at once
        return [*actions, RequeueAfter(POLL_SECONDS)]
    t = s.transition
    if t is not None and t.not_before is not None and now < t.not_before:
        new = replace(s, phase=st.phase_for(t, first=first))
        new = st.set_condition(new, api.COND_READY, False, api.BACKOFF.name, t.message, now)
        return [*actions, *_status_change(observed.status, new),
                RequeueAfter(max(1.0, (t.not_before - now).total_seconds()))]
    planned = plan_shape(spec, observed.nodes, now)
    if planned is None:
        detail = explain_shortfall(spec, observed.nodes, now)
        new = replace(s, phase=st.phase_for(t, first=first))
        new = st.set_condition(new, api.COND_READY, False, api.INSUFFICIENT_CAPACITY.name,
                               api.INSUFFICIENT_CAPACITY.format(detail=detail), now)
        changed = (s.condition(api.COND_READY) or st.Condition("", "", "", "")).reason != api.INSUFFICIENT_CAPACITY.name
        events = [EmitEvent("Warning", api.INSUFFICIENT_CAPACITY.name, api.INSUFFICIENT_CAPACITY.format(detail=detail))]
        return [*actions, *_status_change(observed.status, new, *(events if changed else [])),
                RequeueAfter(CAPACITY_POLL_SECONDS)]

    generation = s.generation + 1
    restore = spec.checkpoint.restore_step if generation == 1 else RESTORE_LATEST
    plan = GenerationPlan(generation, planned.shape, planned.pools, restore, s.worker_nodes)
    if t is None:
        phase = api.PHASE_PENDING if first else api.PHASE_RECOVERING
    else:
        phase = api.PHASE_RESIZING if t.kind in st.RESIZE_KINDS else api.PHASE_RECOVERING
    new = replace(s, phase=phase, generation=generation, shape=planned.shape, hosts=planned.hosts, pools=planned.pools,
                  restore_step=restore, generation_start_time=st.truncate(now), workers_created=planned.hosts == 1,
                  restarts=s.restarts + (0 if first else 1), planned_from=fingerprint(spec), transition=None)
    message = api.GENERATION_CREATED.format(generation=generation, count=planned.shape.count,
                                            topology=planned.shape.topology, hosts=planned.hosts, restore=restore)
    new = st.set_condition(new, api.COND_READY, False, api.WORKERS_STARTING.name, message, now)
    new = _degraded(spec, new, now)
    new = st.set_condition(new, api.COND_SAVING, False, api.NOT_SAVING.name, api.NOT_SAVING.message, now)
    pods = build_pods(observed.job, spec, plan, settings, coordinator_ip=None)
    return [*actions, SetStatus(new), EmitEvent("Normal", api.GENERATION_CREATED.name, message),
            CreateGeneration(generation, build_service(observed.job, plan, settings), tuple(pods))]


def _degraded(spec: JobSpec, s: JobStatus, now: datetime) -> JobStatus:
    if s.shape is None:
        return s
    wanted = spec.spec_shape
    if shape_chips(spec, s.shape) < shape_chips(spec, wanted):
        return st.set_condition(s, api.COND_DEGRADED, True, api.SHRUNK.name,
                                api.SHRUNK.format(current=s.shape, wanted=wanted), now)
    return st.set_condition(s, api.COND_DEGRADED, False, api.AT_FULL_SHAPE.name,
                            api.AT_FULL_SHAPE.format(current=s.shape), now)


# ---- watching the running generation


def _watch_generation(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings,
                      actions: list[Action]) -> list[Action]:
    now, g = observed.now, s.generation
    pods = _pods_of(observed, g)
    grace = timedelta(seconds=spec.recovery.node_loss_grace_seconds)
    s = st.record_worker_nodes(s, plan_worker_nodes(s, pods))

    # 1. Hard node loss: a node hosting a worker has been down for longer than the grace.
    waiting_for: str | None = None
    for p in sorted(pods, key=lambda p: p.name):
        node = observed.node(p.node_name)
        if p.node_name and node is None:
            return _begin(spec, observed, s, settings, actions, st.NODE_LOSS, api.NODE_LOST.name,
                          f"node {p.node_name} hosting generation {g} is gone")
        if node is None:
            continue
        since = node.down_since(now)
        if since is not None:
            if now - since >= grace:
                return _begin(spec, observed, s, settings, actions, st.NODE_LOSS, api.NODE_LOST.name,
                              api.NODE_LOST.format(node=node.name, generation=g, seconds=int((now - since).total_seconds()),
                                                   grace=spec.recovery.node_loss_grace_seconds))
            waiting_for = waiting_for or node.name
    # 2. Preemption notice on a node hosting a worker.
    for p in sorted(pods, key=lambda p: p.name):
        node = observed.node(p.node_name)
        notice = node.notice() if node is not None else None
        if node is not None and notice is not None:
            return _begin(spec, observed, s, settings, actions, st.PREEMPTION, api.PREEMPTION_NOTICE.name,
                          api.PREEMPTION_NOTICE.format(node=node.name, generation=g, notice=notice))
    if waiting_for is not None:
        # A node is down but within its grace: the workers' failures are its doing, not theirs.
        new = st.set_condition(s, api.COND_DEGRADED, True, api.NODE_NOT_READY.name,
                               api.NODE_NOT_READY.format(node=waiting_for, generation=g,
                                                         grace=spec.recovery.node_loss_grace_seconds), now)
        return [*actions, *_status_change(observed.status, new), RequeueAfter(POLL_SECONDS)]
    # The accelerator or the shape bounds changed so that the current shape is no longer allowed:
    # nothing below may interpret the running generation with the new spec's geometry.
    if s.shape is not None and s.planned_from != fingerprint(spec) and (
            _hardware_changed(spec, s) or not spec.allows(s.shape)):
        target = plan_shape(spec, observed.nodes, now)
        return _begin(spec, observed, s, settings, actions, st.RESIZE, api.SPEC_RESIZED.name,
                      api.SPEC_RESIZED.format(old=s.shape, new=target.shape if target else spec.spec_shape))
    # 3. Workers that ended: stopped for rescheduling, failed, or all succeeded.
    for p in sorted(pods, key=lambda p: p.name):
        if p.exit_code == api.EXIT_CODE_STOPPED:
            return _begin(spec, observed, s, settings, actions, st.WORKER_STOPPED, api.WORKER_STOPPED.name,
                          api.WORKER_STOPPED.format(pod=p.name, generation=g, code=p.exit_code))
    for p in sorted(pods, key=lambda p: p.name):
        if p.phase == "Failed" and p.pod_reason in POD_FAILURE_REASONS and p.exit_code is None:
            return _begin(spec, observed, s, settings, actions, st.POD_LOST, api.POD_LOST.name,
                          api.POD_LOST.format(pod=p.name, generation=g) + f" ({p.pod_reason})")
    for p in sorted(pods, key=lambda p: p.name):
        if p.phase == "Failed":
            detail = f"exit code {p.exit_code}" if p.exit_code is not None else "no exit code"
            if p.exit_reason:
                detail += f" ({p.exit_reason})"
            return _begin(spec, observed, s, settings, actions, st.WORKER_FAILURE, api.WORKER_FAILED.name,
                          api.WORKER_FAILED.format(pod=p.name, generation=g, detail=detail))
    if s.workers_created and len(pods) == s.hosts and all(p.phase == "Succeeded" for p in pods):
        message = api.COMPLETED.format(generation=g)
        new = replace(s, phase=api.PHASE_SUCCEEDED)
        new = st.set_condition(new, api.COND_READY, False, api.COMPLETED.name, message, now)
        return [*actions, *_status_change(observed.status, new, EmitEvent("Normal", api.COMPLETED.name, message))]
    # 4. Pods that disappeared or are being deleted by someone else.
    deleted = sorted(p.name for p in pods if p.deletion_timestamp is not None)
    names = _expected_names(observed.job, s)
    missing = sorted(set(names) - {p.name for p in pods})
    if deleted or (s.workers_created and missing) or (not s.workers_created and names[0] in missing and pods):
        lost = (deleted or missing)[0]
        return _begin(spec, observed, s, settings, actions, st.POD_LOST, api.POD_LOST.name,
                      api.POD_LOST.format(pod=lost, generation=g))
    # 5. Workers that no node takes (the capacity the planner saw is not there after all).
    started = s.generation_start_time or now
    if now - started >= timedelta(seconds=settings.schedule_timeout_seconds):
        stuck = sorted(p.name for p in pods if p.node_name is None and p.phase == "Pending")
        if stuck:
            return _begin(spec, observed, s, settings, actions, st.POD_LOST, api.UNSCHEDULABLE.name,
                          api.UNSCHEDULABLE.format(pod=stuck[0], generation=g, seconds=settings.schedule_timeout_seconds))
    # 6. The spec's shape changed, or capacity for a larger shape returned.
    resize = _resize_reason(spec, observed, s, settings, pods)
    if resize is not None:
        kind, reason, message = resize
        return _begin(spec, observed, s, settings, actions, kind, reason, message)
    # 7. Bring the generation up: pod 0 first, the others once its IP is known.
    plan = GenerationPlan(g, s.shape or spec.spec_shape, s.pools, s.restore_step or RESTORE_LATEST, s.worker_nodes)
    if not s.workers_created:
        pod0 = next((p for p in pods if p.name == names[0]), None)
        if pod0 is None:
            return [*actions, CreateGeneration(g, build_service(observed.job, plan, settings),
                                               tuple(build_pods(observed.job, spec, plan, settings, coordinator_ip=None))),
                    RequeueAfter(POLL_SECONDS)]
        if pod0.pod_ip is None:
            return [*actions, RequeueAfter(POLL_SECONDS)]
        rest = [m for m in build_pods(observed.job, spec, plan, settings, coordinator_ip=pod0.pod_ip)
                if m["metadata"]["name"] not in {p.name for p in pods}]
        return [*actions, CreateGeneration(g, None, tuple(rest)), SetStatus(replace(s, workers_created=True)),
                RequeueAfter(POLL_SECONDS)]
    # 8. Steady state: phase and conditions.
    running = sum(1 for p in pods if p.phase in ("Running", "Succeeded"))
    new = replace(_degraded(spec, s, now), planned_from=fingerprint(spec))
    if running == s.hosts:
        message = api.WORKERS_RUNNING.format(generation=g, hosts=s.hosts)
        new = replace(new, phase=api.PHASE_RUNNING)
        new = st.set_condition(new, api.COND_READY, True, api.WORKERS_RUNNING.name, message, now)
        became_ready = observed.status.phase != api.PHASE_RUNNING
        events = [EmitEvent("Normal", api.WORKERS_RUNNING.name, message)] if became_ready else []
        return [*actions, *_status_change(observed.status, new, *events)]
    message = api.WORKERS_STARTING.format(generation=g, running=running, hosts=s.hosts)
    new = st.set_condition(new, api.COND_READY, False, api.WORKERS_STARTING.name, message, now)
    return [*actions, *_status_change(observed.status, new), RequeueAfter(POLL_SECONDS)]


def plan_worker_nodes(s: JobStatus, pods: Iterable[ObservedPod]) -> dict[int, str]:
    """Worker process index → node, for the current generation's pods bound to a node."""
    count = s.shape.count if s.shape is not None else 1
    hosts = max(1, s.hosts // max(1, count))
    return {p.slice_index * hosts + p.host: p.node_name for p in pods
            if p.node_name and p.generation == s.generation}


def decide_pod_refused(spec: JobSpec | None, status: JobStatus, generation: int, pod: str, detail: str,
                       now: datetime, settings: OperatorSettings) -> list[Action]:
    """The API server refused to create a worker pod (Pod Security admission, a quota, a webhook):
    Ready=False with reason PodCreationRefused, the API server's message and, when the pods mount a
    hostPath local tier, the fix; a Warning event when that message is new; try again later."""
    fix = api.HOSTPATH_FIX if spec is not None and node_scoped(spec) else ""
    message = api.POD_CREATION_REFUSED.format(generation=generation, pod=pod, detail=detail, fix=fix)
    old = status.condition(api.COND_READY)
    new = st.set_condition(status, api.COND_READY, False, api.POD_CREATION_REFUSED.name, message, now)
    events = [] if old is not None and old.reason == api.POD_CREATION_REFUSED.name and old.message == message \
        else [EmitEvent("Warning", api.POD_CREATION_REFUSED.name, message)]
    return [*_status_change(status, new, *events), RequeueAfter(float(settings.refused_retry_seconds))]


def _expected_names(job: JobRef, s: JobStatus) -> list[str]:
    """The current generation's pod names, from the status alone (the spec may have changed since)."""
    count = s.shape.count if s.shape is not None else 1
    hosts = max(1, s.hosts // max(1, count))
    return [build_pod_name(job.name, s.generation, i, h) for i in range(count) for h in range(hosts)]


def _hardware_changed(spec: JobSpec, s: JobStatus) -> bool:
    return s.planned_from.split("/")[0] != fingerprint(spec).split("/")[0]


def _resize_reason(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings,
                   pods: list[ObservedPod]) -> tuple[str, str, str] | None:
    """(kind, reason, message) when the running generation should move to another shape."""
    now, current = observed.now, s.shape
    if current is None:
        return None
    if s.planned_from != fingerprint(spec):
        # (a shape the spec no longer allows was handled before this point)
        planned = plan_shape(spec, observed.nodes, now)
        if planned is not None and shape_chips(spec, planned.shape) > shape_chips(spec, current):
            return st.RESIZE, api.SPEC_RESIZED.name, api.SPEC_RESIZED.format(old=current, new=planned.shape)
        return None
    if spec.elastic is None or not spec.elastic.grow_back:
        return None
    started = s.generation_start_time or now
    if now - started < timedelta(seconds=settings.grow_back_settle_seconds):
        return None
    if not (pods and len(pods) == s.hosts and all(p.phase == "Running" for p in pods)):
        return None
    planned = plan_shape(spec, observed.nodes, now)
    if planned is not None and shape_chips(spec, planned.shape) > shape_chips(spec, current):
        return st.GROW_BACK, api.GROW_BACK.name, api.GROW_BACK.format(old=current, new=planned.shape)
    return None


def _begin(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings, actions: list[Action],
           kind: str, reason: str, message: str) -> list[Action]:
    """Record a transition away from the current generation, then act on it."""
    now, g = observed.now, s.generation
    if kind == st.WORKER_FAILURE:
        failures = s.failures + 1
        if failures > spec.recovery.max_restarts:
            text = api.MAX_RESTARTS_EXCEEDED.format(max_restarts=spec.recovery.max_restarts, detail=message)
            new = replace(s, phase=api.PHASE_FAILED, failures=failures)
            new = st.set_condition(new, api.COND_READY, False, api.MAX_RESTARTS_EXCEEDED.name, text, now)
            return [*actions, SetStatus(new), EmitEvent("Warning", api.MAX_RESTARTS_EXCEEDED.name, text),
                    _delete(observed, spec, g, "job failed", settings)]
        s = replace(s, failures=failures)
    save = (kind == st.PREEMPTION and spec.checkpoint.final_save.on_preemption) or (
        kind in st.RESIZE_KINDS and spec.checkpoint.final_save.on_resize)
    running = tuple(sorted(p.name for p in _pods_of(observed, g) if p.phase == "Running"))
    save = save and bool(running)
    not_before = None
    if kind == st.WORKER_FAILURE:
        not_before = st.truncate(now) + timedelta(seconds=spec.recovery.backoff_seconds)
    t = Transition(kind=kind, generation=g, since=st.truncate(now), message=message,
                   save_request_id=f"{observed.job.name}-g{g}-{kind.lower()}" if save else None,
                   save_deadline=st.truncate(now) + timedelta(seconds=spec.checkpoint.final_save.timeout_seconds)
                   if save else None, not_before=not_before)
    new = replace(s, transition=t, phase=st.phase_for(t, first=False))
    new = st.set_condition(new, api.COND_READY, False, reason, message, now)
    event_type = "Normal" if kind in st.RESIZE_KINDS else "Warning"
    head: list[Action] = [*actions, SetStatus(new), EmitEvent(event_type, reason, message)]
    if kind == st.WORKER_FAILURE:
        head.append(EmitEvent("Warning", api.BACKOFF.name, api.BACKOFF.format(
            failures=new.failures, max_restarts=spec.recovery.max_restarts, until=st.format_time(not_before))))
    # Act on the recorded transition right away, as the next decision would.
    return head + _continue_transition(spec, replace(observed, status=new), new, settings, [], announce=False)


# ---- finishing a transition


def _continue_transition(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings,
                         actions: list[Action], *, announce: bool = True) -> list[Action]:
    now = observed.now
    t = s.transition
    assert t is not None
    g = t.generation
    pods = _pods_of(observed, g)
    base = observed.status if announce else s

    if t.saving:
        outcome = next((o for o in observed.save_outcomes if o.request_id == t.save_request_id), None)
        lost = _force_pods(observed, pods, spec, settings)
        timed_out = t.save_deadline is not None and now >= t.save_deadline
        all_ended = all(p.terminated or p.deletion_timestamp is not None for p in pods)
        if outcome is None and not timed_out and not all_ended and not lost:
            new = st.set_condition(s, api.COND_SAVING, True, api.SAVING.name, api.SAVING.format(
                reason=t.kind, generation=g, deadline=st.format_time(t.save_deadline)), now)
            new = replace(new, phase=api.PHASE_SAVING)
            running = tuple(sorted(p.name for p in pods if p.phase == "Running"))
            wait = max(1.0, min(POLL_SECONDS, ((t.save_deadline or now) - now).total_seconds()))
            return [*actions, *_status_change(base, new),
                    RequestFinalSave(g, t.save_request_id or "", _save_reason(t.kind), t.save_deadline or now, running),
                    RequeueAfter(wait)]
        if outcome is not None:
            detail = (f"step {outcome.step} committed" if outcome.committed and outcome.error is None
                      else f"error: {outcome.error or 'not committed'}")
            event = EmitEvent("Normal" if outcome.committed else "Warning", api.FINAL_SAVE_DONE.name,
                              api.FINAL_SAVE_DONE.format(generation=g, detail=detail))
        elif timed_out:
            event = EmitEvent("Warning", api.FINAL_SAVE_TIMEOUT.name, api.FINAL_SAVE_TIMEOUT.format(
                generation=g, seconds=spec.checkpoint.final_save.timeout_seconds))
        else:
            event = EmitEvent("Normal", api.FINAL_SAVE_DONE.name, api.FINAL_SAVE_DONE.format(
                generation=g, detail="the workers exited" if all_ended else "a node was lost"))
        checkpoint = s.checkpoint
        if outcome is not None and outcome.committed and outcome.step is not None:
            checkpoint = st.newer_checkpoint(checkpoint, CheckpointInfo(outcome.step, st.truncate(now), True))
        s = replace(s, transition=replace(t, save_done=True), checkpoint=checkpoint)
        s = replace(s, phase=st.phase_for(s.transition, first=False))
        s = st.set_condition(s, api.COND_SAVING, False, api.NOT_SAVING.name, api.NOT_SAVING.message, now)
        actions = [*actions, SetStatus(s), event]
        base = s
        t = s.transition
        assert t is not None
    else:
        new = replace(s, phase=st.phase_for(t, first=False))
        new = st.set_condition(new, api.COND_SAVING, False, api.NOT_SAVING.name, api.NOT_SAVING.message, now)
        actions = [*actions, *_status_change(base, new)]
        base = s = new

    if pods or g in observed.services:
        delete = _delete(observed, spec, g, t.kind, settings)
        out = list(actions)
        if _needs_delete(observed, g, delete):
            out.append(delete)
        if pods:
            return [*out, RequeueAfter(POLL_SECONDS)]
        actions = out
    return _start_generation(spec, replace(observed, status=base), s, settings, actions)


def decide_cleanup(observed: Observed, settings: OperatorSettings) -> list[Action]:
    """For the JAXJob's delete handler: the garbage collector deletes the workers gracefully, but no
    kubelet will ever confirm pods on a down node; force-delete those (checkpoints stay in storage)."""
    out: list[Action] = []
    for g in sorted({p.generation for p in observed.pods}):
        forced = []
        for p in _pods_of(observed, g):
            node = observed.node(p.node_name)
            if p.node_name and (node is None or node.down_since(observed.now) is not None):
                forced.append(p.name)
        if forced:
            out.append(DeleteGeneration(g, "job deleted", tuple(sorted(forced))))
    return out


def _save_reason(kind: str) -> str:
    return "preemption" if kind == st.PREEMPTION else "resize"
