"""node_loss.py: a worker's node down past its grace (or gone) replaces the generation at once.

Driven through the in-memory world (op_world), which checks at every decision that deciding twice
gives the same actions and that no generation is created while another one's pods exist; the
tables call the policy's functions directly."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from op_restart import KEEP, Driver, assert_survives_restarts
from op_samples import good_spec
from op_world import SETTINGS, T0, cpu_pool, fixed_spec, four_pools, running_world, tpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import (
    DeleteGeneration,
    PodDeletion,
    RequeueAfter,
    SetStatus,
)
from resilax_operator.observed.snapshot import Taint
from resilax_operator.policies import node_loss
from resilax_operator.reconcile import decide_cleanup
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec


def test_hard_node_loss_after_grace_force_deletes_and_shrinks() -> None:
    w = running_world()
    dead = w.gen_pods()[6].node_name or ""
    w.advance(100)
    w.set_node(dead, ready="Unknown", ready_since=w.now, taints=(Taint(api.UNREACHABLE_TAINT, "", "NoSchedule"),))
    w.advance(29)
    actions = w.step()
    assert not any(isinstance(a, DeleteGeneration) for a in actions)
    degraded = w.status.condition(api.COND_DEGRADED)
    assert degraded is not None and degraded.reason == api.NODE_NOT_READY.name
    # the other workers fail (JAX: when one process dies the others fail) within the grace: not counted
    w.exit_workers(1, names=[w.gen_pods()[0].name])
    assert not any(isinstance(a, DeleteGeneration) for a in w.step())
    w.advance(1)
    dead_pod = next(p.name for p in w.gen_pods(1) if p.node_name == dead)
    actions = w.step()
    delete = next(a for a in actions if isinstance(a, DeleteGeneration))
    assert delete.force_pods == (dead_pod,)
    assert w.status.transition is not None and w.status.transition.kind == st.NODE_LOSS
    assert w.status.phase == api.PHASE_RECOVERING and w.status.failures == 0
    w.settle()
    assert w.status.generation == 2 and w.status.shape == Shape("4x4", 3)
    assert w.nodes[dead].pool not in w.status.pools


def test_pods_on_a_deleted_node_are_lost_at_once() -> None:
    w = running_world()
    gone = w.gen_pods()[0].node_name or ""
    del w.nodes[gone]
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.NODE_LOSS


def test_fixed_shape_node_loss_waits_for_capacity() -> None:
    w = running_world(fixed_spec(2), [tpu_pool("pool-a", 4), tpu_pool("pool-b", 4)])
    dead = w.gen_pods()[0].node_name or ""
    w.set_node(dead, ready="False", ready_since=w.now)
    w.advance(31)
    w.settle()
    assert w.status.generation == 1 and w.status.phase == api.PHASE_RECOVERING
    assert not w.pods
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.INSUFFICIENT_CAPACITY.name
    w.set_node(dead, ready="True", ready_since=w.now)
    w.settle()
    assert w.status.generation == 2 and w.status.phase == api.PHASE_RUNNING


def test_cpu_job_on_local_pools() -> None:
    raw = copy.deepcopy(good_spec())
    raw["slices"] = {"accelerator": "cpu", "topology": "2x4", "count": 2, "chipsPerHost": 4}
    raw["elastic"] = {"minCount": 1, "maxCount": 2}
    w = running_world(raw, [cpu_pool("cpu-a", 2), cpu_pool("cpu-b", 2)])
    assert w.status.shape == Shape("2x4", 2) and w.status.hosts == 4
    dead = w.gen_pods()[0].node_name or ""
    w.set_node(dead, ready="Unknown", ready_since=w.now)
    w.advance(30)
    w.settle()
    assert w.status.shape == Shape("2x4", 1) and w.status.pools == ("cpu-b",)
    w.set_node(dead, ready="True", ready_since=w.now)
    w.advance(60)
    w.settle()
    assert w.status.transition is not None and w.status.transition.kind == st.GROW_BACK
    w.exit_workers(75)
    w.settle()
    assert w.status.shape == Shape("2x4", 2) and w.status.generation == 3


def test_cleanup_forces_pods_on_down_nodes_only() -> None:
    w = running_world()
    dead = w.gen_pods()[0]
    w.set_node(dead.node_name or "", ready="Unknown")
    actions = decide_cleanup(w.observed())
    assert actions == [DeleteGeneration(1, "job deleted", (PodDeletion(dead.name, force=True),))]


# ---------------------------------------------------------------- the rule, as a table

LEASE_FOREVER = T0 + timedelta(days=1)
LOST_CASES = {
    # id: (node changes for the first worker's node, seconds after it went down, lost?, waiting?)
    "ready": ({}, 0, False, False),
    "unknown-within-grace": ({"ready": "Unknown"}, 29, False, True),
    "unknown-at-grace": ({"ready": "Unknown"}, 30, True, False),
    "false-past-grace": ({"ready": "False"}, 31, True, False),
    "ready-but-unreachable-taint-past-grace": ({"taints": (Taint(api.UNREACHABLE_TAINT, "", "NoExecute"),)}, 30, True, False),
    "ready-but-unreachable-taint-within-grace": ({"taints": (Taint(api.UNREACHABLE_TAINT, "", "NoExecute"),)}, 5, False, True),
    "unschedulable-only": ({"unschedulable": True}, 300, False, False),
    # NotReady reported by a kubelet that still renews its Lease: not down, whatever the time
    "false-with-a-live-lease": ({"ready": "False", "lease_live_until": LEASE_FOREVER}, 600, False, False),
    "false-with-an-expired-lease": ({"ready": "False", "lease_live_until": T0}, 31, True, False),
    "shutting-down-with-a-live-lease": ({"ready": "False", "lease_live_until": LEASE_FOREVER,
                                         "ready_message": "node is shutting down"}, 31, True, False),
    "unknown-with-a-live-lease": ({"ready": "Unknown", "lease_live_until": LEASE_FOREVER}, 31, True, False),
    "false-live-lease-but-unreachable": ({"ready": "False", "lease_live_until": LEASE_FOREVER,
                                          "taints": (Taint(api.UNREACHABLE_TAINT, "", "NoExecute"),)}, 31, True, False),
}


@pytest.mark.parametrize(("changes", "seconds", "lost", "waiting"), list(LOST_CASES.values()), ids=list(LOST_CASES))
def test_node_loss_table(changes: dict[str, Any], seconds: int, lost: bool, waiting: bool) -> None:
    w = running_world()
    node = w.gen_pods()[0].node_name or ""
    w.set_node(node, ready_since=w.now, **changes)
    w.advance(seconds)
    spec, observed = validate_spec(w.spec), w.observed()
    finding = node_loss.check_lost(spec, observed, w.status, SETTINGS)
    assert (finding is not None) == lost
    if finding is not None:
        assert finding.kind == st.NODE_LOSS and finding.reason == api.NODE_LOST.name and node in finding.message
        assert not finding.failure and finding.not_before is None
    wait = node_loss.check_not_ready(spec, observed, w.status, SETTINGS)
    assert (wait is not None) == (waiting or lost)
    if waiting:
        assert wait is not None and wait[-1] == RequeueAfter(5.0)
        degraded = next(a for a in wait if isinstance(a, SetStatus)).status.condition(api.COND_DEGRADED)
        assert degraded is not None and degraded.reason == api.NODE_NOT_READY.name and node in degraded.message


def test_a_down_node_without_workers_changes_nothing() -> None:
    w = running_world(pools=[*four_pools(), tpu_pool("spare", 4)])
    w.set_node("spare-n0", ready="Unknown", ready_since=w.now)
    w.advance(600)
    spec, observed = validate_spec(w.spec), w.observed()
    assert node_loss.check_lost(spec, observed, w.status, SETTINGS) is None
    assert node_loss.check_not_ready(spec, observed, w.status, SETTINGS) is None


FORCE_CASES = {
    # id: (pod changes, node changes, seconds later, forced?)
    "healthy": ({}, {}, 0, False),
    "node-down": ({}, {"ready": "Unknown"}, 0, True),
    "terminating-within-grace-and-margin": ({"deletion_timestamp": T0, "deletion_grace_seconds": 30}, {}, 89, False),
    "terminating-past-grace-and-margin": ({"deletion_timestamp": T0, "deletion_grace_seconds": 30}, {}, 90, True),
    "terminating-no-grace": ({"deletion_timestamp": T0}, {}, 60, True),
}


@pytest.mark.parametrize(("pod", "node", "seconds", "forced"), list(FORCE_CASES.values()), ids=list(FORCE_CASES))
def test_pods_to_force_table(pod: dict[str, Any], node: dict[str, Any], seconds: int, forced: bool) -> None:
    w = running_world()
    first = w.gen_pods()[0]
    w.pods[first.name] = replace(first, **pod)
    if node:
        w.set_node(first.node_name or "", ready_since=w.now, **node)
    w.now = T0 + timedelta(seconds=seconds)
    assert node_loss.pods_to_force(w.observed(), w.gen_pods(), SETTINGS) == ((first.name,) if forced else ())


def test_pods_on_a_gone_node_are_forced() -> None:
    w = running_world()
    first = w.gen_pods()[0]
    del w.nodes[first.node_name or ""]
    assert node_loss.pods_to_force(w.observed(), w.gen_pods(), SETTINGS) == (first.name,)


def test_a_notready_node_with_a_live_lease_is_not_schedulable() -> None:
    w = running_world()
    node = w.nodes[w.gen_pods()[0].node_name or ""]
    alive = replace(node, ready="False", lease_live_until=LEASE_FOREVER)
    assert alive.down_since(w.now) is None and not alive.schedulable(w.now)


# ---------------------------------------------------------------- the disruption guard

def _down(w: Any, names: list[str]) -> None:
    for name in names:
        w.set_node(name, ready="Unknown", ready_since=w.now, taints=(Taint(api.UNREACHABLE_TAINT, "", "NoExecute"),))


GUARD_CASES = {
    # id: (nodes down of the 16, guard percent, guard min nodes, guarded?)
    "one-node": (1, 50, 2, False),
    "seven-of-sixteen": (7, 50, 2, False),
    "half": (8, 50, 2, True),
    "all": (16, 50, 2, True),
    "half-guard-off": (8, 0, 2, False),
    "three-at-twenty-percent": (3, 20, 2, False),
    "four-at-twenty-percent": (4, 20, 2, True),
    "four-at-twenty-percent-min-five": (4, 20, 5, False),
}


@pytest.mark.parametrize(("down", "percent", "min_nodes", "guarded"), list(GUARD_CASES.values()), ids=list(GUARD_CASES))
def test_guard_table(down: int, percent: int, min_nodes: int, guarded: bool) -> None:
    w = running_world()
    worker_nodes = [p.node_name or "" for p in w.gen_pods()]
    others = sorted(set(w.nodes) - set(worker_nodes))
    _down(w, (worker_nodes + others)[:down])
    w.advance(600)
    settings = replace(SETTINGS, node_loss_guard_percent=percent, node_loss_guard_min_nodes=min_nodes)
    observed = w.observed()
    assert (node_loss.guard_active(observed, settings) is not None) == guarded
    wait = node_loss.check_guard(validate_spec(w.spec), observed, w.status, settings)
    assert (wait is not None) == guarded
    forced = node_loss.pods_to_force(observed, w.gen_pods(), settings)
    assert (forced == ()) == guarded


def test_guard_on_a_two_node_cluster_needs_both_down() -> None:
    w = running_world()
    observed = replace(w.observed(), nodes=w.observed().nodes[:2])
    one = replace(observed, nodes=(replace(observed.nodes[0], ready="Unknown"), observed.nodes[1]))
    assert node_loss.guard_active(one, SETTINGS) is None
    both = replace(observed, nodes=tuple(replace(n, ready="Unknown") for n in observed.nodes))
    assert node_loss.guard_active(both, SETTINGS) == (2, 2)


def test_half_the_nodes_unknown_waits_then_the_same_generation_runs_on() -> None:
    """Issue 18, item 5: half the cluster's nodes go Unknown at once, far past the grace: no teardown,
    no force-delete, Degraded=True NodeLossGuard saying why (one event); they come back: generation 1
    runs on."""
    w = running_world()
    half = sorted(w.nodes)[:8]
    assert any(p.node_name in half for p in w.gen_pods())
    _down(w, half)
    for _ in range(3):
        w.advance(300)
        actions = w.step()
        assert not any(isinstance(a, DeleteGeneration) for a in actions), actions
    assert w.status.transition is None and w.status.generation == 1
    degraded = w.status.condition(api.COND_DEGRADED)
    assert degraded is not None and degraded.status == "True" and degraded.reason == api.NODE_LOSS_GUARD.name
    assert "8 of 16 nodes" in degraded.message
    assert w.reasons().count(api.NODE_LOSS_GUARD.name) == 1
    for name in half:
        w.set_node(name, ready="True", ready_since=w.now, taints=(Taint(api.TPU_TAINT_KEY),))
    w.settle()
    assert w.status.generation == 1 and w.status.phase == api.PHASE_RUNNING and w.status.restarts == 0
    degraded = w.status.condition(api.COND_DEGRADED)
    assert degraded is not None and degraded.reason != api.NODE_LOSS_GUARD.name


# ---------------------------------------------------------------- operator restarts


def node_loss_flow(d: Driver) -> None:
    d.tick(6)
    node = d.w.gen_pods()[0].node_name or ""
    d.w.set_node(node, ready="Unknown", ready_since=d.w.now)
    d.tick(2)
    d.w.advance(30)
    d.tick(10)


@pytest.mark.parametrize("keep", list(KEEP.values()), ids=list(KEEP))
def test_operator_dies_at_every_step_of_a_node_loss(keep: int) -> None:
    assert_survives_restarts(node_loss_flow, keep)


# ---------------------------------------------------------------- witnessed Lease staleness (issue 26, item 6)

def _renewed(ago: float, seconds: float = 40) -> dict[str, Any]:
    """A Lease last renewed `ago` seconds before T0, of `seconds` duration (the ObservedNode fields)."""
    return {"lease_live_until": T0 - timedelta(seconds=ago) + timedelta(seconds=seconds), "lease_seconds": seconds}


@pytest.mark.parametrize(("node", "down"), [
    # a Ready node's Lease is read only with a witness (a worker exited 76): two missed renewals prove it
    ({"ready": "True", **_renewed(10)}, None),  # one renewal missed at most: alive
    ({"ready": "True", **_renewed(19.9)}, None),
    ({"ready": "True", **_renewed(20)}, T0),  # renewTime + 0.5 x 40 s
    ({"ready": "True", **_renewed(35)}, T0 - timedelta(seconds=15)),
    ({"ready": "True", **_renewed(35, seconds=80)}, None),  # a longer Lease: 40 s of proof
    ({"ready": "True", **_renewed(50, seconds=80)}, T0 - timedelta(seconds=10)),
    ({"ready": "True"}, None),  # no Lease read (no witness): the node controller's word only
    # NotReady (the kubelet's own report) with a live Lease stays not down: the full duration, no witness
    ({"ready": "False", "ready_since": T0 - timedelta(seconds=60), **_renewed(30)}, None),
    ({"ready": "False", "ready_since": T0 - timedelta(seconds=60), **_renewed(40)}, T0 - timedelta(seconds=60)),
], ids=["renewed-10s-ago", "just-under-two-renewals", "two-renewals-missed", "long-stale", "longer-lease-live",
        "longer-lease-stale", "no-lease-read", "notready-lease-live", "notready-lease-expired"])
def test_a_witnessed_ready_nodes_lease_proves_it_down_after_two_missed_renewals(node: dict[str, Any],
                                                                                down: Any) -> None:
    from resilax_operator.observed.snapshot import ObservedNode

    assert ObservedNode("n", **node).down_since(T0) == down


def test_peers_lost_and_two_renewals_missed_is_a_node_loss_before_the_lease_expires() -> None:
    """A worker exited 76; the Ready node of another worker last renewed its Lease 25 s ago (not expired
    for 15 s more): NodeLoss at once, naming that node."""
    w = running_world()
    pods = w.gen_pods()
    victim = pods[-1]
    w.exit_workers(api.EXIT_CODE_PEER_LOST, names=[pods[0].name])
    w.set_node(victim.node_name or "", lease_live_until=w.now + timedelta(seconds=15), lease_seconds=40)
    spec, observed = validate_spec(w.spec), w.observed()
    finding = node_loss.check_lost(spec, observed, w.status, SETTINGS)
    assert finding is not None and finding.kind == st.NODE_LOSS and (victim.node_name or "") in finding.message
    assert "not waiting for the grace" in finding.message


# ---------------------------------------------------------------- an abort (exit 134) as a witness


def _abort_world(renewed_before: set[int]) -> tuple[Any, list[Any]]:
    """A running world where worker 0's trainer aborted (exit 134) at `w.now`; the Lease of each other
    worker's node was renewed 5 s before the abort for the indices in `renewed_before`, else 1 s after
    (2 s later, when the world looks)."""
    w = running_world()
    w.advance(100)
    pods = w.gen_pods()
    aborted_at = w.now
    w.exit_workers(api.EXIT_CODE_ABORTED, names=[pods[0].name])
    w.advance(2)
    for i, p in enumerate(pods[1:], start=1):
        renewed = aborted_at - timedelta(seconds=5) if i in renewed_before else aborted_at + timedelta(seconds=1)
        w.set_node(p.node_name or "", lease_live_until=renewed + timedelta(seconds=40), lease_seconds=40)
    return w, pods


def test_an_abort_whose_peers_nodes_all_renewed_after_it_is_the_workers_own_failure() -> None:
    """Exit 134 and every other worker's node renewed its Lease after the abort: no node is down, so the
    abort is the worker's own (counted, as before)."""
    w, pods = _abort_world(set())
    w.step()
    assert w.status.failures == 1 and w.status.transition is not None
    assert w.status.transition.kind == st.WORKER_FAILURE and pods[0].name in w.status.transition.message


def test_an_abort_while_a_peers_node_lease_is_stale_waits_then_is_a_node_loss_with_no_failure_counted() -> None:
    """Goodput run of 2026-12-07: a node killed; JAX's coordination service aborted a survivor (exit 134)
    0.2 s later, before any Python error could exit 76. The operator counted it as that worker's failure and
    restarted in place on the killed node's slice (5 min Pending). Now it waits for the Lease of the node
    that has not renewed since the abort: past two missed renewals, NodeLoss at once (a spare, not counted)."""
    w, pods = _abort_world({5})
    victim = pods[5]
    actions = w.step()
    assert not any(isinstance(a, DeleteGeneration) for a in actions) and w.status.failures == 0
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.ABORT_CAUSE_WAIT.name and (victim.node_name or "") in ready.message
    assert api.ABORT_CAUSE_WAIT.name in w.reasons()
    assert any(isinstance(a, RequeueAfter) and a.seconds <= 13.5 for a in actions)  # the proof: renewed + 20 s
    w.advance(13)  # 20 s after the renewal (5 s before the abort, which was 2 s ago)
    actions = w.step()
    delete = next(a for a in actions if isinstance(a, DeleteGeneration))
    assert victim.name in delete.force_pods
    assert w.status.transition is not None and w.status.transition.kind == st.NODE_LOSS
    assert "was aborted (exit 134)" in w.status.transition.message and w.status.failures == 0


def test_an_abort_with_leases_that_cannot_be_read_waits_at_most_the_peer_lost_timeout() -> None:
    w = running_world()
    w.advance(100)
    pods = w.gen_pods()
    w.exit_workers(api.EXIT_CODE_ABORTED, names=[pods[0].name])
    w.step()
    assert w.status.failures == 0 and w.status.condition(api.COND_READY).reason == api.ABORT_CAUSE_WAIT.name
    w.advance(SETTINGS.peer_lost_timeout_seconds)
    w.step()
    assert w.status.failures == 1 and w.status.transition is not None
    assert w.status.transition.kind == st.WORKER_FAILURE


def test_any_other_exit_code_is_counted_at_once_whatever_the_leases() -> None:
    w = running_world()
    w.advance(100)
    pods = w.gen_pods()
    w.exit_workers(1, names=[pods[0].name])
    w.step()
    assert w.status.failures == 1
