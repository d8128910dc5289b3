"""Goodput accounting (resilax_operator/status_fields/goodput.py, pure) on timelines with known answers, and how the
operator keeps it in status.goodput and the metrics (policies/goodput_status.py)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from op_samples import good_spec
from op_world import World, running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import SetStatus
from resilax_operator.observed.snapshot import TrainerReport
from resilax_operator.policies import goodput_status
from resilax_operator.settings import OperatorSettings
from resilax_operator.status_fields import goodput as gp

M = gp.GenerationMarks


def lost_gen1(**changes: object) -> M:
    """Generation 1: created 0, running 2, steps 1..11 from 5 to 15 (1 s each), replaced at 30."""
    return replace(M(1, created=0.0, running=2.0, first_step=1, first_step_time=5.0, last_step=11, last_step_time=15.0,
                     detected=30.0), **changes)


def gen2(**changes: object) -> M:
    """Generation 2: created 32, running 35, restore 36 -> 38, restored step 8: steps 9..20 from 40 to 51."""
    return replace(M(2, created=32.0, running=35.0, restore_began=36.0, restore_ended=38.0, first_step=9,
                     first_step_time=40.0, last_step=20, last_step_time=51.0), **changes)


def buckets(**nonzero: float) -> dict[str, float]:
    return {**dict.fromkeys(gp.BUCKETS, 0.0), **nonzero}


CASES = {
    # the node of generation 1 died after step 11 (15); the operator replaced it at 30 (its grace);
    # generation 2 restored step 8: steps 9..11 (3 s) were trained twice.
    "hard-loss": ([lost_gen1(), gen2()], 52.0, buckets(
        productive=11 + 12 - 3, lost_steps_redone=3, detection=15, teardown=2, scheduling=2 + 3, jax_startup=2 + 1 + 1,
        restore=2, other=1), 3),
    # the same replaced because it hung (TrainerHung): last step -> detection is the hang bucket
    "hang": ([lost_gen1(hang=True), gen2()], 52.0, buckets(
        productive=11 + 12 - 3, lost_steps_redone=3, hang=15, teardown=2, scheduling=2 + 3, jax_startup=2 + 1 + 1,
        restore=2, other=1), 3),
    # a preemption notice at 12: the trainers stepped on to a final save of step 11 at 15; generation 2
    # restored it (first step 12): nothing lost, no detection; teardown from the last step.
    "preemption-final-save": ([lost_gen1(detected=12.0), gen2(first_step=12, last_step=23)], 52.0, buckets(
        productive=11 + 12, teardown=17, scheduling=2 + 3, jax_startup=2 + 1 + 1, restore=2, other=1), 0),
    # 2 s of generation 1's stepping were saves blocking the loop (steps then 0.8 s each)
    "checkpoint-blocking": ([lost_gen1(blocking_seconds=2.0), gen2()], 52.0, buckets(
        productive=(15 - 4.2) - 2 + 12 - 3 * 0.8, checkpoint_blocking=2, lost_steps_redone=3 * 0.8,
        detection=15, teardown=2, scheduling=2 + 3, jax_startup=2.2 + 1 + 1, restore=2, other=1), 3),
    # generation 2 never stepped (its trainer died in start-up, replaced at 40); generation 3 restored
    # step 8: generation 1's lost steps are settled against generation 3
    "a-generation-that-never-trained": ([lost_gen1(), M(2, created=32.0, running=35.0, detected=40.0),
                                         gen2(generation=3, created=42.0, running=45.0, restore_began=46.0,
                                              restore_ended=48.0, first_step_time=50.0, last_step_time=61.0)],
                                        62.0, buckets(
        productive=11 + 12 - 3, lost_steps_redone=3, detection=15, teardown=2 + 2, scheduling=2 + 3 + 3,
        jax_startup=2 + 5 + 1 + 1, restore=2, other=1), 3),
    # no running or restore marks: scheduling runs to the first step (less one typical step)
    "missing-marks-extend-the-segment-before": ([lost_gen1(running=None), gen2(running=None, restore_began=None,
                                                                               restore_ended=None)],
                                                52.0, buckets(
        productive=20, lost_steps_redone=3, detection=15, teardown=2, scheduling=4 + 7, other=1), 3),
    # the benchmark knows the fault (20): last step 15 -> fault is other, fault -> reaction detection
    "fault-after-the-last-step": ([lost_gen1(fault=20.0), gen2()], 52.0, buckets(
        productive=20, lost_steps_redone=3, detection=10, teardown=2, scheduling=5, jax_startup=4, restore=2,
        other=5 + 1), 3),
    # still training, nothing replaced it: the time since the last step seen is other (provisional)
    "open-generation": ([lost_gen1(detected=None)], 17.0, buckets(productive=11, scheduling=2, jax_startup=2, other=2), 0),
    # the new generation restored from scratch (no checkpoint): all 11 steps were trained again
    "restored-from-scratch": ([lost_gen1(), gen2(first_step=1, last_step=12)], 52.0, buckets(
        productive=12, lost_steps_redone=11, detection=15, teardown=2, scheduling=5, jax_startup=4, restore=2, other=1),
        11),
}


@pytest.mark.parametrize(("gens", "end", "expected", "lost"), list(CASES.values()), ids=list(CASES))
def test_breakdown_with_known_answer(gens: list[M], end: float, expected: dict[str, float], lost: int) -> None:
    g = gp.account(0.0, end, gens)
    assert g.buckets == pytest.approx(expected)
    assert sum(g.buckets.values()) == pytest.approx(g.wall_seconds) == end
    assert g.lost_steps == lost
    assert g.ratio == pytest.approx(expected["productive"] / end)


@pytest.mark.parametrize("case", ["hard-loss", "checkpoint-blocking", "a-generation-that-never-trained"])
def test_folding_one_look_at_a_time_gives_the_same_breakdown(case: str) -> None:
    """The operator sees each generation grow mark by mark and folds it when the next one is created;
    every partial breakdown sums to its wall time; the end result equals the whole-run account."""
    gens, end, expected, lost = CASES[case]
    ledger: gp.Ledger | None = None
    for g in gens:
        seen = M(g.generation, created=g.created)
        for field in ("running", "restore_began", "restore_ended", "first_step_time", "last_step_time", "detected"):
            value = getattr(g, field)
            if field == "first_step_time":
                seen = replace(seen, first_step=g.first_step, first_step_time=value, last_step=g.first_step,
                               last_step_time=value)
            elif field == "last_step_time":
                seen = replace(seen, last_step=g.last_step, last_step_time=value, blocking_seconds=g.blocking_seconds)
            else:
                seen = replace(seen, **{field: value})
            ledger = gp.advance(ledger, seen, start=0.0)
            t = max(x for x in (seen.created, seen.running, seen.last_step_time, seen.detected, 0.0) if x is not None)
            partial = gp.summarize(ledger, t)
            assert sum(partial.buckets.values()) == pytest.approx(partial.wall_seconds) == pytest.approx(t)
    assert ledger is not None
    final = gp.summarize(ledger, end)
    assert final.buckets == pytest.approx(expected)
    assert final.lost_steps == lost


def test_status_round_trip_keeps_the_ledger_and_the_figures() -> None:
    ledger = gp.advance(gp.advance(None, lost_gen1(), start=0.0), gen2())
    record = st.GoodputRecord(ledger, datetime.fromtimestamp(52, UTC))
    s = st.JobStatus(phase=api.PHASE_RUNNING, generation=2, goodput=record)
    body = st.build_status(s)
    again = st.parse_status(body)
    assert st.build_status(again) == body
    assert again.goodput is not None
    assert again.goodput.summary().buckets == pytest.approx(record.summary().buckets, abs=0.01)
    g = body["goodput"]
    assert set(g["breakdown"]) == {"productive", "checkpointBlocking", "lostStepsRedone", "detection", "hang", "teardown",
                                   "scheduling", "jaxStartup", "restore", "other"}
    assert g["wallSeconds"] == 52.0 and g["breakdown"] == {
        "productive": 20.0, "checkpointBlocking": 0.0, "lostStepsRedone": 3.0, "detection": 15.0, "hang": 0.0,
        "teardown": 2.0, "scheduling": 5.0, "jaxStartup": 4.0, "restore": 2.0, "other": 1.0}
    assert g["productiveSeconds"] == g["breakdown"]["productive"]
    hung = replace(s, goodput=st.GoodputRecord(gp.advance(None, lost_gen1(hang=True), start=0.0),
                                               datetime.fromtimestamp(20, UTC)))
    again = st.parse_status(st.build_status(hung))
    assert again.goodput is not None and again.goodput.ledger.current == lost_gen1(hang=True)
    assert 0 < g["ratio"] < 1 and g["asOf"] == "1970-01-01T00:00:52Z" and g["lostSteps"] == 3
    assert st.parse_status({**body, "goodput": {"ratio": 1}}).goodput is None  # unreadable: starts again


@pytest.mark.parametrize(("gens", "message"), [
    ([M(1)], "no start time"),
    ([M(2, created=5.0), M(1, created=9.0)], "older than"),
])
def test_bad_ledger_input_names_the_generation(gens: list[M], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ledger = None
        for g in gens:
            ledger = gp.advance(ledger, g)


# ---- the operator: status.goodput and when it is written -------------------------------------------------

def report(w: World, **fields: float) -> TrainerReport:
    base = w.now.timestamp()
    return TrainerReport(generation=w.status.generation, **{k: (base + v if k.endswith("_time") else v)
                                                            for k, v in fields.items()})  # type: ignore[arg-type]


def test_a_running_job_accounts_from_its_first_generation() -> None:
    w = running_world()
    g = w.status.goodput
    assert g is not None and g.ledger.start == w.status.generation_start_time.timestamp()
    assert g.ledger.current is not None and g.ledger.current.running is not None  # the trainers started


def test_trainer_progress_alone_is_not_written_until_the_refresh_interval() -> None:
    w = running_world()
    w.trainer = report(w, restores=1, restored_time=-1.0, last_restore_seconds=1.0, first_step=1, first_step_time=1.0,
                       step=1, step_time=1.0)
    w.advance(2)
    w.step()  # the restore and the first step are marks: written
    assert w.status.goodput is not None and w.status.goodput.ledger.current.first_step == 1
    written = w.status
    for i in range(2, 60):  # progress only, for 290 s < goodput_status_seconds (300)
        w.advance(5)
        w.trainer = replace(w.trainer, step=i, step_time=w.now.timestamp())
        assert w.step() == [] and w.status == written
    w.advance(20)
    actions = w.step()
    assert [type(a) for a in actions] == [SetStatus]
    g = w.status.goodput
    assert g is not None and g.ledger.current.last_step == 59 and g.as_of == w.now
    assert g.summary().buckets["productive"] > 0


def test_a_hard_loss_puts_the_grace_in_detection_and_the_redone_steps_in_lost() -> None:
    """Workers train to step 40 (1 s a step), their node dies: the operator waits out the grace, replaces
    the generation, the next one restores step 30 and trains: the breakdown shows it."""
    spec = good_spec()
    grace = 30
    spec["recovery"] = {**spec.get("recovery", {}), "nodeLossGraceSeconds": grace}
    w = running_world(spec)
    start = w.status.generation_start_time
    assert start is not None
    w.trainer = report(w, restores=0, first_step=1, first_step_time=5.0, step=40, step_time=44.0)
    w.advance(45)
    w.step()
    victim = w.gen_pods()[0].node_name
    w.advance(5)
    w.set_node(victim, ready="Unknown", ready_since=w.now)
    w.advance(grace)
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.NODE_LOSS
    w.kubelets()
    w.advance(3)  # the teardown
    w.settle(3)
    assert w.status.generation == 2, w.status
    w.settle(3)
    w.trainer = report(w, restores=1, restored_time=3.0, last_restore_seconds=1.0, first_step=31, first_step_time=5.0,
                       step=40, step_time=14.0)
    w.advance(15)
    w.step()
    g = w.status.goodput
    assert g is not None
    b = g.summary().buckets
    assert b["detection"] == pytest.approx(50 + grace - 44)  # the last step (44 s) -> node down (50) + grace
    assert b["teardown"] == pytest.approx(3)
    assert b["lost_steps_redone"] == pytest.approx(10.0, abs=0.01)  # steps 31..40 trained again, 1 s each
    assert b["productive"] == pytest.approx(40 + 10 - 10, abs=0.01)  # steps 1..40, then 31..40 again
    assert b["restore"] == pytest.approx(1.0)
    assert sum(b.values()) == pytest.approx((w.now - start).total_seconds())
    assert g.summary().ratio < 1


def test_a_finished_job_keeps_the_figures_of_its_end() -> None:
    w = running_world()
    w.advance(30)
    w.exit_workers(0)
    w.step()
    assert w.status.phase == api.PHASE_SUCCEEDED
    ended = w.status.goodput
    assert ended is not None and ended.as_of == w.now
    w.advance(600)
    assert w.step() == [] and w.status.goodput == ended
    assert goodput_status.current(w.observed(), w.status) == ended


def test_time_alone_never_writes_and_the_progress_refresh_can_be_turned_off() -> None:
    """A job whose trainer reports nothing (or nothing new) costs no status writes, however long it
    runs (the operator's steady cost: at most one request per job per minute, issue 17)."""
    w = running_world()
    later = replace(w.observed(), now=w.now + timedelta(hours=1))
    for seconds in (0, 60):
        assert goodput_status.with_goodput([], later, OperatorSettings(goodput_status_seconds=seconds)) == []
    progress = replace(later, trainer=report(w, first_step=1, first_step_time=5.0, step=1, step_time=5.0))
    written = goodput_status.with_goodput([], progress, OperatorSettings(goodput_status_seconds=60))
    assert written != []  # new marks (the first step): written
    w.status = next(a.status for a in written if isinstance(a, SetStatus))
    more = replace(w.observed(), now=w.now + timedelta(hours=2),
                   trainer=report(w, first_step=1, first_step_time=5.0, step=900, step_time=3600.0))
    assert goodput_status.with_goodput([], more, OperatorSettings(goodput_status_seconds=0)) == []
    assert goodput_status.with_goodput([], more, OperatorSettings(goodput_status_seconds=60)) != []


def test_the_marks_come_from_the_trainer_containers_and_pod_0s_figures() -> None:
    from resilax_operator.observed.snapshot import parse_pod, parse_trainer_report

    pod = {"metadata": {"name": "j-g1-s0-h0", "labels": {api.LABEL_GENERATION: "1", api.LABEL_SLICE: "0",
                                                          api.LABEL_HOST: "0"}},
           "spec": {"containers": [{"name": api.TRAINER_CONTAINER}]},
           "status": {"phase": "Running", "containerStatuses": [
               {"name": "sidecar", "state": {"running": {"startedAt": "2026-01-01T11:00:00Z"}}},
               {"name": api.TRAINER_CONTAINER, "state": {"running": {"startedAt": "2026-01-01T12:00:05Z"}}}]}}
    parsed = parse_pod(pod)
    assert parsed is not None and parsed.trainer_started_at == datetime(2026, 1, 1, 12, 0, 5, tzinfo=UTC)
    body = {"trainer": {"step": 40, "step_time": 1.5, "first_step": 31, "first_step_time": 0.5, "restores": 1,
                        "last_restore_seconds": 2, "restored_time": 0.25, "save_blocking_seconds": 0.75}}
    assert parse_trainer_report(body, 2) == TrainerReport(2, 40, 1.5, 31, 0.5, 0.75, 1, 2.0, 0.25)
    # a trainer of an older library (no wall times) or garbage: what is there, nothing more
    assert parse_trainer_report({"trainer": {"step": "x", "step_time": True}}, 2) == TrainerReport(2)
    assert parse_trainer_report({"trainer": None}, 2) is None
    # a pod kept by an in-place restart still shows its old incarnation's figures: they name generation 2,
    # not the generation 3 the pod now belongs to, so generation 3's marks (firstStep) never take them
    kept = parse_trainer_report({"trainer": {**body["trainer"], "generation": 2}}, 3)
    assert kept is not None and kept.generation == 2 and kept.first_step == 31


def test_a_suspension_is_left_out_of_the_wall_time() -> None:
    """Generation 1 trains, the job is suspended from 40 to 1040 (no workers), generation 2 resumes:
    the 1000 s are nobody's time; generation 2's restore of step 11 loses nothing."""
    ledger = gp.advance(None, lost_gen1(detected=16.0), start=0.0)
    ledger = gp.pause(ledger, 40.0, 1040.0)
    assert ledger.current is None and ledger.carry is not None and ledger.carry.step == 11
    ledger = gp.advance(ledger, gen2(created=1042.0, running=1045.0, restore_began=1046.0, restore_ended=1048.0,
                                     first_step=12, first_step_time=1050.0, last_step=23, last_step_time=1061.0))
    g = gp.summarize(ledger, 1062.0)
    assert g.wall_seconds == pytest.approx(62.0) and sum(g.buckets.values()) == pytest.approx(62.0)
    assert g.buckets == pytest.approx(buckets(productive=11 + 12, detection=1, teardown=24, scheduling=2 + 2 + 3,
                                              jax_startup=2 + 1 + 1, restore=2, other=1))
    assert g.lost_steps == 0


def test_the_operator_leaves_a_suspension_out_of_the_jobs_wall_time() -> None:
    from resilax_operator.observed.snapshot import SaveOutcome

    w = running_world()
    created = w.status.generation_start_time
    assert created is not None
    w.advance(100)
    w.spec["suspend"] = True
    save = next(a for a in w.step() if hasattr(a, "request_id"))
    w.outcomes.append(SaveOutcome(save.request_id, step=50, committed=True))  # type: ignore[union-attr]
    w.exit_workers(75)
    w.settle()
    assert w.status.phase == api.PHASE_SUSPENDED
    frozen = w.status.goodput
    assert frozen is not None and frozen.summary().wall_seconds == pytest.approx(100)
    w.advance(3600)
    assert not any(isinstance(a, SetStatus) for a in w.step())  # suspended: nothing is written, nothing counts
    assert w.status.goodput == frozen and goodput_status.current(w.observed(), w.status) == frozen
    w.spec["suspend"] = False
    w.step()
    w.settle()
    w.advance(20)
    w.step_besides_goodput()
    g = goodput_status.current(w.observed(), w.status)
    assert g is not None and g.summary().wall_seconds == pytest.approx(100 + 20)  # the hour is nobody's


# ---- device-weighted goodput (issue 26, item 5) -------------------------------------------------------

WEIGHTED = {
    # every generation at the declared shape: the device-weighted figure is the plain one
    "declared-shape": ([lost_gen1(), gen2()], 20.0),
    # generation 2 runs at half the declared devices: its 12 productive seconds count 6; the 3 s it
    # redid were generation 1's (share 1): taken back at 1
    "shrunk-second": ([lost_gen1(), gen2(devices_share=0.5)], 11 + 12 * 0.5 - 3),
    # generation 1 shrunk (a quarter), generation 2 at full shape: its redone seconds cost a quarter
    "shrunk-first": ([lost_gen1(devices_share=0.25), gen2()], 11 * 0.25 + 12 - 3 * 0.25),
    # a generation that never trained adds nothing whatever its share
    "untrained-shrunk": ([lost_gen1(), M(2, created=32.0, running=35.0, detected=40.0, devices_share=0.5),
                          gen2(generation=3, created=42.0, running=45.0, restore_began=46.0, restore_ended=48.0,
                               first_step_time=50.0, last_step_time=61.0)], 20.0),
}


@pytest.mark.parametrize(("gens", "weighted"), list(WEIGHTED.values()), ids=list(WEIGHTED))
def test_device_weighted_goodput_weights_each_window_by_its_share(gens: list[M], weighted: float) -> None:
    end = 62.0 if len(gens) == 3 else 52.0
    g = gp.account(0.0, end, gens)
    assert g.device_productive == pytest.approx(weighted)
    assert g.device_ratio == pytest.approx(weighted / end)
    assert g.ratio == pytest.approx(g.buckets["productive"] / end)  # the plain figure is untouched
    # folded one generation at a time (as the operator does) gives the same, and survives the status
    ledger: gp.Ledger | None = None
    for m in gens:
        ledger = gp.advance(ledger, m, start=0.0)
        assert ledger is not None
        record = st.GoodputRecord(ledger, datetime.fromtimestamp(end, UTC))
        again = st.parse_status(st.build_status(st.JobStatus(goodput=record))).goodput
        assert again is not None
        ledger = again.ledger
    assert ledger is not None
    assert gp.summarize(ledger, end).device_productive == pytest.approx(weighted, abs=0.01)


@pytest.mark.parametrize(("shape", "declared", "share"), [
    (("2x4", 2), ("2x4", 2), 1.0), (("2x4", 1), ("2x4", 2), 0.5), (("2x2", 2), ("2x4", 2), 0.5),
    (("2x4", 3), ("2x4", 2), 1.0),  # above the declared devices (elastic maxCount): at most 1
    (("2x4", 1), None, None), (None, ("2x4", 2), None),
], ids=["declared", "half-the-slices", "smaller-topology", "capped-at-1", "no-spec", "no-shape"])
def test_devices_share_is_the_generations_devices_over_the_declared(
        shape: tuple[str, int] | None, declared: tuple[str, int] | None, share: float | None) -> None:
    from resilax_operator.spec import Shape

    assert goodput_status.devices_share(Shape(*shape) if shape else None,
                                        Shape(*declared) if declared else None) == share


def test_an_old_status_without_the_weighted_fields_reads_as_every_generation_at_full_shape() -> None:
    ledger = gp.advance(gp.advance(None, lost_gen1(), start=0.0), gen2())
    body = st.build_status(st.JobStatus(goodput=st.GoodputRecord(ledger, datetime.fromtimestamp(52, UTC))))
    led = body["goodput"]["ledger"]
    del led["closedDeviceProductive"], led["carry"], led["current"]["devicesShare"]
    again = st.parse_status(body).goodput
    assert again is not None and again.ledger.current is not None and again.ledger.current.devices_share == 1.0
    assert again.summary().device_ratio == pytest.approx(again.summary().ratio)


def test_the_operator_shows_both_figures_and_weights_a_shrunk_generation() -> None:
    """A generation running on half the slices the spec declares (as after a shrink): status.goodput's
    deviceRatio is half its ratio."""
    from resilax_operator.spec import Shape

    w = running_world()
    s = w.status
    assert s.shape is not None
    spec = Shape(s.shape.topology, 2 * s.shape.count)
    w.advance(30)
    report = TrainerReport(s.generation, step=20, step_time=w.now.timestamp() - 1, first_step=1,
                           first_step_time=w.now.timestamp() - 20)
    observed = replace(w.observed(), trainer=report)
    record = goodput_status.live(observed, s, spec)
    assert record is not None and record.ledger.current is not None
    assert record.ledger.current.devices_share == 0.5
    g = st.build_goodput(record)
    assert g["ratio"] > 0 and g["deviceRatio"] == pytest.approx(g["ratio"] * record.ledger.current.devices_share,
                                                                abs=1e-3)
