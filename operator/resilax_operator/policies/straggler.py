"""Stragglers (docs/architecture.md, "Hangs and stragglers"): a worker whose own step time stays
>= RATIO x the median of the generation's workers for `settings.straggler_window_seconds` gets a
`StragglerDetected` Warning event (no restart: a slow host slows every step, but replacing it may cost
more than it gains; the user or an alert decides).

A worker's own step time is its trainer's `step_seconds` (the median over its recent steps of the time
between two steps less what it waited at the request agreement's barrier for the others: the slowest
host waits least, so its own time is the longest; resilax_ckpt.control.trainer_metrics). observed/observe.py reads every
worker's figures once per `settings.straggler_sample_seconds`; a decision sees all of them only then.

The memory is the `Straggler` condition (restart-safe, visible in `kubectl describe`):

| sample (every worker's own step time)        | condition                                                   |
|----------------------------------------------|-------------------------------------------------------------|
| not taken this time                          | kept (removed if the worker it names left the generation)   |
| the slowest < RATIO x the median             | removed                                                     |
| the slowest >= RATIO x the median, not the one the condition names | True, StragglerSuspected, since now        |
| the same worker, suspected for the window    | True, StragglerDetected + the Warning event (once)          |
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Final

from .. import api
from .. import status as st
from ..actions import EmitEvent
from ..observed.snapshot import Observed
from ..settings import OperatorSettings
from ..status import JobStatus
from .hang import generation_figures

#: A worker this many times slower (its own step time) than the generation's median is a straggler.
RATIO: Final = 1.5


@dataclass(frozen=True)
class Sample:
    """The slowest worker of one sample: its own step time, the median and how many workers."""

    pod: str
    seconds: float
    median: float
    hosts: int

    @property
    def ratio(self) -> float:
        return self.seconds / self.median if self.median > 0 else 0.0

    @property
    def straggles(self) -> bool:
        """At least RATIO x the median (a relative tolerance for the figures' rounding)."""
        return self.median > 0 and self.seconds >= RATIO * self.median * (1 - 1e-9)


def slowest(observed: Observed, s: JobStatus) -> Sample | None:
    """The slowest worker of the running generation, when every worker (at least two) reported its own
    step time in this decision; None otherwise (no sample this time)."""
    pods = observed.pods_of(s.generation)
    times = {pod: f.step_seconds for pod, f in generation_figures(observed, s).items()
             if f.step_seconds is not None and f.step_seconds > 0}
    if len(pods) < 2 or len(times) < len(pods):
        return None
    pod, seconds = max(times.items(), key=lambda kv: (kv[1], kv[0]))
    return Sample(pod, seconds, statistics.median(times.values()), len(times))


def named_pod(condition: st.Condition) -> str:
    """The worker a Straggler condition names (its message begins `worker <pod> `)."""
    words = condition.message.split(" ", 2)
    return words[1] if len(words) > 1 and words[0] == "worker" else ""


def _without(s: JobStatus) -> JobStatus:
    return replace(s, conditions=tuple(c for c in s.conditions if c.type != api.COND_STRAGGLER))


def record(observed: Observed, s: JobStatus, settings: OperatorSettings) -> tuple[JobStatus, list[EmitEvent]]:
    """The status with the Straggler condition brought up to date (module table), and the event to emit."""
    old = s.condition(api.COND_STRAGGLER)
    if settings.straggler_sample_seconds <= 0:
        return (_without(s) if old is not None else s), []
    sample = slowest(observed, s)
    if sample is None:
        present = {p.name for p in observed.pods_of(s.generation)}
        return (_without(s) if old is not None and named_pod(old) not in present else s), []
    if not sample.straggles:
        return (_without(s) if old is not None else s), []
    now, minutes = observed.now, f"{settings.straggler_window_seconds / 60:g}"
    names = s.pod_names(observed.job.name)
    node = next((p.node_name for p in observed.pods_of(s.generation) if p.name == sample.pod), None) or "?"
    figures = {"pod": sample.pod, "generation": s.generation, "seconds": f"{sample.seconds:.3g}",
               "ratio": f"{sample.ratio:.2f}", "median": f"{sample.median:.3g}", "hosts": sample.hosts,
               "minutes": minutes}
    if old is None or named_pod(old) != sample.pod:
        message = api.STRAGGLER_SUSPECTED.format(**figures)
        return st.set_condition(_without(s), api.COND_STRAGGLER, True, api.STRAGGLER_SUSPECTED.name, message,
                                now), []
    since = old.last_transition_time
    if old.reason != api.STRAGGLER_SUSPECTED.name or since is None \
            or now - since < timedelta(seconds=settings.straggler_window_seconds):
        return s, []
    message = api.STRAGGLER_DETECTED.format(
        **figures, process=names.index(sample.pod) if sample.pod in names else "?", node=node)
    new = st.set_condition(s, api.COND_STRAGGLER, True, api.STRAGGLER_DETECTED.name, message, now)
    return new, [EmitEvent("Warning", api.STRAGGLER_DETECTED.name, message)]
