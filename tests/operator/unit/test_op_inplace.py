"""policies/inplace.py: in-place restart of the survivors.

Driven through the in-memory world (op_world), which plays the supervisors too: a stop ends a trainer
(unless it is hung), a start runs once no trainer lives in the pod, and at every step it asserts that
no two generations' trainers are alive at once, that deciding twice gives the same actions and that no
pod of another generation exists when one is created. `decide_mode` has its own table."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from op_restart import KEEP
from op_samples import good_spec
from op_world import SETTINGS, World, cpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import CreateGeneration, DeleteGeneration, RequestFinalSave, StartTrainers
from resilax_operator.builders import JobRef
from resilax_operator.observed.snapshot import SaveOutcome, Taint
from resilax_operator.observed.trainer_process import SIDECAR_START_SECONDS, SILENCE_SECONDS
from resilax_operator.policies import Finding, node_loss
from resilax_operator.policies.inplace import decide_mode
from resilax_operator.status_fields.checkpoint import CheckpointInfo
from resilax_operator.validation import validate_spec

NODE_LOST = Finding(st.NODE_LOSS, api.NODE_LOST.name, "node gone")


def _spec(in_place: str = "Auto", **recovery: Any) -> dict[str, Any]:
    spec = good_spec()
    spec["slices"] = {"accelerator": "cpu", "topology": "2x4", "chipsPerHost": 4, "count": 2}
    spec["elastic"] = {"minCount": 1, "maxCount": 2}
    spec["recovery"].update(inPlace=in_place, **recovery)
    return spec


def _world(in_place: str = "Auto", spare: int = 1, **recovery: Any) -> World:
    """2 slices x 2 hosts on CPU pools a and b, `spare` free nodes in each; running generation 1."""
    w = World.make(_spec(in_place, **recovery), cpu_pool("pool-a", 2 + spare), cpu_pool("pool-b", 2 + spare))
    settle(w)
    assert w.status.phase == api.PHASE_RUNNING and w.status.generation == 1
    return w


def tick(w: World, only: int | None = None) -> list[Any]:
    actions = w.step(only=only)
    w.schedule()
    w.kubelets()
    return actions


def settle(w: World, steps: int = 12) -> None:
    for _ in range(steps):
        tick(w)


def _node_of(w: World, pod: str) -> str:
    node = w.pods[pod].node_name
    assert node is not None
    return node


def _lose_node(w: World, pod: str) -> str:
    """The node of `pod` goes down, past nodeLossGraceSeconds (30 s in the sample spec)."""
    node = _node_of(w, pod)
    w.set_node(node, ready="Unknown", ready_since=w.now)
    w.advance(31)
    return node


def _identity(w: World) -> dict[str, tuple[str, str | None]]:
    return {n: (p.uid, p.node_name) for n, p in w.pods.items()}


# ---- decide_mode ---------------------------------------------------------------------------------


def _mode_case(case: str) -> tuple[Any, Finding, JobRef | None]:
    w = _world("Never" if case == "never" else "Auto")
    finding = NODE_LOST
    job = None
    if case == "preemption":
        finding = Finding(st.PREEMPTION, api.PREEMPTION_NOTICE.name, "notice")
    elif case == "kueue":
        job = JobRef("llama", "ml", "uid-1", queue="team-a")
    elif case == "no-command":
        del w.spec["template"]["spec"]["containers"][0]["command"]
    elif case == "unsupervised-pod":
        w.pods["llama-g1-s1-h0"] = replace(w.pods["llama-g1-s1-h0"], supervised=False)
    elif case == "no-sidecar-answers":
        w.unreachable = set(w.pods)
    elif case in ("node-loss", "worker-failure", "shrink"):
        _lose_node(w, "llama-g1-s1-h1")
    if case == "worker-failure":
        finding = Finding(st.WORKER_FAILURE, api.WORKER_FAILED.name, "exit 1", failure=True)
    if case == "shrink":
        finding = Finding(st.SHRINK, api.CAPACITY_TIMEOUT.name, "shrink")
    return w, finding, job


@pytest.mark.parametrize(("case", "kept", "why"), [
    pytest.param("never", None, "", id="inPlace-Never"),
    pytest.param("preemption", None, "", id="planned-move-stays-full-replacement"),
    pytest.param("kueue", None, "Kueue queue", id="kueue"),
    pytest.param("no-command", None, "has no command", id="trainer-without-command"),
    pytest.param("unsupervised-pod", None, "runs no supervisor", id="a-pod-from-before-Auto"),
    pytest.param("no-sidecar-answers", None, "no surviving pod qualifies", id="no-survivor-heard"),
    pytest.param("node-loss", ["llama-g1-s0-h0", "llama-g1-s0-h1", "llama-g1-s1-h0", "llama-g2-s1-h1"], "",
                 id="node-loss-same-shape"),
    pytest.param("worker-failure", ["llama-g1-s0-h0", "llama-g1-s0-h1", "llama-g1-s1-h0", "llama-g2-s1-h1"], "",
                 id="worker-failure"),
])
def test_decide_mode(case: str, kept: list[str] | None, why: str) -> None:
    w, finding, job = _mode_case(case)
    observed = w.observed() if job is None else replace(w.observed(), job=job)
    mode = decide_mode(validate_spec(w.spec), observed, w.status, finding)
    if kept is None:
        assert mode.plan is None and why in mode.why and bool(mode.why) == bool(why)
        return
    assert mode.plan is not None and mode.why == ""
    assert list(mode.plan.worker_pods) == kept
    assert [k.process for k in mode.kept] == [i for i, n in enumerate(kept) if n.startswith("llama-g1")]


def test_a_shrink_keeps_the_whole_surviving_slices_renumbered() -> None:
    w = _world(spare=0)
    _lose_node(w, "llama-g1-s0-h1")  # slice 0 is broken, pool-a has no spare: one slice, slice 1's pods
    mode = decide_mode(validate_spec(w.spec), w.observed(), w.status, NODE_LOST)
    assert mode.plan is not None and mode.plan.shape.count == 1 and mode.plan.pools == ("pool-b",)
    assert list(mode.plan.worker_pods) == ["llama-g1-s1-h0", "llama-g1-s1-h1"]
    assert [(k.pod, k.process) for k in mode.kept] == [("llama-g1-s1-h0", 0), ("llama-g1-s1-h1", 1)]


# ---- the flow ------------------------------------------------------------------------------------


def test_a_lost_slices_surviving_pod_goes_with_the_lost_process_named() -> None:
    """The other pod of the lost slice survived but is not kept (its slice is dropped): it goes with the
    survivors' grace, and the deletion names the lost process (slice 0 host 1: process 1), which the
    executor tells its sidecar, so its final upload stops waiting for process 1's marker (goodput run of
    2026-12-07, seed 1: it waited out its whole grace, and the next generation with it)."""
    w = _world(spare=0)
    _lose_node(w, "llama-g1-s0-h1")
    actions = tick(w)
    assert w.status.in_place is not None
    delete = next(a for a in actions if isinstance(a, DeleteGeneration) and a.generation == 1)
    assert {d.name: (d.grace_seconds, d.force) for d in delete.pods} == {
        "llama-g1-s0-h0": (node_loss.SURVIVOR_GRACE_SECONDS, False), "llama-g1-s0-h1": (None, True)}
    assert delete.lost == (1,)


def test_hard_loss_keeps_the_survivors_and_replaces_only_the_lost_pod() -> None:
    w = _world()
    before = _identity(w)
    lost = "llama-g1-s1-h1"
    _lose_node(w, lost)
    actions = tick(w)
    assert [e.reason for e in w.events][-1] == api.RESTARTING_IN_PLACE.name
    assert w.status.generation == 2 and w.status.in_place is not None
    assert w.status.in_place.phase in (st.IN_PLACE_STOPPING, st.IN_PLACE_STARTING)
    deleted = [d.name for a in actions if isinstance(a, DeleteGeneration) for d in a.pods]
    assert deleted == [lost]  # forced: its node is down
    settle(w)
    s = w.status
    assert s.phase == api.PHASE_RUNNING and s.generation == 2 and s.in_place is None
    assert s.restarts == 1 and s.in_place_restarts == 1 and s.failures == 0
    survivors = [n for n in before if n != lost]
    assert {n: _identity(w)[n] for n in survivors} == {n: before[n] for n in survivors}  # same UIDs, same nodes
    assert list(s.worker_pods) == [*survivors, "llama-g2-s1-h1"]
    assert all(p.generation == 2 for p in w.pods.values()) and len(w.pods) == 4
    assert all(w.processes[n].generation == 2 and w.processes[n].state == "running" for n in w.pods)
    assert w.created == [1, 2]


def test_no_start_before_every_kept_trainer_is_stopped() -> None:
    w = _world()
    slow = "llama-g1-s0-h1"
    w.hung.add(slow)  # its trainer ignores the stop for a while
    _lose_node(w, "llama-g1-s1-h1")
    for _ in range(4):
        tick(w)
        w.advance(2)
    assert not [c for c in w.trainer_calls if c[0] == "start"]
    assert not any(p.name.startswith("llama-g2") for p in w.pods.values())  # nothing created either
    assert w.status.in_place is not None and w.status.in_place.phase == st.IN_PLACE_STOPPING
    w.hung.discard(slow)
    settle(w)
    assert w.status.phase == api.PHASE_RUNNING and slow in w.pods and w.status.in_place is None


def test_the_deadline_drops_a_kept_pod_whose_trainer_never_stops() -> None:
    w = _world(inPlaceStopTimeoutSeconds=10)
    stuck = "llama-g1-s0-h1"
    w.hung.add(stuck)  # in D state: SIGKILL does not end it
    _lose_node(w, "llama-g1-s1-h1")
    tick(w)
    w.advance(11)
    tick(w)
    assert api.IN_PLACE_STOP_TIMEOUT.name in w.reasons()
    settle(w)
    s = w.status
    assert s.phase == api.PHASE_RUNNING and s.in_place is None and stuck not in w.pods
    assert list(s.worker_pods) == ["llama-g1-s0-h0", "llama-g2-s0-h1", "llama-g1-s1-h0", "llama-g2-s1-h1"]


def test_a_kept_pod_whose_trainer_container_ends_mid_restart_is_dropped_at_once() -> None:
    """Its supervisor dies while its old trainer is being stopped: nothing left to prove the stop, so the
    restart does not wait for the deadline; its slot gets a new pod."""
    w = _world()
    gone = "llama-g1-s0-h1"
    w.hung.add(gone)  # keeps the restart in Stopping
    _lose_node(w, "llama-g1-s1-h1")
    tick(w)
    assert w.status.in_place is not None and gone in [k.pod for k in w.status.in_place.kept]
    w.end_container(gone, 137)
    actions = tick(w)
    assert [d.name for a in actions if isinstance(a, DeleteGeneration) for d in a.pods] == [gone]
    w.advance(2)
    settle(w)
    s = w.status
    assert s.phase == api.PHASE_RUNNING and s.generation == 2 and s.in_place is None and gone not in w.pods
    assert api.IN_PLACE_STOP_TIMEOUT.name not in w.reasons()
    assert list(s.worker_pods) == ["llama-g1-s0-h0", "llama-g2-s0-h1", "llama-g1-s1-h0", "llama-g2-s1-h1"]


def test_a_node_down_mid_restart_starts_again_from_the_new_generation() -> None:
    w = _world(spare=2)
    w.hung.add("llama-g1-s0-h0")  # keeps the restart in Stopping
    _lose_node(w, "llama-g1-s1-h1")
    tick(w)
    assert w.status.generation == 2 and w.status.in_place is not None
    _lose_node(w, "llama-g1-s1-h0")  # a kept pod's node dies too
    w.hung.clear()
    tick(w)
    assert w.status.generation == 3
    settle(w)
    s = w.status
    assert s.phase == api.PHASE_RUNNING and s.generation == 3 and s.in_place is None
    assert "llama-g1-s0-h0" in w.pods and "llama-g1-s0-h1" in w.pods and len(w.pods) == 4
    assert s.in_place_restarts == 2


def test_a_worker_failure_restarts_every_trainer_in_place_after_the_backoff() -> None:
    w = _world()
    before = _identity(w)
    w.fail_trainer("llama-g1-s0-h1", 1)
    actions = tick(w)
    assert not [d for a in actions if isinstance(a, DeleteGeneration) for d in a.pods]  # every pod is kept
    assert w.status.failures == 1 and w.status.in_place is not None
    assert w.status.in_place.not_before == st.truncate(w.now) + timedelta(seconds=10)  # backoffSeconds
    settle(w, 4)
    assert not [c for c in w.trainer_calls if c[0] == "start"]  # backoffSeconds: 10
    w.advance(11)
    settle(w)
    assert w.status.phase == api.PHASE_RUNNING and w.status.generation == 2 and _identity(w) == before
    assert all(t.generation == 2 and t.state == "running" for t in w.processes.values())


def _aged_world() -> World:
    """`_world()` a while later: its trainers past SIDECAR_START_SECONDS (no sidecar may still be starting)."""
    w = _world()
    w.advance(SIDECAR_START_SECONDS)
    settle(w, 2)
    return w


def _silence(w: World, names: list[str], *, exit_code: int | None = None) -> None:
    """The sidecars of `names` stop answering (their pods' addresses gone, as in goodput seed 2 of
    2026-12-07), so their readiness probes fail; with `exit_code`, their trainers then exit unheard."""
    w.unreachable |= set(names)
    for name in names:
        if exit_code is not None:
            w.fail_trainer(name, exit_code)
        w.pods[name] = w.with_readiness(w.pods[name], False)


def _until_unreachable(w: World) -> list[Any]:
    """Ticks up to SILENCE_SECONDS: nothing is decided before it; the tick at it finds WorkerUnreachable."""
    tick(w)
    w.advance(SILENCE_SECONDS - 1)
    tick(w)
    assert w.status.generation == 1 and api.WORKER_UNREACHABLE.name not in w.reasons(), w.reasons()
    w.advance(1)
    return tick(w)


def test_every_sidecar_silent_and_every_trainer_aborted_unheard_replaces_every_pod() -> None:
    """Goodput seed 2 of 2026-12-07: every pod's address went, every sidecar fell silent and every
    trainer aborted (134) unheard; the operator waited for an answer for 110 s. Now: WorkerUnreachable
    after SILENCE_SECONDS, and since no sidecar answers, no pod can be kept."""
    w = _aged_world()
    before = set(w.pods)
    _silence(w, sorted(w.pods), exit_code=134)
    actions = _until_unreachable(w)
    deleted = [d for a in actions if isinstance(a, DeleteGeneration) for d in a.pods]
    # their final save would be a collective with the silent ones: the survivors' grace, not their own
    assert sorted(d.name for d in deleted) == sorted(before)
    assert {d.grace_seconds for d in deleted} == {node_loss.SURVIVOR_GRACE_SECONDS}, deleted
    unreachable = next(e for e in w.events if e.reason == api.WORKER_UNREACHABLE.name)
    assert unreachable.message.startswith("worker llama-g1-s0-h0 of generation 1 is unreachable: its trainer has "
                                          f"not been ready for {int(SILENCE_SECONDS)}s"), unreachable.message
    assert "(4 of 4 workers so)" in unreachable.message, unreachable.message
    assert api.IN_PLACE_UNAVAILABLE.name in w.reasons() and api.TRAINER_HUNG.name not in w.reasons()
    settle(w)
    s = w.status
    assert s.phase == api.PHASE_RUNNING and s.generation == 2 and not before & set(w.pods)
    assert (s.failures, s.pod_losses) == (0, 1), s


@pytest.mark.parametrize("silent", ["llama-g1-s1-h1", "llama-g1-s0-h0"], ids=["one-worker", "pod-0"])
def test_one_silent_sidecar_replaces_its_pod_and_keeps_the_others_in_place(silent: str) -> None:
    w = _aged_world()
    before = _identity(w)
    _silence(w, [silent], exit_code=134)
    _until_unreachable(w)
    assert api.RESTARTING_IN_PLACE.name in w.reasons() and api.TRAINER_HUNG.name not in w.reasons()
    settle(w)
    s = w.status
    kept = {n: v for n, v in before.items() if n != silent}
    assert s.phase == api.PHASE_RUNNING and s.generation == 2 and {n: _identity(w).get(n) for n in kept} == kept
    assert silent not in w.pods and (s.failures, s.pod_losses) == (0, 1), s


def test_a_silent_sidecar_whose_trainer_runs_on_is_replaced_too() -> None:
    """Its trainer may well run (a sidecar stopped, a network cut between it and the node): nothing of it can
    be learnt, and its checkpoints no longer reach the storage."""
    w = _aged_world()
    _silence(w, ["llama-g1-s1-h0"])
    _until_unreachable(w)
    assert api.RESTARTING_IN_PLACE.name in w.reasons()


def test_every_trainer_failing_at_once_with_its_sidecar_answering_is_a_worker_failure_at_once() -> None:
    w = _aged_world()
    for name in sorted(w.pods):
        w.fail_trainer(name, 134)
    tick(w)
    assert api.WORKER_FAILED.name in w.reasons() and api.RESTARTING_IN_PLACE.name in w.reasons(), w.reasons()
    assert w.status.failures == 1 and w.status.in_place is not None


def test_inplace_never_replaces_every_pod_as_before() -> None:
    w = _world("Never")
    before = set(w.pods)
    _lose_node(w, "llama-g1-s1-h1")
    settle(w)
    assert w.status.generation == 2 and w.status.in_place_restarts == 0 and not before & set(w.pods)


def test_unavailable_is_said_once_and_replaces_every_pod() -> None:
    w = _world()
    w.unreachable = set(w.pods)  # no sidecar answers: no survivor is proven
    _lose_node(w, "llama-g1-s1-h1")
    settle(w)
    assert w.reasons().count(api.IN_PLACE_UNAVAILABLE.name) == 1
    assert w.status.generation == 2 and not any(n.startswith("llama-g1") for n in w.pods)


def _flow(w: World, crash_at: int | None, keep: int) -> None:
    _lose_node(w, "llama-g1-s1-h1")
    for n in range(16):
        w.step(only=keep if n == crash_at else None)
        w.schedule()
        w.kubelets()


@pytest.mark.parametrize("keep", KEEP.values(), ids=KEEP.keys())
def test_operator_dies_at_every_step_of_an_in_place_restart(keep: int) -> None:
    """The status alone (and the cluster, the sidecars) lets a new operator finish the restart."""
    clean = _world()
    _flow(clean, None, 0)
    expected = (clean.status.phase, clean.status.generation, clean.status.worker_pods, _identity(clean),
                clean.status.in_place)
    assert expected[0] == api.PHASE_RUNNING and expected[1] == 2 and expected[4] is None
    for crash_at in range(8):
        w = _world()
        _flow(w, crash_at, keep)
        got = (w.status.phase, w.status.generation, w.status.worker_pods, _identity(w), w.status.in_place)
        assert got == expected, f"crash at decision {crash_at}"


def test_pod_0_lost_is_created_first_and_the_kept_trainers_start_with_its_address() -> None:
    w = _world()
    _lose_node(w, "llama-g1-s0-h0")
    starts: list[StartTrainers] = []
    creates: list[CreateGeneration] = []
    for _ in range(12):
        actions = tick(w)
        starts += [a for a in actions if isinstance(a, StartTrainers)]
        creates += [a for a in actions if isinstance(a, CreateGeneration)]
    assert [m["metadata"]["name"] for m in creates[0].pods] == ["llama-g2-s0-h0"]
    pod0_ip = w.pods["llama-g2-s0-h0"].pod_ip
    env = dict(dict(starts[0].pods)["llama-g1-s1-h1"])
    assert env["JAX_COORDINATOR_ADDRESS"] == f"{pod0_ip}:{SETTINGS.coordinator_port}"
    assert (env["JAX_PROCESS_ID"], env["RESILAX_GENERATION"], env["RESILAX_RESTORE_STEP"]) == ("3", "2", "latest")
    assert w.status.phase == api.PHASE_RUNNING


# ---- planned moves, after their final save -------------------------------------------------------


def _node_returns(w: World, node: str) -> None:
    """`node` is Ready again: the capacity settles (growBack), then the grow-back asks for its final save."""
    w.set_node(node, ready="True", ready_since=w.now)
    for _ in range(8):
        w.advance(10)
        settle(w, 2)
        if w.save_requests:
            return


def _final_save_done(w: World, step: int) -> None:
    """The trainers commit the final save the operator asked for and stop (exit 75, their pods stay)."""
    request = w.save_requests[-1]
    for name, t in w.processes.items():
        if t.state == "running":
            w.fail_trainer(name, api.EXIT_CODE_STOPPED)
    w.outcomes.append(SaveOutcome(request.request_id, step=step, committed=True))


def test_a_grow_back_keeps_the_shrunk_generations_pods_and_creates_only_the_new_slice() -> None:
    w = _world(spare=0)
    node = _lose_node(w, "llama-g1-s1-h1")
    settle(w)
    assert w.status.shape is not None and w.status.shape.count == 1 and w.status.in_place is None
    shrunk = _identity(w)
    assert sorted(shrunk) == ["llama-g1-s0-h0", "llama-g1-s0-h1"]
    _node_returns(w, node)
    t = w.status.transition
    assert t is not None and t.kind == st.GROW_BACK and t.saving
    assert not [c for c in w.trainer_calls if c[0] == "stop" and c[1] == 3]  # the save first, then the stop
    _final_save_done(w, 4200)
    settle(w)
    s = w.status
    assert s.phase == api.PHASE_RUNNING and s.generation == 3 and s.in_place is None and s.transition is None
    assert s.shape is not None and s.shape.count == 2 and s.checkpoint is not None and s.checkpoint.step == 4200
    assert {n: _identity(w)[n] for n in shrunk} == shrunk  # the same pods, on the same nodes
    assert list(s.worker_pods) == [*shrunk, "llama-g3-s1-h0", "llama-g3-s1-h1"]
    assert all(w.processes[n].generation == 3 and w.processes[n].state == "running" for n in w.pods)
    assert w.reasons().count(api.GROW_BACK.name) == 1  # said once, by the transition
    assert w.reasons().count(api.RESTARTING_IN_PLACE.name) == 2  # the shrink, then the grow-back
    assert api.IN_PLACE_UNAVAILABLE.name not in w.reasons()
    assert s.in_place_restarts == 2 and s.failures == 0


def test_a_grow_back_keeps_every_shrunk_pod_crossed_and_with_its_readiness_lagging() -> None:
    """The CI failure of test_op_e2e_inplace.py::test_a_shrink_and_its_grow_back_keep_the_surviving_slices_pods:
    the shrunk slice's pods run crossed (host 0's pod on node n1, host 1's on n0), and when the final save
    is seen done, the kubelet has not yet turned the stopped trainers' readiness (the doorbell) false, so
    no fault is in view. Every sidecar must still be asked: both pods are kept, not pod 0 alone."""
    w = _world(spare=0)
    node = _lose_node(w, "llama-g1-s1-h1")
    settle(w)
    h0, h1 = "llama-g1-s0-h0", "llama-g1-s0-h1"
    assert sorted(w.pods) == [h0, h1] and w.status.in_place is None
    n0, n1 = _node_of(w, h0), _node_of(w, h1)
    w.pods[h0], w.pods[h1] = replace(w.pods[h0], node_name=n1), replace(w.pods[h1], node_name=n0)
    crossed = _identity(w)
    _node_returns(w, node)
    t = w.status.transition
    assert t is not None and t.kind == st.GROW_BACK and t.saving
    _final_save_done(w, 4200)
    w.pods = {n: replace(p, trainer_ready=True) for n, p in w.pods.items()}  # the probe has not run yet
    tick(w)
    assert w.status.in_place is not None and [k.pod for k in w.status.in_place.kept] == [h0, h1]
    settle(w)
    s = w.status
    assert s.phase == api.PHASE_RUNNING and s.generation == 3 and s.in_place is None
    assert {n: _identity(w)[n] for n in crossed} == crossed  # the same pods, on the same (crossed) nodes
    assert list(s.worker_pods) == [h0, h1, "llama-g3-s1-h0", "llama-g3-s1-h1"]
    assert all(w.processes[n].generation == 3 and w.processes[n].state == "running" for n in w.pods)


def test_a_preemption_notice_keeps_the_other_slice_after_the_final_save() -> None:
    w = _world(spare=0)
    noticed = _node_of(w, "llama-g1-s1-h0")
    w.set_node(noticed, taints=(Taint(api.IMPENDING_TERMINATION_TAINT, "", "NoSchedule"),))
    tick(w)
    t = w.status.transition
    assert t is not None and t.kind == st.PREEMPTION and t.saving
    _final_save_done(w, 4100)
    settle(w)
    s = w.status
    assert s.phase == api.PHASE_RUNNING and s.generation == 2 and s.in_place is None
    assert s.shape is not None and s.shape.count == 1
    assert list(s.worker_pods) == ["llama-g1-s0-h0", "llama-g1-s0-h1"]
    assert sorted(w.pods) == ["llama-g1-s0-h0", "llama-g1-s0-h1"]  # the noticed slice's pods are gone
    assert all(w.processes[n].generation == 2 and w.processes[n].state == "running" for n in w.pods)


def test_with_in_place_never_a_grow_back_still_replaces_every_pod() -> None:
    w = _world("Never", spare=0)
    node = _lose_node(w, "llama-g1-s1-h1")
    settle(w)
    _node_returns(w, node)
    before = set(w.pods)
    w.exit_workers(api.EXIT_CODE_STOPPED)
    w.outcomes.append(SaveOutcome(w.save_requests[-1].request_id, step=4200, committed=True))
    settle(w)
    assert w.status.generation == 3 and w.status.shape is not None and w.status.shape.count == 2
    assert not before & set(w.pods) and api.RESTARTING_IN_PLACE.name not in w.reasons()


# ---- a rollback (spec.checkpoint.restore.step edited; policies/rollback.py), after its final save ---


def _save_done_and_stopped(w: World, step: int) -> None:
    """The final save commits `step` and every trainer stops: a supervised one exits 75 under its
    supervisor (its pod stays), an unsupervised one ends its container (its pod Failed, 75)."""
    w.outcomes.append(SaveOutcome(w.save_requests[-1].request_id, step=step, committed=True))
    for name, p in list(w.pods.items()):
        if p.supervised and w.processes[name].state == "running":
            w.fail_trainer(name, api.EXIT_CODE_STOPPED)
        elif not p.supervised:
            w.exit_workers(api.EXIT_CODE_STOPPED, names=[name])


@pytest.mark.parametrize(("case", "why"), [
    pytest.param("auto", None, id="kept-every-pod"),
    pytest.param("never", "", id="inPlace-Never-full-replacement"),
    pytest.param("unsupervised-pod", "llama-g1-s1-h0 runs no supervisor", id="unsupervised-pod-full-replacement"),
])
def test_a_rollback_after_its_final_save(case: str, why: str | None) -> None:
    """A rollback changes neither nodes nor shape: in place, every pod is kept (same UIDs and nodes) and
    each kept trainer is started with the new generation's environment, which restores the step asked;
    no pod is created. inPlace Never, or a pod without a supervisor: every pod replaced, the new pods
    told the step asked; the reason said once (InPlaceUnavailable) when there is one."""
    w = _world("Never" if case == "never" else "Auto")
    if case == "unsupervised-pod":
        w.pods["llama-g1-s1-h0"] = replace(w.pods["llama-g1-s1-h0"], supervised=False)
    before = _identity(w)
    w.checkpoint = CheckpointInfo(44)
    tick(w)
    w.spec["checkpoint"].setdefault("restore", {})["step"] = 8
    w.spec_generation += 1
    actions = tick(w)
    t = w.status.transition
    assert t is not None and t.kind == st.ROLLBACK and t.saving, w.status  # the current step saved first
    assert any(isinstance(a, RequestFinalSave) for a in actions)
    assert not [c for c in w.trainer_calls if c[0] == "stop"]  # nothing stopped before the save
    _save_done_and_stopped(w, 50)
    actions = [a for _ in range(15) for a in tick(w)]
    s = w.status
    assert s.phase == api.PHASE_RUNNING and s.generation == 2 and s.transition is None and s.in_place is None, s
    assert (s.restore_step, s.restore_asked, s.failures) == ("8", "8", 0)
    assert w.reasons().count(api.ROLLBACK_ASKED.name) == 1
    created = [m for a in actions if isinstance(a, CreateGeneration) for m in a.pods]
    started = [dict(env) for a in actions if isinstance(a, StartTrainers) for _, env in a.pods]
    unavailable = [e.message for e in w.events if e.reason == api.IN_PLACE_UNAVAILABLE.name]
    if why is None:
        assert _identity(w) == before and list(s.worker_pods) == sorted(before)  # the same pods, on the same nodes
        assert not created and s.in_place_restarts == 1 and not unavailable
        assert w.reasons().count(api.RESTARTING_IN_PLACE.name) == 1
        assert len(started) == 4 and {env["RESILAX_RESTORE_STEP"] for env in started} == {"8"}, started
        assert {env["RESILAX_GENERATION"] for env in started} == {"2"}
        assert all(w.processes[n].generation == 2 and w.processes[n].state == "running" for n in w.pods)
        assert s.history[-1].in_place and s.history[-2].end_reason == api.ROLLBACK_ASKED.name
        return
    assert not set(before) & set(w.pods) and s.in_place_restarts == 0 and not started
    assert api.RESTARTING_IN_PLACE.name not in w.reasons()
    told = {e["value"] for m in created for c in m["spec"]["containers"] for e in c.get("env") or []
            if e["name"] == "RESILAX_RESTORE_STEP"}
    assert len(created) == 4 and told == {"8"}
    assert len(unavailable) == bool(why) and all(why in m for m in unavailable), unavailable


def test_a_worker_whose_trainer_container_ended_is_replaced_at_once_and_the_others_kept() -> None:
    """A worker killed whole (SIGKILL to the trainer container's supervisor: the kubelet says terminated,
    137): no supervisor is left in that pod to stop or start a trainer, and its sidecar, still running,
    repeats the incarnation it last read. Kept, it held the in-place restart for inPlaceStopTimeoutSeconds
    (test_op_e2e_node_local_tier's worker failure, 2026-12-07: 30 s, then InPlaceStopTimeout). It is no
    survivor: deleted in the first tick, its slot's new pod on its node; the other three pods, in its slice
    and in the other, are kept and restarted in place."""
    w = _world()
    before = _identity(w)
    dead = "llama-g1-s0-h1"
    w.end_container(dead, 137)
    actions = tick(w)
    deleted = [d.name for a in actions if isinstance(a, DeleteGeneration) for d in a.pods]
    assert deleted == [dead]
    assert w.status.in_place is not None and w.status.in_place.kind == st.WORKER_FAILURE
    survivors = [n for n in before if n != dead]
    assert [k.pod for k in w.status.in_place.kept] == survivors
    for _ in range(12):
        tick(w)
        w.advance(2)  # past the failure's backoff, well short of the 30 s stop timeout
    s = w.status
    assert s.phase == api.PHASE_RUNNING and s.generation == 2 and s.in_place is None and s.in_place_restarts == 1
    assert api.IN_PLACE_STOP_TIMEOUT.name not in w.reasons()
    assert {n: _identity(w)[n] for n in survivors} == {n: before[n] for n in survivors}  # same UIDs, same nodes
    assert list(s.worker_pods) == ["llama-g1-s0-h0", "llama-g2-s0-h1", *survivors[1:]]
    assert w.pods["llama-g2-s0-h1"].node_name == before[dead][1]  # its node is healthy: the same node


def test_pod_0s_trainer_exit_heard_before_its_readiness_turns_keeps_every_pod() -> None:
    """Pod 0's sidecar, asked every reconcile, says its trainer exited before the kubelet's readiness probe
    has run again: nothing put a fault in view before that answer, so the other sidecars were not asked,
    and the in-place restart counted pod 0 the only survivor and replaced the three healthy pods. The
    answer puts the fault in view and the others are asked in the same observation (pods_to_poll_again):
    every pod is kept (pod 0's supervisor lives, and starts the next incarnation)."""
    w = _world()
    before = _identity(w)
    pod0 = "llama-g1-s0-h0"
    w.processes[pod0] = replace(w.processes[pod0], state="exited", exit_code=1, finished_at=w.now)
    assert w.pods[pod0].trainer_ready  # the probe has not run since
    actions = tick(w)
    assert not [d for a in actions if isinstance(a, DeleteGeneration) for d in a.pods]  # every pod is kept
    assert w.status.in_place is not None and [k.pod for k in w.status.in_place.kept] == list(before)
    w.advance(11)  # backoffSeconds: 10
    settle(w)
    assert w.status.phase == api.PHASE_RUNNING and w.status.generation == 2 and _identity(w) == before
