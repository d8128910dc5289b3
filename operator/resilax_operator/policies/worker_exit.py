"""Worker exit: a worker of the running generation ended, or its pod went away.

The first row that matches (pods by name) decides:

| the pod                                                  | decision                                   |
|----------------------------------------------------------|--------------------------------------------|
| trainer exited 75 (stopped for rescheduling)             | WorkerStopped (not counted)                |
| Failed by the node or cluster (Evicted, ...; no exit code) | PodLost (not counted)                    |
| Failed (the worker's own exit code)                      | WorkerFailure: counted; backoff, or Failed past maxRestarts |
| every worker Succeeded                                   | Succeeded (Completed)                      |
| deleted by someone else, or missing once created         | PodLost                                    |
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Final

from .. import api
from .. import status as st
from ..actions import Action, EmitEvent, SetStatus, status_change
from ..observed import Observed
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus
from . import Finding, Verdict
from .generation_start import expected_pod_names
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
        if p.phase == "Failed" and p.pod_reason in POD_FAILURE_REASONS and p.exit_code is None:
            return Finding(st.POD_LOST, api.POD_LOST.name, api.POD_LOST.format(pod=p.name, generation=g)
                           + f" ({p.pod_reason})")
    for p in pods:
        if p.phase == "Failed":
            detail = f"exit code {p.exit_code}" if p.exit_code is not None else "no exit code"
            if p.exit_reason:
                detail += f" ({p.exit_reason})"
            return counted_failure(spec, observed, s, settings,
                            api.WORKER_FAILED.format(pod=p.name, generation=g, detail=detail))
    if s.workers_created and len(pods) == s.hosts and all(p.phase == "Succeeded" for p in pods):
        message = api.COMPLETED.format(generation=g)
        new = replace(s, phase=api.PHASE_SUCCEEDED)
        new = st.set_condition(new, api.COND_READY, False, api.COMPLETED.name, message, observed.now)
        return status_change(observed.status, new, EmitEvent("Normal", api.COMPLETED.name, message))
    deleted = [p.name for p in pods if p.deletion_timestamp is not None]
    names = expected_pod_names(observed.job, s)
    missing = sorted(set(names) - {p.name for p in pods})
    if deleted or (s.workers_created and missing) or (not s.workers_created and names[0] in missing and pods):
        return Finding(st.POD_LOST, api.POD_LOST.name, api.POD_LOST.format(pod=(deleted or missing)[0], generation=g))
    return None


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
