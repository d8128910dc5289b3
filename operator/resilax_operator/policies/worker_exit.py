"""Worker exit: a worker of the running generation ended, or its pod went away.

The first row that matches (pods by name) decides:

| the pod                                                  | decision                                   |
|----------------------------------------------------------|--------------------------------------------|
| trainer exited 75 (stopped for rescheduling)             | WorkerStopped (not counted)                |
| trainer exited 78 (a live job of another uid holds the storage) | Failed, StorageInUse naming that job (not retried: it would take the storage over) |
| Failed by the node or cluster (Evicted, ...; no exit code) | PodLost (not counted)                    |
| trainer aborted (exit 134) while the Lease of a Ready node hosting another worker has not been renewed since, for less than peerLostTimeoutSeconds | Ready=False WorkerAborted, wait: that Lease proves the node down (node_loss.py: NodeLoss at once) or alive (the row below) |
| Failed (the worker's own exit code, not 76)              | WorkerFailure: counted; backoff, or Failed past maxRestarts |
| supervised, its trainer (running SIDECAR_START_SECONDS) not ready for SILENCE_SECONDS and its sidecar silent (trainer_process.unreachable_workers) | WorkerUnreachable: PodLost (not counted): its exit cannot be learnt |
| trainer exited 76 (a peer process is gone), for less than peerLostTimeoutSeconds | Ready=False PeerLost, wait for the cause: a node down (node_loss.py: NodeLoss at once) or a peer's own failure (the row above) |
| trainer exited 76, no cause found in that time           | PodLost (not counted)                      |
| every worker Succeeded                                   | Succeeded (Completed)                      |
| deleted by someone else, or missing once created         | PodLost                                    |
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Final

from .. import api
from .. import status as st
from ..actions import POLL_SECONDS, Action, EmitEvent, RequeueAfter, SetStatus, status_change
from ..observed.snapshot import Observed, ObservedPod
from ..observed.trainer_process import unreachable_workers
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus
from . import Finding, Verdict
from .transition import plan_delete

#: Pod status reasons that mean the node or the cluster ended the pod, not the worker: not counted
#: against recovery.maxRestarts.
POD_FAILURE_REASONS: Final = frozenset({"Evicted", "NodeShutdown", "Terminated", "NodeAffinity", "Preempting",
                                        "UnexpectedAdmissionError", "OutOfpods", "OutOfcpu", "OutOfmemory"})


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Verdict:
    g = s.generation
    pods = observed.pods_of(g)
    for p in pods:
        if p.exit_code == api.EXIT_CODE_STOPPED:
            return Finding(st.WORKER_STOPPED, api.WORKER_STOPPED.name,
                           api.WORKER_STOPPED.format(pod=p.name, generation=g, code=p.exit_code))
    for p in pods:
        if p.exit_code == api.EXIT_CODE_STORAGE_IN_USE:
            return storage_in_use(spec, observed, s, settings, p.name)
    for p in pods:
        if p.phase == "Failed" and p.pod_reason in POD_FAILURE_REASONS and p.exit_code is None:
            return Finding(st.POD_LOST, api.POD_LOST.name, api.POD_LOST.format(pod=p.name, generation=g)
                           + f" ({p.pod_reason})")
    for p in pods:
        if p.failed and p.exit_code != api.EXIT_CODE_PEER_LOST:
            if (wait := wait_for_abort_cause(observed, s, settings, p)) is not None:
                return wait
            detail = f"exit code {p.exit_code}" if p.exit_code is not None else "no exit code"
            if p.exit_reason:
                detail += f" ({p.exit_reason})"
            return counted_failure(spec, observed, s, settings,
                            api.WORKER_FAILED.format(pod=p.name, generation=g, detail=detail))
    unheard = unreachable_workers(observed)
    if unheard:
        first, seconds = unheard[0]
        return Finding(st.POD_LOST, api.WORKER_UNREACHABLE.name, api.WORKER_UNREACHABLE.format(
            pod=first.name, generation=g, seconds=int(seconds), count=len(unheard), hosts=len(pods)))
    peer_lost = peer_lost_since(pods)
    if peer_lost is not None:
        return wait_for_peer_loss_cause(observed, s, settings, peer_lost)
    if s.workers_created and len(pods) == s.hosts and all(p.phase == "Succeeded" for p in pods):
        message = api.COMPLETED.format(generation=g)
        new = replace(s, phase=api.PHASE_SUCCEEDED)
        new = st.set_condition(new, api.COND_READY, False, api.COMPLETED.name, message, observed.now)
        return status_change(observed.status, new, EmitEvent("Normal", api.COMPLETED.name, message))
    deleted = [p.name for p in pods if p.deletion_timestamp is not None]
    names = s.pod_names(observed.job.name)
    missing = sorted(set(names) - {p.name for p in pods})
    if deleted or (s.workers_created and missing) or (not s.workers_created and names[0] in missing and pods):
        return Finding(st.POD_LOST, api.POD_LOST.name, api.POD_LOST.format(pod=(deleted or missing)[0], generation=g))
    return None


def storage_in_use(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings,
                   pod: str) -> list[Action]:
    """A worker refused the storage: another live JAXJob holds it. The job fails (a retry would only be
    refused again, or fence that job out if it finished meanwhile), naming the jobs it shares the
    storage with; the user gives it its own storage or sets spec.checkpoint.takeOver."""
    holders = ", ".join(f"JAXJob {name} (uid {uid})" for uid, name in observed.storage_sharers) or "another JAXJob"
    text = api.STORAGE_IN_USE.format(storage=spec.checkpoint.storage, holders=holders, pod=pod)
    new = replace(s, phase=api.PHASE_FAILED)
    new = st.set_condition(new, api.COND_READY, False, api.STORAGE_IN_USE.name, text, observed.now)
    return [SetStatus(new), EmitEvent("Warning", api.STORAGE_IN_USE.name, text),
            plan_delete(observed, spec, s.generation, "storage in use", settings)]


def peer_lost_since(pods: list[ObservedPod]) -> tuple[str, datetime] | None:
    """(the first, when it exited) of the workers that exited 76 (a peer process is gone); None if none."""
    lost = sorted((p.trainer_finished_at or datetime.max.replace(tzinfo=UTC), p.name) for p in pods
                   if p.exit_code == api.EXIT_CODE_PEER_LOST)
    return (lost[0][1], lost[0][0]) if lost else None


def wait_for_peer_loss_cause(observed: Observed, s: JobStatus, settings: OperatorSettings,
                             first: tuple[str, datetime]) -> Verdict:
    """Workers exited 76: their generation is broken, but not by them. Wait for the cause (the node
    rules and the failure row decide once it shows); past peerLostTimeoutSeconds, PodLost."""
    name, since = first
    seconds = settings.peer_lost_timeout_seconds
    message = api.PEER_LOST.format(pod=name, generation=s.generation, seconds=seconds)
    if since.year < 9999 and observed.now - since >= timedelta(seconds=seconds):
        return Finding(st.POD_LOST, api.PEER_LOST.name, message + "; no cause found: replacing the generation")
    # look again when a Lease read for the witness would prove its node down, if that comes sooner
    proofs = [(at - observed.now).total_seconds() for n in observed.nodes
              if n.ready == "True" and (at := n.lease_proof_at()) is not None and at > observed.now]
    return _waiting(observed, s, api.PEER_LOST.name, message, min([POLL_SECONDS, *(p + 0.2 for p in proofs)]))


def wait_for_abort_cause(observed: Observed, s: JobStatus, settings: OperatorSettings,
                         pod: ObservedPod) -> list[Action] | None:
    """A worker aborted (exit 134): JAX's coordination service aborts every surviving process once one
    task is gone, often before the Python error that would exit 76, so the abort may be a killed node's
    doing rather than the worker's. Wait while the Lease of a Ready node hosting another worker (not a
    witness itself) has not been renewed since the abort: past its proof time the node is down
    (node_loss.check_lost: NodeLoss at once, a spare taken); once renewed, the node lives and the abort is
    the worker's own failure (None: counted as before). At most peerLostTimeoutSeconds after the abort
    (a Lease that cannot be read). None for any other exit, or an abort of unknown time."""
    at = pod.trainer_finished_at
    if pod.exit_code != api.EXIT_CODE_ABORTED or at is None:
        return None
    now, limit = observed.now, at + timedelta(seconds=settings.peer_lost_timeout_seconds)
    if now >= limit:
        return None
    waiting: dict[str, datetime] = {}
    for q in observed.pods_of(s.generation):
        node = observed.node(q.node_name)
        if q.exit_code in api.PEER_LOSS_WITNESS_CODES or node is None or node.ready != "True":
            continue  # a witness's node lives (its exit was reported); a node not Ready: node_loss.py decides
        if node.lease_live_until is None:
            waiting[node.name] = limit  # not read (yet): read at every look while a witness exists
        elif node.lease_live_until - timedelta(seconds=node.lease_seconds) <= at:
            proof = node.lease_proof_at()
            waiting[node.name] = min(limit, proof if proof is not None else limit)
    if not waiting:
        return None
    until = max(waiting.values())
    message = api.ABORT_CAUSE_WAIT.format(pod=pod.name, generation=s.generation, seconds=settings.peer_lost_timeout_seconds,
                                          nodes=", ".join(sorted(waiting)))
    return _waiting(observed, s, api.ABORT_CAUSE_WAIT.name, message,
                    min(POLL_SECONDS, max(0.2, (until - now).total_seconds() + 0.2)))


def _waiting(observed: Observed, s: JobStatus, reason: str, message: str, seconds: float) -> list[Action]:
    """Ready=False with `reason` while the cause of an exit is awaited (a Warning event when that reason
    starts), and a look again in `seconds`."""
    new = st.set_condition(s, api.COND_READY, False, reason, message, observed.now)
    old = s.condition(api.COND_READY)
    events = [] if old is not None and old.reason == reason else [EmitEvent("Warning", reason, message)]
    return [*status_change(observed.status, new, *events), RequeueAfter(seconds)]


def counted_failure(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings,
             message: str) -> Finding | list[Action]:
    """A worker's own failure (also a crash-looping container, container_waiting.py): counted; the next generation after `recovery.backoffSeconds`, or the job
    fails (and keeps no workers) once the count exceeds `recovery.maxRestarts`."""
    now, failures, limit = observed.now, s.failures + 1, spec.recovery.max_restarts
    if failures > limit:
        text = api.MAX_RESTARTS_EXCEEDED.format(max_restarts=limit, detail=message)
        new = replace(s, phase=api.PHASE_FAILED, failures=failures)
        new = st.set_condition(new, api.COND_READY, False, api.MAX_RESTARTS_EXCEEDED.name, text, now)
        return [SetStatus(new), EmitEvent("Warning", api.MAX_RESTARTS_EXCEEDED.name, text),
                plan_delete(observed, spec, s.generation, "job failed", settings)]
    not_before = st.truncate(now) + timedelta(seconds=spec.recovery.backoff_seconds)
    backoff = EmitEvent("Warning", api.BACKOFF.name, api.BACKOFF.format(
        failures=failures, max_restarts=limit, until=st.format_time(not_before)))
    return Finding(st.WORKER_FAILURE, api.WORKER_FAILED.name, message, failure=True, not_before=not_before,
                   events=(backoff,))
