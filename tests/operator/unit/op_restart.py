"""Operator restart at any point of a flow: an operator that dies after executing only part of a
decision's actions (none, or the first) resumes from the status and the cluster and reaches the same
end state; no decision ever creates a generation while another one's pods exist (op_world asserts it),
and deciding twice on the same state gives the same actions (op_world asserts it at every step).
Each policy's test file drives its own flow through `assert_survives_restarts`."""

from __future__ import annotations

from collections.abc import Callable

from op_samples import good_spec
from op_world import World, cpu_pool
from resilax_operator import api

#: `keep` values: how many of the dying decision's actions were executed.
KEEP = {"dies-before-acting": 0, "dies-after-first-action": 1}


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


def _end(d: Driver) -> tuple[object, ...]:
    s = d.w.status
    return (s.phase, s.shape, s.generation, s.restarts, s.failures, s.transition, len(d.w.gen_pods()))


def assert_survives_restarts(flow: Callable[[Driver], None], keep: int) -> None:
    """Run `flow` once cleanly, then once per decision with the operator dying at that decision."""
    clean = Driver(None, 0)
    flow(clean)
    expected = _end(clean)
    assert expected[0] == api.PHASE_RUNNING and expected[2] == 2
    for crash_at in range(clean.n):
        d = Driver(crash_at, keep)
        flow(d)
        assert _end(d) == expected, f"crash at decision {crash_at}"
