"""policies/spares.py and pods/spares.py (issue 39): a job holds spare slices of its shape with
placeholder pods; a hard loss moves the lost slice's work onto a spare at full size (no shrink, no
wait); the spare is replenished when capacity returns.

Flows through the in-memory world (op_world: deciding twice gives the same actions at every step, no
generation is created while another one's pods exist), then tables of the pure decisions."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
from op_samples import good_spec
from op_world import SETTINGS, T0, World, fixed_spec, tpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import CreateGeneration, CreateSpares, DeleteSpares, EmitEvent, SetStatus
from resilax_operator.builders import geometry_of
from resilax_operator.capacity import plan_pools
from resilax_operator.errors import InvalidSpecError
from resilax_operator.observed.snapshot import Taint
from resilax_operator.pods.spares import (
    ObservedSpare,
    SpareStatus,
    build_spare_pods,
    build_spare_status,
    parse_spare,
    parse_spare_status,
)
from resilax_operator.policies import spares
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec


def spare_spec(count: int = 1, spares_: int = 1, **recovery: Any) -> dict[str, Any]:
    raw = fixed_spec(count)
    raw["recovery"].update({"spareSlices": spares_, **recovery})
    return raw


def world(count: int = 1, spares_: int = 1, pools: str = "abc") -> World:
    w = World.make(spare_spec(count, spares_), *(tpu_pool(f"pool-{c}", 4) for c in pools))
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING, w.status
    return w


def spare_pools(w: World) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for p in w.spares.values():
        out.setdefault(p.slot, set()).add(w.nodes[p.node_name].pool if p.node_name else "")
    return out


def kill(w: World, node: str) -> None:
    w.set_node(node, ready="Unknown", ready_since=w.now, taints=(Taint(api.UNREACHABLE_TAINT, "", "NoSchedule"),))


def test_a_spare_is_held_off_the_workers_pools_and_shows_in_the_status() -> None:
    w = world()
    assert w.status.pools == ("pool-a",)
    assert spare_pools(w) == {0: {"pool-b"}}  # 4 hosts of one slot, all on one pool
    assert sorted(w.spares) == [f"llama-spare-s0-h{h}" for h in range(4)]
    assert w.status.spares == SpareStatus(desired=1, ready=1, pools=("pool-b",))
    pod = w.spare_manifests["llama-spare-s0-h0"]
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"] == {api.LABEL_JOB: "llama", api.LABEL_ROLE: api.ROLE_SPARE, api.LABEL_SPARE_SLICE: "0",
                              api.LABEL_HOST: "0"}
    assert api.LABEL_GENERATION not in meta["labels"]  # never taken for a worker
    assert meta["ownerReferences"][0]["uid"] == "uid-1"
    (container,) = spec["containers"]
    assert container["command"] == ["sleep", "infinity"] and container["image"] == SETTINGS.sidecar_image
    assert container["resources"]["requests"][api.TPU_RESOURCE] == "4" == container["resources"]["limits"][api.TPU_RESOURCE]
    assert spec["nodeSelector"] == {api.TPU_ACCELERATOR_LABEL: "tpu-v5-lite-podslice", api.TPU_TOPOLOGY_LABEL: "4x4",
                                    api.NODE_POOL_LABEL: "pool-b"}  # the spare choice: the first free pool
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": api.NODE_POOL_LABEL, "operator": "NotIn", "values": ["pool-a"]} in term["matchExpressions"]
    assert spec["terminationGracePeriodSeconds"] == 0 and "priorityClassName" not in spec
    with_class = build_spare_pods(w.job, validate_spec(spare_spec()), 0, (),
                                         replace(SETTINGS, spare_priority_class="resilax-spare"))
    assert with_class[0]["spec"]["priorityClassName"] == "resilax-spare"
    assert meta["annotations"] == {api.ANNOTATION_SHAPE: "tpu-v5-lite-podslice/4x4/4"}
    assert parse_spare(pod, "uid-1") == ObservedSpare("llama-spare-s0-h0", 0, 0, pinned="pool-b",
                                                      shape="tpu-v5-lite-podslice/4x4/4")
    assert parse_spare(pod, "uid-other") is None
    # a steady job: nothing more to do
    assert not [a for a in w.step() if isinstance(a, CreateSpares | DeleteSpares)]


def test_a_hard_loss_takes_the_spare_at_full_size_then_the_spare_is_replenished_when_the_node_returns() -> None:
    w = world(pools="ab")
    assert spare_pools(w) == {0: {"pool-b"}}
    dead = w.gen_pods()[1].node_name or ""
    kill(w, dead)
    w.advance(31)  # past recovery.nodeLossGraceSeconds (30)
    w.step()  # the loss: the generation goes (forced)
    assert w.status.transition is not None and w.status.transition.kind == st.NODE_LOSS
    creating: list[Any] = []
    for _ in range(10):
        w.kubelets()  # the other workers' graceful deletions finish
        actions = w.step()
        creating = [a for a in actions if isinstance(a, CreateGeneration | DeleteSpares)]
        if creating:
            break
    # the spare's placeholders go first, then the workers land on its pool: the spec's shape, at once
    assert [type(a) for a in creating] == [DeleteSpares, CreateGeneration], actions
    assert w.status.generation == 2 and w.status.shape == Shape("4x4", 1) and w.status.pools == ("pool-b",)
    taken = [a for a in actions if isinstance(a, EmitEvent) and a.reason == api.SPARE_TAKEN.name]
    assert len(taken) == 1 and "generation 2" in taken[0].message and "pool-b" in taken[0].message
    assert w.status.spares is not None and w.status.spares.taken_total == 1
    assert w.status.spares.taken_generation == 2 and w.status.spares.taken_pools == ("pool-b",)
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.status.generation == 2 and w.reasons().count("SpareTaken") == 1
    # no whole pool left: the new placeholders wait where the scheduler puts them (pool-a: 3 of 4 nodes up)
    assert w.status.spares.ready == 0 and w.status.spares.taken_total == 1
    assert len(w.spares) == 4 and sum(1 for p in w.spares.values() if p.node_name) == 3
    assert spare_pools(w) == {0: {"pool-a", ""}}
    w.set_node(dead, ready="True", ready_since=w.now, taints=())
    w.settle()
    assert w.status.spares == replace(w.status.spares, ready=1, pools=("pool-a",))
    assert spare_pools(w) == {0: {"pool-a"}} and w.status.generation == 2


def test_a_hard_loss_goes_to_free_capacity_first_and_keeps_the_spare() -> None:
    w = world(pools="abc")
    assert spare_pools(w) == {0: {"pool-b"}}
    kill(w, w.gen_pods()[1].node_name or "")
    w.advance(31)
    for _ in range(10):
        w.kubelets()
        w.step()
        w.schedule()
    assert w.status.generation == 2 and w.status.pools == ("pool-c",) and w.status.shape == Shape("4x4", 1)
    assert spare_pools(w) == {0: {"pool-b"}} and api.SPARE_TAKEN.name not in w.reasons()


def test_a_restart_keeps_off_the_spare_when_other_capacity_fits() -> None:
    w = world()
    w.exit_workers(1)  # a worker failure, no node lost
    w.settle()
    w.advance(60)  # the backoff
    w.settle()
    assert w.status.generation == 2 and w.status.pools == ("pool-a",)  # not the spare's pool-b
    assert spare_pools(w) == {0: {"pool-b"}} and api.SPARE_TAKEN.name not in w.reasons()


def test_the_planner_takes_spare_pools_last() -> None:
    nodes = [*tpu_pool("pool-a", 4), *tpu_pool("pool-b", 4)]
    geometry = geometry_of(validate_spec(spare_spec()), "4x4")
    held = [replace(n, spare=True) if n.pool == "pool-a" else n for n in nodes]
    assert plan_pools(geometry, nodes, T0) == ("pool-a", "pool-b")
    assert plan_pools(geometry, held, T0) == ("pool-b", "pool-a")


def test_no_spare_before_the_first_generation_and_none_for_a_queue_or_a_suspended_job() -> None:
    w = World.make(spare_spec(), tpu_pool("pool-a", 4), tpu_pool("pool-b", 4))
    spec = validate_spec(spare_spec())
    want, why = spares.desired(spec, w.observed(), w.status)
    assert (want, why) == (1, "held once the first generation is planned")
    queued = replace(w.job, queue="team-a")
    assert spares.desired(spec, replace(w.observed(), job=queued), replace(w.status, generation=1, pools=("a",)))[0] == 0
    suspended = validate_spec({**spare_spec(), "suspend": True})
    assert spares.desired(suspended, w.observed(), replace(w.status, generation=1, pools=("a",)))[1].startswith(
        "the job is suspended")


def test_suspending_deletes_the_placeholders_and_the_status_says_why() -> None:
    w = world()
    w.spec["suspend"] = True
    w.spec_generation += 1
    w.settle()
    assert w.spares == {}
    assert w.status.spares is not None and w.status.spares.ready == 0
    assert w.status.spares.message == "the job is suspended (spec.suspend)"


def test_fewer_spares_asked_deletes_the_extra_slot() -> None:
    w = world(spares_=2, pools="abcd")
    assert spare_pools(w) == {0: {"pool-b"}, 1: {"pool-c"}}
    w.spec["recovery"]["spareSlices"] = 1
    w.spec_generation += 1
    actions = w.step()
    (delete,) = [a for a in actions if isinstance(a, DeleteSpares)]
    assert delete.names == tuple(f"llama-spare-s1-h{h}" for h in range(4)) and "slot 1 not asked for" in delete.reason
    w.spec["recovery"]["spareSlices"] = 0
    w.spec_generation += 1
    w.settle()
    assert w.spares == {} and w.status.spares is None


def test_a_placeholder_on_a_node_gone_is_replaced_elsewhere() -> None:
    w = world(pools="abcd")
    node = next(p.node_name for p in w.spares.values() if p.host == 0) or ""
    del w.nodes[node]
    actions = w.step()
    (delete,) = [a for a in actions if isinstance(a, DeleteSpares)]
    assert len(delete.names) == 4 and "node down, gone" in delete.reason
    w.settle()
    assert spare_pools(w) == {0: {"pool-c"}} and w.status.spares is not None and w.status.spares.ready == 1


@pytest.mark.parametrize("raw", [
    None, [], {"desired": "x"},
], ids=["absent", "not-an-object", "unreadable"])
def test_unreadable_spare_status_is_none(raw: Any) -> None:
    assert parse_spare_status(raw) is None


def test_spare_status_round_trip() -> None:
    s = SpareStatus(2, 1, ("pool-b",), "", 3, ("pool-c",), 2)
    assert parse_spare_status(build_spare_status(s)) == s
    assert build_spare_status(None) is None
    assert build_spare_status(SpareStatus(1)) == {"desired": 1, "ready": 0, "pools": [], "takenTotal": 0}
    full = st.JobStatus(spares=s)
    assert st.parse_status(st.build_status(full)).spares == s


@pytest.mark.parametrize(("change", "path", "wanted"), [
    (lambda r: r["recovery"].update(spareSlices=-1), "spec.recovery.spareSlices", "must be >= 0"),
    (lambda r: r["recovery"].update(spareSlices=9), "spec.recovery.spareSlices", "allowed: 0-8"),
    (lambda r: r["recovery"].update(spareSlices="1"), "spec.recovery.spareSlices", "must be an integer"),
    (lambda r: (r["recovery"].update(spareSlices=1), r["slices"].update(accelerator="cpu", topology="1")),
     "spec.recovery.spareSlices", "allowed with cpu: 0"),
], ids=["negative", "too-many", "not-an-integer", "cpu"])
def test_bad_spare_slices_are_refused_naming_the_field(change: Any, path: str, wanted: str) -> None:
    raw = copy.deepcopy(good_spec())
    change(raw)
    with pytest.raises(InvalidSpecError) as e:
        validate_spec(raw)
    assert any(p.path == path and wanted in p.message for p in e.value.problems), e.value.problems


def test_the_decision_is_idempotent_and_collapsed() -> None:
    w = world()
    observed = w.observed()
    spec = validate_spec(w.spec)
    first = spares.with_spares([], spec, observed, SETTINGS)
    assert first == spares.with_spares([], spec, observed, SETTINGS)
    assert sum(isinstance(a, SetStatus) for a in first) <= 1


def test_a_new_slot_never_gets_the_pool_a_pending_slot_is_pinned_to() -> None:
    w = world(pools="abcd")
    for name, p in w.spares.items():  # slot 0 waits, pinned to pool-b (its nodes not bound yet)
        w.spares[name] = replace(p, node_name=None, running=False)
    w.spec["recovery"]["spareSlices"] = 2
    w.spec_generation += 1
    (create,) = [a for a in w.step() if isinstance(a, CreateSpares)]
    assert {m["spec"]["nodeSelector"][api.NODE_POOL_LABEL] for m in create.pods} == {"pool-c"}
    assert {m["metadata"]["labels"][api.LABEL_SPARE_SLICE] for m in create.pods} == {"1"}


def test_a_preemption_notice_takes_the_spare_after_the_final_save() -> None:
    w = world(pools="ab")
    doomed = w.gen_pods()[0].node_name or ""
    w.set_node(doomed, taints=(*w.nodes[doomed].taints, Taint(api.IMPENDING_TERMINATION_TAINT, "", "NoSchedule")))
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.PREEMPTION
    w.exit_workers(75)  # the trainers stop after their final save
    w.settle()
    assert w.status.generation == 2 and w.status.phase == api.PHASE_RUNNING, w.status
    assert w.status.pools == ("pool-b",) and w.status.shape == Shape("4x4", 1)
    assert w.reasons().count(api.SPARE_TAKEN.name) == 1


def test_a_placeholder_on_a_cordoned_or_noticed_node_is_placed_again_but_a_not_ready_blip_is_not() -> None:
    w = world(pools="abcd")
    node = next(p.node_name for p in w.spares.values() if p.host == 0) or ""
    w.set_node(node, ready="False", ready_since=w.now)  # a kubelet blip within its grace
    assert not [a for a in w.step() if isinstance(a, DeleteSpares)]
    w.advance(31)  # past recovery.nodeLossGraceSeconds (30): down
    (delete,) = [a for a in w.step() if isinstance(a, DeleteSpares)]
    assert "node down" in delete.reason
    w.settle()
    node = next(p.node_name for p in w.spares.values() if p.host == 0) or ""
    w.set_node(node, unschedulable=True)  # cordoned: the planner would not use it
    (delete,) = [a for a in w.step() if isinstance(a, DeleteSpares)]
    assert "cordoned" in delete.reason and len(delete.names) == 4


def test_a_slices_edit_replaces_the_placeholders_of_the_old_shape() -> None:
    w = world(pools="abc")
    spec = validate_spec(w.spec)
    old = replace(w.observed(), spares=tuple(replace(p, shape="tpu-v5-lite-podslice/2x4/4") for p in w.spares.values()))
    plan = spares.plan(spec, old, w.status)
    assert plan.delete is not None and len(plan.delete[0]) == 4 and "another shape" in plan.delete[1]
    assert spares.plan(spec, w.observed(), w.status).delete is None


def _spare_flow(crash_at: int | None, keep: int) -> tuple[World, int]:
    """A hard loss that takes the spare, then the node's return, with the operator dying at decision
    `crash_at` after executing `keep` of its actions."""
    w = World.make(spare_spec(), tpu_pool("pool-a", 4), tpu_pool("pool-b", 4))
    n = 0

    def tick(times: int) -> None:
        nonlocal n
        for _ in range(times):
            w.step(only=keep if n == crash_at else None)
            n += 1
            w.schedule()
            w.kubelets()

    tick(8)
    dead = w.gen_pods()[1].node_name or ""
    kill(w, dead)
    w.advance(31)
    tick(10)
    w.set_node(dead, ready="True", ready_since=w.now, taints=())
    tick(8)
    return w, n


def _spare_end(w: World) -> tuple[object, ...]:
    s = w.status
    return (s.phase, s.generation, s.pools, s.shape, s.spares, spare_pools(w), len(w.gen_pods()))


@pytest.mark.parametrize("keep", [0, 1], ids=["dies-before-acting", "dies-after-first-action"])
def test_operator_dies_at_every_step_of_taking_and_replenishing_a_spare(keep: int) -> None:
    clean, decisions = _spare_flow(None, 0)
    expected = _spare_end(clean)
    assert expected[:4] == (api.PHASE_RUNNING, 2, ("pool-b",), Shape("4x4", 1)), expected
    assert expected[4] == SpareStatus(desired=1, ready=1, pools=("pool-a",), taken_generation=2,
                                      taken_pools=("pool-b",), taken_total=1)
    for crash_at in range(decisions):
        w, _ = _spare_flow(crash_at, keep)
        assert _spare_end(w) == expected, f"crash at decision {crash_at}"
