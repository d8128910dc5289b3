"""Operator restart at any point of any flow: an operator that dies after executing only part of a
decision's actions (none, or the first) resumes from the status and the cluster and reaches the same
end state; no decision ever creates a generation while another one's pods exist (op_world asserts it),
and deciding twice on the same state gives the same actions (op_world asserts it at every step)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from op_samples import good_spec
from op_world import World, cpu_pool
from resilax_operator import api
from resilax_operator.observed import Taint


def _world() -> World:
    spec = good_spec()
    spec["slices"] = {"accelerator": "cpu", "topology": "2x4", "chipsPerHost": 4, "count": 4}
    spec["elastic"] = {"minCount": 2, "maxCount": 4}
    return World.make(spec, *[cpu_pool(f"pool-{c}", 2) for c in "abcd"])


class Driver:
    def __init__(self, crash_at: int | None, keep: int) -> None:
        self.w = _world()
        self.n = 0
        self.crash_at = crash_at
        self.keep = keep

    def tick(self, times: int = 1) -> None:
        for _ in range(times):
            self.w.step(only=self.keep if self.n == self.crash_at else None)
            self.n += 1
            self.w.schedule()
            self.w.kubelets()


def preemption(d: Driver) -> None:
    d.tick(6)
    node = d.w.gen_pods()[0].node_name or ""
    d.w.set_node(node, taints=(Taint(api.IMPENDING_TERMINATION_TAINT),))
    d.tick(3)
    d.w.exit_workers(75, generation=d.w.status.generation)
    d.tick(10)


def node_loss(d: Driver) -> None:
    d.tick(6)
    node = d.w.gen_pods()[0].node_name or ""
    d.w.set_node(node, ready="Unknown", ready_since=d.w.now)
    d.tick(2)
    d.w.advance(30)
    d.tick(10)


def worker_failure(d: Driver) -> None:
    d.tick(6)
    d.w.exit_workers(1, names=[d.w.gen_pods()[0].name])
    d.tick(3)
    d.w.advance(10)
    d.tick(10)


def grow_back(d: Driver) -> None:
    lost = [n for n in d.w.nodes.values() if n.pool == "pool-d"]
    for n in lost:
        d.w.nodes.pop(n.name)
    d.tick(6)
    d.w.nodes.update({n.name: n for n in lost})
    d.w.advance(60)
    d.tick(3)
    d.w.exit_workers(75, generation=d.w.status.generation)
    d.tick(10)


FLOWS: dict[str, Callable[[Driver], None]] = {
    "preemption": preemption, "node-loss": node_loss, "worker-failure": worker_failure, "grow-back": grow_back}


def _end(d: Driver) -> tuple[object, ...]:
    s = d.w.status
    return (s.phase, s.shape, s.generation, s.restarts, s.failures, s.transition, len(d.w.gen_pods()))


@pytest.mark.parametrize("flow", list(FLOWS), ids=list(FLOWS))
@pytest.mark.parametrize("keep", [0, 1], ids=["dies-before-acting", "dies-after-first-action"])
def test_operator_dies_at_every_step(flow: str, keep: int) -> None:
    clean = Driver(None, 0)
    FLOWS[flow](clean)
    expected = _end(clean)
    assert expected[0] == api.PHASE_RUNNING and expected[2] == 2
    for crash_at in range(clean.n):
        d = Driver(crash_at, keep)
        FLOWS[flow](d)
        assert _end(d) == expected, f"crash at decision {crash_at}"
