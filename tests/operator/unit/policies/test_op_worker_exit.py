"""worker_exit.py: a worker stopped, failed, was lost or all finished.

Driven through the in-memory world (op_world), which checks at every decision that deciding twice
gives the same actions and that no generation is created while another one's pods exist; the
tables call the policy's functions directly."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from op_restart import KEEP, Driver, assert_survives_restarts
from op_samples import good_spec
from op_world import SETTINGS, T0, running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import (
    CreateGeneration,
    DeleteGeneration,
    EmitEvent,
    RequeueAfter,
    SetStatus,
)
from resilax_operator.policies import Finding, transition, worker_exit
from resilax_operator.validation import validate_spec


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


# ---------------------------------------------------------------- the rule, as a table

EXIT_CASES = {
    # id: (changes to worker s1-h1, expected kind or phase, reason, counted as a failure?)
    "exit-75-stopped": ({"phase": "Failed", "exit_code": 75}, st.WORKER_STOPPED, api.WORKER_STOPPED.name, False),
    "exit-75-succeeded-phase": ({"phase": "Succeeded", "exit_code": 75}, st.WORKER_STOPPED, api.WORKER_STOPPED.name, False),
    "evicted-no-exit-code": ({"phase": "Failed", "pod_reason": "Evicted"}, st.POD_LOST, api.POD_LOST.name, False),
    "node-shutdown": ({"phase": "Failed", "pod_reason": "NodeShutdown"}, st.POD_LOST, api.POD_LOST.name, False),
    "evicted-but-exit-code-1": ({"phase": "Failed", "pod_reason": "Evicted", "exit_code": 1}, st.WORKER_FAILURE,
                                api.WORKER_FAILED.name, True),
    "exit-1": ({"phase": "Failed", "exit_code": 1, "exit_reason": "Error"}, st.WORKER_FAILURE, api.WORKER_FAILED.name, True),
    "oom-killed": ({"phase": "Failed", "exit_code": 137, "exit_reason": "OOMKilled"}, st.WORKER_FAILURE,
                   api.WORKER_FAILED.name, True),
    "deleted-by-someone": ({"deletion_timestamp": T0}, st.POD_LOST, api.POD_LOST.name, False),
    "one-succeeded-others-run": ({"phase": "Succeeded", "exit_code": 0}, None, None, False),
    "running": ({}, None, None, False),
}


@pytest.mark.parametrize(("changes", "kind", "reason", "failure"), list(EXIT_CASES.values()), ids=list(EXIT_CASES))
def test_worker_exit_table(changes: dict[str, Any], kind: str | None, reason: str | None, failure: bool) -> None:
    w = running_world()
    w.pods["llama-g1-s1-h1"] = replace(w.pods["llama-g1-s1-h1"], **changes)
    verdict = worker_exit.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    if kind is None:
        assert verdict is None
        return
    assert isinstance(verdict, Finding)
    assert (verdict.kind, verdict.reason, verdict.failure) == (kind, reason, failure)
    assert "llama-g1-s1-h1" in verdict.message
    if failure:  # backoff: the next generation no earlier than recovery.backoffSeconds from now
        assert verdict.not_before == T0 + timedelta(seconds=10)
        assert [e.reason for e in verdict.events] == [api.BACKOFF.name]
    else:
        assert verdict.not_before is None and verdict.events == ()


def test_a_missing_pod_is_lost() -> None:
    w = running_world()
    del w.pods["llama-g1-s2-h0"]
    verdict = worker_exit.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    assert isinstance(verdict, Finding) and verdict.kind == st.POD_LOST and "llama-g1-s2-h0" in verdict.message


def test_the_workers_are_the_pods_the_status_names_not_names_built_from_the_generation() -> None:
    w = running_world()
    assert list(w.status.worker_pods) == sorted(w.pods)  # written at the generation's start
    # An in-place restart kept llama-g1-s2-h0 for generation 2: its name keeps the generation it was made in.
    w.status = replace(w.status, generation=2, worker_pods=tuple(sorted(w.pods)))
    w.pods = {n: replace(p, generation=2) for n, p in w.pods.items()}
    assert worker_exit.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS) is None
    del w.pods["llama-g1-s2-h0"]
    verdict = worker_exit.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    assert isinstance(verdict, Finding) and verdict.kind == st.POD_LOST and "llama-g1-s2-h0" in verdict.message


def test_all_succeeded_completes_and_the_failure_past_max_restarts_fails_the_job() -> None:
    w = running_world()
    w.exit_workers(0)
    done = worker_exit.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    assert isinstance(done, list) and isinstance(done[0], SetStatus) and done[0].status.phase == api.PHASE_SUCCEEDED
    assert done[1] == EmitEvent("Normal", api.COMPLETED.name, api.COMPLETED.format(generation=1))
    w = running_world()
    w.status = replace(w.status, failures=20)  # good_spec allows maxRestarts=20
    w.exit_workers(1, names=["llama-g1-s0-h0"])
    failed = worker_exit.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    assert isinstance(failed, list) and [type(a).__name__ for a in failed] == ["SetStatus", "EmitEvent", "DeleteGeneration"]
    assert failed[0].status.phase == api.PHASE_FAILED and failed[0].status.failures == 21  # type: ignore[union-attr]


# ---------------------------------------------------------------- operator restarts


def worker_failure_flow(d: Driver) -> None:
    d.tick(6)
    d.w.exit_workers(1, names=[d.w.gen_pods()[0].name])
    d.tick(3)
    d.w.advance(10)
    d.tick(10)


@pytest.mark.parametrize("keep", list(KEEP.values()), ids=list(KEEP))
def test_operator_dies_at_every_step_of_a_worker_failure(keep: int) -> None:
    assert_survives_restarts(worker_failure_flow, keep)


# ---------------------------------------------------------------- pod-level losses back off

BACKOFF_CASES = {
    # id: (pod-level losses in a row, seconds before the next generation) with the default settings
    "first": (1, 0),
    "second": (2, 10),
    "third": (3, 20),
    "fifth": (5, 80),
    "sixth": (6, 160),
    "capped": (7, 300),
    "still-capped": (19, 300),
}


@pytest.mark.parametrize(("losses", "seconds"), list(BACKOFF_CASES.values()), ids=list(BACKOFF_CASES))
def test_pod_loss_backoff_table(losses: int, seconds: int) -> None:
    assert transition.pod_loss_backoff(losses, SETTINGS) == seconds


def test_a_trainer_exiting_75_again_and_again_backs_off_then_fails() -> None:
    """Issue 18, item 4: each stop waits longer (the backoff is in the status: notBefore, podLosses),
    and past max_pod_losses the job is Failed with the reason; none of it counts as a worker failure."""
    w = running_world()
    waits = []
    for loss in range(1, SETTINGS.max_pod_losses + 1):
        w.exit_workers(75, generation=w.status.generation)
        w.step()
        t = w.status.transition
        assert t is not None and t.kind == st.WORKER_STOPPED and w.status.pod_losses == loss
        waits.append(0 if t.not_before is None else int((t.not_before - t.since).total_seconds()))
        w.settle(3)
        w.advance(waits[-1] + 1)
        w.settle()
        assert w.status.phase == api.PHASE_RUNNING and w.status.generation == loss + 1
        w.advance(5)
    assert waits[:4] == [0, 10, 20, 40] and max(waits) == SETTINGS.pod_loss_backoff_max_seconds
    assert api.POD_LOSS_BACKOFF.name in w.reasons()
    w.exit_workers(75, generation=w.status.generation)
    w.settle()
    assert w.status.phase == api.PHASE_FAILED and w.status.failures == 0 and not w.gen_pods()
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.POD_LOSSES_EXCEEDED.name
    assert "exit 75" in ready.message and str(SETTINGS.max_pod_losses + 1) in ready.message


def test_a_generation_that_runs_long_enough_clears_the_pod_losses() -> None:
    w = running_world()
    w.exit_workers(75)
    w.settle()
    w.exit_workers(75, generation=w.status.generation)
    w.settle()
    w.advance(11)
    w.settle()
    assert w.status.pod_losses == 2 and w.status.phase == api.PHASE_RUNNING
    started = w.status.generation_start_time
    assert started is not None
    w.now = started + timedelta(seconds=SETTINGS.pod_loss_reset_seconds - 1)
    w.step()
    assert w.status.pod_losses == 2
    w.now = started + timedelta(seconds=SETTINGS.pod_loss_reset_seconds)
    w.step()
    assert w.status.pod_losses == 0
    w.exit_workers(75, generation=w.status.generation)
    w.step()
    t = w.status.transition
    assert t is not None and t.not_before is None and w.status.pod_losses == 1  # the first again: at once


# ---- exit 76: a peer process is gone (resilax_ckpt's exit watchdog) -----------------------------------

PEERS = ["llama-g1-s0-h0", "llama-g1-s0-h1", "llama-g1-s1-h0"]
VICTIM = "llama-g1-s1-h1"


def _peers_lost() -> tuple[Any, str]:
    """A running job (nodeLossGraceSeconds 120) whose PEERS exited 76 after VICTIM's node died, decided
    once: the world and the victim's node (still Ready for the node lifecycle controller)."""
    spec = good_spec()
    spec["recovery"] = {**spec.get("recovery", {}), "nodeLossGraceSeconds": 120}
    w = running_world(spec)
    victim_node = w.pods[VICTIM].node_name
    assert victim_node is not None
    w.exit_workers(api.EXIT_CODE_PEER_LOST, names=PEERS)
    w.step()
    return w, victim_node


def test_peers_that_lost_a_peer_are_not_a_failure_and_a_down_node_is_not_waited_for() -> None:
    """A node dies: the workers on the others lose their collective's peer and exit 76 at once, before
    the node is even NotReady. The operator waits for the cause; once the node is down it replaces the
    generation (NodeLoss) without waiting out nodeLossGraceSeconds, and counts no failure."""
    w, victim_node = _peers_lost()
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.PEER_LOST.name and w.status.transition is None
    assert api.PEER_LOST.name in w.reasons() and w.status.failures == 0
    w.advance(16)
    w.set_node(victim_node, ready="Unknown", ready_since=w.now)
    w.step()
    t = w.status.transition
    assert t is not None and t.kind == st.NODE_LOSS and "not waiting for the grace" in t.message
    assert w.status.failures == 0 and w.status.pod_losses == 0


def test_a_peers_own_failure_is_the_cause_and_counted_once() -> None:
    w = running_world()
    w.exit_workers(api.EXIT_CODE_PEER_LOST, names=PEERS)
    w.step()
    assert w.status.transition is None  # waiting for the cause
    w.advance(10)
    w.exit_workers(1, names=[VICTIM])  # its exit watchdog: code 1 after its grace
    w.step()
    t = w.status.transition
    assert t is not None and t.kind == st.WORKER_FAILURE and VICTIM in t.message
    assert w.status.failures == 1


def test_no_cause_found_replaces_the_generation_as_a_pod_loss() -> None:
    w = running_world()
    w.exit_workers(api.EXIT_CODE_PEER_LOST, names=PEERS)
    w.step()
    w.advance(SETTINGS.peer_lost_timeout_seconds - 1)
    w.step()
    assert w.status.transition is None
    w.advance(1)
    w.step()
    t = w.status.transition
    assert t is not None and t.kind == st.POD_LOST and "no cause found" in t.message
    assert w.status.failures == 0 and w.status.pod_losses == 1


@pytest.mark.parametrize(("expired", "lost"), [pytest.param(True, True, id="lease-expired-NodeLoss-at-once"),
                                               pytest.param(False, False, id="lease-live-wait")])
def test_peers_lost_and_the_nodes_lease_expired_is_a_node_loss_before_it_turns_notready(expired: bool,
                                                                                      lost: bool) -> None:
    """Issue 26 item 6: the peers exited 76 and the victim's node is still Ready (the node lifecycle
    controller has not noticed yet), but its Lease (read because of the exit 76) expired: NodeLoss now."""
    w, victim_node = _peers_lost()
    w.advance(5)
    lease = w.now - timedelta(seconds=1) if expired else w.now + timedelta(seconds=30)
    w.set_node(victim_node, lease_live_until=lease)
    assert w.nodes[victim_node].ready == "True"
    w.step()
    t = w.status.transition
    if lost:
        assert t is not None and t.kind == st.NODE_LOSS and "not waiting for the grace" in t.message
        assert any(d.force and d.name == VICTIM for a in w.step() if isinstance(a, DeleteGeneration) for d in a.pods) \
            or VICTIM not in w.pods
    else:
        assert t is None and (w.status.condition(api.COND_READY) or st.Condition("", "", "", "")).reason == \
            api.PEER_LOST.name


def test_waiting_for_the_peer_loss_cause_looks_again_when_the_lease_would_prove_it() -> None:
    """The witness waits on a Lease that misses its renewals: the operator looks again when the Lease
    would prove the node down (0.5 x 40 s after its renewal), not a whole poll later."""
    w, victim_node = _peers_lost()
    w.set_node(victim_node, lease_live_until=w.now + timedelta(seconds=23), lease_seconds=40)  # proof in 3 s
    waits = [a.seconds for a in w.step() if isinstance(a, RequeueAfter)]
    assert waits and abs(min(waits) - 3.2) < 0.01, waits
    w.set_node(victim_node, lease_live_until=w.now + timedelta(seconds=39), lease_seconds=40)  # renewed: 19 s
    waits = [a.seconds for a in w.step() if isinstance(a, RequeueAfter)]
    assert waits and min(waits) == 5.0, waits  # the poll comes first


def test_a_worker_refusing_a_storage_another_live_job_holds_fails_the_job_naming_it() -> None:
    """Exit 78 (resilax_ckpt.StorageInUseError: another live JAXJob holds the storage, issue 25 item 9):
    the job fails with StorageInUse naming that job and the fix, once, and is not retried (a retry
    would be refused again, or take the storage over)."""
    w = running_world()
    w.storage_sharers = (("uid-other", "ml/other"),)
    w.exit_workers(api.EXIT_CODE_STORAGE_IN_USE, names=["llama-g1-s0-h0"])
    actions = w.step()
    ready = w.status.condition(api.COND_READY)
    assert w.status.phase == api.PHASE_FAILED and ready is not None and ready.reason == api.STORAGE_IN_USE.name
    assert "JAXJob ml/other (uid uid-other)" in ready.message and "takeOver" in ready.message, ready.message
    assert [a.reason for a in actions if isinstance(a, EmitEvent)] == [api.STORAGE_IN_USE.name]
    assert any(isinstance(a, DeleteGeneration) for a in actions)
    w.settle()
    assert w.status.generation == 1 and not w.pods and w.status.failures == 0
    assert w.reasons().count(api.STORAGE_IN_USE.name) == 1
