"""Retention rules (pure, JAX-free: the sidecar applies the same rules to the persistent tier): which
committed steps of the current branch a retention deletes.

The rules, as Orbax's CheckpointManager (`max_to_keep`, `best_fn`/`best_mode`,
`keep_checkpoints_without_metrics`, `keep_period`, `keep_time_interval`; its preservation policies
`LatestN`, `BestN`, `EveryNSteps`, `EveryNSeconds` combined by `AnyPreservationPolicy`). A step is kept
when any of these keeps it:
1. it is the newest step (a restart never loses progress), or protected (the step a restore read, an
   upload in flight);
2. `keep_last`: it is one of the newest N steps;
3. `best` (N, metric, mode): it is one of the N steps with the best value of `metric` ("max": higher
   is better, "min": lower is better; ties: the newer step wins; a NaN value ranks last). A step saved
   without that metric is ranked by recency only: kept by rule 2 when `keep_last` is set, always kept
   when it is not (Orbax's `keep_checkpoints_without_metrics=True`);
4. preservation, outside the counts of 2 and 3: `every_steps` keeps each step divisible by it;
   `every_seconds` keeps the oldest step with a save time and then, oldest first, each step saved at
   least that long after the previous step it kept (Orbax's `keep_time_interval`), so the kept set
   does not change as newer steps come and go.
Nothing is deleted unless `keep_last` or `best` is set (the preservation rules alone keep everything).
The callers pass only the current branch's steps: a step marked bad or superseded by a rollback is
never counted and never deleted (timelines.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Final

from resilax_ckpt.errors import ResilaxCkptError

MODES: Final = ("max", "min")
"""`best` modes: "max" keeps the highest values (accuracy), "min" the lowest (loss)."""


class InvalidMetricsError(ResilaxCkptError, ValueError):
    """`save(..., metrics=)` got something that is not a mapping of names to numbers."""


@dataclasses.dataclass(frozen=True)
class KeepBest:
    """Keep the `count` steps with the best `metric` (a number passed to `save(..., metrics=)`)."""

    count: int
    metric: str
    mode: str

    def problems(self, prefix: str = "") -> list[str]:
        out = []
        if self.count < 1:
            out.append(f"{prefix}keep_best: {self.count!r} must be >= 1")
        if not self.metric:
            out.append(f"{prefix}keep_best_metric: {self.metric!r} must name a metric passed to save(metrics=)")
        if self.mode not in MODES:
            out.append(f"{prefix}keep_best_mode: {self.mode!r} is not a mode; valid: max (higher is better), "
                       "min (lower is better)")
        return out


@dataclasses.dataclass(frozen=True)
class RetentionRule:
    """What a retention keeps (see the module docstring for the rules)."""

    keep_last: int | None = None
    keep_every_steps: int | None = None
    keep_every_seconds: float | None = None
    best: KeepBest | None = None

    @property
    def deletes(self) -> bool:
        """Whether this rule ever deletes a step."""
        return self.keep_last is not None or self.best is not None

    @property
    def needs_facts(self) -> bool:
        """Whether deciding needs each step's metrics or save time (read from its metadata)."""
        return self.deletes and (self.best is not None or self.keep_every_seconds is not None)


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """What a step's metadata says that retention may use."""

    time: float | None = None
    """Wall-clock save time (epoch seconds); None or 0 when unknown."""
    metrics: Mapping[str, float] = dataclasses.field(default_factory=dict)


def decide_retention(steps: Iterable[int], rule: RetentionRule, facts: Mapping[int, StepFacts] | None = None,
                     protected: Iterable[int] = ()) -> list[int]:
    """The committed steps to delete, ascending (the module docstring's rules). `facts` holds the
    metrics and save times of the steps (needed only when `rule.needs_facts`; a step missing from it
    has neither)."""
    ordered = sorted(set(steps))
    if not rule.deletes or not ordered:
        return []
    facts = facts or {}
    keep = {ordered[-1]} | set(protected)
    if rule.keep_last is not None:
        keep |= set(ordered[-rule.keep_last:])
    if rule.best is not None:
        keep |= _best(ordered, rule.best, facts, keep_unranked=rule.keep_last is None)
    if rule.keep_every_steps is not None:
        keep |= {s for s in ordered if s % rule.keep_every_steps == 0}
    if rule.keep_every_seconds is not None:
        keep |= _every_seconds(ordered, rule.keep_every_seconds, facts)
    return [s for s in ordered if s not in keep]


def metric_value(facts: StepFacts | None, metric: str) -> float | None:
    """The step's value of `metric`, or None when it was saved without it (or with a non-number)."""
    if facts is None:
        return None
    value = facts.metrics.get(metric)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _best(ordered: list[int], best: KeepBest, facts: Mapping[int, StepFacts], keep_unranked: bool) -> set[int]:
    ranked: list[tuple[float, int]] = []
    unranked: set[int] = set()
    for step in ordered:
        value = metric_value(facts.get(step), best.metric)
        if value is None:
            unranked.add(step)
            continue
        # Sort key: lower is better, NaN last; ties go to the newer step.
        score = math.inf if math.isnan(value) else (-value if best.mode == "max" else value)
        ranked.append((score, -step))
    ranked.sort()
    kept = {-negative for _, negative in ranked[:best.count]}
    return kept | unranked if keep_unranked else kept


def _every_seconds(ordered: list[int], interval: float, facts: Mapping[int, StepFacts]) -> set[int]:
    kept: set[int] = set()
    anchor: float | None = None
    for step in ordered:
        found = facts.get(step)
        saved = found.time if found is not None else None
        if not saved:
            continue
        if anchor is None or saved >= anchor + interval:
            kept.add(step)
            anchor = saved
    return kept


def validate_metrics(metrics: Mapping[str, object] | None, where: str) -> dict[str, float]:
    """`save(..., metrics=)`: a mapping of names to numbers (int or float; NaN and infinities allowed,
    ranked worst by `best`). Raises InvalidMetricsError naming every bad entry."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidMetricsError(f"{where}: metrics must be a mapping of names to numbers, found "
                                 f"{type(metrics).__name__}")
    problems = []
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            problems.append(f"{where}: metric name {name!r} must be a non-empty string")
        elif isinstance(value, bool) or not isinstance(value, int | float):
            try:
                out[name] = float(value)  # type: ignore[arg-type]  # a NumPy or 0-d JAX scalar
            except (TypeError, ValueError):
                problems.append(f"{where}: metrics[{name!r}]: {value!r} is not a number")
        else:
            out[name] = float(value)
    if problems:
        raise InvalidMetricsError("; ".join(problems))
    return out
