"""hang.py: a generation that makes no progress past its hang timeout is hung (TrainerHung), named by
its stopped (or slowest) worker, and restarted without counting a failure.

The table calls `hang.decide` on a running world whose workers' figures it sets; the flows run the
in-memory world (op_world: every decision made twice gives the same actions)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from op_samples import good_spec
from op_world import SETTINGS, World, cpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import StopTrainers
from resilax_operator.observed.sidecar import worth_asking_every_host
from resilax_operator.observed.snapshot import HostFigures, TrainerReport
from resilax_operator.policies import hang
from resilax_operator.validation import validate_spec

POD0, POD1 = "llama-g1-s0-h0", "llama-g1-s0-h1"


def _spec(in_place: str = "Never", **recovery: Any) -> dict[str, Any]:
    spec = good_spec()
    spec["slices"] = {"accelerator": "cpu", "topology": "2x4", "chipsPerHost": 4, "count": 1}
    spec.pop("elastic", None)
    spec["recovery"].update(inPlace=in_place, **recovery)
    return spec


def _world(in_place: str = "Never", **recovery: Any) -> World:
    """1 slice x 2 hosts on a CPU pool with a spare node; generation 1 running, its trainers started."""
    w = World.make(_spec(in_place, **recovery), cpu_pool("pool-a", 3))
    for _ in range(12):
        w.step()
        w.schedule()
        w.kubelets()
    assert w.status.phase == api.PHASE_RUNNING and w.status.generation == 1 and len(w.gen_pods()) == 2
    return w


def _training(w: World, *, step: int = 50, ago: float = 1.0, p99: float | None = 0.5, beat: float = 0.5,
              **changes: Any) -> HostFigures:
    """A worker's figures: in phase train, reached `step` `ago` seconds before now, heartbeat `beat` ago."""
    now = w.now.timestamp()
    return replace(HostFigures(generation=w.status.generation, step=step, step_time=now - ago, heartbeat=now - beat,
                               phase="train", phase_since=now - 1000, step_seconds=0.4, step_seconds_p99=p99),
                   **changes)


def _both(w: World, pod0: dict[str, Any], pod1: dict[str, Any], since_running: float = 1000.0) -> None:
    w.advance(since_running)  # the trainers started when the world settled
    w.hosts = {POD0: _training(w, **pod0), POD1: _training(w, **pod1)}


def _pod0_report(w: World, step: int, ago: float) -> TrainerReport:
    """Pod 0's figures for the goodput accounting: steps 1..`step`, the last `ago` seconds before now."""
    now = w.now.timestamp()
    return TrainerReport(generation=1, step=step, step_time=now - ago, first_step=1, first_step_time=now - ago - step)


# (id, recovery, pod 0's figures, pod 1's figures, seconds since all ran, the worker named or None, basis)
CASES = [
    ("healthy", {}, {}, {}, 1000.0, None, ""),
    ("train-past-the-60s-floor-names-the-lowest-step", {}, {"ago": 61, "step": 51}, {"ago": 61}, 1000.0, POD1,
     "automatic: max(60s, 10 x p99 step 0.5s)"),
    ("train-within-10x-the-p99", {}, {"ago": 90, "p99": 10.0}, {"ago": 90, "p99": 10.0}, 1000.0, None, ""),
    ("train-past-10x-the-p99", {}, {"ago": 101, "p99": 10.0}, {"ago": 101, "p99": 10.0}, 1000.0, POD0,
     "automatic: max(60s, 10 x p99 step 10s)"),
    ("a-stale-heartbeat-is-named-whatever-its-step", {}, {"ago": 70, "step": 40}, {"ago": 75, "step": 50, "beat": 70},
     1000.0, POD1, "automatic: max(60s, 10 x p99 step 0.5s)"),
    ("save-within-5x-its-p99", {}, {"phase": "save", "phase_since": None, "save_seconds_p99": 20.0}, {}, 1000.0, None,
     ""),
    ("warm-up-has-the-start-allowance", {}, {"ago": 200, "p99": None}, {"ago": 200, "p99": None}, 1000.0, None, ""),
    ("warm-up-past-300s", {}, {"ago": 301, "p99": None}, {"ago": 301, "p99": None}, 1000.0, POD0,
     "start-up or restore: max(300s, 3 x last restore 0s)"),
    ("restore-gets-3x-the-last-restore", {}, {"phase": "restore", "ago": 400, "last_restore_seconds": 150.0},
     {"phase": "restore", "ago": 400, "last_restore_seconds": 150.0}, 1000.0, None, ""),
    ("explicit-timeout", {"hangTimeoutSeconds": 20}, {"ago": 25}, {"ago": 25, "step": 49}, 1000.0, POD1,
     "recovery.hangTimeoutSeconds"),
    ("off", {"hangTimeoutSeconds": 0}, {"ago": 5000}, {"ago": 5000}, 6000.0, None, ""),
    ("waiting-for-the-others-counts-from-when-all-run", {}, {"ago": 100}, {"ago": 100}, 30.0, None, ""),
    ("figures-of-another-generation-are-not-read", {}, {"ago": 100, "generation": 0}, {"ago": 100, "generation": 0},
     1000.0, None, ""),
]


@pytest.mark.parametrize(("recovery", "pod0", "pod1", "running", "named", "basis"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_decide(recovery: dict[str, Any], pod0: dict[str, Any], pod1: dict[str, Any], running: float,
                named: str | None, basis: str) -> None:
    w = _world(**recovery)
    if "phase_since" in pod0 and pod0["phase_since"] is None:  # a save that began 61 s ago
        pod0 = {**pod0, "phase_since": None}
    _both(w, pod0, pod1, running)
    if pod0.get("phase") == "save":
        w.hosts[POD0] = replace(w.hosts[POD0], phase_since=w.now.timestamp() - 61)
    spec = validate_spec(w.spec, name="llama")
    stall = hang.decide(spec, w.observed(), w.status)
    assert (stall.pod if stall else None) == named, stall
    if stall is not None:
        assert stall.basis == basis and stall.stalled_seconds >= stall.timeout_seconds


def test_the_operators_floor_sets_the_least_automatic_allowance() -> None:
    """OperatorSettings.hang_floor_seconds (RESILAX_OPERATOR_HANG_FLOOR_SECONDS) in place of 60 s, for
    training and saves; an explicit hangTimeoutSeconds and the start-up allowance do not use it."""
    w = _world()
    _both(w, {"ago": 25}, {"ago": 25, "step": 49})
    spec = validate_spec(w.spec, name="llama")
    assert hang.decide(spec, w.observed(), w.status) is None  # 25 s < the default 60 s
    stall = hang.decide(spec, w.observed(), w.status, floor=20.0)
    assert stall is not None and stall.pod == POD1 and stall.timeout_seconds == 20, stall
    assert stall.basis == "automatic: max(20s, 10 x p99 step 0.5s)"
    verdict = hang.check(spec, w.observed(), w.status, replace(SETTINGS, hang_floor_seconds=20))
    assert verdict is not None and "timeout 20s, automatic: max(20s" in verdict.message, verdict
    assert hang.check(spec, w.observed(), w.status, SETTINGS) is None
    w.hosts[POD0] = replace(w.hosts[POD0], phase="save", save_seconds_p99=2.0, phase_since=w.now.timestamp() - 25)
    save = hang.allowance(spec, w.hosts[POD0], 20.0)
    assert save[1:] == (20.0, "automatic: max(20s, 5 x p99 save 2s)"), save
    start = hang.allowance(spec, replace(w.hosts[POD0], phase="restore"), 20.0)
    assert start[1] == 300.0, start


def test_a_save_past_5x_its_p99_is_a_hang() -> None:
    w = _world()
    _both(w, {"phase": "save", "save_seconds_p99": 2.0}, {"ago": 1})
    w.hosts[POD0] = replace(w.hosts[POD0], phase_since=w.now.timestamp() - 61)
    stall = hang.decide(validate_spec(w.spec, name="llama"), w.observed(), w.status)
    assert stall is not None and stall.timeout_seconds == 60 and "p99 save 2s" in stall.basis


def test_every_host_is_asked_once_pod_0_looks_stalled() -> None:
    now = 10_000.0
    fresh = HostFigures(generation=1, step=5, step_time=now - 2, heartbeat=now - 0.5, phase="train",
                        step_seconds_p99=0.5)
    assert not worth_asking_every_host(fresh, now)
    assert not worth_asking_every_host(None, now)
    assert worth_asking_every_host(replace(fresh, step_time=now - 11), now)
    assert not worth_asking_every_host(replace(fresh, step_time=now - 11, step_seconds_p99=5.0), now)  # 3 x p99
    assert worth_asking_every_host(replace(fresh, heartbeat=now - 11), now)


def test_a_stopped_trainer_is_named_and_its_generation_replaced_without_a_failure() -> None:
    """inPlace Never: TrainerHung (Ready=False, a Warning event naming the pod, process, node and last
    step), a full replacement not counted in failures; the hang's time goes to goodput's hang bucket."""
    w = _world()
    _both(w, {"ago": 65, "step": 51}, {"ago": 66, "step": 50, "beat": 64})
    w.trainer = _pod0_report(w, 51, 65)
    w.step()
    hung = [e for e in w.events if e.reason == api.TRAINER_HUNG.name]
    assert len(hung) == 1 and hung[0].type == "Warning"
    node = w.pods[POD1].node_name
    assert f"worker {POD1} (process 1, node {node}) of generation 1 hung" in hung[0].message
    assert "last step 50" in hung[0].message and "heartbeat stopped 64s ago" in hung[0].message
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.status == "False" and ready.reason == api.TRAINER_HUNG.name
    assert w.status.transition is not None and w.status.transition.kind == st.TRAINER_HUNG
    w.hosts = {}
    for _ in range(12):
        w.step()
        w.schedule()
        w.kubelets()
        w.advance(3)
    s = w.status
    assert s.generation == 2 and s.phase == api.PHASE_RUNNING, s
    assert s.failures == 0 and s.restarts == 1 and s.pod_losses == 1
    assert s.goodput is not None and s.goodput.summary().buckets["hang"] > 60


def test_in_place_the_hung_trainers_stacks_are_asked_for_and_no_failure_counted() -> None:
    w = _world("Auto")
    assert all(p.supervised for p in w.gen_pods())
    before = {p.name: p.uid for p in w.gen_pods()}
    _both(w, {"ago": 65}, {"ago": 66, "beat": 64})
    w.trainer = _pod0_report(w, 50, 65)
    actions = w.step()
    w.schedule()
    w.kubelets()
    assert api.TRAINER_HUNG.name in w.reasons() and api.RESTARTING_IN_PLACE.name in w.reasons()
    stops = [a for a in actions if isinstance(a, StopTrainers)]
    assert stops and all(a.stacks for a in stops) and set(stops[0].pods) == set(before)
    w.hosts = {}
    for _ in range(12):
        w.step()
        w.schedule()
        w.kubelets()
        w.advance(1)
    s = w.status
    assert s.generation == 2 and s.phase == api.PHASE_RUNNING and s.in_place is None, s
    assert s.failures == 0 and s.in_place_restarts == 1
    assert {p.name: p.uid for p in w.gen_pods()} == before  # the same pods, trainers restarted
    assert s.goodput is not None and s.goodput.summary().buckets["hang"] > 60


def test_a_healthy_generation_is_never_hung() -> None:
    w = _world()
    for _ in range(20):
        w.advance(30)
        w.hosts = {POD0: _training(w, step=100), POD1: _training(w, step=100)}
        w.step()
    assert api.TRAINER_HUNG.name not in w.reasons() and w.status.generation == 1
    w.advance(timedelta(minutes=1).total_seconds())
