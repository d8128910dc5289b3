"""status.history (status_fields/history.py, policies/history_status.py): one entry per generation, derived from the
status changes the operator writes anyway, never written for itself.

A table of single decisions (the stored status, the status the decision writes, what it observed) with
the entries they must give; then whole flows through the in-memory world (op_world: deciding twice
gives the same actions at every step), the write budget, and an operator that dies at every step."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from op_restart import KEEP, Driver
from op_samples import good_spec
from op_world import World, running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import PublishFreshness, SetStatus
from resilax_operator.builders import JobRef
from resilax_operator.observed.snapshot import Observed, RestoreReport, SaveOutcome, TrainerReport
from resilax_operator.policies import history_status
from resilax_operator.spec import Shape
from resilax_operator.status import CheckpointInfo, InPlace, JobStatus, Transition
from resilax_operator.status_fields.history import (
    MAX_ENTRIES,
    HistoryEntry,
    build_entry,
    build_history,
    parse_history,
)
from test_op_inplace import _lose_node
from test_op_inplace import _world as inplace_world
from test_op_inplace import settle as inplace_settle

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def gen(g: int, start: float, *, count: int = 2, pools: tuple[str, ...] = ("a", "b"), **changes: Any) -> JobStatus:
    """The status of a running generation `g` created at T0 + `start`."""
    return replace(JobStatus(phase=api.PHASE_RUNNING, generation=g, shape=Shape("4x4", count), hosts=4 * count,
                             pools=pools[:count], restore_step="latest", generation_start_time=at(start)), **changes)


def entry(g: int, start: float, *, count: int = 2, pools: tuple[str, ...] = ("a", "b"), **changes: Any) -> HistoryEntry:
    return replace(HistoryEntry(g, at(start), "4x4", count, 4 * count, pools[:count]), **changes)


def ready(s: JobStatus, reason: str, message: str = "m") -> JobStatus:
    return st.set_condition(s, api.COND_READY, False, reason, message, T0)


NODE_LOST = Transition(st.NODE_LOSS, 1, at(100), "node n1 hosting generation 1 has not been Ready for 30s",
                       reason=api.NODE_LOST.name)
IN_PLACE = InPlace(2, 1, st.IN_PLACE_STOPPING, at(100), at(130), kind=st.WORKER_FAILURE,
                   reason=api.WORKER_FAILED.name, message="worker llama-g1-s0-h1 of generation 1 failed: exit code 1")


@dataclass(frozen=True)
class Case:
    stored: JobStatus
    written: JobStatus
    expected: tuple[HistoryEntry, ...]
    restore: RestoreReport | None = None
    trainer: TrainerReport | None = None
    checkpoint: CheckpointInfo | None = None
    now: float = 200.0


def _ended(*entries: HistoryEntry) -> tuple[HistoryEntry, ...]:
    return entries


G1 = entry(1, 0)
G1_LOST = replace(G1, end=at(100), end_reason=api.NODE_LOST.name, end_message=NODE_LOST.message)
CASES: dict[str, Case] = {
    "first-generation": Case(JobStatus(), gen(1, 0, phase=api.PHASE_PENDING), (G1,)),
    "a-transition-ends-it-with-the-findings-reason": Case(
        gen(1, 0, history=(G1,)), gen(1, 0, transition=NODE_LOST, history=(G1,)), (G1_LOST,)),
    "a-transition-of-an-older-operator-names-its-kind": Case(
        gen(1, 0, history=(G1,)), gen(1, 0, transition=replace(NODE_LOST, kind=st.PREEMPTION, reason=""), history=(G1,)),
        (replace(G1_LOST, end_reason=api.PREEMPTION_NOTICE.name),)),
    "suspend-ends-it-as-suspended": Case(
        gen(1, 0, history=(G1,)), gen(1, 0, transition=replace(NODE_LOST, kind=st.SUSPEND, reason=api.SUSPENDING.name,
                                                                message="spec.suspend"), history=(G1,)),
        (replace(G1, end=at(100), end_reason=api.SUSPENDED.name, end_message="spec.suspend"),)),
    "the-next-generation-gets-its-entry": Case(
        gen(1, 0, transition=NODE_LOST, history=(G1_LOST,)), gen(2, 130, count=1, restarts=1),
        (G1_LOST, entry(2, 130, count=1))),
    "an-entry-nothing-ended-ends-at-the-next-start": Case(
        gen(1, 0, history=(G1,)), gen(2, 130, count=1), (replace(G1, end=at(130)), entry(2, 130, count=1))),
    "in-place-ends-the-old-one-and-marks-the-new": Case(
        gen(1, 0, history=(G1,)), gen(2, 100, in_place=IN_PLACE, phase=api.PHASE_RECOVERING),
        (replace(G1, end=at(100), end_reason=api.WORKER_FAILED.name, end_message=IN_PLACE.message),
         entry(2, 100, in_place=True))),
    "completed": Case(
        gen(1, 0, history=(G1,)), ready(gen(1, 0, phase=api.PHASE_SUCCEEDED, history=(G1,)), api.COMPLETED.name,
                                         "all workers of generation 1 exited 0"),
        (replace(G1, end=at(200), end_reason="Completed", end_message="all workers of generation 1 exited 0"),)),
    "failed-with-the-ready-reason": Case(
        gen(1, 0, history=(G1,)), ready(gen(1, 0, phase=api.PHASE_FAILED, history=(G1,)),
                                         api.MAX_RESTARTS_EXCEEDED.name, "x" * 300),
        (replace(G1, end=at(200), end_reason=api.MAX_RESTARTS_EXCEEDED.name, end_message="x" * 197 + "..."),)),
    "an-ended-entry-keeps-its-end": Case(
        gen(1, 0, transition=NODE_LOST, history=(G1_LOST,)),
        ready(gen(1, 0, transition=NODE_LOST, phase=api.PHASE_FAILED, history=(G1_LOST,)), "PodLossesExceeded"),
        (G1_LOST,)),
    "an-operator-upgraded-mid-transition-records-both": Case(
        gen(1, 0, transition=NODE_LOST), gen(2, 130, count=1), (G1_LOST, entry(2, 130, count=1))),
    "pools-follow-while-it-runs": Case(
        gen(1, 0, history=(G1,)), gen(1, 0, pools=("c", "d"), history=(G1,)), (entry(1, 0, pools=("c", "d")),)),
    "trimmed-to-the-newest-50": Case(
        gen(50, 4900, transition=replace(NODE_LOST, generation=50), history=tuple(
            replace(entry(g, 100 * (g - 1)), end=at(100 * g - 10), end_reason="NodeLost") for g in range(1, 51))),
        gen(51, 5000),
        (*(replace(entry(g, 100 * (g - 1)), end=at(100 * g - 10), end_reason="NodeLost") for g in range(2, 51)),
         entry(51, 5000))),
    "the-restore-report-of-its-generation": Case(
        gen(2, 130, history=(replace(G1_LOST, last_step=130), entry(2, 130))), gen(2, 130, phase=api.PHASE_RUNNING),
        (replace(G1_LOST, last_step=130, lost_steps=10), entry(2, 130, restored_step=120, restored_from="peer")),
        restore=RestoreReport(120, (), generation=2, source="peer")),
    "a-stale-report-of-the-generation-before-is-not-it": Case(
        gen(2, 130, history=(G1_LOST, entry(2, 130))), gen(2, 130, restarts=1),
        (G1_LOST, entry(2, 130)), restore=RestoreReport(90, (), generation=1, source="local")),
    "a-report-without-generation-counts-for-a-new-pod-0": Case(
        gen(2, 130, history=(G1_LOST, entry(2, 130))), gen(2, 130, restarts=1),
        (G1_LOST, entry(2, 130, restored_step=120)), restore=RestoreReport(120, ())),
    "but-not-for-a-pod-0-kept-in-place": Case(
        gen(2, 130, history=(G1_LOST, entry(2, 130, in_place=True))), gen(2, 130, restarts=1),
        (G1_LOST, entry(2, 130, in_place=True)), restore=RestoreReport(90, ())),
    "an-unknown-source-is-left-out": Case(
        gen(2, 130, history=(G1_LOST, entry(2, 130))), gen(2, 130, restarts=1),
        (G1_LOST, entry(2, 130, restored_step=120)), restore=RestoreReport(120, (), generation=2, source="tape")),
    "steps-and-a-checkpoint-from-pod-0": Case(
        gen(2, 130, history=(G1_LOST, entry(2, 130))), gen(2, 130, restarts=1),
        (G1_LOST, entry(2, 130, first_step=121, last_step=140, checkpoints=(136,))),
        trainer=TrainerReport(2, step=140, step_time=at(190).timestamp(), first_step=121,
                              first_step_time=at(170).timestamp()),
        checkpoint=CheckpointInfo(136, at(180))),
    "the-restored-step-is-no-checkpoint-of-it": Case(
        gen(2, 130, history=(G1_LOST, entry(2, 130, first_step=121))), gen(2, 130, restarts=1),
        (G1_LOST, entry(2, 130, first_step=121)), checkpoint=CheckpointInfo(120, at(180))),
    "a-first-step-shows-what-the-last-one-lost": Case(
        gen(2, 130, history=(replace(G1_LOST, last_step=130), entry(2, 130))), gen(2, 130, restarts=1),
        (replace(G1_LOST, last_step=130, lost_steps=30), entry(2, 130, first_step=101, last_step=101)),
        trainer=TrainerReport(2, step=101, step_time=at(170).timestamp(), first_step=101,
                              first_step_time=at(170).timestamp())),
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_one_decision(case: Case) -> None:
    observed = Observed(now=at(case.now), job=JobRef("llama", "ml", "uid-1"), status=case.stored,
                        restore=case.restore, trainer=case.trainer, checkpoint=case.checkpoint)
    got = history_status.record(observed, case.written)
    assert [build_entry(e) for e in got] == [build_entry(e) for e in case.expected]
    assert got == case.expected
    # through a decision's write: the same entries, and the same again when decided twice
    actions = history_status.with_history([SetStatus(case.written)], observed)
    assert actions == history_status.with_history([SetStatus(case.written)], observed)
    if st.build_status(replace(case.written, history=case.stored.history)) != st.build_status(case.stored):
        assert isinstance(actions[0], SetStatus) and actions[0].status.history == case.expected


def test_no_write_of_its_own() -> None:
    """A decision that writes nothing, or writes the status unchanged, carries no history change, however
    much it observed (a step, a restore, a checkpoint): the history waits for a write made anyway."""
    stored = gen(2, 130, history=(G1_LOST, entry(2, 130)))
    observed = Observed(now=at(200), job=JobRef("llama", "ml", "uid-1"), status=stored,
                        restore=RestoreReport(120, (), generation=2, source="local"),
                        trainer=TrainerReport(2, step=140, step_time=at(190).timestamp(), first_step=121,
                                              first_step_time=at(170).timestamp()),
                        checkpoint=CheckpointInfo(136, at(180)))
    assert history_status.record(observed, stored) != stored.history  # there is something to record
    assert history_status.with_history([], observed) == []
    assert history_status.with_history([SetStatus(stored)], observed) == [SetStatus(stored)]
    (written,) = history_status.with_history([SetStatus(replace(stored, restarts=1))], observed)
    assert isinstance(written, SetStatus) and written.status.history[1].restored_from == "local"


@pytest.mark.parametrize(("window", "shown"), [
    pytest.param({"productive": 20.04, "lost_steps_redone": 3.0}, {"productive": 20.0, "lostStepsRedone": 3.0},
                 id="rounded-to-0.1"),
    pytest.param({"productive": -1.0, "lost_steps_redone": 3.0}, {"productive": 0.0, "lostStepsRedone": 2.0},
                 id="redo-charged-before-it-was-done-shows-what-was-done"),
])
def test_a_window_as_shown(window: dict[str, float], shown: dict[str, float]) -> None:
    from resilax_operator.status_fields import goodput as gp

    full = {b: 0.0 for b in gp.BUCKETS} | window
    got = dict(history_status._shown(full))
    assert got == {st.BREAKDOWN_KEYS[b]: 0.0 for b in gp.BUCKETS} | shown
    assert sum(got.values()) == pytest.approx(sum(full.values()), abs=0.1)


def test_the_history_round_trips_through_the_status() -> None:
    full = replace(entry(2, 130, count=1, in_place=True), end=at(300), end_reason="NodeLost", end_message="m",
                   restored_step=120, restored_from="peer", first_step=121, last_step=170, lost_steps=4,
                   goodput=(("detection", 1.5), ("productive", 20.0)), checkpoints=(124, 128))
    fresh = entry(3, 310)
    s = gen(3, 310, history=(full, fresh))
    body = st.build_status(s)
    assert body["history"][1] == {"generation": 3, "start": "2026-01-01T12:05:10Z",
                                  "shape": {"count": 2, "topology": "4x4", "hosts": 8}, "pools": ["a", "b"],
                                  "inPlace": False, "lostSteps": 0, "goodput": {}}  # no nulls: a list is written whole
    assert body["history"][0]["restoredFrom"] == "peer" and body["history"][0]["end"] == "2026-01-01T12:05:00Z"
    assert st.parse_status(body) == s and st.build_status(st.parse_status(body)) == body
    assert len(build_history(tuple(entry(g, g) for g in range(1, 80)))) == MAX_ENTRIES
    for garbage in ([{"generation": "x", "start": "2026-01-01T00:00:00Z"}], [{"generation": 1}], {"a": 1}, "x"):
        assert parse_history(garbage) == ()  # unreadable: it starts again rather than failing the reconcile


# ---- whole flows through the in-memory world ------------------------------------------------------------


def history(w: World) -> list[tuple[int, int, str | None, bool, int | None, str, int]]:
    """(generation, slices, endReason, inPlace, restoredStep, restoredFrom, lostSteps) per entry."""
    return [(e.generation, e.count, e.end_reason or None, e.in_place, e.restored_step, e.restored_from, e.lost_steps)
            for e in w.status.history]


def report(w: World, **fields: float) -> TrainerReport:
    base = w.now.timestamp()
    return TrainerReport(generation=w.status.generation, **{k: (base + v if k.endswith("_time") else v)
                                                            for k, v in fields.items()})  # type: ignore[arg-type]


def test_a_hard_loss_then_a_grow_back() -> None:
    """Generation 1 trains to step 40 and loses a node; generation 2 (fewer slices) restores step 30 from
    the persistent tier; the node returns and generation 3 grows back through a final save of step 55."""
    spec = good_spec()
    w = running_world(spec)
    assert history(w) == [(1, 4, None, False, None, "", 0)]
    w.trainer = report(w, restores=0, first_step=1, first_step_time=5.0, step=40, step_time=44.0)
    w.checkpoint = CheckpointInfo(30, w.now)
    w.advance(45)
    w.step()
    victim = w.gen_pods()[-1].node_name
    assert victim is not None
    w.set_node(victim, ready="Unknown", ready_since=w.now)
    w.advance(31)
    w.settle(3)
    w.kubelets()
    w.settle(4)
    assert w.status.generation == 2 and w.status.phase == api.PHASE_RUNNING, w.status
    w.restore = RestoreReport(30, (), generation=2, source="persistent")
    w.trainer = report(w, restores=1, restored_time=3.0, last_restore_seconds=1.0, first_step=31, first_step_time=5.0,
                       step=50, step_time=24.0)
    w.advance(25)
    w.step()
    e1, e2 = w.status.history
    assert history(w) == [(1, 4, api.NODE_LOST.name, False, None, "", 10), (2, 3, None, False, 30, "persistent", 0)]
    assert e1.first_step == 1 and e1.last_step == 40 and e1.checkpoints == (30,) and e1.end is not None
    assert "has not been Ready" in e1.end_message and e1.end == w.status.history[0].end
    assert e2.start == w.status.generation_start_time and e2.pools == w.status.pools and e2.first_step == 31
    # the windows of the entries add up to the wall time, and the lost steps' redo is generation 2's
    g = w.status.goodput
    assert g is not None
    total = g.summary()
    for key in st.BREAKDOWN_KEYS.values():
        assert sum(dict(e.goodput)[key] for e in w.status.history) == pytest.approx(
            total.buckets[next(b for b, k in st.BREAKDOWN_KEYS.items() if k == key)], abs=0.11)
    assert dict(e2.goodput)["lostStepsRedone"] == pytest.approx(10.0, abs=0.1)
    assert dict(e1.goodput)["detection"] > 0 and dict(e1.goodput)["lostStepsRedone"] == 0
    # the node comes back: grow-back, a final save of step 55, generation 3 restores it (nothing lost)
    w.set_node(victim, ready="True", ready_since=w.now)
    w.advance(61)
    w.settle(2)
    assert w.status.transition is not None and w.status.transition.kind == st.GROW_BACK
    save = w.save_requests[-1]
    w.trainer = replace(w.trainer, step=55, step_time=w.now.timestamp())
    w.outcomes.append(SaveOutcome(save.request_id, step=55, committed=True))
    w.checkpoint = CheckpointInfo(55, w.now)
    w.exit_workers(75)
    w.settle(6)
    assert w.status.generation == 3 and w.status.phase == api.PHASE_RUNNING, w.status
    w.restore = RestoreReport(55, (), generation=3, source="persistent")
    w.trainer = report(w, restores=1, restored_time=2.0, last_restore_seconds=1.0, first_step=56,
                       first_step_time=4.0, step=57, step_time=5.0)
    w.advance(6)
    w.step()
    assert history(w) == [(1, 4, api.NODE_LOST.name, False, None, "", 10),
                          (2, 3, api.GROW_BACK.name, False, 30, "persistent", 0),
                          (3, 4, None, False, 55, "persistent", 0)]
    assert w.status.history[1].last_step == 55 and w.status.history[1].checkpoints == (55,)


def test_time_and_progress_alone_never_write_and_the_next_write_catches_up() -> None:
    w = running_world()
    w.trainer = report(w, restores=0, first_step=1, first_step_time=1.0, step=1, step_time=1.0)
    w.advance(2)
    w.step()  # the first step is a goodput mark: written
    written = w.status
    assert written.history[0].first_step == 1
    for i in range(2, 40):  # progress only, for less than goodput_status_seconds: no write
        w.advance(5)
        w.trainer = replace(w.trainer, step=i, step_time=w.now.timestamp())
        assert w.step() == [] and w.status == written
    w.advance(300)  # the goodput's own refresh of the progress (goodput_status_seconds): the history rides on it
    assert [type(a) for a in w.step()] == [SetStatus]
    assert w.status.history[0].last_step == 39
    written = w.status
    w.advance(3600)
    assert w.step() == [] and w.status == written  # time alone: nothing
    w.checkpoint = CheckpointInfo(36, w.now)  # a newer checkpoint is a status change the operator writes anyway
    assert [type(a) for a in w.step()] == [SetStatus, PublishFreshness]  # and its annotations (freshness.py)
    (e,) = w.status.history
    assert e.checkpoints == (36,) and e.last_step == 39 and e.end is None


def test_in_place_restart() -> None:
    w = inplace_world()
    _lose_node(w, "llama-g1-s1-h1")
    inplace_settle(w)
    assert w.status.generation == 2 and w.status.in_place is None
    assert history(w) == [(1, 2, api.NODE_LOST.name, False, None, "", 0), (2, 2, None, True, None, "", 0)]
    e1, e2 = w.status.history
    assert e1.end == e2.start


def test_completion_and_failure() -> None:
    w = running_world()
    w.advance(30)
    w.exit_workers(0)
    w.step()
    assert history(w) == [(1, 4, api.COMPLETED.name, False, None, "", 0)]
    assert w.status.history[0].end == w.now
    spec = good_spec()
    spec["recovery"]["maxRestarts"] = 0
    w = running_world(spec)
    w.exit_workers(1, names=[w.gen_pods()[0].name])
    w.step()
    assert w.status.phase == api.PHASE_FAILED
    assert history(w) == [(1, 4, api.MAX_RESTARTS_EXCEEDED.name, False, None, "", 0)]


def test_suspend_and_resume() -> None:
    w = running_world()
    w.spec["suspend"] = True
    w.step()
    w.exit_workers(75)
    w.settle()
    assert w.status.phase == api.PHASE_SUSPENDED
    assert history(w) == [(1, 4, api.SUSPENDED.name, False, None, "", 0)]
    w.advance(3600)
    w.spec["suspend"] = False
    w.settle()
    assert history(w) == [(1, 4, api.SUSPENDED.name, False, None, "", 0), (2, 4, None, False, None, "", 0)]


def _flow(d: Driver) -> None:
    d.tick(6)
    victim = d.w.gen_pods()[-1].node_name
    assert victim is not None
    d.w.set_node(victim, ready="Unknown", ready_since=d.w.now)
    d.w.advance(31)
    d.tick(8)


@pytest.mark.parametrize("keep", list(KEEP.values()), ids=list(KEEP))
def test_operator_dies_at_every_step_the_history_is_the_same(keep: int) -> None:
    clean = Driver(None, 0)
    _flow(clean)
    expected = [(e.generation, e.count, e.end_reason, e.end) for e in clean.w.status.history]
    assert [x[:3] for x in expected] == [(1, 4, api.NODE_LOST.name), (2, 3, "")]
    for crash_at in range(clean.n):
        d = Driver(crash_at, keep)
        _flow(d)
        got = [(e.generation, e.count, e.end_reason, e.end) for e in d.w.status.history]
        assert got == expected, f"crash at decision {crash_at}"


def test_the_restore_report_names_its_generation_and_source() -> None:
    from resilax_operator.observed.snapshot import parse_restore_report

    body = {"restore": {"step": 120, "skipped": [], "generation": 3, "source": "peer"}}
    assert parse_restore_report(body) == RestoreReport(120, (), 3, "peer")
    assert parse_restore_report({"restore": {"step": 120, "skipped": []}}) == RestoreReport(120)  # an older library
    assert parse_restore_report({"restore": {"step": 120, "generation": "x"}}) is None
