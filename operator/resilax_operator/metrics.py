"""The operator's Prometheus metrics, each defined once. Labels are bounded: a transition kind, or a
job's namespace and name (one series per JAXJob, removed when the job goes); never a step or a path.

Fed from the status changes the operator writes (`record_status`), so they follow what the operator
did, not what a log line says:
- a transition recorded, or an in-place restart begun from a finding (status.inPlace, its `kind`) →
  `resilax_operator_recoveries_total{namespace,jaxjob,kind}`;
- the generation bumps → `resilax_operator_generations_total`;
- the first time a new generation is Running after a transition → `resilax_operator_recovery_seconds`
  (from the transition's start, i.e. when the fault was noticed, to all workers Running);
- pod 0's sidecar state (`record_worker_state`, every reconcile that reads it): the step the old
  generation's trainer last reported (`trainer.step`) and the step the new generation restored
  (`restore.step`, else `trainer.restored_step`) → `resilax_operator_steps_lost{namespace,jaxjob,kind}` = reached − restored, once per transition
  (reached also from the sidecars' last words, `record_reached`: the trainers' real last step, however
  fast their pods ended). Without a trainer report, 0 when a final save committed, else not observed;
- every reconcile → `resilax_operator_checkpoint_age_seconds{namespace,jaxjob}` (now − when the
  operator first saw the newest checkpoint);
- every reconcile and every status written → `resilax_operator_job_phase{namespace,jaxjob,phase}` (1 for
  the job's phase, 0 for the others: every phase has its series) and
  `resilax_operator_job_generation{namespace,jaxjob}` and `resilax_operator_job_invalid_spec{namespace,jaxjob}`
  (1 while InvalidSpec is True); the job's recovery series, every kind, at 0 from its first status;
- a node recorded in status.unhealthyNodes (its health check failed) → the new failures in
  `resilax_operator_node_health_check_failures_total{node}` (node names are bounded by the cluster);
- every reconcile and every status written, for a job with `recovery.spareSlices` →
  `resilax_operator_spare_slices{namespace,jaxjob,state}` (state `desired` or `ready`: status.spares);
- every reconcile → `resilax_operator_goodput_ratio{namespace,jaxjob}` and
  `resilax_operator_goodput_seconds{namespace,jaxjob,bucket}` (the job's goodput accounting as of now,
  status_fields/goodput.py; the buckets sum to the wall time since its first generation was created; status.goodput
  holds the same, refreshed less often). Gauges: a bucket can shrink (lost steps move time out of
  productive once a later generation's restore shows them).

`resilax_build_info{version,component="operator"}` is 1 from import on (the sidecar has its own, with
`component="sidecar"`). A job's series go with the job (`forget_job`).

A job's labels are `namespace` and `jaxjob`, never `job`: Prometheus sets `job` on every target, and a
scraped `job` label would be renamed `exported_job`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import threading
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final

from prometheus_client import Counter, Gauge, Histogram

from . import api
from . import status as st
from .builders import JobRef
from .observed.snapshot import Observed
from .status_fields import goodput as gp

#: The per-job recovery metrics' labels: the job, and the transition kind (st.TRANSITION_KINDS, bounded).
RECOVERY_LABELS: Final = ("namespace", "jaxjob", "kind")
RECOVERIES: Final = Counter("resilax_operator_recoveries_total",
                            "Moves to a new generation, by why (NodeLoss, Preemption, Resize, ...)", RECOVERY_LABELS)
RECOVERY_SECONDS: Final = Histogram(
    "resilax_operator_recovery_seconds", "From a transition's start (fault noticed) to the new generation Running",
    RECOVERY_LABELS, buckets=(5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1200))
STEPS_LOST: Final = Histogram("resilax_operator_steps_lost", "Training steps redone after a transition, where known",
                              RECOVERY_LABELS, buckets=(0, 1, 10, 100, 1000, 10000))
CHECKPOINT_AGE: Final = Gauge("resilax_operator_checkpoint_age_seconds",
                              "Seconds since the operator first saw the job's newest checkpoint", ["namespace", "jaxjob"])
GOODPUT_RATIO: Final = Gauge("resilax_operator_goodput_ratio",
                             "Productive seconds / wall seconds since the job's first generation", ["namespace", "jaxjob"])
GOODPUT_SECONDS: Final = Gauge("resilax_operator_goodput_seconds",
                               "The job's wall time by where it went (bucket: productive, checkpoint_blocking, "
                               "lost_steps_redone, detection, teardown, scheduling, jax_startup, restore, other)",
                               ["namespace", "jaxjob", "bucket"])
GENERATIONS: Final = Counter("resilax_operator_generations_total", "Generations (sets of workers) started")
JOB_PHASE: Final = Gauge("resilax_operator_job_phase", "1 for the job's current phase, 0 for the other phases",
                         ["namespace", "jaxjob", "phase"])
JOB_GENERATION: Final = Gauge("resilax_operator_job_generation", "The job's current generation (status.generation)",
                              ["namespace", "jaxjob"])
JOB_INVALID_SPEC: Final = Gauge("resilax_operator_job_invalid_spec",
                                "1 while the job's InvalidSpec condition is True (its spec, or an edit of it, is refused)",
                                ["namespace", "jaxjob"])
NODE_HEALTH_CHECK_FAILURES: Final = Counter(
    "resilax_operator_node_health_check_failures_total",
    "Health checks a node failed on its own part (devices, matmul) before a generation's trainer started; the "
    "node is kept out of that job's generations (status.unhealthyNodes). For the platform team: a node that "
    "fails repeatedly is bad hardware", ["node"])
SPARE_SLICES: Final = Gauge("resilax_operator_spare_slices",
                            "The job's spare slices (spec.recovery.spareSlices): desired, and ready (every placeholder running)",
                            ("namespace", "jaxjob", "state"))
BUILD_INFO: Final = Gauge("resilax_build_info", "Always 1: the running component and its version",
                          ["version", "component"])


def package_version() -> str:
    """The installed `resilax` distribution's version ("unknown" when run from a bare checkout)."""
    try:
        return importlib.metadata.version("resilax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


BUILD_INFO.labels(package_version(), "operator").set(1)

_lock = threading.Lock()
#: job uid -> (kind, since, final save committed) of the last transition, until its generation runs.
_pending: dict[str, tuple[str, datetime, bool]] = {}
#: job uid -> generation -> the newest step its trainer reported.
_reached: dict[str, dict[int, int]] = {}
#: job uid -> (generation, kind, final save committed): a Running generation whose restore is awaited.
_awaiting_restore: dict[str, tuple[int, str, bool]] = {}
#: the jobs whose recovery series (every kind, at 0) exist.
_series_made: set[str] = set()


def record_status(job: JobRef, before: st.JobStatus, after: st.JobStatus, now: datetime) -> None:
    """Called with every status the operator writes (and the one it replaces)."""
    record_job_status(job, after)
    with _lock:
        t = after.transition
        if t is not None and (before.transition is None or before.transition.since != t.since
                              or before.transition.kind != t.kind):
            RECOVERIES.labels(job.namespace, job.name, t.kind).inc()
        if t is not None:
            committed = t.save_done and after.checkpoint is not None and (
                before.checkpoint is None or after.checkpoint.step != before.checkpoint.step)
            previous = _pending.get(job.uid)
            _pending[job.uid] = (t.kind, t.since, committed or (previous is not None and previous[2]))
        ip = after.in_place
        if ip is not None and before.transition is None and (
                before.in_place is None or (before.in_place.since, before.in_place.kind) != (ip.since, ip.kind)):
            # an in-place restart begun from a finding (a planned move's transition was counted above)
            RECOVERIES.labels(job.namespace, job.name, ip.kind).inc()
            _pending[job.uid] = (ip.kind, ip.since, False)
        if after.generation > before.generation:
            GENERATIONS.inc()
        for node, more in count_new_health_failures(before, after):
            NODE_HEALTH_CHECK_FAILURES.labels(node).inc(more)
        if after.phase == api.PHASE_RUNNING and before.phase != api.PHASE_RUNNING and job.uid in _pending:
            kind, since, saved = _pending.pop(job.uid)
            RECOVERY_SECONDS.labels(job.namespace, job.name, kind).observe(max(0.0, (now - since).total_seconds()))
            _awaiting_restore[job.uid] = (after.generation, kind, saved)


def count_new_health_failures(before: st.JobStatus, after: st.JobStatus) -> list[tuple[str, int]]:
    """(node, failures) recorded in status.unhealthyNodes by this status write (pure)."""
    old = {n.node: n.failures for n in before.unhealthy_nodes}
    return [(n.node, n.failures - old.get(n.node, 0)) for n in after.unhealthy_nodes
            if n.failures > old.get(n.node, 0)]


def steps_lost(reached: Mapping[int, int], generation: int, restored: int | None, saved: bool) -> int | None:
    """Steps a recovery to `generation` lost: the newest step an older generation's trainer reported
    minus the step `generation` restored (None: from scratch, step 0). Without a report from an older
    generation: 0 when the final save committed, else unknown (None)."""
    older = [step for gen, step in reached.items() if gen < generation]
    if older:
        return max(0, max(older) - (restored or 0))
    return 0 if saved else None


def record_reached(job: JobRef, generation: int, step: int) -> None:
    """A trainer of `generation` reached `step` (a sidecar's last words)."""
    with _lock:
        _reach(job, generation, step)


def _reach(job: JobRef, generation: int, step: int) -> None:
    steps = _reached.setdefault(job.uid, {})
    steps[generation] = max(steps.get(generation, 0), step)


def record_worker_state(job: JobRef, generation: int, state: Mapping[str, Any]) -> None:
    """Pod 0's sidecar `/v1/state` of `generation`: the trainer's step, and the step it restored."""
    trainer, restore = state.get("trainer"), state.get("restore")
    with _lock:
        if isinstance(trainer, Mapping) and isinstance(trainer.get("step"), int):
            _reach(job, _generation_of(trainer, generation), int(trainer["step"]))
        awaiting = _awaiting_restore.get(job.uid)
        if awaiting is None or awaiting[0] != generation:
            return
        # A pod kept by an in-place restart reports its old incarnation's figures until the new trainer
        # writes its own: evidence of `generation`'s restore only when they name it (or name none).
        if isinstance(trainer, Mapping) and _generation_of(trainer, generation) != generation:
            trainer = None
        if isinstance(restore, Mapping) and _generation_of(restore, generation) != generation:
            restore = None
        # The step restored: the manager's restore report (a restore of the newest step), else the
        # trainer's figures (any restore; a trainer stepping without one started from scratch).
        if isinstance(restore, Mapping):
            restored = restore.get("step")
        elif isinstance(trainer, Mapping) and trainer.get("restores"):
            restored = trainer.get("restored_step")
        elif isinstance(trainer, Mapping) and trainer.get("step") is not None:
            restored = None
        else:
            return  # the new trainer has not restored yet
        _, kind, saved = _awaiting_restore.pop(job.uid)
        lost = steps_lost(_reached.get(job.uid, {}), generation, restored if isinstance(restored, int) else None,
                          saved)
        if lost is not None:
            STEPS_LOST.labels(job.namespace, job.name, kind).observe(lost)
        _reached[job.uid] = {g: s for g, s in _reached.get(job.uid, {}).items() if g >= generation}


def _generation_of(report: Mapping[str, Any], default: int) -> int:
    """The generation a sidecar's `trainer` or `restore` report names (`default` when it names none)."""
    value = report.get("generation")
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def record_job_status(job: JobRef, status: st.JobStatus) -> None:
    """The job's phase and generation gauges (every phase has its series: 1 for the current one)."""
    for phase in api.PHASES:
        JOB_PHASE.labels(job.namespace, job.name, phase).set(1 if status.phase == phase else 0)
    JOB_GENERATION.labels(job.namespace, job.name).set(status.generation)
    invalid = status.condition(api.COND_INVALID_SPEC)
    JOB_INVALID_SPEC.labels(job.namespace, job.name).set(1 if invalid is not None and invalid.status == "True" else 0)
    if status.spares is not None:
        SPARE_SLICES.labels(job.namespace, job.name, "desired").set(status.spares.desired)
        SPARE_SLICES.labels(job.namespace, job.name, "ready").set(status.spares.ready)
    with _lock:
        if job.uid in _series_made:
            return
        _series_made.add(job.uid)
        for kind in st.TRANSITION_KINDS:  # every kind's series at 0 from the job's start: increase() sees the first
            for metric in (RECOVERIES, RECOVERY_SECONDS, STEPS_LOST):
                metric.labels(job.namespace, job.name, kind)


def record_checkpoint(observed: Observed) -> None:
    """Every reconcile: the checkpoint's age, and the job's phase and generation as observed."""
    record_job_status(observed.job, observed.status)
    ck = observed.status.checkpoint
    if ck is not None and ck.time is not None:
        CHECKPOINT_AGE.labels(observed.job.namespace, observed.job.name).set(
            max(0.0, (observed.now - ck.time).total_seconds()))


def record_goodput(job: JobRef, record: st.GoodputRecord | None) -> None:
    """The job's goodput figures (`goodput_status.current`), every reconcile."""
    if record is None:
        return
    g = record.summary()
    GOODPUT_RATIO.labels(job.namespace, job.name).set(g.ratio)
    for bucket in gp.BUCKETS:
        GOODPUT_SECONDS.labels(job.namespace, job.name, bucket).set(g.buckets[bucket])


def forget_job(job: JobRef) -> None:
    with _lock:
        _pending.pop(job.uid, None)
        _reached.pop(job.uid, None)
        _awaiting_restore.pop(job.uid, None)
        _series_made.discard(job.uid)
    with contextlib.suppress(KeyError):
        CHECKPOINT_AGE.remove(job.namespace, job.name)
    with contextlib.suppress(KeyError):
        GOODPUT_RATIO.remove(job.namespace, job.name)
    for bucket in gp.BUCKETS:
        with contextlib.suppress(KeyError):
            GOODPUT_SECONDS.remove(job.namespace, job.name, bucket)
    for state in ("desired", "ready"):
        with contextlib.suppress(KeyError):
            SPARE_SLICES.remove(job.namespace, job.name, state)
    for phase in api.PHASES:
        with contextlib.suppress(KeyError):
            JOB_PHASE.remove(job.namespace, job.name, phase)
    for gauge in (JOB_GENERATION, JOB_INVALID_SPEC):
        with contextlib.suppress(KeyError):
            gauge.remove(job.namespace, job.name)
    for kind in st.TRANSITION_KINDS:
        for metric in (RECOVERIES, RECOVERY_SECONDS, STEPS_LOST):
            with contextlib.suppress(KeyError):
                metric.remove(job.namespace, job.name, kind)
