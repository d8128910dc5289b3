"""Capacity that does not exist yet (issue 18, item 3): `capacity.provisioning: Autoscaled` plans the
declared shape where Ready pools lack (capacity.plan_target), the waiting workers' pods stay Pending for
an autoscaler, the generation runs at the declared shape when nodes come, and shrinks after
`shrinkAfterSeconds` when none do (policies/capacity_wait.py); Kueue's gates are waited for, not replanned.

Driven through the in-memory world (op_world: deciding twice gives the same actions, never two
generations at once); the tables call the pure functions directly."""

from __future__ import annotations

import copy
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_samples import good_spec
from op_world import SETTINGS, T0, World, tpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import CreateGeneration, DeleteGeneration
from resilax_operator.builders import GenerationPlan, JobRef, build_pods
from resilax_operator.capacity import plan_target, record_pools
from resilax_operator.observed.snapshot import Observed, ObservedNode, ObservedPod
from resilax_operator.pods.worker_env import WAITING_INIT_TIMEOUT_SECONDS
from resilax_operator.policies import capacity_wait, node_loss
from resilax_operator.spec import Shape
from resilax_operator.status import JobStatus
from resilax_operator.validation import validate_spec

SHRINK_AFTER = 600


def autoscaled_spec(*, count: int = 2, low: int | None = 1, high: int = 2, provisioning: str = "Autoscaled",
                    shrink_after: int | None = SHRINK_AFTER) -> dict[str, Any]:
    raw = good_spec()
    raw["slices"]["count"] = count
    if low is None:
        del raw["elastic"]
    else:
        raw["elastic"] = {"minCount": low, "maxCount": high, "topologies": ["4x4"], "growBack": True}
    raw["capacity"] = {"provisioning": provisioning}
    if shrink_after is not None and provisioning == "Autoscaled":
        raw["capacity"]["shrinkAfterSeconds"] = shrink_after
    return raw


def pools(*names: str) -> list[list[Any]]:
    return [tpu_pool(n, 4) for n in names]


@pytest.mark.parametrize(("provisioning", "free", "count", "low", "high", "shape", "expected"), [
    ("Ready", 1, 2, 1, 2, Shape("4x4", 1), ("pool-a",)),
    ("Ready", 0, 2, None, 2, None, None),
    ("Autoscaled", 1, 2, 1, 2, Shape("4x4", 2), ("pool-a", "")),
    ("Autoscaled", 0, 2, 1, 2, Shape("4x4", 2), ("", "")),
    ("Autoscaled", 2, 2, 1, 2, Shape("4x4", 2), ("pool-a", "pool-b")),
    ("Autoscaled", 3, 2, 1, 3, Shape("4x4", 3), ("pool-a", "pool-b", "pool-c")),
    ("Autoscaled", 1, 2, None, 2, Shape("4x4", 2), ("pool-a", "")),
], ids=["ready-plans-what-exists", "ready-fixed-none", "autoscaled-one-pending", "autoscaled-all-pending",
        "autoscaled-fits", "autoscaled-larger-than-declared-fits", "autoscaled-fixed"])
def test_plan_target_table(provisioning: str, free: int, count: int, low: int | None, high: int,
                           shape: Shape | None, expected: tuple[str, ...] | None) -> None:
    spec = validate_spec(autoscaled_spec(count=count, low=low, high=high, provisioning=provisioning))
    nodes = [n for pool in pools(*[f"pool-{c}" for c in "abc"][:free]) for n in pool]
    planned = plan_target(spec, nodes, T0)
    if shape is None:
        assert planned is None
        return
    assert planned is not None and planned.shape == shape and planned.pools == expected
    assert planned.hosts == 4 * shape.count
    assert planned.waiting_slices == tuple(i for i, p in enumerate(expected or ()) if not p)


def test_waiting_slice_pods_go_to_one_new_pool_and_no_placed_one() -> None:
    spec = validate_spec(autoscaled_spec())
    plan = GenerationPlan(3, Shape("4x4", 2), ("pool-a", ""))
    job = JobRef("llama", "ml", "uid-1")
    pods = build_pods(job, spec, plan, SETTINGS, coordinator_ip="10.0.0.1")
    placed, waiting = pods[0], pods[4]
    assert placed["spec"]["nodeSelector"][api.NODE_POOL_LABEL] == "pool-a"
    assert "podAffinity" not in placed["spec"]["affinity"]
    assert api.NODE_POOL_LABEL not in waiting["spec"]["nodeSelector"]
    assert waiting["spec"]["nodeSelector"][api.TPU_TOPOLOGY_LABEL] == "4x4"  # what node provisioning creates
    assert waiting["metadata"]["labels"][api.LABEL_NODE_POOL] == ""
    affinity = waiting["spec"]["affinity"]
    (together,) = affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together == {"labelSelector": {"matchLabels": {api.LABEL_JOB: "llama", api.LABEL_GENERATION: "3",
                                                          api.LABEL_SLICE: "1"}},
                        "topologyKey": api.NODE_POOL_LABEL}
    apart = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"labelSelector": {"matchLabels": {api.LABEL_JOB: "llama", api.LABEL_GENERATION: "3"},
                              "matchExpressions": [{"key": api.LABEL_SLICE, "operator": "NotIn", "values": ["1"]}]},
            "topologyKey": api.NODE_POOL_LABEL} in apart
    (term,) = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": api.NODE_POOL_LABEL, "operator": "NotIn", "values": ["pool-a"]}]
    env = {e["name"]: e.get("value") for e in waiting["spec"]["containers"][0]["env"]}
    assert env["RESILAX_INIT_TIMEOUT_SECONDS"] == str(WAITING_INIT_TIMEOUT_SECONDS)


def test_a_user_node_affinity_keeps_its_terms_and_each_gets_the_exclusion() -> None:
    raw = autoscaled_spec()
    user = {"key": "cloud.google.com/gke-spot", "operator": "In", "values": ["true"]}
    raw["template"]["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [user]}, {"matchExpressions": [dict(user, values=["false"])]}]}}}
    spec = validate_spec(raw)
    pods = build_pods(JobRef("llama", "ml", "uid-1"), spec, GenerationPlan(1, Shape("4x4", 2), ("pool-a", "")),
                      SETTINGS, coordinator_ip="10.0.0.1")
    terms = pods[4]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    exclusion = {"key": api.NODE_POOL_LABEL, "operator": "NotIn", "values": ["pool-a"]}
    assert [t["matchExpressions"] for t in terms] == [[user, exclusion], [dict(user, values=["false"]), exclusion]]
    assert raw["template"]["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchExpressions"] == [user]  # the spec itself is not changed
    ready = validate_spec(autoscaled_spec(provisioning="Ready"))
    env = {e["name"] for e in build_pods(JobRef("llama", "ml", "uid-1"), ready, GenerationPlan(
        1, Shape("4x4", 1), ("pool-a",)), SETTINGS, coordinator_ip=None)[0]["spec"]["containers"][0]["env"]}
    assert "RESILAX_INIT_TIMEOUT_SECONDS" not in env  # JAX's own default where nobody waits for nodes


def ready_reason(w: World) -> tuple[str, str]:
    c = w.status.condition(api.COND_READY)
    assert c is not None
    return c.reason, c.message


def test_nodes_that_come_later_run_the_declared_shape_in_the_same_generation() -> None:
    w = World.make(autoscaled_spec(), *pools("pool-a"))
    w.settle()
    assert w.status.generation == 1 and w.status.shape == Shape("4x4", 2) and w.status.pools == ("pool-a", "")
    assert w.status.phase == api.PHASE_PENDING and len(w.gen_pods()) == 8
    assert sum(p.node_name is None for p in w.gen_pods()) == 4  # slice 1 Pending: what an autoscaler reacts to
    reason, message = ready_reason(w)
    assert reason == api.WAITING_FOR_CAPACITY.name
    assert ("generation 1: 4 of 8 workers wait for nodes that do not exist yet" in message
            and "slice 1 each need a node pool of 4 node(s) with 4 google.com/tpu each labelled "
                "cloud.google.com/gke-tpu-accelerator=tpu-v5-lite-podslice, cloud.google.com/gke-tpu-topology=4x4"
            in message and "if they do not come by 2026-01-01T12:10:00Z (capacity.shrinkAfterSeconds=600)" in message), \
        message
    assert w.reasons().count(api.WAITING_FOR_CAPACITY.name) == 1
    # Past the operator's scheduleTimeoutSeconds (300): waiting for new nodes is no reason to replan.
    w.advance(SETTINGS.schedule_timeout_seconds + 60)
    w.settle()
    assert w.status.generation == 1 and w.status.transition is None
    assert w.reasons().count(api.WAITING_FOR_CAPACITY.name) == 1  # the event once
    # The autoscaler adds a node pool: the waiting slice lands there, all on it.
    w.nodes.update({n.name: n for n in tpu_pool("pool-new", 4)})
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.status.generation == 1
    assert w.status.shape == Shape("4x4", 2) and w.status.pools == ("pool-a", "pool-new")
    assert {w.nodes[p.node_name or ""].pool for p in w.gen_pods() if p.slice_index == 1} == {"pool-new"}
    assert ready_reason(w)[0] == api.WORKERS_RUNNING.name
    assert w.created == [1]


def test_no_ready_pool_at_all_pod_zero_waits_too_then_all_come() -> None:
    w = World.make(autoscaled_spec(), *pools())
    w.settle()
    assert w.status.generation == 1 and w.status.pools == ("", "") and [p.name for p in w.gen_pods()] == ["llama-g1-s0-h0"]
    reason, message = ready_reason(w)
    assert reason == api.WAITING_FOR_CAPACITY.name and "8 of 8 workers" in message and "slices 0, 1 each" in message
    w.nodes.update({n.name: n for pool in pools("pool-x", "pool-y") for n in pool})
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.status.generation == 1
    assert sorted(w.status.pools) == ["pool-x", "pool-y"]


def test_no_nodes_shrink_after_the_timeout_then_grow_back_as_usual() -> None:
    w = World.make(autoscaled_spec(), *pools("pool-a"))
    w.settle()
    w.advance(SHRINK_AFTER - 5)
    w.settle(3)
    assert w.status.generation == 1 and w.status.transition is None
    w.advance(5)
    actions = w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.SHRINK
    assert w.status.transition.save_request_id is None  # the workers never all ran: nothing to save
    reason, message = ready_reason(w)
    assert reason == api.CAPACITY_TIMEOUT.name and message == (
        "generation 1: 4 workers found no node within capacity.shrinkAfterSeconds=600; shrinking from 2x[4x4] "
        "to 1x[4x4], which the Ready nodes fit")
    delete = next(a for a in actions if isinstance(a, DeleteGeneration))
    assert {d.grace_seconds for d in delete.pods} == {node_loss.SURVIVOR_GRACE_SECONDS}
    w.settle()
    assert w.status.generation == 2 and w.status.shape == Shape("4x4", 1) and w.status.pools == ("pool-a",)
    assert w.status.phase == api.PHASE_RUNNING
    degraded = w.status.condition(api.COND_DEGRADED)
    assert degraded is not None and degraded.status == "True"
    assert api.CAPACITY_TIMEOUT.name in w.reasons()
    # Capacity comes later: elastic.growBack moves to the declared shape (final save) as for any shrink.
    w.nodes.update({n.name: n for n in tpu_pool("pool-b", 4)})
    w.advance(SETTINGS.grow_back_settle_seconds)
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.GROW_BACK


def test_a_shrink_in_place_keeps_every_bound_worker() -> None:
    # inPlace Auto: the bound slice's trainers run (ready) while slice 1 waits; the capacity timeout's
    # in-place decision must have heard every bound pod's sidecar, not pod 0's alone
    raw = autoscaled_spec()
    raw["recovery"]["inPlace"] = "Auto"
    w = World.make(raw, *pools("pool-a"))
    w.settle()
    bound = [p.name for p in w.gen_pods() if p.node_name is not None]
    assert len(bound) == 4 and all(w.pods[n].supervised and w.pods[n].trainer_ready for n in bound)
    uids = {n: w.pods[n].uid for n in bound}
    w.advance(SHRINK_AFTER)
    w.step()
    assert w.status.in_place is not None and w.status.in_place.kind == st.SHRINK
    assert [k.pod for k in w.status.in_place.kept] == bound
    w.settle()
    assert w.status.generation == 2 and w.status.shape == Shape("4x4", 1) and w.status.phase == api.PHASE_RUNNING
    assert list(w.status.worker_pods) == bound and {n: w.pods[n].uid for n in bound} == uids


@pytest.mark.parametrize(("low", "free", "fragment"), [
    (None, 1, "no spec.elastic: the job waits for exactly this shape"),
    (1, 0, "capacity.shrinkAfterSeconds has passed, but no smaller allowed shape fits the Ready nodes either: "
           "still waiting"),
], ids=["fixed-shape", "nothing-smaller-fits"])
def test_past_the_timeout_without_a_smaller_shape_it_keeps_waiting(low: int | None, free: int, fragment: str) -> None:
    w = World.make(autoscaled_spec(low=low), *pools(*["pool-a"][:free]))
    w.settle()
    w.advance(SHRINK_AFTER + 120)
    w.settle()
    assert w.status.generation == 1 and w.status.transition is None and w.created == [1]
    reason, message = ready_reason(w)
    assert reason == api.WAITING_FOR_CAPACITY.name and fragment in message, message


def status_waiting(pools_: tuple[str, ...]) -> JobStatus:
    return JobStatus(phase=api.PHASE_PENDING, generation=1, shape=Shape("4x4", len(pools_)), hosts=4 * len(pools_),
                     pools=pools_, generation_start_time=T0, workers_created=True)


def observed(s: JobStatus, pods: list[ObservedPod], seconds: int, free: int) -> Observed:
    nodes = tuple(n for pool in pools(*["pool-a", "pool-b"][:free]) for n in pool)
    return Observed(now=T0 + timedelta(seconds=seconds), job=JobRef("llama", "ml", "u"), status=s, pods=tuple(pods),
                    nodes=nodes)


def slice_pods(slice_index: int, bound: int, *, gates: tuple[str, ...] = ()) -> list[ObservedPod]:
    return [ObservedPod(f"llama-g1-s{slice_index}-h{h}", 1, slice_index, h, phase="Running" if h < bound else "Pending",
                        node_name=f"n{slice_index}{h}" if h < bound else None, gates=() if h < bound else gates)
            for h in range(4)]


@pytest.mark.parametrize(("pools_", "bound", "seconds", "free", "gated", "shrink", "waiting"), [
    (("pool-a", ""), 0, 0, 1, False, False, {1: 4}),
    (("pool-a", ""), 2, 0, 1, False, False, {1: 2}),
    (("pool-a", ""), 4, 700, 1, False, False, {}),
    (("pool-a", ""), 0, 599, 1, False, False, {1: 4}),
    (("pool-a", ""), 0, 600, 1, False, True, {1: 4}),
    (("pool-a", ""), 0, 600, 0, False, False, {1: 4}),
    (("pool-a", ""), 0, 600, 2, False, False, {1: 4}),
    (("pool-a", ""), 0, 700, 1, True, False, {1: 4}),
    (("pool-a", "pool-b"), 0, 700, 2, False, False, {}),
], ids=["waiting", "half-bound", "all-bound", "before-timeout", "at-timeout", "nothing-smaller-fits",
        "the-nodes-came-not-yet-bound",
        "gated-by-a-queue", "all-placed"])
def test_capacity_wait_table(pools_: tuple[str, ...], bound: int, seconds: int, free: int, gated: bool,
                             shrink: bool, waiting: dict[int, int]) -> None:
    spec = validate_spec(autoscaled_spec())
    s = status_waiting(pools_)
    gates = ("kueue.x-k8s.io/admission",) if gated else ()
    pods = [*slice_pods(0, 4), *slice_pods(1, bound, gates=gates)]
    o = observed(s, pods, seconds, free)
    assert capacity_wait.waiting_workers(o, s) == waiting
    finding = capacity_wait.check(spec, o, s, SETTINGS)
    assert (finding is not None and finding.kind == st.SHRINK) == shrink
    wait = capacity_wait.waiting(spec, o, s)
    if gated:
        assert wait is not None and wait[0] == api.WAITING_FOR_ADMISSION.name
    else:
        assert (wait is not None and wait[0] == api.WAITING_FOR_CAPACITY.name) == bool(waiting)


def test_record_pools_only_once_every_worker_is_bound() -> None:
    s = status_waiting(("pool-a", ""))
    node_pools = {"n10": "pool-new", "n11": "pool-new", "n12": "pool-new", "n13": "pool-new",
                  **{f"n0{h}": "pool-a" for h in range(4)}}
    nodes = [ObservedNode(n, {api.NODE_POOL_LABEL: p}) for n, p in node_pools.items()]
    half = [*slice_pods(0, 4), *slice_pods(1, 2)]
    assert record_pools(s, half, nodes) == s
    full = [*slice_pods(0, 4), *slice_pods(1, 4)]
    assert record_pools(s, full, nodes).pools == ("pool-a", "pool-new")
    assert record_pools(replace(s, workers_created=False), full, nodes) == replace(s, workers_created=False)


# ---------------------------------------------------------------- Kueue


def queued_world(spec: dict[str, Any], *pools_: list[Any]) -> World:
    w = World.make(spec, *pools_)
    w.job = JobRef("llama", "ml", "uid-1", queue="team-a")
    w.gates = ("kueue.x-k8s.io/admission",)
    return w


def test_kueue_pod_group_created_at_once_with_the_coordinator_by_dns() -> None:
    raw = autoscaled_spec(provisioning="Ready")
    w = queued_world(raw, *pools("pool-a", "pool-b"))
    actions = w.step()
    leads = next(a for a in actions if isinstance(a, CreateGeneration))
    # Under the planning lock only the first pod of each slice (each pins its pool for the next plan);
    # the next decision creates the rest, outside the lock (issue 25, item 6).
    assert [m["metadata"]["name"] for m in leads.pods] == ["llama-g1-s0-h0", "llama-g1-s1-h0"]
    assert w.status.generation == 1 and not w.status.workers_created
    rest = next(a for a in w.step() if isinstance(a, CreateGeneration))
    assert rest.generation == 1 == w.status.generation and len(rest.pods) == 6
    created = [*leads.pods, *rest.pods]
    assert len({m["metadata"]["name"] for m in created}) == 8  # Kueue makes the Workload once it sees them all
    for m in created:
        labels, annotations = m["metadata"]["labels"], m["metadata"]["annotations"]
        assert labels[api.KUEUE_QUEUE_LABEL] == "team-a" and labels[api.KUEUE_POD_GROUP_LABEL] == "llama-g1"
        assert annotations[api.KUEUE_POD_GROUP_COUNT_ANNOTATION] == "8"
    envs = [{e["name"]: e.get("value") for e in m["spec"]["containers"][0]["env"]} for m in created]
    assert envs[0]["JAX_COORDINATOR_ADDRESS"] == "$(RESILAX_POD_IP):8482"
    assert {e["JAX_COORDINATOR_ADDRESS"] for e in envs[1:]} == {"llama-g1-s0-h0.llama-workers:8482"}
    assert {e["RESILAX_INIT_TIMEOUT_SECONDS"] for e in envs} == {str(WAITING_INIT_TIMEOUT_SECONDS)}
    # Gated: waiting for admission, whatever the schedule timeout; no replan.
    w.settle()
    assert w.status.workers_created and w.status.generation == 1
    reason, message = ready_reason(w)
    assert reason == api.WAITING_FOR_ADMISSION.name and message == (
        "generation 1: 8 of 8 workers are held by scheduling gates (kueue.x-k8s.io/admission): waiting for the "
        "queue (Kueue) to admit the pod group llama-g1")
    w.advance(SETTINGS.schedule_timeout_seconds + SHRINK_AFTER)
    w.settle()
    assert w.status.generation == 1 and w.status.transition is None
    w.admit()
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.created == [1]


def test_the_queue_label_of_the_template_counts_too() -> None:
    raw = autoscaled_spec(provisioning="Ready")
    raw["template"]["metadata"] = {"labels": {api.KUEUE_QUEUE_LABEL: "team-b"}}
    spec = validate_spec(copy.deepcopy(raw))
    pods = build_pods(JobRef("llama", "ml", "u"), spec, GenerationPlan(2, Shape("4x4", 1), ("pool-a",)), SETTINGS,
                      coordinator_ip=None)
    assert len(pods) == 4 and {p["metadata"]["labels"][api.KUEUE_POD_GROUP_LABEL] for p in pods} == {"llama-g2"}
    plain = build_pods(JobRef("llama", "ml", "u"), validate_spec(autoscaled_spec(provisioning="Ready")),
                       GenerationPlan(2, Shape("4x4", 1), ("pool-a",)), SETTINGS, coordinator_ip=None)
    assert len(plain) == 1 and api.KUEUE_POD_GROUP_LABEL not in plain[0]["metadata"]["labels"]


def test_a_larger_declared_shape_resizes_to_it_even_without_the_nodes() -> None:
    w = World.make(autoscaled_spec(high=3), *pools("pool-a", "pool-b"))
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.status.shape == Shape("4x4", 2)
    w.spec["slices"]["count"] = 3
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.RESIZE
    w.exit_workers(75)
    w.settle()
    assert w.status.generation == 2 and w.status.shape == Shape("4x4", 3)
    assert w.status.pools == ("pool-a", "pool-b", "")
    assert ready_reason(w)[0] == api.WAITING_FOR_CAPACITY.name
    # With Ready capacity planning the same edit keeps the running shape (no pool for a third slice).
    r = World.make(autoscaled_spec(high=3, provisioning="Ready"), *pools("pool-a", "pool-b"))
    r.settle()
    r.spec["slices"]["count"] = 3
    r.settle()
    assert r.status.generation == 1 and r.status.shape == Shape("4x4", 2)


def test_the_gke_example_is_a_valid_autoscaled_queued_job() -> None:
    job = yaml.safe_load((Path(__file__).resolve().parents[3] / "examples" / "jaxjob-gke-autoscaled.yaml").read_text())
    spec = validate_spec(job["spec"], name=job["metadata"]["name"])
    assert spec.capacity.autoscaled and spec.capacity.shrink_after == 900 and not spec.suspend
    assert job["metadata"]["labels"][api.KUEUE_QUEUE_LABEL] == "team-a"
