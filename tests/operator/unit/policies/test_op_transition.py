"""transition.py: recording a transition and tearing a generation down pod by pod.

Driven through the in-memory world (op_world), which checks at every decision that deciding twice
gives the same actions and that no generation is created while another one's pods exist; the
tables call the policy's functions directly."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from op_samples import good_spec
from op_world import SETTINGS, T0, running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import (
    DeleteGeneration,
    EmitEvent,
    PodDeletion,
)
from resilax_operator.observed.snapshot import SaveOutcome
from resilax_operator.policies import Finding, transition
from resilax_operator.validation import validate_spec


def test_pod_stuck_terminating_on_a_ready_node_is_forced() -> None:
    w = running_world()
    w.exit_workers(1, names=["llama-g1-s0-h0"])
    w.step()
    # a kubelet that never confirms: keep the pods Terminating (the survivors of a failure: grace 5 s)
    w.advance(5 + 59)
    assert not any(isinstance(a, DeleteGeneration) and a.force_pods for a in w.step())
    w.advance(1)
    actions = w.step()
    delete = next(a for a in actions if isinstance(a, DeleteGeneration))
    assert len(delete.force_pods) == 16
    assert delete.lost == ()  # forced, but on Ready nodes: their sidecars may live


def test_the_processes_on_a_down_node_are_named_lost_unless_the_guard_holds() -> None:
    """`DeleteGeneration.lost`: the processes whose node is down or gone (the executor tells the sidecars
    of the pods it deletes with a grace); none while the disruption guard holds (the nodes are likelier
    to come back)."""
    w = running_world()
    pods = w.gen_pods()
    w.set_node(pods[5].node_name or "", ready="Unknown", ready_since=w.now)
    w.now = TEARDOWN
    delete = transition.plan_delete(w.observed(), validate_spec(w.spec), 1, st.NODE_LOSS, SETTINGS, TEARDOWN)
    assert delete.force_pods == (pods[5].name,) and delete.lost == (pods[5].process,) and pods[5].process == 5
    for p in pods[:12]:  # 12 of 16 nodes down: the guard holds
        w.set_node(p.node_name or "", ready="Unknown", ready_since=T0)
    delete = transition.plan_delete(w.observed(), validate_spec(w.spec), 1, st.NODE_LOSS, SETTINGS, TEARDOWN)
    assert delete.force_pods == () and delete.lost == ()


# ---------------------------------------------------------------- how each pod is deleted, as a table

TEARDOWN = T0 + timedelta(seconds=100)

DELETE_CASES = {
    # id: (reason, pod changes, node down?, local tier?, expected PodDeletion fields or None: left alone)
    "planned-trainer-running-waits": (st.PREEMPTION, {"trainer_running": True}, False, False,
                                      {"not_before": TEARDOWN + timedelta(seconds=15)}),
    "resize-trainer-running-waits": (st.RESIZE, {"trainer_running": True}, False, True,
                                     {"not_before": TEARDOWN + timedelta(seconds=15)}),
    "worker-stopped-trainer-running-waits": (st.WORKER_STOPPED, {"trainer_running": True}, False, False,
                                             {"not_before": TEARDOWN + timedelta(seconds=15)}),
    "planned-trainer-exited-short-grace": (st.PREEMPTION, {"trainer_running": False, "exit_code": 75}, False, False,
                                           {"grace_seconds": 2}),
    "trainer-exited-local-tier-own-grace": (st.PREEMPTION, {"trainer_running": False, "exit_code": 75}, False, True,
                                            {}),
    # a worker failed: the survivors' final save would need it, so they get the short grace
    "failure-survivor-short-grace": (st.WORKER_FAILURE, {"trainer_running": True}, False, False, {"grace_seconds": 5}),
    "peer-lost-survivor-short-grace": (st.POD_LOST, {"trainer_running": False, "exit_code": 76}, False, True,
                                       {"grace_seconds": 5}),
    "pod-lost-trainer-running-own-grace": (st.POD_LOST, {"trainer_running": True}, False, True, {}),
    "node-loss-survivor-short-grace": (st.NODE_LOSS, {"trainer_running": True}, False, True, {"grace_seconds": 5}),
    "node-loss-on-the-down-node-forced": (st.NODE_LOSS, {"trainer_running": True}, True, True, {"force": True}),
    "planned-on-a-down-node-forced": (st.PREEMPTION, {"trainer_running": True}, True, False, {"force": True}),
    "already-terminating-left-alone": (st.PREEMPTION, {"deletion_timestamp": TEARDOWN}, False, False, None),
    "stuck-terminating-forced": (st.PREEMPTION, {"deletion_timestamp": T0 - timedelta(seconds=400),
                                                 "deletion_grace_seconds": 330}, False, False, {"force": True}),
    "superseded-generation": ("superseded generation", {"trainer_running": True}, False, True, {}),
    # a pod whose trainer never ran (its health check failed, it never got a node): nothing to save, and
    # its sidecar would otherwise wait out finalSave.timeoutSeconds for a trainer that never answers
    "trainer-never-started-short-grace": (st.POD_LOST, {"trainer_running": False, "trainer_started_at": None},
                                          False, True, {"grace_seconds": 2}),
    "planned-trainer-never-started-short-grace": (st.RESIZE, {"trainer_running": False, "trainer_started_at": None},
                                                  False, True, {"grace_seconds": 2}),
    "trainer-started-then-waiting-own-grace": (st.POD_LOST, {"trainer_running": False, "trainer_started_at": T0},
                                               False, True, {}),
}


@pytest.mark.parametrize(("reason", "pod", "down", "local", "expected"), list(DELETE_CASES.values()),
                         ids=list(DELETE_CASES))
def test_plan_delete_table(reason: str, pod: dict[str, Any], down: bool, local: bool,
                           expected: dict[str, Any] | None) -> None:
    raw = good_spec()
    if not local:
        del raw["checkpoint"]["local"]
    w = running_world(raw)
    first = w.gen_pods()[0]
    w.pods[first.name] = replace(first, **pod)
    if down:
        w.set_node(first.node_name or "", ready="Unknown", ready_since=w.now)
    w.now = TEARDOWN
    delete = transition.plan_delete(w.observed(), validate_spec(w.spec), 1, reason, SETTINGS, TEARDOWN)
    assert delete.generation == 1 and delete.reason == reason
    mine = [d for d in delete.pods if d.name == first.name]
    if expected is None:
        assert mine == []
    else:
        assert mine == [PodDeletion(first.name, **expected)]
    assert len(delete.pods) == 16 - (expected is None)


def test_the_wait_for_a_stopping_trainer_survives_an_operator_restart() -> None:
    """teardownSince is in the status, so a new operator process computes the same not-before."""
    w = running_world()
    w.spec["slices"]["count"] = 3
    w.spec["elastic"]["maxCount"] = 3  # resize down: no larger shape, but the bounds exclude count 4
    w.step()
    t = w.status.transition
    assert t is not None and t.kind == st.RESIZE and t.saving
    w.outcomes.append(SaveOutcome(t.save_request_id or "", step=10, committed=True))
    w.advance(3)
    first = next(a for a in w.step() if isinstance(a, DeleteGeneration))
    w.advance(4)
    w.status = st.parse_status(st.build_status(w.status))  # a restarted operator reads the status
    again = next(a for a in w.step() if isinstance(a, DeleteGeneration))
    assert {d.not_before for d in first.pods} == {d.not_before for d in again.pods} == {T0 + timedelta(seconds=3 + 15)}


def test_begin_records_the_transition_before_acting_on_it() -> None:
    w = running_world()
    finding = Finding(st.WORKER_STOPPED, api.WORKER_STOPPED.name, "worker x stopped")
    actions = transition.begin(validate_spec(w.spec), w.observed(), w.status, SETTINGS, [], finding)
    assert [type(a).__name__ for a in actions][:2] == ["SetStatus", "EmitEvent"]
    t = actions[0].status.transition  # type: ignore[union-attr]
    assert t is not None and t.kind == st.WORKER_STOPPED and t.teardown_since == T0 and not t.saving
    assert actions[1] == EmitEvent("Warning", api.WORKER_STOPPED.name, "worker x stopped")
