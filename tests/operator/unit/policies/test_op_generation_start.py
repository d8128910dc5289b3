"""generation_start.py: planning and creating a generation, bringing it up, refused pods.

Driven through the in-memory world (op_world), which checks at every decision that deciding twice
gives the same actions and that no generation is created while another one's pods exist; the
tables call the policy's functions directly."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
from op_samples import good_spec
from op_world import SETTINGS, T0, World, fixed_spec, four_pools, running_world, tpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import (
    CreateGeneration,
    EmitEvent,
    RequeueAfter,
    SetStatus,
)
from resilax_operator.observed.snapshot import ObservedPod
from resilax_operator.policies import generation_start
from resilax_operator.policies.generation_start import decide_pod_refused
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec


def test_first_generation_coordinator_first_then_the_rest() -> None:
    w = World.make(good_spec(), *four_pools())
    actions = w.step()
    assert [type(a).__name__ for a in actions] == ["SetStatus", "EmitEvent", "CreateGeneration"]
    create = actions[2]
    assert isinstance(create, CreateGeneration) and create.service is not None
    assert [m["metadata"]["name"] for m in create.pods] == ["llama-g1-s0-h0"]
    assert w.status.generation == 1 and w.status.shape == Shape("4x4", 4) and w.status.hosts == 16
    assert w.status.phase == api.PHASE_PENDING and w.status.restore_step == "latest"
    # pod 0 has no IP yet: wait
    assert [type(a).__name__ for a in w.step()] == ["RequeueAfter"]
    w.schedule()
    actions = w.step()
    create = next(a for a in actions if isinstance(a, CreateGeneration))
    assert len(create.pods) == 15 and create.service is None
    env = {e["name"]: e.get("value") for e in create.pods[0]["spec"]["containers"][0]["env"]}
    assert env["JAX_COORDINATOR_ADDRESS"] == "10.0.0.1:8482"
    assert w.status.workers_created
    w.schedule()
    w.step()
    assert w.status.phase == api.PHASE_RUNNING
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.status == "True" and ready.reason == api.WORKERS_RUNNING.name
    assert w.reasons() == [api.GENERATION_CREATED.name, api.WORKERS_RUNNING.name]
    assert w.step() == []  # steady: nothing to do


def test_restore_step_from_spec_for_first_generation_only() -> None:
    spec = good_spec()
    spec["checkpoint"]["restore"]["step"] = 1200
    w = running_world(spec)
    assert w.status.restore_step == "1200"
    w.exit_workers(75, names=["llama-g1-s0-h0"])
    w.settle()
    w.advance(15)  # the others' trainers still run: they get STOPPING_TRAINER_WAIT_SECONDS to stop
    w.settle()
    assert w.status.generation == 2 and w.status.restore_step == "latest"


def test_fixed_shape_waits_for_capacity() -> None:
    w = World.make(fixed_spec(count=3), tpu_pool("pool-a", 4), tpu_pool("pool-b", 4))
    w.settle()
    assert w.status.generation == 0 and w.status.phase == api.PHASE_PENDING
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.INSUFFICIENT_CAPACITY.name
    assert w.reasons().count(api.INSUFFICIENT_CAPACITY.name) == 1  # one event, not one per decision
    w.nodes.update({n.name: n for n in tpu_pool("pool-c", 4)})
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.status.shape == Shape("4x4", 3)


def test_insufficient_capacity_says_what_each_topology_needs_and_what_nodes_offer() -> None:
    spec = fixed_spec(count=1)
    spec["slices"]["topology"] = "2x4"  # v5e 2x4 defaults to one host with 8 chips (GKE's 8t)
    w = World.make(spec, tpu_pool("small", 2, topology="2x4", chips=4))
    w.settle()
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.INSUFFICIENT_CAPACITY.name
    assert "2x4: 1..1 node pools of 1 host(s) with 8 free google.com/tpu each" in ready.message
    assert "2 schedulable nodes with these labels, at most 4 free per node" in ready.message
    assert "set slices.machineType or slices.chipsPerHost" in ready.message
    spec["slices"]["chipsPerHost"] = 4  # the hint's fix: 2 hosts x 4 chips fit these nodes
    w = World.make(spec, tpu_pool("small", 2, topology="2x4", chips=4))
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.status.hosts == 2


def test_insufficient_capacity_without_a_host_size_hint_when_the_user_chose_it() -> None:
    w = World.make(fixed_spec(count=3), tpu_pool("pool-a", 4), tpu_pool("pool-b", 4))
    w.settle()
    ready = w.status.condition(api.COND_READY)
    assert ready is not None
    assert "4x4: 3..3 node pools of 4 host(s) with 4 free google.com/tpu each" in ready.message
    assert "8 schedulable nodes with these labels, at most 4 free per node" in ready.message
    assert "chipsPerHost" not in ready.message


def test_elastic_starts_at_the_largest_shape_capacity_allows() -> None:
    w = running_world(pools=[tpu_pool("pool-a", 4), tpu_pool("pool-b", 4), tpu_pool("pool-c", 4)])
    assert w.status.shape == Shape("4x4", 3)
    degraded = w.status.condition(api.COND_DEGRADED)
    assert degraded is not None and degraded.status == "True" and degraded.reason == api.SHRUNK.name


def test_topology_fallback_when_big_slices_are_gone() -> None:
    spec = good_spec()
    pools = [tpu_pool("big-a", 4), tpu_pool("small-a", 1, topology="2x4", chips=8),
             tpu_pool("small-b", 1, topology="2x4", chips=8)]
    spec["slices"]["count"] = 2
    w = running_world(spec, pools)
    # 1 x 4x4 (16 chips) is below minCount 2, so it falls back to 2 x 2x4
    assert w.status.shape == Shape("2x4", 2) and w.status.pools == ("small-a", "small-b")


@pytest.mark.parametrize("tpu_labels", [True], ids=["tpu-nodes-not-used-for-cpu"])
def test_cpu_job_does_not_take_tpu_nodes(tpu_labels: bool) -> None:
    raw = copy.deepcopy(good_spec())
    raw["slices"] = {"accelerator": "cpu", "topology": "1x4", "count": 1}
    del raw["elastic"]
    w = World.make(raw, tpu_pool("pool-a", 4))
    w.settle()
    assert w.status.generation == 0


def test_unschedulable_workers_are_replanned() -> None:
    w = World.make(good_spec(), *four_pools())
    w.step()
    w.advance(299)
    assert w.step_besides_goodput() == [RequeueAfter(5.0)]
    w.advance(1)
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.POD_LOST
    assert api.UNSCHEDULABLE.name in w.reasons()


def test_worker_nodes_are_recorded_and_the_next_generation_prefers_them() -> None:
    raw = fixed_spec()
    raw["checkpoint"]["local"] = {}
    w = running_world(raw)
    placed = {p.slice_index * 4 + p.host: p.node_name for p in w.gen_pods()}
    assert dict(w.status.worker_nodes) == placed and len(placed) == 8
    w.exit_workers(1, names=[w.gen_pods()[3].name])
    created: list[CreateGeneration] = []
    for _ in range(12):
        created += [a for a in w.step() if isinstance(a, CreateGeneration) and a.generation == 2]
        w.schedule()
        w.kubelets()
        w.advance(5)
    pods = [m for a in created for m in a.pods]
    assert len(pods) == 8
    for m in pods:
        index = int(m["metadata"]["labels"][api.LABEL_PROCESS])
        preferred = m["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert preferred[0]["preference"]["matchFields"][0]["values"] == [placed[index]]
    assert w.status.generation == 2 and dict(w.status.worker_nodes) == placed


def test_pod_creation_refused_names_the_api_answer_and_the_fix_once() -> None:
    raw = fixed_spec()
    raw["checkpoint"]["local"] = {}
    spec = validate_spec(raw)
    status = st.JobStatus(generation=1, phase=api.PHASE_PENDING)
    answer = 'pods "llama-g1-s0-h0" is forbidden: violates PodSecurity "baseline:latest": hostPath volumes'
    actions = decide_pod_refused(spec, status, 1, "llama-g1-s0-h0", answer, T0, SETTINGS)
    assert [type(a).__name__ for a in actions] == ["SetStatus", "EmitEvent", "RequeueAfter"]
    new = actions[0].status  # type: ignore[union-attr]
    ready = new.condition(api.COND_READY)
    assert ready is not None and ready.status == "False" and ready.reason == "PodCreationRefused"
    assert answer in ready.message and "checkpoint.local.scope: Pod" in ready.message
    assert "pod-security.kubernetes.io/enforce=privileged" in ready.message
    assert actions[1] == EmitEvent("Warning", "PodCreationRefused", ready.message)
    assert actions[2] == RequeueAfter(30.0)
    # the same refusal again: no new event, no status write
    assert decide_pod_refused(spec, new, 1, "llama-g1-s0-h0", answer, T0, SETTINGS) == [RequeueAfter(30.0)]
    # without a hostPath local tier, no hostPath fix
    raw["checkpoint"]["local"] = {"scope": "Pod"}
    other = decide_pod_refused(validate_spec(raw), status, 1, "p", "exceeded quota", T0, SETTINGS)
    message = other[0].status.condition(api.COND_READY).message  # type: ignore[union-attr]
    assert "exceeded quota" in message and "scope" not in message



# ---------------------------------------------------------------- the rule, as a table

START_CASES = {
    # id: (status, pods of another generation exist?, pools, expected action types, Ready reason)
    "first-generation": (st.JobStatus(), False, 4, ["SetStatus", "EmitEvent", "CreateGeneration"],
                         api.WORKERS_STARTING.name),
    "old-pods-still-exist": (st.JobStatus(generation=1), True, 4, ["RequeueAfter"], None),
    "in-backoff": (st.JobStatus(generation=1, transition=st.Transition(
        st.WORKER_FAILURE, 1, T0, "worker failed", not_before=T0 + timedelta(seconds=10))), False, 4,
                   ["SetStatus", "RequeueAfter"], api.BACKOFF.name),
    "backoff-over": (st.JobStatus(generation=1, transition=st.Transition(
        st.WORKER_FAILURE, 1, T0, "worker failed", not_before=T0)), False, 4,
                     ["SetStatus", "EmitEvent", "CreateGeneration"], api.WORKERS_STARTING.name),
    "no-capacity": (st.JobStatus(), False, 1, ["SetStatus", "EmitEvent", "RequeueAfter"], api.INSUFFICIENT_CAPACITY.name),
}


@pytest.mark.parametrize(("status", "old_pods", "pools", "types", "reason"), list(START_CASES.values()),
                         ids=list(START_CASES))
def test_start_table(status: st.JobStatus, old_pods: bool, pools: int, types: list[str], reason: str | None) -> None:
    w = World.make(good_spec(), *four_pools()[:pools])
    w.status = status
    if old_pods:
        w.pods["llama-g1-s0-h0"] = ObservedPod("llama-g1-s0-h0", 1, 0, 0)
    observed = w.observed()
    actions = generation_start.start(validate_spec(w.spec), observed, status, SETTINGS, [])
    assert [type(a).__name__ for a in actions] == types
    if reason is not None:
        new = next(a for a in actions if isinstance(a, SetStatus)).status
        ready = new.condition(api.COND_READY)
        assert ready is not None and ready.reason == reason
    create = next((a for a in actions if isinstance(a, CreateGeneration)), None)
    if create is not None:
        assert create.generation == status.generation + 1 and len(create.pods) == 1  # pod 0 first


UNSCHEDULED_CASES = {
    # id: (seconds since the generation started, scheduled?, finding?)
    "pending-within-timeout": (299, False, False),
    "pending-past-timeout": (300, False, True),
    "scheduled-past-timeout": (600, True, False),
}


@pytest.mark.parametrize(("seconds", "scheduled", "found"), list(UNSCHEDULED_CASES.values()), ids=list(UNSCHEDULED_CASES))
def test_unscheduled_table(seconds: int, scheduled: bool, found: bool) -> None:
    w = World.make(good_spec(), *four_pools())
    w.step()
    if scheduled:
        w.schedule()
    w.advance(seconds)
    finding = generation_start.check_unscheduled(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    assert (finding is not None) == found
    if finding is not None:
        assert finding.kind == st.POD_LOST and finding.reason == api.UNSCHEDULABLE.name
