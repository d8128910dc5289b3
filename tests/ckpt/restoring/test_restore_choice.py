"""The restore's pure choices (resilax_ckpt.restoring.restore_choice): tables, no I/O."""

from __future__ import annotations

import pytest
from resilax_ckpt.restoring import restore_choice


@pytest.mark.parametrize(("local", "persistent", "step", "want"), [
    pytest.param([10, 20, 30], [], None, [10, 20, 30], id="no-persistent-offers-all"),
    pytest.param([10, 20, 30], [10, 20], None, [20, 30], id="from-newest-persistent-up"),
    pytest.param([10, 20, 30], [10, 20], 10, [10], id="asked-step-even-if-older"),
    pytest.param([10, 20, 30], [40], None, [], id="all-older-than-persistent"),
    pytest.param([10, 20], [10], 30, [], id="asked-step-not-held"),
])
def test_local_candidates(local: list[int], persistent: list[int], step: int | None, want: list[int]) -> None:
    assert restore_choice.local_candidates(local, persistent, step) == want


@pytest.mark.parametrize(("agreed", "step", "fallback", "want"), [
    pytest.param([10, 30, 20], None, True, [30, 20, 10], id="newest-first"),
    pytest.param([10, 30, 20], 20, True, [20, 10], id="fallback-from-latest"),
    pytest.param([20], 20, False, [20], id="asked-step-alone"),
    pytest.param([], None, True, [], id="nothing"),
])
def test_steps_to_try(agreed: list[int], step: int | None, fallback: bool, want: list[int]) -> None:
    assert restore_choice.steps_to_try(agreed, step, fallback) == want


def test_decide_agreed_steps_needs_a_known_peer_for_every_missing_copy() -> None:
    # step -> process -> holders of its shards (empty: its own tier)
    plan = {40: {0: [], 1: [3, 2]}, 30: {0: [], 1: [2]}, 20: {0: [], 1: [3]}, 10: {0: [], 1: []}}
    sources, agreed = restore_choice.decide_agreed_steps(plan, 1, {0: "a:1", 2: "c:1"})
    assert agreed == {40, 30, 10}  # step 20's only holder (3) has no known sidecar
    assert sources == {40: ["c:1"], 30: ["c:1"], 20: []}
    sources0, _ = restore_choice.decide_agreed_steps(plan, 0, {0: "a:1", 2: "c:1"})
    assert sources0 == {}  # process 0 has its own copy of every step


def test_judge_try() -> None:
    views = [{"local": "p0: bad crc", "persistent": None, "error": None},
             {"local": "p1: gone", "persistent": "p1: gone too", "error": "p1: gone; p1: gone too"},
             {"local": None, "persistent": None, "error": None}]
    outcome = restore_choice.judge_try(views)
    assert outcome.failed == ["p1: gone; p1: gone too"]
    assert outcome.recovered == ["p0: bad crc"]
    assert outcome.bad_persistent == ["p1: gone too"]
    assert restore_choice.judge_try([{"local": None, "persistent": None, "error": None}]) == \
        restore_choice.TryOutcome([], [], [])


@pytest.mark.parametrize(("sources", "want"), [
    pytest.param(["local", "local"], "local", id="every-host-its-own"),
    pytest.param(["local", "peer"], "peer", id="a-replica-fetched"),
    pytest.param(["peer", "persistent", "local"], "persistent", id="one-process-read-the-persistent-tier"),
    pytest.param([None, "local"], "local", id="a-view-without-source"),
    pytest.param([None], None, id="none-named"),
])
def test_farthest_source(sources: list[str | None], want: str | None) -> None:
    assert restore_choice.farthest_source(sources) == want
