"""The operator's Prometheus metrics, each defined once. Labels are bounded: a transition kind, or a
job's namespace and name (one series per JAXJob, removed when the job goes); never a step or a path.

Fed from the status changes the operator writes (`record_status`), so they follow what the operator
did, not what a log line says:
- a transition recorded → `resilax_operator_recoveries_total{kind}`;
- the generation bumps → `resilax_operator_generations_total`;
- the first time a new generation is Running after a transition → `resilax_operator_recovery_seconds`
  (from the transition's start, i.e. when the fault was noticed, to all workers Running) and
  `resilax_operator_steps_lost` (0 when a final save committed; otherwise unknown to the operator,
  which never sees the step the workers reached, so not observed);
- every reconcile → `resilax_operator_checkpoint_age_seconds{namespace,job}` (now − when the operator
  first saw the newest checkpoint).
"""

from __future__ import annotations

import contextlib
import threading
from datetime import datetime
from typing import Final

from prometheus_client import Counter, Gauge, Histogram

from . import api
from . import status as st
from .builders import JobRef
from .reconcile import Observed

RECOVERIES: Final = Counter("resilax_operator_recoveries_total",
                            "Moves to a new generation, by why (NodeLoss, Preemption, Resize, ...)", ["kind"])
RECOVERY_SECONDS: Final = Histogram(
    "resilax_operator_recovery_seconds", "From a transition's start (fault noticed) to the new generation Running",
    ["kind"], buckets=(5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1200))
STEPS_LOST: Final = Histogram("resilax_operator_steps_lost", "Training steps redone after a transition, where known",
                              ["kind"], buckets=(0, 1, 10, 100, 1000, 10000))
CHECKPOINT_AGE: Final = Gauge("resilax_operator_checkpoint_age_seconds",
                              "Seconds since the operator first saw the job's newest checkpoint", ["namespace", "job"])
GENERATIONS: Final = Counter("resilax_operator_generations_total", "Generations (sets of workers) started")

_lock = threading.Lock()
#: job uid -> (kind, since, final save committed) of the last transition, until its generation runs.
_pending: dict[str, tuple[str, datetime, bool]] = {}


def record_status(job: JobRef, before: st.JobStatus, after: st.JobStatus, now: datetime) -> None:
    """Called with every status the operator writes (and the one it replaces)."""
    with _lock:
        t = after.transition
        if t is not None and (before.transition is None or before.transition.since != t.since
                              or before.transition.kind != t.kind):
            RECOVERIES.labels(t.kind).inc()
        if t is not None:
            committed = t.save_done and after.checkpoint is not None and (
                before.checkpoint is None or after.checkpoint.step != before.checkpoint.step)
            previous = _pending.get(job.uid)
            _pending[job.uid] = (t.kind, t.since, committed or (previous is not None and previous[2]))
        if after.generation > before.generation:
            GENERATIONS.inc()
        if after.phase == api.PHASE_RUNNING and before.phase != api.PHASE_RUNNING and job.uid in _pending:
            kind, since, saved = _pending.pop(job.uid)
            RECOVERY_SECONDS.labels(kind).observe(max(0.0, (now - since).total_seconds()))
            if saved:
                STEPS_LOST.labels(kind).observe(0)


def record_checkpoint(observed: Observed) -> None:
    ck = observed.status.checkpoint
    if ck is not None and ck.time is not None:
        CHECKPOINT_AGE.labels(observed.job.namespace, observed.job.name).set(
            max(0.0, (observed.now - ck.time).total_seconds()))


def forget_job(job: JobRef) -> None:
    with _lock:
        _pending.pop(job.uid, None)
    with contextlib.suppress(KeyError):
        CHECKPOINT_AGE.remove(job.namespace, job.name)
