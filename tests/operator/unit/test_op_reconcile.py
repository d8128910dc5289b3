"""The decision table: every flow of DESIGN §4 driven through the in-memory world (op_world)."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest
from op_samples import good_spec
from op_world import SETTINGS, T0, World, cpu_pool, tpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import (
    CreateGeneration,
    DeleteGeneration,
    EmitEvent,
    PodDeletion,
    RequestFinalSave,
    RequeueAfter,
    SetStatus,
)
from resilax_operator.observed import SaveOutcome, Taint
from resilax_operator.policies.generation_start import decide_pod_refused
from resilax_operator.reconcile import decide_cleanup
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec


def fixed_spec(count: int = 2) -> dict[str, Any]:
    raw = good_spec()
    del raw["elastic"]
    raw["slices"]["count"] = count
    return raw


def four_pools(hosts: int = 4) -> list[list[Any]]:
    return [tpu_pool(f"pool-{c}", hosts) for c in "abcd"]


def running_world(spec: dict[str, Any] | None = None, pools: list[list[Any]] | None = None) -> World:
    w = World.make(spec or good_spec(), *(pools or four_pools()))
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING, w.status
    return w


# ---------------------------------------------------------------- first generation


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
    assert env["JAX_COORDINATOR_ADDRESS"] == "10.0.0.1:8476"
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


# ---------------------------------------------------------------- preemption


def test_preemption_notice_final_save_then_new_generation_without_the_doomed_node() -> None:
    w = running_world()
    doomed = w.gen_pods()[5].node_name
    assert doomed is not None
    w.set_node(doomed, taints=(*w.nodes[doomed].taints, Taint(api.IMPENDING_TERMINATION_TAINT, "", "NoSchedule")))
    actions = w.step()
    save = next(a for a in actions if isinstance(a, RequestFinalSave))
    assert save.reason == "preemption" and save.generation == 1 and len(save.pods) == 16
    assert save.deadline == T0 + __import__("datetime").timedelta(seconds=300)
    assert not any(isinstance(a, DeleteGeneration) for a in actions)
    assert w.status.phase == api.PHASE_SAVING and w.status.transition is not None
    saving = w.status.condition(api.COND_SAVING)
    assert saving is not None and saving.status == "True"
    # still saving: the request is repeated (idempotent by id), nothing is deleted
    w.advance(5)
    again = w.step()
    assert any(isinstance(a, RequestFinalSave) and a.request_id == save.request_id for a in again)
    # the workers commit and exit 75
    w.outcomes.append(SaveOutcome(save.request_id, step=4200, committed=True))
    w.exit_workers(75)
    actions = w.step()
    assert any(isinstance(a, DeleteGeneration) and a.generation == 1 for a in actions)
    assert w.status.checkpoint is not None and w.status.checkpoint.step == 4200
    assert w.status.phase == api.PHASE_RECOVERING
    w.settle()
    assert w.status.generation == 2 and w.status.phase == api.PHASE_RUNNING
    assert w.status.shape == Shape("4x4", 3) and w.status.restarts == 1 and w.status.failures == 0
    doomed_pool = w.nodes[doomed].pool
    assert doomed_pool not in w.status.pools
    assert all(p.node_name != doomed for p in w.pods.values())
    assert api.FINAL_SAVE_DONE.name in w.reasons()


def test_maintenance_label_is_a_notice_too() -> None:
    w = running_world()
    node = w.gen_pods()[0].node_name or ""
    w.set_node(node, labels={**w.nodes[node].labels, api.SCHEDULED_MAINTENANCE_LABEL: "1767225600"})
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.PREEMPTION


def test_final_save_timeout_stops_the_generation_anyway() -> None:
    w = running_world()
    node = w.gen_pods()[0].node_name or ""
    w.set_node(node, taints=(Taint(api.IMPENDING_TERMINATION_TAINT),))
    w.step()
    w.advance(299)
    assert not any(isinstance(a, DeleteGeneration) for a in w.step())
    w.advance(1)
    actions = w.step()
    assert any(isinstance(a, DeleteGeneration) for a in actions)
    assert api.FINAL_SAVE_TIMEOUT.name in w.reasons()


def test_no_final_save_when_on_preemption_is_off() -> None:
    spec = good_spec()
    spec["checkpoint"]["finalSave"]["onPreemption"] = False
    w = running_world(spec)
    node = w.gen_pods()[0].node_name or ""
    w.set_node(node, taints=(Taint(api.IMPENDING_TERMINATION_TAINT),))
    actions = w.step()
    assert not any(isinstance(a, RequestFinalSave) for a in actions)
    delete = next(a for a in actions if isinstance(a, DeleteGeneration))
    assert delete.force_pods == ()  # graceful: SIGTERM makes the workers save anyway


# ---------------------------------------------------------------- hard node loss


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


def test_topology_fallback_when_big_slices_are_gone() -> None:
    spec = good_spec()
    pools = [tpu_pool("big-a", 4), tpu_pool("small-a", 1, topology="2x4", chips=8),
             tpu_pool("small-b", 1, topology="2x4", chips=8)]
    spec["slices"]["count"] = 2
    w = running_world(spec, pools)
    # 1 x 4x4 (16 chips) is below minCount 2, so it falls back to 2 x 2x4
    assert w.status.shape == Shape("2x4", 2) and w.status.pools == ("small-a", "small-b")


# ---------------------------------------------------------------- resize and grow back


def test_spec_edit_resizes_with_final_save() -> None:
    w = running_world(fixed_spec(2), four_pools())
    w.spec["slices"]["count"] = 3
    actions = w.step()
    assert any(isinstance(a, RequestFinalSave) and a.reason == "resize" for a in actions)
    assert w.status.transition is not None and w.status.transition.kind == st.RESIZE
    w.exit_workers(75)
    w.settle()
    assert w.status.shape == Shape("4x4", 3) and w.status.phase == api.PHASE_RUNNING
    assert api.SPEC_RESIZED.name in w.reasons()


def test_unrelated_spec_edit_keeps_the_generation() -> None:
    w = running_world()
    w.spec["checkpoint"]["every"]["steps"] = 50
    w.spec["elastic"]["minCount"] = 1  # bounds changed, but the current shape is still the best
    assert not any(isinstance(a, (DeleteGeneration, RequestFinalSave)) for a in w.step())
    assert w.step() == []


def test_grow_back_when_capacity_returns() -> None:
    w = running_world(pools=[tpu_pool("pool-a", 4), tpu_pool("pool-b", 4)])
    assert w.status.shape == Shape("4x4", 2)
    w.nodes.update({n.name: n for n in tpu_pool("pool-c", 4)})
    w.advance(30)
    assert w.step() == []  # not settled yet
    w.advance(30)
    actions = w.step()
    assert any(isinstance(a, RequestFinalSave) and a.reason == "resize" for a in actions)
    assert w.status.transition is not None and w.status.transition.kind == st.GROW_BACK
    w.exit_workers(75)
    w.settle()
    assert w.status.shape == Shape("4x4", 3) and w.status.phase == api.PHASE_RUNNING


def test_no_grow_back_when_disabled() -> None:
    spec = good_spec()
    spec["elastic"]["growBack"] = False
    w = running_world(spec, [tpu_pool("pool-a", 4), tpu_pool("pool-b", 4)])
    w.nodes.update({n.name: n for n in tpu_pool("pool-c", 4)})
    w.advance(600)
    assert w.step() == []


# ---------------------------------------------------------------- endings and failures


def test_all_workers_exit_zero_succeeds() -> None:
    w = running_world()
    w.exit_workers(0)
    actions = w.step()
    assert w.status.phase == api.PHASE_SUCCEEDED
    assert not any(isinstance(a, (DeleteGeneration, CreateGeneration)) for a in actions)
    assert w.step() == []


def test_worker_failure_backoff_then_restart() -> None:
    w = running_world()
    w.exit_workers(1, names=["llama-g1-s2-h1"])
    w.step()
    t = w.status.transition
    assert t is not None and t.kind == st.WORKER_FAILURE and w.status.failures == 1
    assert "exit code 1 (Error)" in t.message
    w.settle()
    assert w.status.generation == 1 and not w.pods  # torn down, waiting for the backoff
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.BACKOFF.name
    w.advance(10)
    w.settle()
    assert w.status.generation == 2 and w.status.phase == api.PHASE_RUNNING and w.status.restarts == 1


def test_failed_after_max_restarts() -> None:
    spec = good_spec()
    spec["recovery"]["maxRestarts"] = 1
    w = running_world(spec)
    for generation in (1, 2):
        w.exit_workers(1, generation=generation)
        w.step()
        w.advance(10)
        w.settle()
    assert w.status.phase == api.PHASE_FAILED and w.status.failures == 2
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.MAX_RESTARTS_EXCEEDED.name
    assert "recovery.maxRestarts=1" in ready.message
    assert not w.pods and w.status.generation == 2


def test_stopped_worker_moves_on_without_counting_a_failure() -> None:
    w = running_world()
    w.exit_workers(75, names=["llama-g1-s0-h3"])
    w.settle()
    assert w.status.generation == 1 and len(w.gen_pods()) == 15  # the other trainers get time to stop
    w.advance(15)
    w.settle()
    assert w.status.generation == 2 and w.status.failures == 0 and w.status.restarts == 1


def test_evicted_pod_is_lost_not_failed() -> None:
    w = running_world()
    w.pods["llama-g1-s1-h1"] = replace(w.pods["llama-g1-s1-h1"], phase="Failed", pod_reason="Evicted")
    w.settle()
    assert w.status.failures == 0 and w.status.generation == 2 and w.status.phase == api.PHASE_RUNNING
    assert any("(Evicted)" in e.message for e in w.events)


def test_pod_deleted_by_someone_else() -> None:
    w = running_world()
    del w.pods["llama-g1-s1-h1"]
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.POD_LOST


def test_pod_stuck_terminating_on_a_ready_node_is_forced() -> None:
    w = running_world()
    w.exit_workers(1, names=["llama-g1-s0-h0"])
    w.step()
    # a kubelet that never confirms: keep the pods Terminating
    w.advance(330 + 59)
    assert not any(isinstance(a, DeleteGeneration) and a.force_pods for a in w.step())
    w.advance(1)
    actions = w.step()
    delete = next(a for a in actions if isinstance(a, DeleteGeneration))
    assert len(delete.force_pods) == 16


# ---------------------------------------------------------------- invalid specs


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


# ---------------------------------------------------------------- cpu on the local cluster


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


@pytest.mark.parametrize("tpu_labels", [True], ids=["tpu-nodes-not-used-for-cpu"])
def test_cpu_job_does_not_take_tpu_nodes(tpu_labels: bool) -> None:
    raw = copy.deepcopy(good_spec())
    raw["slices"] = {"accelerator": "cpu", "topology": "1x4", "count": 1}
    del raw["elastic"]
    w = World.make(raw, tpu_pool("pool-a", 4))
    w.settle()
    assert w.status.generation == 0


# ---------------------------------------------------------------- more edges


def test_accelerator_edit_resizes_without_reading_the_old_shape_with_the_new_spec() -> None:
    w = running_world()
    w.nodes.update({n.name: n for n in tpu_pool("v4-a", 2, accelerator="tpu-v4-podslice", topology="2x2x2")})
    w.spec["slices"].update(accelerator="tpu-v4-podslice", topology="2x2x2", count=1)
    w.spec["elastic"] = {"minCount": 1, "maxCount": 1}
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.RESIZE
    w.exit_workers(75)
    w.settle()
    assert w.status.shape == Shape("2x2x2", 1) and w.status.pools == ("v4-a",) and w.status.hosts == 2


def test_unschedulable_workers_are_replanned() -> None:
    w = World.make(good_spec(), *four_pools())
    w.step()
    w.advance(299)
    assert w.step() == [RequeueAfter(5.0)]
    w.advance(1)
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.POD_LOST
    assert api.UNSCHEDULABLE.name in w.reasons()


def test_cleanup_forces_pods_on_down_nodes_only() -> None:
    w = running_world()
    dead = w.gen_pods()[0]
    w.set_node(dead.node_name or "", ready="Unknown")
    actions = decide_cleanup(w.observed())
    assert actions == [DeleteGeneration(1, "job deleted", (PodDeletion(dead.name, force=True),))]


# ---------------------------------------------------------------- the local tier: placement and refusals


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
