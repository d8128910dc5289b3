"""The node agent renews the no-process nodes' Leases spread over the interval, not in a burst.

A round of 1,617 renewals sent at once queued behind itself on a loaded API server and outlasted the
node lifecycle controller's grace (docs/benchmarks.md, the fleet-scale section). The loop is driven here
with a fake clock (its waits advance it), so the renewal times are exact.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from typing import Any

from resilax_local.node import agent as agent_module
from resilax_local.node.agent import NodeAgent


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class _Stop:
    """`stopping`: each wait advances the clock; set once `until` is reached."""

    def __init__(self, clock: _Clock, until: float) -> None:
        self.clock, self.until = clock, until

    def wait(self, seconds: float) -> bool:
        self.clock.now += seconds
        return self.clock.now >= self.until

    def is_set(self) -> bool:
        return self.clock.now >= self.until


class _InlinePool:
    """Runs each renewal at once; `slow` seconds of the clock each (the API server's answer time)."""

    def __init__(self, clock: _Clock, slow: float) -> None:
        self.clock, self.slow = clock, slow

    def submit(self, fn: Any, *args: Any) -> Future[None]:
        fn(*args)
        self.clock.now += self.slow
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _run(monkeypatch: Any, nodes: int, interval: float, rounds: float, slow: float = 0.0) -> list[tuple[float, str]]:
    clock = _Clock()
    monkeypatch.setattr(agent_module.time, "monotonic", clock.monotonic)
    renewed: list[tuple[float, str]] = []
    fake: Any = type("FakeAgent", (), {})()
    fake.no_process_lease_seconds = interval
    fake.stopping = _Stop(clock, clock.now + interval * (rounds + 1))
    fake.lease_pool = _InlinePool(clock, slow)
    fake._ready_nodes = lambda run_pods: [type("N", (), {"name": f"n{i}"})() for i in range(nodes)]
    fake._renew_if_ready = lambda node: renewed.append((clock.now, node.name))
    NodeAgent._no_process_lease_loop(fake)
    return renewed


def test_renewals_are_spread_evenly_over_the_interval(monkeypatch: Any) -> None:
    renewed = _run(monkeypatch, nodes=4, interval=20.0, rounds=2)
    first = renewed[0][0]
    assert [(round(t - first, 6), name) for t, name in renewed[:8]] == [
        (0.0, "n0"), (5.0, "n1"), (10.0, "n2"), (15.0, "n3"), (20.0, "n0"), (25.0, "n1"), (30.0, "n2"), (35.0, "n3")]


def test_a_slow_api_server_stretches_the_round_and_the_next_starts_at_once(monkeypatch: Any) -> None:
    """Each renewal takes 8 s of the clock with 4 nodes every 20 s: a round takes 32 s; no wait between."""
    renewed = _run(monkeypatch, nodes=4, interval=20.0, rounds=3, slow=8.0)
    gaps = [round(b[0] - a[0], 6) for a, b in itertools.pairwise(renewed)]
    assert gaps[:6] == [8.0] * 6

