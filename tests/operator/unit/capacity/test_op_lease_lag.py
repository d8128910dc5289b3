"""A Ready node held down by a witnessed Lease never makes capacity planning shrink the job while its
kubelet's renewals merely lag (issue 39): `ObservedNode.lease_lags`, `capacity.plan_lease_wait`, and the
two planners that use it (generation_start.start for a full replacement, inplace.decide_mode)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from op_samples import good_spec
from op_world import T0, World, running_world, tpu_pool
from resilax_operator import api
from resilax_operator.capacity import LeaseWait, plan_lease_wait
from resilax_operator.observed.snapshot import ObservedNode, Taint
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec
from test_op_inplace import _node_of, _world, settle

LEASE = 40.0


@pytest.mark.parametrize("ready,live_for,unreachable,lags", [
    ("True", 5, False, True),        # proof (live_until - 20 s) passed, the full duration not: lags
    ("True", 25, False, False),      # two renewals not missed yet: not even held down
    ("True", -1, False, False),      # expired in full: down, no longer merely lagging
    ("True", 5, True, False),        # the node lifecycle controller tainted it: down
    ("Unknown", 5, False, False),    # marked by the controller: down
    ("True", None, False, False),    # Lease not read: nothing witnessed
], ids=["lagging", "not-proven", "expired", "unreachable-taint", "not-ready", "not-read"])
def test_lease_lags_table(ready: str, live_for: float | None, unreachable: bool, lags: bool) -> None:
    taints = (Taint(api.UNREACHABLE_TAINT, "", "NoSchedule"),) if unreachable else ()
    node = ObservedNode("n", ready=ready, taints=taints, ready_since=T0, lease_seconds=LEASE,
                        lease_live_until=None if live_for is None else T0 + timedelta(seconds=live_for))
    assert node.lease_lags(T0) == lags


def _lagging(nodes: list[ObservedNode], index: int, live_for: float = 5) -> list[ObservedNode]:
    n = nodes[index]
    lagging = ObservedNode(n.name, n.labels, n.taints, n.ready, n.ready_since, allocatable=n.allocatable,
                           lease_live_until=T0 + timedelta(seconds=live_for), lease_seconds=LEASE)
    return [*nodes[:index], lagging, *nodes[index + 1:]]


def _spec() -> object:
    return validate_spec(good_spec(), name="llama")  # 4 x 4x4 (4 hosts each), elastic 2..4


@pytest.mark.parametrize("hosts_b,other_pools,waits", [
    (4, 3, True),    # its pool has no spare host and no fifth pool: the shape would shrink, so wait
    (5, 3, False),   # a spare host in its pool: the same shape without it
    (4, 4, False),   # a fifth pool: the same shape without it
], ids=["no-spare-waits", "spare-host-plans", "spare-pool-plans"])
def test_plan_lease_wait_only_when_the_lagging_node_changes_the_shape(hosts_b: int, other_pools: int,
                                                                      waits: bool) -> None:
    nodes = _lagging(tpu_pool("pool-b", hosts_b), 0)
    for c in "acde"[:other_pools]:
        nodes += tpu_pool(f"pool-{c}", 4)
    wait = plan_lease_wait(_spec(), nodes, T0)  # type: ignore[arg-type]
    assert wait == (LeaseWait(T0 + timedelta(seconds=5), ("pool-b-n0",)) if waits else None)


def test_no_wait_once_the_lease_expired_in_full_or_without_one() -> None:
    nodes = _lagging(tpu_pool("pool-b", 4), 0, live_for=-1) + tpu_pool("pool-a", 4) + tpu_pool("pool-c", 4)
    assert plan_lease_wait(_spec(), nodes, T0) is None  # type: ignore[arg-type]
    assert plan_lease_wait(_spec(), tpu_pool("pool-a", 4), T0) is None  # type: ignore[arg-type]


def _hold_down(w: World, node: str, live_for: float) -> None:
    """`node`'s Lease, read by a witness, proves it down (since 40 s: past nodeLossGraceSeconds 30) but
    has `live_for` seconds of its full duration left; the node is still Ready."""
    w.set_node(node, lease_live_until=w.now + timedelta(seconds=live_for), lease_seconds=2 * (40 + live_for))


def test_full_replacement_waits_for_the_lease_then_shrinks() -> None:
    w = running_world()  # inPlace Never, 4 slices on 4 pools of 4 hosts
    victim = w.gen_pods()[6].node_name or ""
    _hold_down(w, victim, 10)
    w.settle(4)
    assert w.status.generation == 1 and w.status.transition is not None  # torn down: its peer is gone
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.LEASE_LAGGING.name and victim in ready.message, ready
    w.advance(10)
    w.settle()
    assert w.status.generation == 2 and w.status.shape == Shape("4x4", 3), w.status
    assert w.nodes[victim].pool not in w.status.pools


def test_full_replacement_keeps_the_shape_when_the_kubelet_renews_meanwhile() -> None:
    w = running_world()
    victim = w.gen_pods()[6].node_name or ""
    _hold_down(w, victim, 10)
    w.settle(4)
    w.advance(5)
    w.set_node(victim, lease_live_until=w.now + timedelta(seconds=40), lease_seconds=40)  # renewed, read again
    w.settle()
    assert w.status.generation == 2 and w.status.shape == Shape("4x4", 4), w.status


def test_in_place_waits_for_the_lease_then_shrinks_in_place() -> None:
    w = _world(spare=0)  # inPlace Auto, 2 slices x 2 hosts, no spare node
    victim = _node_of(w, "llama-g1-s1-h1")
    _hold_down(w, victim, 10)
    settle(w, 4)
    assert w.status.generation == 1 and w.status.in_place is None, w.status
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.LEASE_LAGGING.name and victim in ready.message, ready
    w.advance(10)
    settle(w)
    assert w.status.generation == 2 and w.status.shape == Shape("2x4", 1) and w.status.in_place_restarts == 1, w.status
