"""The worker pods a decision sees (pure): `ObservedPod` (phase, node, the trainer's state and exit,
waiting and start-up reasons, gates, owner) and its parser from a Pod."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from .. import api
from .. import status as st
from ..ownership import owner_uid


@dataclass(frozen=True)
class HealthResult:
    """What a worker pod's `resilax health-check` init container reported once it terminated."""

    exit_code: int
    #: The part that failed (rendezvous, devices, matmul, collective); None when it passed or said nothing.
    failed_part: str | None = None
    reason: str = ""
    #: The failure is the host's own (devices, matmul): the check's `host_fault`.
    host_fault: bool = False


def parse_health_result(exit_code: int, message: str) -> HealthResult:
    """The health-check container's exit code and termination message (its JSON result, possibly cut or
    absent) → HealthResult. Without a readable result a non-zero exit blames no host (pure)."""
    try:
        raw = json.loads(message) if message else {}
    except ValueError:
        raw = {}
    if not isinstance(raw, Mapping):
        raw = {}
    part = raw.get("failed_part")
    reason = str(raw.get("reason") or ("" if exit_code == 0 else f"exit code {exit_code}, no readable result"))
    return HealthResult(exit_code, str(part) if part else None, reason[:500],
                        exit_code != 0 and raw.get("host_fault") is True)


#: Waiting reasons of a container that is simply starting (not stuck).
STARTING_REASONS: Final = frozenset({"ContainerCreating", "PodInitializing"})


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
    #: sidecar's `trainer_process` (observed/trainer_process.py), not the kubelet.
    supervised: bool = False
    #: The trainer container's readiness (for a supervised trainer: its incarnation runs).
    trainer_ready: bool = False
    #: While the trainer is not ready: since when (the pod's Ready condition turned False, or the trainer
    #: container started, whichever is later); None while it is ready or when no time is known.
    trainer_not_ready_since: datetime | None = None
    #: uid of the JAXJob that controls the pod (its controller ownerReference); "" for none.
    owner_uid: str = ""
    #: (container, reason) of each container still in a start-up state (ContainerCreating, PodInitializing).
    starting: tuple[tuple[str, str], ...] = ()
    #: When the pod was bound to its node (the PodScheduled condition's lastTransitionTime).
    scheduled_at: datetime | None = None
    #: (container, exit code) of each container (init or not) whose current state is terminated.
    container_exits: tuple[tuple[str, int], ...] = ()
    #: The kubelet says the trainer container itself has terminated (its supervisor with it): nothing in
    #: the pod can start the next incarnation, so it is no survivor for an in-place restart.
    trainer_container_ended: bool = False
    #: "<reason>: <message>" of a True `TerminationTarget` condition: a queue (Kueue) stopped the pod's
    #: group (preempted or evicted it) and deletes the pod; None otherwise.
    queue_stop: str | None = None
    #: Its checkpoint freshness annotations (api.FRESHNESS_ANNOTATIONS), sorted (key, value) pairs.
    freshness: tuple[tuple[str, str], ...] = ()
    #: Its health-check init container's result once that terminated (spec.recovery.healthCheck); None
    #: before, or without one.
    health: HealthResult | None = None
    #: Its process index in its generation (label resilax.dev/process); None without a readable one.
    process: int | None = None

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

    @property
    def trainer_never_started(self) -> bool:
        """The trainer container has not run at all (the pod is unscheduled, its image or an init
        container such as the health check has not let it start): no state of its own to save."""
        return self.trainer_started_at is None and not self.trainer_running and self.exit_code is None


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
    process = labels.get(api.LABEL_PROCESS)
    spec = raw.get("spec") or {}
    status = raw.get("status") or {}
    containers = [c.get("name") for c in spec.get("containers") or []]
    trainer = api.TRAINER_CONTAINER if api.TRAINER_CONTAINER in containers else (containers[0] if containers else None)
    exit_code = exit_reason = None
    trainer_running = trainer_ready = trainer_ended = False
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
            trainer_ended = bool(terminated)
            if terminated:
                code = terminated.get("exitCode")
                exit_code = None if code is None else int(code)
                exit_reason = terminated.get("reason")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    not_ready_since = None if trainer_ready or trainer is None else _not_ready_since(status, started_at)
    statuses = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    waiting = tuple(
        (str(cs.get("name", "")), str(w.get("reason")), str(w.get("message") or ""))
        for cs in statuses
        if (w := (cs.get("state") or {}).get("waiting")) and w.get("reason") and w.get("reason") not in STARTING_REASONS)
    starting = tuple((str(cs.get("name", "")), str(w.get("reason"))) for cs in statuses
                     if (w := (cs.get("state") or {}).get("waiting")) and w.get("reason") in STARTING_REASONS)
    scheduled: Mapping[str, Any] = next((c for c in status.get("conditions") or []
                      if c.get("type") == "PodScheduled" and c.get("status") == "True"), {})
    container_exits = tuple((str(cs.get("name", "")), int(t["exitCode"])) for cs in statuses
                            if (t := (cs.get("state") or {}).get("terminated")) and t.get("exitCode") is not None)
    health = None
    for cs in status.get("initContainerStatuses") or []:
        if cs.get("name") == api.HEALTH_CHECK_CONTAINER:
            t = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if t and t.get("exitCode") is not None:
                health = parse_health_result(int(t["exitCode"]), str(t.get("message") or ""))
    grace = meta.get("deletionGracePeriodSeconds")
    stop: Mapping[str, Any] = next((c for c in status.get("conditions") or []
                                    if c.get("type") == api.KUEUE_STOP_CONDITION and c.get("status") == "True"), {})
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
        trainer_not_ready_since=not_ready_since,
        owner_uid=owner_uid(raw), starting=starting, scheduled_at=_time_or_none(scheduled.get("lastTransitionTime")),
        container_exits=container_exits, queue_stop=_queue_stop(stop), freshness=pick_freshness(meta),
        health=health, trainer_container_ended=trainer_ended, process=int(process) if isinstance(process, str) and process.isdigit() else None)


def _not_ready_since(status: Mapping[str, Any], started_at: datetime | None) -> datetime | None:
    """Since when a trainer that is not ready has been so: the later of the pod's Ready condition turning
    False (its lastTransitionTime; the pod is not ready while one of its containers is not) and the trainer
    container's start (it could not be ready before). None when neither is known."""
    condition: Mapping[str, Any] = next((c for c in status.get("conditions") or []
                                         if c.get("type") == "Ready" and c.get("status") != "True"), {})
    times = [t for t in (_time_or_none(condition.get("lastTransitionTime")), started_at) if t is not None]
    return max(times, default=None)


def pick_freshness(meta: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """An object's checkpoint freshness annotations (api.FRESHNESS_ANNOTATIONS) from its metadata."""
    notes = meta.get("annotations") or {}
    return tuple(sorted((k, str(notes[k])) for k in api.FRESHNESS_ANNOTATIONS if notes.get(k) is not None))


def _queue_stop(condition: Mapping[str, Any]) -> str | None:
    """`ObservedPod.queue_stop` from the TerminationTarget condition ({} when the pod has none)."""
    if not condition:
        return None
    reason, message = str(condition.get("reason") or "Stopped"), str(condition.get("message") or "")
    return f"{reason}: {message}" if message else reason


def _time_or_none(raw: Any) -> datetime | None:
    try:
        return st.parse_time(raw)
    except ValueError:
        return None
