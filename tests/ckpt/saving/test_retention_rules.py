"""The retention rules (retention.py, pure): keep-last, preservation by steps and by time, best-N by a
metric; the newest step is always kept, a step without the metric is kept by recency."""

from __future__ import annotations

import math

import pytest
import resilax_ckpt as rc
from resilax_ckpt.saving import retention
from resilax_ckpt.saving.retention import KeepBest, RetentionRule, StepFacts, decide_retention

LOSS = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.2, 5: 0.8}
"""step -> loss of a run whose best (lowest) losses are at steps 4, 2, 3."""


def _losses(values: dict[int, float], name: str = "loss") -> dict[int, StepFacts]:
    return {s: StepFacts(time=1000.0 + s, metrics={name: v}) for s, v in values.items()}


@pytest.mark.parametrize(("steps", "rule", "facts", "protected", "deleted"), [
    ([1, 2, 3, 4, 5], RetentionRule(keep_last=2), None, (), [1, 2, 3]),
    ([10, 20, 30, 40, 50], RetentionRule(keep_last=1, keep_every_steps=20), None, (), [10, 30]),
    ([1, 2, 3], RetentionRule(keep_last=1), None, (1,), [2]),
    ([1, 2, 3], RetentionRule(), None, (), []),
    ([1, 2, 3], RetentionRule(keep_every_steps=2, keep_every_seconds=5.0), None, (), []),
    ([], RetentionRule(keep_last=1), None, (), []),
    # best 2 by lowest loss (4 and 2) plus the newest (5), whatever its loss.
    ([1, 2, 3, 4, 5], RetentionRule(best=KeepBest(2, "loss", "min")), _losses(LOSS), (), [1, 3]),
    # "max": the highest (1 and 5; 5 is also the newest).
    ([1, 2, 3, 4, 5], RetentionRule(best=KeepBest(2, "accuracy", "max")), _losses(LOSS, "accuracy"), (), [2, 3, 4]),
    # best ∪ keep-last: the 2 best (4, 2) and the newest 2 (4, 5).
    ([1, 2, 3, 4, 5], RetentionRule(keep_last=2, best=KeepBest(2, "loss", "min")), _losses(LOSS), (), [1, 3]),
    # the newest step is kept even when it is the worst.
    ([1, 2, 3], RetentionRule(best=KeepBest(1, "loss", "min")), _losses({1: 0.1, 2: 0.2, 3: 9.0}), (), [2]),
    # ties: the newer step wins.
    ([1, 2, 3, 4], RetentionRule(best=KeepBest(1, "loss", "min")), _losses({1: 0.5, 2: 0.5, 3: 0.9, 4: 0.9}),
     (), [1, 3]),
    # NaN ranks last in either mode.
    ([1, 2, 3], RetentionRule(best=KeepBest(1, "loss", "min")), _losses({1: math.nan, 2: 0.5, 3: 0.9}), (), [1]),
    ([1, 2, 3], RetentionRule(best=KeepBest(1, "acc", "max")), _losses({1: math.nan, 2: 0.5, 3: 0.1}, "acc"),
     (), [1]),
    # steps without the metric: all kept without keep_last (Orbax's keep_checkpoints_without_metrics)...
    ([1, 2, 3, 4, 5], RetentionRule(best=KeepBest(1, "loss", "min")), _losses({2: 0.1, 4: 0.5}), (), [4]),
    # ...and kept by recency (keep_last) with it: 1 and 3 (no metric) age out, 5 and 4 are the newest.
    ([1, 2, 3, 4, 5], RetentionRule(keep_last=2, best=KeepBest(1, "loss", "min")), _losses({2: 0.1, 4: 0.5}),
     (), [1, 3]),
    # a step with another metric, or a non-number, has no value of this one.
    ([1, 2, 3], RetentionRule(keep_last=1, best=KeepBest(1, "loss", "min")),
     {1: StepFacts(metrics={"acc": 0.1}), 2: StepFacts(metrics={"loss": 0.3}), 3: StepFacts()}, (), [1]),
    # preservation by steps is outside the best count.
    ([10, 20, 30, 40], RetentionRule(keep_every_steps=20, best=KeepBest(1, "loss", "min")),
     _losses({10: 0.1, 20: 0.9, 30: 0.8, 40: 0.7}), (), [30]),
    # protected steps (the restored one, an upload in flight) are kept.
    ([1, 2, 3], RetentionRule(best=KeepBest(1, "loss", "min")), _losses({1: 0.1, 2: 0.9, 3: 0.8}), (2,), []),
], ids=["keep-last", "keep-every", "protected", "keep-all", "preservation-alone-deletes-nothing", "empty",
        "best-min", "best-max", "best-and-last", "newest-always", "ties-newer", "nan-last-min", "nan-last-max",
        "no-metric-kept-without-last", "no-metric-by-recency", "other-metric", "every-steps-outside-best",
        "best-protected"])
def test_decide_retention(steps, rule, facts, protected, deleted):
    assert decide_retention(steps, rule, facts, protected) == deleted


def _timed(times: dict[int, float]) -> dict[int, StepFacts]:
    return {s: StepFacts(time=t) for s, t in times.items()}


@pytest.mark.parametrize(("times", "deleted"), [
    # one per 100 s: 1 (the oldest), 4 (>= 100 s after 1), 7 (>= 100 s after 4); 8 the newest.
    ({1: 0, 2: 40, 3: 80, 4: 110, 5: 150, 6: 200, 7: 215, 8: 220}, [2, 3, 5, 6]),
    # a step without a save time is never preserved by time.
    ({1: 0, 2: 0, 3: 1000, 4: 1050, 5: 1100}, [2, 4]),
], ids=["one-per-period", "unknown-time"])
def test_keep_every_seconds_walks_from_the_oldest(times, deleted):
    base = 1_700_000_000.0
    facts = _timed({s: (base + t if t or s == 1 else 0.0) for s, t in times.items()})
    assert decide_retention(sorted(times), RetentionRule(keep_last=1, keep_every_seconds=100.0), facts) == deleted


def test_keep_every_seconds_is_stable_as_steps_are_deleted():
    """Deleting what the rule does not keep and deciding again deletes nothing more (decide twice)."""
    rule = RetentionRule(keep_last=2, keep_every_seconds=60.0, best=KeepBest(2, "loss", "min"))
    facts = {s: StepFacts(time=1e9 + 25.0 * s, metrics={"loss": ((s * 7) % 11) / 10}) for s in range(1, 30)}
    steps = list(range(1, 30))
    doomed = decide_retention(steps, rule, facts)
    left = [s for s in steps if s not in doomed]
    assert decide_retention(left, rule, facts) == []
    # and one more save only ever deletes among the newer, non-preserved steps
    assert set(decide_retention([*left, 30], rule, {**facts, 30: StepFacts(1e9 + 750, {"loss": 5.0})})) <= set(left)


@pytest.mark.parametrize(("metrics", "message"), [
    ([1.0], "metrics must be a mapping of names to numbers, found list"),
    ({"loss": "low"}, "metrics['loss']: 'low' is not a number"),
    ({"": 1.0}, "metric name '' must be a non-empty string"),
], ids=["not-a-mapping", "not-a-number", "empty-name"])
def test_bad_metrics_are_named(metrics, message):
    with pytest.raises(rc.InvalidMetricsError, match="save\\(step=3"):
        retention.validate_metrics(metrics, "save(step=3, metrics=...)")
    with pytest.raises(ValueError) as e:
        retention.validate_metrics(metrics, "here")
    assert message in str(e.value)


def test_metrics_accept_numpy_and_ints():
    import numpy as np
    assert retention.validate_metrics({"loss": np.float32(0.5), "step": 3}, "x") == {"loss": 0.5, "step": 3.0}


@pytest.mark.parametrize(("options", "message"), [
    ({"keep_best": 2}, "keep_best_metric: '' must name a metric passed to save(metrics=)"),
    ({"keep_best": 2, "keep_best_metric": "loss"}, "keep_best_mode: '' is not a mode; valid: max (higher is better), "
                                                   "min (lower is better)"),
    ({"keep_best": 2, "keep_best_metric": "loss", "keep_best_mode": "lowest"}, "keep_best_mode: 'lowest' is not a mode"),
    ({"keep_best": 0, "keep_best_metric": "loss", "keep_best_mode": "min"}, "keep_best: 0 must be >= 1"),
    ({"keep_best_metric": "loss"}, "keep_best_metric: 'loss' needs keep_best"),
    ({"keep_every_seconds": 0}, "keep_every_seconds: 0 must be > 0 or None"),
], ids=["no-metric", "no-mode", "bad-mode", "zero", "metric-alone", "every-seconds-zero"])
def test_bad_retention_options_are_named(options, message):
    with pytest.raises(rc.InvalidOptionsError) as e:
        rc.ManagerOptions(**options)
    assert message in str(e.value)


def test_retention_options_from_env():
    opts = rc.ManagerOptions.from_env({"RESILAX_KEEP_LAST": "2", "RESILAX_KEEP_BEST": "3",
                                       "RESILAX_KEEP_BEST_METRIC": "loss", "RESILAX_KEEP_BEST_MODE": "min",
                                       "RESILAX_KEEP_EVERY_SECONDS": "3600", "RESILAX_KEEP_EVERY_STEPS": "1000"})
    assert opts.retention_rule == RetentionRule(keep_last=2, keep_every_steps=1000, keep_every_seconds=3600.0,
                                                best=KeepBest(3, "loss", "min"))
