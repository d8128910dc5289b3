"""policies/recovery_wait.py (issue 39): a generation Recovering for minutes gets a `RecoveryWaiting`
Event naming what it waits for, once per change of that (at most once a minute) or every 10 minutes,
remembered in status.recoveryNotice. The pure decision in tables, then through the whole reconcile."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from op_world import T0, fixed_spec, running_world, tpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import EmitEvent, SetStatus
from resilax_operator.builders import JobRef
from resilax_operator.observed.snapshot import Observed, ObservedNode, ObservedPod, Taint
from resilax_operator.policies import recovery_wait
from resilax_operator.policies.recovery_wait import MAX_MESSAGE, decide_notice, with_notice
from resilax_operator.spec import Shape
from resilax_operator.status import Condition, JobStatus, build_status, parse_status
from resilax_operator.status_fields.recovery_notice import (
    RecoveryNotice,
    build_recovery_notice,
    parse_recovery_notice,
)

JOB = JobRef("llama", "ml", "uid-1")


def _status(*, phase: str = api.PHASE_RECOVERING, reason: str = api.WORKERS_STARTING.name, down_for: float = 150,
            notice: RecoveryNotice | None = None, generation: int = 2, **changes: Any) -> JobStatus:
    ready = Condition(api.COND_READY, "False", reason, f"{reason} message", T0 - timedelta(seconds=down_for))
    return JobStatus(phase=phase, generation=generation, shape=Shape("4x4", 1), hosts=2, conditions=(ready,),
                     recovery_notice=notice, **changes)


def _observed(s: JobStatus, pods: tuple[ObservedPod, ...] = (), nodes: tuple[ObservedNode, ...] = (),
              after: float = 0) -> Observed:
    return Observed(now=T0 + timedelta(seconds=after), job=JOB, status=s, pods=pods, nodes=nodes)


def _pods(generation: int = 2) -> tuple[ObservedPod, ...]:
    return (ObservedPod(f"llama-g{generation}-s0-h0", generation, 0, 0, phase="Running", node_name="n0", ready=True),
            ObservedPod(f"llama-g{generation}-s0-h1", generation, 0, 1, phase="Pending"))


def test_no_event_before_two_minutes_then_one_naming_the_pods_and_nodes() -> None:
    nodes = (ObservedNode("n0"), ObservedNode("n1", ready="Unknown", ready_since=T0 - timedelta(seconds=90)))
    s = _status(down_for=100, worker_nodes=((0, "n0"), (1, "n1")))
    assert decide_notice(s, _observed(s, _pods(), nodes)) == (None, None)
    notice, event = decide_notice(s, _observed(s, _pods(), nodes, after=25))
    assert notice == RecoveryNotice(2, api.WORKERS_STARTING.name, T0 + timedelta(seconds=25))
    assert event is not None and event.type == "Warning" and event.reason == api.RECOVERY_WAITING.name
    assert event.message.startswith("generation 2 has been Recovering for 2m05s: waiting for WorkersStarting (")
    assert "pods not ready: llama-g2-s0-h1 (Pending, no node yet)" in event.message, event.message
    assert "llama-g2-s0-h0" not in event.message  # running and ready: nothing to wait for
    assert "nodes down: n1 (down since " in event.message, event.message


@pytest.mark.parametrize("last_after,key,now_after,emits", [
    (0, api.WORKERS_STARTING.name, 30, False),    # the same wait, told 30 s ago
    (0, api.WORKERS_STARTING.name, 599, False),   # ... and 599 s ago
    (0, api.WORKERS_STARTING.name, 600, True),    # every 10 minutes
    (0, api.INSUFFICIENT_CAPACITY.name, 59, False),  # another wait, but the last Event is under a minute old
    (0, api.INSUFFICIENT_CAPACITY.name, 60, True),   # another wait: told again
], ids=["same-30s", "same-599s", "same-600s", "changed-59s", "changed-60s"])
def test_once_per_change_of_what_it_waits_for_or_every_ten_minutes(last_after: float, key: str, now_after: float,
                                                                  emits: bool) -> None:
    last = RecoveryNotice(2, key, T0 + timedelta(seconds=last_after))
    s = _status(notice=last)
    notice, event = decide_notice(s, _observed(s, _pods(), after=now_after))
    assert (event is not None) == emits
    assert notice == (RecoveryNotice(2, api.WORKERS_STARTING.name, T0 + timedelta(seconds=now_after)) if emits else last)


@pytest.mark.parametrize("phase,ready_status", [
    (api.PHASE_RUNNING, "True"), (api.PHASE_SAVING, "True"), (api.PHASE_PENDING, "False"), (api.PHASE_FAILED, "False"),
])
def test_no_notice_outside_a_recovery_and_the_last_one_is_cleared(phase: str, ready_status: str) -> None:
    s = _status(phase=phase, notice=RecoveryNotice(2, "X", T0))
    s = replace(s, conditions=(replace(s.conditions[0], status=ready_status),))
    assert decide_notice(s, _observed(s, _pods(), after=1000)) == (None, None)


def test_a_new_generation_starts_its_own_count() -> None:
    s = _status(notice=RecoveryNotice(1, api.WORKERS_STARTING.name, T0))
    notice, event = decide_notice(s, _observed(s, _pods(), after=10))
    assert event is not None and notice is not None and notice.generation == 2


def test_resizing_waits_too_and_names_the_final_save_and_the_old_pods() -> None:
    t = st.Transition(kind=st.RESIZE, generation=1, since=T0, message="resize", save_request_id="r1",
                      save_deadline=T0 + timedelta(seconds=300))
    s = _status(phase=api.PHASE_RESIZING, reason=api.SAVING.name, generation=1, transition=t)
    old = ObservedPod("llama-g1-s0-h0", 1, 0, 0, phase="Running", node_name="n0", ready=True,
                      deletion_timestamp=T0)
    _, event = decide_notice(s, _observed(s, (old,)))
    assert event is not None
    assert "the final save of generation 1 (until " in event.message
    assert "pods not created yet" not in event.message  # the final save comes first


def test_in_place_names_the_kept_trainers_not_stopped_yet() -> None:
    kept = (st.KeptPod("llama-g1-s0-h0", "u0", 0, stopped=True), st.KeptPod("llama-g1-s0-h1", "u1", 1))
    ip = st.InPlace(2, 1, st.IN_PLACE_STOPPING, T0, T0 + timedelta(seconds=30), kept)
    s = _status(reason=api.RESTARTING_IN_PLACE.name, in_place=ip, worker_pods=("llama-g1-s0-h0", "llama-g1-s0-h1"))
    pods = tuple(ObservedPod(k.pod, 1, 0, k.process, phase="Running", node_name=f"n{k.process}") for k in kept)
    _, event = decide_notice(s, _observed(s, pods))
    assert event is not None and "kept trainers to stop: llama-g1-s0-h1" in event.message, event.message
    assert "old pods to go" not in event.message  # kept pods are not leftovers


def test_the_message_stays_bounded() -> None:
    s = replace(_status(), shape=Shape("4x4", 20), hosts=40)
    pods = tuple(ObservedPod(f"llama-g2-s{i}-h0", 2, i, 0, phase="Pending") for i in range(40))
    _, event = decide_notice(s, _observed(s, pods))
    assert event is not None and len(event.message) <= MAX_MESSAGE and "and 35 more" in event.message, event.message


def test_with_notice_writes_the_notice_into_the_decisions_status_write_and_decides_twice_the_same() -> None:
    s = _status()
    observed = _observed(s, _pods())
    out = with_notice([], observed)
    assert [type(a) for a in out] == [SetStatus, EmitEvent]
    written = out[0].status  # type: ignore[union-attr]
    assert written.recovery_notice is not None and with_notice([], observed) == out
    # once written, the next decision finds it and says nothing more
    assert with_notice([], replace(observed, status=written)) == []
    # inside a decision that writes the status anyway: the same write carries it
    other = SetStatus(replace(s, restarts=7))
    merged = with_notice([other], observed)
    assert len([a for a in merged if isinstance(a, SetStatus)]) == 1
    assert merged[0].status.restarts == 7 and merged[0].status.recovery_notice is not None  # type: ignore[union-attr]


def test_the_notice_round_trips_through_the_status() -> None:
    notice = RecoveryNotice(3, api.INSUFFICIENT_CAPACITY.name, T0)
    assert parse_recovery_notice(build_recovery_notice(notice)) == notice
    assert parse_status(build_status(JobStatus(recovery_notice=notice))).recovery_notice == notice
    assert build_recovery_notice(None) is None and parse_recovery_notice({"time": "not a time"}) is None


def test_a_job_waiting_for_capacity_is_told_once_then_every_ten_minutes_through_the_reconcile() -> None:
    """The whole decision: a fixed 2-slice job loses a node of its only other pool and waits for capacity."""
    w = running_world(fixed_spec(count=2), [tpu_pool("pool-a", 4), tpu_pool("pool-b", 4)])
    dead = w.gen_pods()[6].node_name or ""
    w.set_node(dead, ready="Unknown", ready_since=w.now, taints=(Taint(api.UNREACHABLE_TAINT, "", "NoSchedule"),))
    for _ in range(10):  # 5 minutes in 30 s steps
        w.advance(30)
        w.settle(3)
    assert w.status.phase == api.PHASE_RECOVERING, w.status
    told = [e for e in w.events if e.reason == api.RECOVERY_WAITING.name]
    assert len(told) == 1, [e.message for e in told]
    assert "InsufficientCapacity" in told[0].message and f"{dead} (down since" in told[0].message, told[0].message
    assert w.status.recovery_notice is not None and w.status.recovery_notice.waiting_for == "InsufficientCapacity"
    for _ in range(16):  # 8 more minutes: 10 minutes after the first
        w.advance(30)
        w.settle(3)
    assert len([e for e in w.events if e.reason == api.RECOVERY_WAITING.name]) == 2
    # capacity returns: the job runs and the notice goes
    w.set_node(dead, ready="True", ready_since=w.now, taints=(Taint(api.TPU_TAINT_KEY),))
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.status.recovery_notice is None


def test_the_module_is_pure() -> None:
    assert "k8s" not in recovery_wait.__dict__ and "kopf" not in recovery_wait.__dict__
