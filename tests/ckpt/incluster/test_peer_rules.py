"""The pure rules of peer replicas (resilax_ckpt.incluster.peers): where each host's newest local step is
copied, and which source each process restores from after a loss. Tables with readable ids."""

from __future__ import annotations

import pytest
from resilax_ckpt.incluster.peers import Holdings, PeerHost, decide_sources, origins_held_by, plan_peers


def hosts(slices: int, per_slice: int, nodes: list[str] | None = None) -> list[PeerHost]:
    count = slices * per_slice
    names = nodes or [f"n{p}" for p in range(count)]
    return [PeerHost(p, p // per_slice, names[p]) for p in range(count)]


@pytest.mark.parametrize(("shape", "nodes", "want"), [
    pytest.param((2, 2), None, {0: 2, 1: 3, 2: 0, 3: 1}, id="2x2-same-host-index-other-slice"),
    pytest.param((3, 2), None, {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}, id="3x2-ring-over-slices"),
    pytest.param((1, 3), None, {0: 1, 1: 2, 2: 0}, id="one-slice-next-process"),
    pytest.param((1, 3), ["a", "a", "b"], {0: 2, 1: 2, 2: 0}, id="one-slice-skips-same-node"),
    pytest.param((2, 1), ["a", "a"], {}, id="one-node-no-peer"),
    pytest.param((1, 1), None, {}, id="one-process-no-peer"),
    pytest.param((2, 2), ["a", "b", "a", "c"], {0: 3, 1: 3, 2: 1, 3: 1}, id="other-slice-on-same-node-skipped"),
])
def test_plan_peers(shape: tuple[int, int], nodes: list[str] | None, want: dict[int, int]) -> None:
    placement = plan_peers(hosts(*shape, nodes))
    assert placement == want
    assert plan_peers(list(reversed(hosts(*shape, nodes)))) == placement  # order of the input does not matter
    for origin, holder in placement.items():
        assert origin in origins_held_by(holder, placement)


def own(*steps: int, save: str = "s") -> dict[int, str]:
    return {s: f"{save}{s}" for s in steps}


# 2 slices x 2 hosts: holders 0<->2, 1<->3 (test_plan_peers). Each process holds its origin's newest
# replica. Steps 10 (persistent too in practice), 12 and 14 local.
FULL = {p: Holdings(own(12, 14), {o: own(14) for o in origins_held_by(p, plan_peers(hosts(2, 2)))})
        for p in range(4)}


def lost(views: dict[int, Holdings], *gone: int) -> dict[int, Holdings]:
    """The views after the nodes of `gone` were replaced by empty ones (same process ids)."""
    return {p: Holdings({}, {}) if p in gone else v for p, v in views.items()}


@pytest.mark.parametrize(("views", "want"), [
    pytest.param(FULL, {12: {p: [] for p in range(4)}, 14: {p: [] for p in range(4)}}, id="nothing-lost-all-own"),
    pytest.param(lost(FULL, 1), {14: {0: [], 1: [3], 2: [], 3: []}}, id="one-lost-newest-from-its-peer"),
    pytest.param(lost(FULL, 0, 1), {14: {0: [2], 1: [3], 2: [], 3: []}}, id="two-lost-not-each-others-holders"),
    pytest.param(lost(FULL, 1, 3), {}, id="two-lost-holding-each-others-replicas-nothing-local"),
    pytest.param(lost(FULL, 0, 1, 2, 3), {}, id="all-lost"),
    pytest.param({0: Holdings(own(14)), 1: Holdings(own(14, save="other"))}, {}, id="different-saves-never-mixed"),
    pytest.param({0: Holdings(own(14)), 1: Holdings({}, {}), 2: Holdings({}, {1: own(14, save="old")}),
                  3: Holdings({}, {1: own(14)})}, {}, id="partial-others-lost-too"),
    pytest.param({0: Holdings(own(14)), 1: Holdings({}), 2: Holdings(own(14), {1: own(14)}),
                  3: Holdings(own(14), {1: own(14)})}, {14: {0: [], 1: [2, 3], 2: [], 3: []}},
                 id="several-holders-in-process-order"),
    pytest.param({0: Holdings(own(14), {1: own(14, save="stale")}), 1: Holdings({})}, {},
                 id="a-stale-replica-of-another-save-is-not-used"),
])
def test_decide_sources(views: dict[int, Holdings], want: dict[int, dict[int, list[int]]]) -> None:
    assert decide_sources(views) == want
    assert decide_sources({p: Holdings.from_json(v.to_json()) for p, v in views.items()}) == want  # as exchanged


def test_two_lost_holding_each_others_replicas_fall_back_to_an_older_common_step() -> None:
    """The two hosts holding each other's replicas are lost: no newest local step for them; when the
    survivors still hold an older step that is complete elsewhere (here nowhere), nothing local
    qualifies and the restore takes the persistent tier's newest (the manager's candidates)."""
    views = lost(FULL, 0, 2)
    assert decide_sources(views) == {}
    # ... while losing one of them keeps the newest step.
    assert max(decide_sources(lost(FULL, 2))) == 14
