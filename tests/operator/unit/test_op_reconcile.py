"""reconcile.py, the dispatcher: invalid specs, the order of the checks on a running generation.

Driven through the in-memory world (op_world), which checks at every decision that deciding twice
gives the same actions and that no generation is created while another one's pods exist; the
tables call the policy's functions directly."""

from __future__ import annotations

from datetime import timedelta

import pytest
from op_samples import good_spec
from op_world import World, four_pools, running_world, tpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import (
    SetStatus,
)
from resilax_operator.observed.snapshot import Taint
from resilax_operator.reconcile import WATCH


def test_invalid_spec_before_start_fails_the_job() -> None:
    spec = good_spec()
    spec["slices"]["topology"] = "4x3"
    w = World.make(spec, *four_pools())
    actions = w.step()
    assert isinstance(actions[0], SetStatus) and w.status.phase == api.PHASE_FAILED
    cond = w.status.condition(api.COND_INVALID_SPEC)
    assert cond is not None and cond.status == "True" and "spec.slices.topology: '4x3'" in cond.message
    assert w.step() == []


def test_fixing_an_invalid_spec_starts_the_job() -> None:
    spec = good_spec()
    spec["slices"]["topology"] = "4x3"
    w = World.make(spec, *four_pools())
    w.step()
    assert w.status.phase == api.PHASE_FAILED
    w.spec["slices"]["topology"] = "4x4"
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.status.generation == 1


def test_invalid_edit_leaves_the_running_generation_alone() -> None:
    w = running_world()
    w.spec["checkpoint"]["storage"] = "s3://nope"
    actions = w.step()
    assert [type(a).__name__ for a in actions] == ["SetStatus", "EmitEvent"]
    assert w.status.phase == api.PHASE_RUNNING and w.gen_pods()
    w.spec["checkpoint"]["storage"] = "gs://bucket/x"
    w.step()
    cond = w.status.condition(api.COND_INVALID_SPEC)
    assert cond is not None and cond.status == "False"


# ---------------------------------------------------------------- the order of the checks

ORDER_CASES = {
    # id: (faults, the transition kind that wins, or None: the job waits)
    "the-guard-beats-node-lost-and-a-notice": (["half-down", "notice"], None),
    "node-lost-beats-a-notice": (["lost", "notice"], st.NODE_LOSS),
    "a-notice-beats-a-node-within-its-grace": (["not-ready", "notice"], st.PREEMPTION),
    "a-node-within-its-grace-hides-worker-failures": (["not-ready", "failed"], None),
    "a-notice-beats-a-worker-failure": (["notice", "failed"], st.PREEMPTION),
    "an-incompatible-spec-beats-a-worker-stop": (["incompatible", "stopped"], st.RESIZE),
    "a-worker-stop-beats-a-grow-back": (["stopped", "capacity"], st.WORKER_STOPPED),
}


@pytest.mark.parametrize(("faults", "kind"), list(ORDER_CASES.values()), ids=list(ORDER_CASES))
def test_the_first_check_that_finds_something_decides(faults: list[str], kind: str | None) -> None:
    w = running_world(pools=[tpu_pool("pool-a", 4), tpu_pool("pool-b", 4), tpu_pool("pool-c", 4)])
    pods = w.gen_pods()
    for fault in faults:
        if fault == "half-down":
            for name in sorted(w.nodes)[:6]:
                w.set_node(name, ready="Unknown", ready_since=w.now - timedelta(seconds=600))
        elif fault == "lost":
            w.set_node(pods[0].node_name or "", ready="Unknown", ready_since=w.now - timedelta(seconds=60))
        elif fault == "not-ready":
            w.set_node(pods[0].node_name or "", ready="Unknown", ready_since=w.now)
        elif fault == "notice":
            w.set_node(pods[5].node_name or "", taints=(Taint(api.IMPENDING_TERMINATION_TAINT),))
        elif fault == "failed":
            w.exit_workers(1, names=[pods[9].name])
        elif fault == "stopped":
            w.exit_workers(75, names=[pods[9].name])
        elif fault == "incompatible":
            w.spec["slices"].update(accelerator="tpu-v4-podslice", topology="2x2x2", count=1)
            w.spec["elastic"] = {"minCount": 1, "maxCount": 1}
        elif fault == "capacity":
            w.nodes.update({n.name: n for n in tpu_pool("pool-d", 4)})
            w.advance(600)
    w.step()
    t = w.status.transition
    assert (t.kind if t is not None else None) == kind
    assert w.status.failures == 0


def test_watch_lists_every_check_once() -> None:
    names = [f"{c.__module__.rsplit('.', 1)[-1]}.{c.__name__}" for c in WATCH]
    assert names == ["node_loss.check_guard", "node_loss.check_lost", "preemption.check", "queue_eviction.check",
                     "suspend.check",
                     "node_loss.check_not_ready", "health_check.check", "resize.check_incompatible",
                     "failure_rules.check",
                     "worker_exit.check", "hang.check",
                     "capacity_wait.check", "generation_start.check_unscheduled",
                     "container_waiting.check", "rollback.check",
                     "resize.check"]
