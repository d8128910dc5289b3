"""The JAXJob status (pure): parsed from and rendered to the status subresource, and its conditions.

The status is the operator's memory: the current generation, its shape and node pools, the move to a
new generation in progress (`transition`, with the final save request and backoff), and counters.
Everything `reconcile.decide` needs to resume after an operator restart is here or in the cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Final

from . import api
from .generation import worker_pod_names
from .pods.spares import SpareStatus, build_spare_status, parse_spare_status
from .spec import Shape
from .status_fields import goodput as gp
from .status_fields.checkpoint import CheckpointInfo as CheckpointInfo
from .status_fields.checkpoint import build_branch, parse_branch
from .status_fields.checkpoint import newer_checkpoint as newer_checkpoint
from .status_fields.history import HistoryEntry, build_history, parse_history
from .status_fields.merge_patch import merge_patch
from .status_fields.recovery_notice import RecoveryNotice, build_recovery_notice, parse_recovery_notice
from .status_fields.unhealthy_nodes import UnhealthyNode, build_unhealthy_nodes, parse_unhealthy_nodes

# Transition kinds: why the current generation is being replaced.
PREEMPTION: Final = "Preemption"
NODE_LOSS: Final = "NodeLoss"
POD_LOST: Final = "PodLost"
WORKER_FAILURE: Final = "WorkerFailure"
WORKER_STOPPED: Final = "WorkerStopped"
RESIZE: Final = "Resize"
GROW_BACK: Final = "GrowBack"
SHRINK: Final = "Shrink"  # capacity.provisioning Autoscaled: no node came for waiting workers within shrinkAfterSeconds
SUSPEND: Final = "Suspend"  # spec.suspend became true
QUEUE_EVICTION: Final = "QueueEviction"  # a queue (Kueue) preempted or evicted the pod group: not a failure
TRAINER_HUNG: Final = "TrainerHung"  # no progress past the hang timeout (policies/hang.py): not a failure
ROLLBACK: Final = "Rollback"  # spec.checkpoint.restore.step edited on a running job (policies/rollback.py)
TRANSITION_KINDS: Final = (PREEMPTION, NODE_LOSS, POD_LOST, WORKER_FAILURE, WORKER_STOPPED, RESIZE, GROW_BACK, SHRINK,
                           SUSPEND, QUEUE_EVICTION, TRAINER_HUNG, ROLLBACK)
#: Kinds whose final save `checkpoint.finalSave.onResize` governs.
RESIZE_KINDS: Final = frozenset({RESIZE, GROW_BACK})
#: Kinds that move to another shape on purpose (phase Resizing).
RESHAPE_KINDS: Final = frozenset({RESIZE, GROW_BACK, SHRINK})


@dataclass(frozen=True)
class Transition:
    """The move from generation `generation` to the next one."""

    kind: str
    generation: int
    since: datetime
    message: str = ""
    #: Id of the final save request sent to the workers (None: no final save for this transition).
    save_request_id: str | None = None
    save_deadline: datetime | None = None
    #: True once the final save finished, failed or timed out (the teardown may start).
    save_done: bool = False
    #: The next generation starts no earlier than this (backoff after a worker failure).
    not_before: datetime | None = None
    #: When the teardown of `generation` began (after its final save, if any); None: not yet.
    teardown_since: datetime | None = None
    reason: str = ""  #: the Event reason of the finding that began it (status.history's endReason)

    @property
    def saving(self) -> bool:
        return self.save_request_id is not None and not self.save_done


#: status.inPlace.phase: the kept pods' old trainers are being stopped (and the lost pods deleted).
IN_PLACE_STOPPING: Final = "Stopping"
#: status.inPlace.phase: every kept pod is proven stopped; missing pods are created, kept ones started.
IN_PLACE_STARTING: Final = "Starting"


@dataclass(frozen=True)
class KeptPod:
    """A pod an in-place restart keeps: its trainer is stopped, then started as the new generation's."""

    pod: str
    uid: str
    #: Its process id in the new generation.
    process: int
    #: Its old trainer is proven gone (the sidecar's `trainer_process`).
    stopped: bool = False
    #: Its sidecar accepted the new generation's start (`/v1/trainer/start` answered 200 or 202).
    started: bool = False


@dataclass(frozen=True)
class InPlace:
    """status.inPlace: the in-place restart in progress (docs/architecture.md, its state machine)."""

    generation: int
    from_generation: int
    phase: str
    since: datetime
    deadline: datetime
    kept: tuple[KeptPod, ...] = ()
    #: The transition kind that started it (NodeLoss, WorkerFailure, PodLost, Shrink).
    kind: str = ""
    #: No trainer of the new generation starts before this (a worker failure's backoff).
    not_before: datetime | None = None
    reason: str = ""  #: the Event reason of the finding that started it (status.history's endReason)
    message: str = ""  #: and its message


@dataclass(frozen=True)
class GoodputRecord:
    """status.goodput: the accounting (status_fields/goodput.py's ledger) and the time its figures are given for."""

    ledger: gp.Ledger
    as_of: datetime

    def summary(self) -> gp.Goodput:
        return gp.summarize(self.ledger, self.as_of.timestamp())


@dataclass(frozen=True)
class SpecRecord:
    """status.lastValidSpec: the newest spec that validated, nulls dropped (`without_nulls`), and its
    metadata.generation. An invalid edit leaves the job running under it (policies/invalid_edit.py)."""

    generation: int
    spec: Mapping[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str
    last_transition_time: datetime | None = None


@dataclass(frozen=True)
class JobStatus:
    phase: str = api.PHASE_PENDING
    generation: int = 0
    shape: Shape | None = None
    hosts: int = 0
    pools: tuple[str, ...] = ()
    restore_step: str = ""
    #: spec.checkpoint.restore.step as the operator last acted on it (written at each generation start):
    #: an edit to another step number rolls the running job back (policies/rollback.py). "": not yet known.
    restore_asked: str = ""
    generation_start_time: datetime | None = None
    #: True once every worker pod of the current generation has been created.
    workers_created: bool = False
    restarts: int = 0
    failures: int = 0
    #: Pod-level losses (PodLost, WorkerStopped) in a row, without a generation that ran
    #: podLossResetSeconds in between: their backoff grows with it, and past maxPodLosses the job fails.
    pod_losses: int = 0
    planned_from: str = ""
    observed_generation: int = 0
    transition: Transition | None = None
    checkpoint: CheckpointInfo | None = None
    conditions: tuple[Condition, ...] = ()
    #: (worker process index, node it last ran on), sorted; kept across generations.
    worker_nodes: tuple[tuple[int, str], ...] = ()
    #: Measured: seconds the last committed final save took (transition start to the sidecar's answer).
    final_save_seconds: int | None = None
    #: Measured: seconds from the last new generation's creation to all its workers Running.
    restart_seconds: int | None = None
    #: When a queue (Kueue) admitted the current generation's workers (their scheduling gates went):
    #: the timeouts on their start count from then (`workers_since`). None: never held by a queue.
    admitted_time: datetime | None = None
    #: Goodput so far and where the rest of the wall time went (status_fields/goodput.py; policies/goodput_status.py).
    goodput: GoodputRecord | None = None
    #: The current generation's pod names by process id (written at every generation start); () from an
    #: operator that predates it: the names `builders.build_pod_name` gives the generation.
    worker_pods: tuple[str, ...] = ()
    #: The in-place restart in progress; None: none.
    in_place: InPlace | None = None
    #: Restarts done in place (counted in `restarts` as well).
    in_place_restarts: int = 0
    #: The newest spec that validated: what the job runs under while an edit is invalid.
    last_valid_spec: SpecRecord | None = None
    #: One entry per generation, oldest first (status_fields/history.py; policies/history_status.py fills it).
    history: tuple[HistoryEntry, ...] = ()
    #: Nodes that failed the health check, by name: kept out of later generations (policies/health_check.py).
    unhealthy_nodes: tuple[UnhealthyNode, ...] = ()
    #: The last Event about a long recovery and what it waited for (policies/recovery_wait.py).
    recovery_notice: RecoveryNotice | None = None
    #: status.spares: the spare slices held and taken (policies/spares.py); None: the job asks for none.
    spares: SpareStatus | None = None

    @property
    def workers_since(self) -> datetime | None:
        """When the current generation's workers could start: its creation, or its admission by a queue."""
        times = [t for t in (self.generation_start_time, self.admitted_time) if t is not None]
        return max(times) if times else None

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)

    def pod_names(self, job: str) -> list[str]:
        """The current generation's pod names by process id (status.workerPods, else the built names)."""
        return worker_pod_names(job, self.worker_pods, self.generation,
                                self.shape.count if self.shape is not None else 1, self.hosts)


def format_time(t: datetime | None) -> str | None:
    return None if t is None else t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(raw: Any) -> datetime | None:
    if not raw:
        return None
    if isinstance(raw, datetime):
        return raw if raw.tzinfo else raw.replace(tzinfo=UTC)
    return datetime.fromisoformat(str(raw).replace("Z", "+00:00"))


def truncate(t: datetime) -> datetime:
    """Times stored in the status have whole seconds; decisions use the same precision."""
    return t.replace(microsecond=0)


def parse_status(raw: Mapping[str, Any] | None) -> JobStatus:
    """The status subresource (as the API returns it) → JobStatus. Unknown or missing fields default."""
    raw = raw or {}
    shape_raw = raw.get("shape") or {}
    shape = Shape(str(shape_raw["topology"]), int(shape_raw["count"])) if shape_raw.get("topology") else None
    t = raw.get("transition") or None
    transition = None
    if t and t.get("kind"):
        transition = Transition(
            kind=str(t["kind"]), generation=int(t.get("generation", 0)),
            since=parse_time(t.get("since")) or datetime.fromtimestamp(0, UTC),
            message=str(t.get("message", "")), save_request_id=t.get("saveRequestId") or None,
            save_deadline=parse_time(t.get("saveDeadline")), save_done=bool(t.get("saveDone", False)),
            not_before=parse_time(t.get("notBefore")), teardown_since=parse_time(t.get("teardownSince")),
            reason=str(t.get("reason") or ""))
    ck = raw.get("checkpoint") or None
    checkpoint = None
    if ck and ck.get("step") is not None:
        checkpoint = CheckpointInfo(int(ck["step"]), parse_time(ck.get("time")), bool(ck.get("committed", True)),
                                    str(ck.get("tier", "persistent")), parse_branch(ck.get("branch")))
    conditions = tuple(
        Condition(str(c["type"]), str(c.get("status", "Unknown")), str(c.get("reason", "")),
                  str(c.get("message", "")), parse_time(c.get("lastTransitionTime")))
        for c in raw.get("conditions") or [] if c.get("type"))
    return JobStatus(
        phase=str(raw.get("phase") or api.PHASE_PENDING), generation=int(raw.get("generation") or 0),
        shape=shape, hosts=int(shape_raw.get("hosts") or 0), pools=tuple(raw.get("pools") or ()),
        restore_step=str(raw.get("restoreStep") or ""),
        restore_asked=str(raw.get("restoreAsked") or ""),
        generation_start_time=parse_time(raw.get("generationStartTime")),
        workers_created=bool(raw.get("workersCreated", False)),
        restarts=int(raw.get("restarts") or 0), failures=int(raw.get("failures") or 0),
        pod_losses=int(raw.get("podLosses") or 0),
        planned_from=str(raw.get("plannedFrom") or ""), observed_generation=int(raw.get("observedGeneration") or 0),
        transition=transition, checkpoint=checkpoint, conditions=conditions,
        worker_nodes=tuple(sorted((int(k), str(v)) for k, v in (raw.get("workerNodes") or {}).items()
                                  if str(k).isdigit() and v)),
        final_save_seconds=_num((raw.get("timings") or {}).get("finalSaveSeconds")),
        restart_seconds=_num((raw.get("timings") or {}).get("restartSeconds")),
        admitted_time=parse_time(raw.get("admittedTime")),
        goodput=parse_goodput(raw.get("goodput")),
        worker_pods=tuple(str(n) for n in raw.get("workerPods") or () if n),
        in_place=parse_in_place(raw.get("inPlace")),
        in_place_restarts=int(raw.get("inPlaceRestarts") or 0),
        last_valid_spec=parse_spec_record(raw.get("lastValidSpec")), history=parse_history(raw.get("history")),
        unhealthy_nodes=parse_unhealthy_nodes(raw.get("unhealthyNodes")), spares=parse_spare_status(raw.get("spares")),
        recovery_notice=parse_recovery_notice(raw.get("recoveryNotice")))


def parse_in_place(raw: Any) -> InPlace | None:
    """status.inPlace → InPlace (None when absent or unreadable)."""
    if not isinstance(raw, Mapping) or not raw.get("phase"):
        return None
    try:
        since = parse_time(raw.get("since")) or datetime.fromtimestamp(0, UTC)
        kept = tuple(KeptPod(str(k["pod"]), str(k.get("uid") or ""), int(k["process"]), bool(k.get("stopped")),
                             bool(k.get("started"))) for k in raw.get("kept") or () if isinstance(k, Mapping))
        return InPlace(int(raw["generation"]), int(raw.get("from") or 0), str(raw["phase"]), since,
                       parse_time(raw.get("deadline")) or since, kept, str(raw.get("kind") or ""),
                       parse_time(raw.get("notBefore")), str(raw.get("reason") or ""), str(raw.get("message") or ""))
    except (KeyError, TypeError, ValueError):
        return None


def build_in_place(p: InPlace) -> dict[str, Any]:
    return {"generation": p.generation, "from": p.from_generation, "phase": p.phase, "since": format_time(p.since),
            "deadline": format_time(p.deadline), "kind": p.kind, "notBefore": format_time(p.not_before),
            "reason": p.reason or None, "message": p.message or None,
            "kept": [{"pod": k.pod, "uid": k.uid, "process": k.process, "stopped": k.stopped, "started": k.started}
                     for k in p.kept]}


def parse_spec_record(raw: Any) -> SpecRecord | None:
    """status.lastValidSpec -> SpecRecord (None when absent or not an object with a `spec` object)."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("spec"), Mapping):
        return None
    generation = _num(raw.get("generation"))
    return SpecRecord(generation or 0, without_nulls(raw["spec"]))


def without_nulls(value: Any) -> Any:
    """A deep copy of `value` without the null members of its objects. A null means "absent" in a spec,
    and "remove" in the JSON merge patch that writes the status: stored without them, the copy in the
    status reads back equal to what was written (so it is not written again)."""
    if isinstance(value, Mapping):
        return {str(k): without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [without_nulls(v) for v in value]
    return value


def _num(raw: Any, kind: type[int] | type[float] = int) -> Any:
    """`raw` as an int (or `kind`), None when absent or not a number."""
    try:
        return None if raw is None else kind(raw)
    except (TypeError, ValueError):
        return None


def build_status(status: JobStatus) -> dict[str, Any]:
    """JobStatus → the status subresource body. Absent fields are None, so that a JSON merge patch of
    this dict also removes them (e.g. a finished transition)."""
    t = status.transition
    ck = status.checkpoint
    return {
        "phase": status.phase,
        "generation": status.generation,
        "shape": None if status.shape is None else {
            "topology": status.shape.topology, "count": status.shape.count, "hosts": status.hosts},
        "pools": list(status.pools),
        "workerNodes": {str(i): node for i, node in status.worker_nodes} or None,
        "workerPods": list(status.worker_pods) or None,
        "inPlace": None if status.in_place is None else build_in_place(status.in_place),
        "inPlaceRestarts": status.in_place_restarts or None,
        "restoreStep": status.restore_step or None,
        "restoreAsked": status.restore_asked or None,
        "generationStartTime": format_time(status.generation_start_time),
        "admittedTime": format_time(status.admitted_time),
        "workersCreated": status.workers_created,
        "restarts": status.restarts,
        "failures": status.failures,
        "podLosses": status.pod_losses or None,
        "plannedFrom": status.planned_from or None,
        "observedGeneration": status.observed_generation,
        "transition": None if t is None else {
            "kind": t.kind, "generation": t.generation, "since": format_time(t.since), "message": t.message,
            "saveRequestId": t.save_request_id, "saveDeadline": format_time(t.save_deadline),
            "saveDone": t.save_done, "notBefore": format_time(t.not_before),
            "teardownSince": format_time(t.teardown_since), "reason": t.reason or None},
        "timings": {"finalSaveSeconds": status.final_save_seconds, "restartSeconds": status.restart_seconds}
        if status.final_save_seconds is not None or status.restart_seconds is not None else None,
        "checkpoint": None if ck is None else {
            "step": ck.step, "time": format_time(ck.time), "committed": ck.committed, "tier": ck.tier,
            "branch": build_branch(ck.branch)},
        "goodput": None if status.goodput is None else build_goodput(status.goodput),
        "lastValidSpec": None if status.last_valid_spec is None else {
            "generation": status.last_valid_spec.generation, "spec": without_nulls(status.last_valid_spec.spec)},
        "history": build_history(status.history) or None,
        "recoveryNotice": build_recovery_notice(status.recovery_notice),
        "unhealthyNodes": build_unhealthy_nodes(status.unhealthy_nodes), "spares": build_spare_status(status.spares),
        # each condition was decided against the spec of status.observedGeneration, and says so
        "conditions": [
            {"type": c.type, "status": c.status, "reason": c.reason, "message": c.message,
             "lastTransitionTime": format_time(c.last_transition_time),
             "observedGeneration": status.observed_generation} for c in status.conditions],
    }


def build_status_patch(stored: Mapping[str, Any] | None, new: JobStatus) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns the status subresource as stored (the raw body, as the
    API server returned it) into the body of `new`: only the members that differ (None for those that
    go). Empty when nothing differs. A write then carries what changed, not the whole status
    (lastValidSpec, a copy of the spec, only when the spec changes). Against what is stored, not its
    parse: a member the parse defaults (phase Pending, generation 0) is written all the same."""
    return merge_patch(stored or {}, build_status(new))


def set_condition(status: JobStatus, type_: str, true: bool, reason: str, message: str,
                  now: datetime) -> JobStatus:
    """Set one condition; its lastTransitionTime changes only when its status does."""
    value = "True" if true else "False"
    old = status.condition(type_)
    since = old.last_transition_time if old is not None and old.status == value else truncate(now)
    new = Condition(type_, value, reason, message, since)
    others = [c for c in status.conditions if c.type != type_]
    ordered = sorted([*others, new], key=lambda c: (*api.CONDITION_TYPES, c.type).index(c.type))
    return replace(status, conditions=tuple(ordered))


def record_worker_nodes(status: JobStatus, placed: Mapping[int, str]) -> JobStatus:
    """`status` with `placed` (worker index → node) merged into its workerNodes."""
    merged = {**dict(status.worker_nodes), **placed}
    return replace(status, worker_nodes=tuple(sorted(merged.items())))


def phase_for(transition: Transition | None, *, first: bool) -> str:
    """The phase while moving to a new generation (or starting the first)."""
    if transition is None:
        return api.PHASE_PENDING if first else api.PHASE_RECOVERING
    if transition.saving:
        return api.PHASE_SAVING
    if transition.kind == SUSPEND:
        return api.PHASE_SUSPENDED
    return api.PHASE_RESIZING if transition.kind in RESHAPE_KINDS else api.PHASE_RECOVERING


# ---- status.goodput -------------------------------------------------------------------------------------

#: bucket (goodput.BUCKETS) -> its key in status.goodput.breakdown
BREAKDOWN_KEYS: Final = {b: b.split("_")[0] + "".join(w.capitalize() for w in b.split("_")[1:]) for b in gp.BUCKETS}
_MARK_KEYS: Final = (("created", "created"), ("running", "running"), ("restore_began", "restoreBegan"),
                     ("restore_ended", "restoreEnded"), ("first_step_time", "firstStepTime"),
                     ("last_step_time", "lastStepTime"), ("detected", "detected"))


def _round(x: float) -> float:
    return round(float(x), 3)


def _share(x: float) -> float | None:
    return None if x == 1.0 else x  # the declared shape: left out


def build_goodput(record: GoodputRecord) -> dict[str, Any]:
    """status.goodput: the figures as of `asOf` (ratio, wall and productive seconds, breakdown) and the
    ledger they come from (docs/jaxjob-reference.md)."""
    g = record.summary()
    led = record.ledger
    cur = led.current
    return {
        "ratio": round(g.ratio, 4), "deviceRatio": round(g.device_ratio, 4), "wallSeconds": round(g.wall_seconds, 1),
        "productiveSeconds": round(g.buckets[gp.PRODUCTIVE], 1),
        "deviceProductiveSeconds": round(g.device_ratio * g.wall_seconds, 1),
        "lostSteps": g.lost_steps,
        "breakdown": {BREAKDOWN_KEYS[b]: round(g.buckets[b], 1) for b in gp.BUCKETS},
        "asOf": format_time(record.as_of),
        "ledger": {
            "start": _round(led.start),
            "closedUntil": _round(led.closed_until),
            "closed": {BREAKDOWN_KEYS[b]: _round(led.closed.get(b, 0.0)) for b in gp.BUCKETS},
            "lostSteps": led.lost_steps, "closedDeviceProductive": _round(led.closed_device_productive),
            "carry": None if led.carry is None else {
                "step": led.carry.step, "stepSeconds": _round(led.carry.step_seconds),
                "productiveSeconds": _round(led.carry.productive), "devicesShare": _share(led.carry.devices_share)},
            "current": None if cur is None else {
                "generation": cur.generation, "firstStep": cur.first_step, "lastStep": cur.last_step,
                "blockingSeconds": _round(cur.blocking_seconds), "hang": cur.hang or None,
                "devicesShare": _share(cur.devices_share),
                **{key: None if getattr(cur, attr) is None else _round(getattr(cur, attr)) for attr, key in _MARK_KEYS}},
        },
    }


def parse_goodput(raw: Any) -> GoodputRecord | None:
    """status.goodput -> GoodputRecord (None when absent or unreadable: the accounting starts again)."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("ledger"), Mapping):
        return None
    led = raw["ledger"]
    try:
        as_of = parse_time(raw.get("asOf"))
        start = float(led["start"])
        closed = {b: float((led.get("closed") or {}).get(BREAKDOWN_KEYS[b]) or 0.0) for b in gp.BUCKETS}
        carry_raw = led.get("carry")
        carry = None if not isinstance(carry_raw, Mapping) else gp.Carry(
            int(carry_raw["step"]), float(carry_raw.get("stepSeconds") or 0.0),
            float(carry_raw.get("productiveSeconds") or 0.0), float(carry_raw.get("devicesShare") or 1.0))
        cur_raw = led.get("current")
        current = None
        if isinstance(cur_raw, Mapping):
            current = gp.GenerationMarks(
                generation=int(cur_raw["generation"]),
                first_step=None if cur_raw.get("firstStep") is None else int(cur_raw["firstStep"]),
                last_step=None if cur_raw.get("lastStep") is None else int(cur_raw["lastStep"]),
                blocking_seconds=float(cur_raw.get("blockingSeconds") or 0.0), hang=cur_raw.get("hang") is True,
                devices_share=float(cur_raw.get("devicesShare") or 1.0),
                **{attr: _num(cur_raw.get(key), float) for attr, key in _MARK_KEYS})
    except (KeyError, TypeError, ValueError):
        return None
    if as_of is None:
        return None
    ledger = gp.Ledger(start=start, closed=closed, closed_until=float(led.get("closedUntil") or start),
                       lost_steps=int(led.get("lostSteps") or 0), carry=carry, current=current,
                       closed_device_productive=float(led.get("closedDeviceProductive", closed[gp.PRODUCTIVE])))
    return GoodputRecord(ledger, as_of)
