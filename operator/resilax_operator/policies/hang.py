"""Hangs (docs/architecture.md, "Hangs and stragglers"): a generation whose training makes no progress
past its hang timeout is hung, and is restarted without counting a failure.

What each worker's trainer reports (its sidecar's `trainer`, `Observed.hosts`; resilax_ckpt.control.trainer_metrics)
decides, for the workers of the running generation whose figures are of that generation:

| the worker's phase                      | no progress since            | allowance, automatic (`recovery.hangTimeoutSeconds` unset) |
|-----------------------------------------|------------------------------|---------------------------------------------------|
| `train`, after its warm-up (a p99 known) | it reached its last step     | max(floor, 10 x the p99 time between steps)       |
| `save` (a save blocks the loop)          | the save began               | max(floor, 5 x the p99 save blocking time)        |
| `init`, `restore`, or `train` in warm-up | the phase began (or its last step) | max(300 s, 3 x the last restore's seconds)  |

The floor is the operator's `hang_floor_seconds` (RESILAX_OPERATOR_HANG_FLOOR_SECONDS, default 60 s).
Times count from no earlier than when every worker of the generation runs (waiting for the others, a
generation still starting, is not a hang). An explicit `hangTimeoutSeconds` replaces the first two
allowances and is the least of the third; 0 turns detection off.

A worker past its allowance makes the generation hung. The worker named (`culprit`): the one whose
heartbeat stopped (a stopped or frozen process: the oldest heartbeat older than HEARTBEAT_STALE_SECONDS);
if every heartbeat is fresh (a collective or an input pipeline that never returns) the one with the
lowest last step; ties by pod name (pod 0 first). Finding `TrainerHung`: not a failure (a pod-level loss:
transition.py's backoff, so a hang that recurs backs off); in place when recovery.inPlace is Auto and the
pods qualify (the kept trainers are stopped with their stacks dumped first), else a full replacement.

`observed.sidecar.worth_asking_every_host`: observed/observe.py reads pod 0's figures every reconcile and every worker's only when
pod 0 looks stalled (the other workers then name the culprit): O(faults), not O(pods).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from .. import api
from .. import status as st
from ..observed.sidecar import HEARTBEAT_STALE_SECONDS
from ..observed.snapshot import HostFigures, Observed
from ..settings import OperatorSettings
from ..spec import HANG_DETECTION_OFF, JobSpec
from ..status import JobStatus
from . import Finding, Verdict

#: The default floor of the training and save allowances (OperatorSettings.hang_floor_seconds).
FLOOR_SECONDS: Final = float(OperatorSettings.hang_floor_seconds)
TRAIN_STEPS: Final = 10.0
SAVE_TIMES: Final = 5.0
START_FLOOR_SECONDS: Final = 300.0
RESTORE_TIMES: Final = 3.0


@dataclass(frozen=True)
class Stall:
    """One worker past its allowance, or the worker named for the hang."""

    pod: str
    figures: HostFigures
    stalled_seconds: float
    timeout_seconds: float
    basis: str


def allowance(spec: JobSpec, f: HostFigures, floor: float = FLOOR_SECONDS) -> tuple[float | None, float, str]:
    """(no progress since when: epoch seconds or None, the allowance in seconds, how it was set) for one
    worker's figures (module table), with `floor` the least automatic allowance in training and saves."""
    explicit = spec.recovery.hang_timeout_seconds
    if f.phase == "save" and (explicit or f.save_seconds_p99 is not None):
        if explicit:
            return f.phase_since, float(explicit), "recovery.hangTimeoutSeconds"
        assert f.save_seconds_p99 is not None
        return f.phase_since, max(floor, SAVE_TIMES * f.save_seconds_p99), \
            f"automatic: max({floor:g}s, {SAVE_TIMES:g} x p99 save {f.save_seconds_p99:.3g}s)"
    if f.phase == "train" and (explicit or f.step_seconds_p99 is not None):
        since = f.step_time if f.step_time is not None else f.phase_since
        if explicit:
            return since, float(explicit), "recovery.hangTimeoutSeconds"
        assert f.step_seconds_p99 is not None
        return since, max(floor, TRAIN_STEPS * f.step_seconds_p99), \
            f"automatic: max({floor:g}s, {TRAIN_STEPS:g} x p99 step {f.step_seconds_p99:.3g}s)"
    since = max((t for t in (f.phase_since, f.step_time) if t is not None), default=None)
    start = max(START_FLOOR_SECONDS, RESTORE_TIMES * f.last_restore_seconds, float(explicit or 0))
    return since, start, (f"start-up or restore: max({START_FLOOR_SECONDS:g}s, {RESTORE_TIMES:g} x last restore "
                          f"{f.last_restore_seconds:.3g}s" + (", recovery.hangTimeoutSeconds)" if explicit else ")"))


def all_running_since(observed: Observed, s: JobStatus) -> float | None:
    """When every worker of the running generation ran its trainer (epoch seconds; None: not all yet)."""
    pods = observed.pods_of(s.generation)
    if not s.workers_created or len(pods) < s.hosts or not pods:
        return None
    times = []
    for p in pods:
        tp = observed.trainer_processes.get(p.name)
        started = tp.started_at if tp is not None and tp.generation == s.generation and tp.started_at else None
        started = started or p.trainer_started_at  # a kept pod's container started before its new trainer
        if p.phase != "Running" or started is None:
            return None
        times.append(started.timestamp())
    if s.generation_start_time is not None:
        times.append(s.generation_start_time.timestamp())
    return max(times)


def generation_figures(observed: Observed, s: JobStatus) -> dict[str, HostFigures]:
    """Pod name → figures of the running generation's trainers (figures of another generation left out:
    a kept pod whose new trainer has not written yet still shows its old one's)."""
    names = {p.name for p in observed.pods_of(s.generation)}
    return {pod: f for pod, f in observed.hosts.items() if pod in names and f.generation == s.generation}


def decide(spec: JobSpec, observed: Observed, s: JobStatus, floor: float = FLOOR_SECONDS) -> Stall | None:
    """The hung worker, or None (not hung, detection off, not every worker running); `floor`: `allowance`."""
    if spec.recovery.hang_timeout_seconds == HANG_DETECTION_OFF or s.in_place is not None or s.transition is not None:
        return None
    running = all_running_since(observed, s)
    if running is None:
        return None
    now = observed.now.timestamp()
    figures = generation_figures(observed, s)
    stalls = []
    for pod, f in sorted(figures.items()):
        since, timeout, basis = allowance(spec, f, floor)
        if since is None:
            continue
        stalled = now - max(since, running)
        if stalled >= timeout:
            stalls.append(Stall(pod, f, stalled, timeout, basis))
    if not stalls:
        return None
    worst = max(stalls, key=lambda x: x.stalled_seconds - x.timeout_seconds)
    return replace_pod(worst, culprit(figures, now) or worst.pod, figures)


def replace_pod(stall: Stall, pod: str, figures: dict[str, HostFigures]) -> Stall:
    return Stall(pod, figures.get(pod, stall.figures), stall.stalled_seconds, stall.timeout_seconds, stall.basis)


def culprit(figures: dict[str, HostFigures], now: float) -> str | None:
    """The worker to name (module doc): the oldest stale heartbeat, else the lowest last step."""
    stale = sorted((f.heartbeat, pod) for pod, f in figures.items()
                   if f.heartbeat is not None and now - f.heartbeat > HEARTBEAT_STALE_SECONDS)
    if stale:
        return stale[0][1]
    stepped = sorted((f.step if f.step is not None else -1, pod) for pod, f in figures.items())
    return stepped[0][1] if stepped else None


def _when(t: float | None) -> str:
    return "never" if t is None else st.format_time(datetime.fromtimestamp(t, UTC)) or "?"


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Verdict:
    """In `reconcile.WATCH`, after worker_exit: a hung generation is replaced (`TrainerHung`)."""
    stall = decide(spec, observed, s, float(settings.hang_floor_seconds))
    if stall is None:
        return None
    f, now = stall.figures, observed.now.timestamp()
    pod = next((p for p in observed.pods_of(s.generation) if p.name == stall.pod), None)
    names = s.pod_names(observed.job.name)
    if f.heartbeat is not None and now - f.heartbeat > HEARTBEAT_STALE_SECONDS:
        why = f"its trainer's heartbeat stopped {now - f.heartbeat:.0f}s ago (a stopped or frozen process)"
    else:
        why = "every trainer's heartbeat is fresh but none progresses (a collective or an input that never " \
              "returns); the lowest last step"
    message = api.TRAINER_HUNG.format(
        pod=stall.pod, process=names.index(stall.pod) if stall.pod in names else "?",
        node=(pod.node_name if pod is not None else None) or "?", generation=s.generation, why=why,
        step=f.step if f.step is not None else "none", step_time=_when(f.step_time), phase=f.phase or "?",
        seconds=f"{stall.stalled_seconds:.0f}", timeout=f"{stall.timeout_seconds:.0f}", basis=stall.basis)
    return Finding(st.TRAINER_HUNG, api.TRAINER_HUNG.name, message)
