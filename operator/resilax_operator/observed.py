"""The world a decision sees (pure): its types and the parsers that build them from raw API bodies.

The I/O side (observe.py) reads the JAXJob, its pods and Services, the nodes and the pods of others
from the watch cache and the sidecars' answers, and hands them to `build_observed`; every decision reads
only the resulting `Observed` snapshot (time included: `Observed.now`, never the clock).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any, Final

from . import api
from . import status as st
from .builders import JobRef
from .devices import DEVICE_RESOURCES, count_devices_in_use
from .ownership import owner_uid
from .status import CheckpointInfo, JobStatus
from .trainer_process import TrainerProcess


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
    #: Until when the node's Lease (kube-node-lease) says its kubelet is alive: renewTime +
    #: leaseDurationSeconds. Read only for a NotReady (Ready=False) node hosting a worker; None: unknown.
    lease_live_until: datetime | None = None
    #: The Ready condition's message (the kubelet's reason for NotReady).
    ready_message: str = ""

    @property
    def pool(self) -> str | None:
        return self.labels.get(api.NODE_POOL_LABEL)

    def notice(self, now: datetime, lead: timedelta = timedelta(0)) -> str | None:
        """The disruption notice that tells the job to save and move off this node now, if any: GKE's
        "now" signals at once (the impending-termination and maintenance-window-started taints, the
        active-node-maintenance label), a scheduled host maintenance once `now` is within `lead` of its
        time (at once when the label's time cannot be read)."""
        for t in self.taints:
            if t.key in (api.IMPENDING_TERMINATION_TAINT, api.MAINTENANCE_WINDOW_STARTED_TAINT):
                return f"taint {t.key}"
        active = self.labels.get(api.ACTIVE_MAINTENANCE_LABEL)
        if active in api.ACTIVE_MAINTENANCE_VALUES:
            return f"label {api.ACTIVE_MAINTENANCE_LABEL}={active}"
        raw = self.labels.get(api.SCHEDULED_MAINTENANCE_LABEL)
        if raw is None:
            return None
        when = self.maintenance_time()
        if when is None:
            return f"label {api.SCHEDULED_MAINTENANCE_LABEL}={raw} (not a time: acting now)"
        if now >= when - lead:
            return (f"label {api.SCHEDULED_MAINTENANCE_LABEL}={raw}: host maintenance at "
                    f"{st.format_time(when)}, within the lead of {int(lead.total_seconds())}s")
        return None

    def maintenance_time(self) -> datetime | None:
        """The time of the scheduled host maintenance (the label's Unix epoch seconds; an RFC 3339 time is
        read too); None without the label or when its value is not a time."""
        return parse_maintenance_time(self.labels.get(api.SCHEDULED_MAINTENANCE_LABEL))

    def down_since(self, now: datetime) -> datetime | None:
        """When the node stopped being Ready (or got the unreachable taint); None while it is Ready, and
        while it is NotReady (Ready=False) with a live Lease: its kubelet runs and still manages the pods
        (a runtime or network-plugin hiccup), so it is no node loss and nothing on it is force-deleted.
        A node whose kubelet says it is shutting down (graceful node shutdown: a spot VM's preemption) is
        down whatever its Lease: it is going away."""
        if self.ready == "False" and self.lease_live_until is not None and now < self.lease_live_until \
                and SHUTTING_DOWN_MESSAGE not in self.ready_message \
                and not any(t.key == api.UNREACHABLE_TAINT for t in self.taints):
            return None
        if self.ready != "True":
            return self.ready_since or now
        if any(t.key == api.UNREACHABLE_TAINT for t in self.taints):
            return self.ready_since or now
        if self.lease_live_until is not None and now >= self.lease_live_until:
            # Still Ready for the node lifecycle controller, but its kubelet's Lease expired (read only
            # when a worker exited 76: `nodes_needing_lease`): the same evidence, without its grace.
            return self.lease_live_until
        return None

    def schedulable(self, now: datetime, lead: timedelta = timedelta(0)) -> bool:
        """Whether a new generation may use this node: up, no notice within `lead`, not cordoned."""
        return (self.ready == "True" and self.down_since(now) is None and self.notice(now, lead) is None
                and not self.unschedulable
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
    #: The trainer container is running (its state is `running`).
    trainer_running: bool = False
    #: (container, reason, message) of each container (init, trainer, sidecar, ...) waiting for a reason
    #: other than the normal start-up ones (ImagePullBackOff, CreateContainerConfigError, CrashLoopBackOff).
    waiting: tuple[tuple[str, str, str], ...] = ()
    #: spec.schedulingGates names: the scheduler leaves the pod alone until they are removed (Kueue's
    #: `kueue.x-k8s.io/admission` until it admits the pod group).
    gates: tuple[str, ...] = ()
    #: When the trainer container started (its `startedAt`, running or terminated); None before.
    trainer_started_at: datetime | None = None
    #: When the trainer container terminated (its `finishedAt`); None while it runs.
    trainer_finished_at: datetime | None = None
    uid: str = ""
    #: Its trainer runs under the supervisor (annotation resilax.dev/supervised): its exits come from the
    #: sidecar's `trainer_process` (trainer_process.py), not the kubelet.
    supervised: bool = False
    #: The trainer container's readiness (for a supervised trainer: its incarnation runs).
    trainer_ready: bool = False
    #: uid of the JAXJob that controls the pod (its controller ownerReference); "" for none.
    owner_uid: str = ""
    #: (container, reason) of each container still in a start-up state (ContainerCreating, PodInitializing).
    starting: tuple[tuple[str, str], ...] = ()
    #: When the pod was bound to its node (the PodScheduled condition's lastTransitionTime).
    scheduled_at: datetime | None = None

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def failed(self) -> bool:
        """The pod failed, or (supervised: the supervisor stays, the pod keeps Running) its trainer
        exited with a non-zero code."""
        return self.phase == "Failed" or (self.supervised and self.exit_code not in (None, 0))

    @property
    def trainer_exited(self) -> bool:
        """The trainer container has terminated (whatever the pod's phase)."""
        return self.exit_code is not None


@dataclass(frozen=True)
class SaveOutcome:
    """A final save result a sidecar reported ($RESILAX_CONTROL_DIR/results/<id>.json)."""

    request_id: str
    step: int | None = None
    committed: bool = False
    error: str | None = None


@dataclass(frozen=True)
class RestoreReport:
    """The trainer's restore of the newest step (`restore` in the sidecar's `/v1/state`)."""

    step: int | None
    #: (step, why) of each newer committed step it could not read and skipped.
    skipped: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class TrainerReport:
    """The figures pod 0's trainer last reported for one generation (`trainer` in its sidecar's
    `/v1/state`, resilax_ckpt.trainer_metrics; epoch seconds). The I/O side keeps the last one it read,
    so a pod 0 that died leaves what it said last."""

    generation: int
    step: int | None = None
    step_time: float | None = None
    first_step: int | None = None
    first_step_time: float | None = None
    save_blocking_seconds: float = 0.0
    restores: int = 0
    last_restore_seconds: float = 0.0
    restored_time: float | None = None


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
    #: Pod 0's trainer figures, the last read (its `generation` says of which generation).
    trainer: TrainerReport | None = None
    #: Pod name → its supervised trainer's incarnation, from the sidecars asked (trainer_process.py).
    trainer_processes: Mapping[str, TrainerProcess] = field(default_factory=dict, hash=False)

    def node(self, name: str | None) -> ObservedNode | None:
        return self._nodes_by_name.get(name) if name else None

    @cached_property
    def _nodes_by_name(self) -> dict[str, ObservedNode]:
        return {n.name: n for n in self.nodes}

    def pods_of(self, generation: int) -> list[ObservedPod]:
        """The pods of one generation, by name."""
        return sorted((p for p in self.pods if p.generation == generation), key=lambda p: p.name)


# ---------------------------------------------------------------- parsers (raw API bodies → Observed)

#: The kubelet's Ready=False message during a graceful node shutdown.
SHUTTING_DOWN_MESSAGE: Final = "node is shutting down"
#: Waiting reasons of a container that is simply starting (not stuck).
STARTING_REASONS: Final = frozenset({"ContainerCreating", "PodInitializing"})


def parse_maintenance_time(raw: str | None) -> datetime | None:
    """`cloud.google.com/scheduled-maintenance-time` → a time: Unix epoch seconds as GKE writes them (an
    RFC 3339 time is accepted too); None when absent or unreadable."""
    if not raw:
        return None
    try:
        return datetime.fromtimestamp(int(raw), UTC)
    except (ValueError, OverflowError, OSError):
        pass
    try:
        when = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def parse_job_ref(job: Mapping[str, Any]) -> JobRef:
    """The JAXJob → the reference the builders use (name, namespace, uid, Kueue queue label)."""
    meta = job.get("metadata") or {}
    return JobRef(str(meta.get("name", "")), str(meta.get("namespace", "")), str(meta.get("uid", "")),
                  str((meta.get("labels") or {}).get(api.KUEUE_QUEUE_LABEL) or ""))


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
    trainer_running = trainer_ready = False
    started_at = finished_at = None
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") == trainer:
            state = cs.get("state") or {}
            trainer_running = bool(state.get("running"))
            trainer_ready = bool(cs.get("ready"))
            with contextlib.suppress(ValueError):
                started_at = st.parse_time((state.get("running") or state.get("terminated") or {}).get("startedAt"))
                finished_at = st.parse_time((state.get("terminated") or {}).get("finishedAt"))
            terminated = state.get("terminated")
            if terminated:
                code = terminated.get("exitCode")
                exit_code = None if code is None else int(code)
                exit_reason = terminated.get("reason")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    statuses = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    waiting = tuple(
        (str(cs.get("name", "")), str(w.get("reason")), str(w.get("message") or ""))
        for cs in statuses
        if (w := (cs.get("state") or {}).get("waiting")) and w.get("reason") and w.get("reason") not in STARTING_REASONS)
    starting = tuple((str(cs.get("name", "")), str(w.get("reason"))) for cs in statuses
                     if (w := (cs.get("state") or {}).get("waiting")) and w.get("reason") in STARTING_REASONS)
    scheduled: Mapping[str, Any] = next((c for c in status.get("conditions") or []
                      if c.get("type") == "PodScheduled" and c.get("status") == "True"), {})
    grace = meta.get("deletionGracePeriodSeconds")
    gates = tuple(str(g.get("name", "")) for g in spec.get("schedulingGates") or [] if isinstance(g, Mapping))
    return ObservedPod(
        name=str(meta.get("name", "")), generation=generation, slice_index=slice_index, host=host,
        phase=str(status.get("phase") or "Pending"), node_name=spec.get("nodeName") or None,
        pod_ip=status.get("podIP") or None, deletion_timestamp=st.parse_time(meta.get("deletionTimestamp")),
        deletion_grace_seconds=None if grace is None else int(grace),
        exit_code=exit_code, exit_reason=exit_reason, pod_reason=status.get("reason") or None, ready=ready,
        trainer_running=trainer_running, waiting=waiting, gates=gates, trainer_started_at=started_at,
        trainer_finished_at=finished_at, uid=str(meta.get("uid") or ""),
        supervised=(meta.get("annotations") or {}).get(api.ANNOTATION_SUPERVISED) == "1", trainer_ready=trainer_ready,
        owner_uid=owner_uid(raw), starting=starting, scheduled_at=_time_or_none(scheduled.get("lastTransitionTime")))


def _time_or_none(raw: Any) -> datetime | None:
    try:
        return st.parse_time(raw)
    except ValueError:
        return None


def parse_lease(raw: Mapping[str, Any]) -> datetime | None:
    """A node's Lease (coordination.k8s.io/v1, namespace kube-node-lease) → until when it says the
    kubelet is alive (renewTime + leaseDurationSeconds); None when it has no renewTime."""
    spec = raw.get("spec") or {}
    try:
        renewed = st.parse_time(spec.get("renewTime"))
    except ValueError:
        return None
    if renewed is None:
        return None
    return renewed + timedelta(seconds=int(spec.get("leaseDurationSeconds") or 40))


def parse_node(raw: Mapping[str, Any], in_use_by_others: Mapping[str, int] | None = None,
               lease_live_until: datetime | None = None) -> ObservedNode:
    """A Node as the API returns it → ObservedNode. `in_use_by_others`: see `devices.count_devices_in_use`;
    `lease_live_until`: see `parse_lease`."""
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
        ready_message=str(ready.get("message") or ""),
        unschedulable=bool(spec.get("unschedulable", False)), allocatable=allocatable,
        in_use_by_others=dict(in_use_by_others or {}), lease_live_until=lease_live_until)


def parse_save_outcome(request_id: str, body: Mapping[str, Any]) -> SaveOutcome | None:
    """The sidecar's `GET /v1/save/{id}` answer → SaveOutcome for the operator's `request_id`
    (None while it is pending)."""
    state = body.get("status")
    if state == "pending":
        return None
    step = body.get("step")
    return SaveOutcome(request_id, None if step is None else int(step), bool(body.get("committed")),
                       body.get("error") or (None if state == "committed" else f"save {state}"))


def parse_service(raw: Mapping[str, Any]) -> tuple[int, str] | None:
    """A job's headless Service → (the generation it serves: its `resilax.dev/generation` label, the uid
    of the JAXJob owning it: `ownership.owner_uid`)."""
    label = ((raw.get("metadata") or {}).get("labels") or {}).get(api.LABEL_GENERATION)
    return (int(label), owner_uid(raw)) if label is not None and str(label).isdigit() else None


def build_observed(job: Mapping[str, Any], *, now: datetime, pods: Iterable[Mapping[str, Any]],
                   services: Iterable[Mapping[str, Any]], nodes: Iterable[Mapping[str, Any]],
                   other_pods: Iterable[Mapping[str, Any]] = (), save_outcomes: Iterable[SaveOutcome] = (),
                   checkpoint: CheckpointInfo | None = None, restore: RestoreReport | None = None,
                   leases: Mapping[str, datetime] | None = None, trainer: TrainerReport | None = None) -> Observed:
    """Observed from raw API bodies (the full parse): the JAXJob, its pods and Services (label
    resilax.dev/job=<name>), all Nodes, and the pods of everything else that may hold accelerators
    (`other_pods`, any namespace; this job's pods among them are ignored). `leases`: node name →
    `parse_lease` of the NotReady nodes hosting a worker (`nodes_needing_lease`).

    The operator builds the same snapshot from what the watch cache keeps parsed (`assemble_observed`
    with cache.py's indexes); this is the reference the cache's tests compare it with."""
    meta = job.get("metadata") or {}
    nodes = tuple(nodes)
    in_use = count_devices_in_use(other_pods, str(meta.get("name", "")), nodes, str(meta.get("namespace", "")))
    parsed = [parse_node(n, in_use.get(str((n.get("metadata") or {}).get("name", "")), {})) for n in nodes]
    observed = assemble_observed(
        job, now=now, pods=[p for p in (parse_pod(raw) for raw in pods) if p is not None],
        services=[g for g in (parse_service(s) for s in services) if g is not None],
        nodes=sorted(parsed, key=lambda n: n.name), save_outcomes=save_outcomes, checkpoint=checkpoint,
        restore=restore, trainer=trainer)
    return with_leases(observed, leases or {})


def assemble_observed(job: Mapping[str, Any], *, now: datetime, pods: Iterable[ObservedPod],
                      services: Iterable[tuple[int, str]], nodes: Sequence[ObservedNode],
                      save_outcomes: Iterable[SaveOutcome] = (), checkpoint: CheckpointInfo | None = None,
                      restore: RestoreReport | None = None, trainer: TrainerReport | None = None) -> Observed:
    """Observed from parts already parsed: the pods and Services (generation, owner uid) labelled with
    the job's name and every node, sorted by name, with the devices others hold counted
    (`in_use_by_others`). Only what the job owns (`owner_uid` = its uid) is its own: a pod or Service
    carrying its label but owned by another object (a JAXJob of the same name deleted and created
    again, anybody's) is never a worker, never deleted, never asked anything."""
    meta = job.get("metadata") or {}
    ref = parse_job_ref(job)
    mine = [p for p in pods if p.owner_uid and p.owner_uid == ref.uid]
    generations = {g for g, owner in services if owner and owner == ref.uid}
    return Observed(now=now, job=ref, status=st.parse_status(job.get("status")),
                    spec_generation=int(meta.get("generation") or 0),
                    pods=tuple(sorted(mine, key=lambda p: p.name)), services=tuple(sorted(generations)),
                    nodes=tuple(nodes), save_outcomes=tuple(save_outcomes), checkpoint=checkpoint, restore=restore,
                    trainer=trainer)


def nodes_needing_lease(observed: Observed) -> list[str]:
    """The nodes whose Lease a decision reads: NotReady (Ready=False, the kubelet's own report) and
    hosting one of the job's pods; and, once a worker of the current generation exited 76 (a peer
    process is gone), the Ready nodes of the workers that did not: an expired Lease there proves that
    kubelet dead before the node lifecycle controller says so (`ObservedNode.down_since`). Sorted."""
    out = {p.node_name for p in observed.pods
           if p.node_name and (node := observed.node(p.node_name)) is not None and node.ready == "False"}
    current = observed.pods_of(observed.status.generation)
    if any(p.exit_code == api.EXIT_CODE_PEER_LOST for p in current):
        out |= {p.node_name for p in current if p.node_name and p.exit_code != api.EXIT_CODE_PEER_LOST
                and (node := observed.node(p.node_name)) is not None and node.ready == "True"}
    return sorted(out)


def with_leases(observed: Observed, leases: Mapping[str, datetime]) -> Observed:
    """`observed` with each node of `leases` (name → `parse_lease`) knowing until when its kubelet lives."""
    if not leases:
        return observed
    nodes = tuple(replace(n, lease_live_until=leases[n.name]) if n.name in leases else n for n in observed.nodes)
    return replace(observed, nodes=nodes)


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


def parse_sidecar_state(body: Mapping[str, Any], now: datetime) -> CheckpointInfo | None:
    """The sidecar's `GET /v1/state` answer → the newest checkpoint it knows (persisted beats local).
    `time` is when the operator first saw the step (the status keeps the first time it saw it)."""
    persisted, local = body.get("newest_persisted_step"), body.get("newest_local_step")
    if persisted is not None:
        return CheckpointInfo(int(persisted), st.truncate(now), True, "persistent")
    if local is not None:
        return CheckpointInfo(int(local), st.truncate(now), True, "local")
    return None


def parse_trainer_report(body: Mapping[str, Any], generation: int) -> TrainerReport | None:
    """`trainer` of the sidecar's `GET /v1/state` (pod 0 of `generation`) → TrainerReport (None if
    absent or malformed)."""
    raw = body.get("trainer")
    if not isinstance(raw, Mapping):
        return None

    def num(key: str) -> float | None:
        value = raw.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    def whole(key: str) -> int | None:
        value = raw.get(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    return TrainerReport(generation=generation, step=whole("step"), step_time=num("step_time"),
                         first_step=whole("first_step"), first_step_time=num("first_step_time"),
                         save_blocking_seconds=num("save_blocking_seconds") or 0.0, restores=whole("restores") or 0,
                         last_restore_seconds=num("last_restore_seconds") or 0.0, restored_time=num("restored_time"))
