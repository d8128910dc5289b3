"""The goodput benchmark's pure core: the seeded failure schedule and the goodput breakdown of a
recorded run (bench/resilax_bench/goodput_model.py), on synthetic timelines with known answers."""

from __future__ import annotations

from pathlib import Path

import pytest
from resilax_bench.goodput_model import (
    BUCKETS,
    KILL,
    PREEMPT,
    RESTORE,
    GenerationMarks,
    GoodputInputError,
    build_schedule,
    compute_goodput,
    find_reaction,
    pod_marks,
)
from resilax_local.demo.timeline import Fault, JobSnapshot, LossRecord, TimelineEvent


def rec(step: int, time: float, generation: int) -> LossRecord:
    return LossRecord(step=step, loss=1.0 / step, generation=generation, devices=8, time=time)


# ---- the schedule -------------------------------------------------------------------------------------

def test_same_seed_same_schedule_other_seed_other_times() -> None:
    a = build_schedule(7, duration=1200, kill_every=300, restore_after=90)
    assert a == build_schedule(7, duration=1200, kill_every=300, restore_after=90)
    assert [f.at for f in a] != [f.at for f in build_schedule(8, duration=1200, kill_every=300, restore_after=90)]


def test_schedule_losses_every_interval_one_preemption_each_followed_by_the_node_back() -> None:
    s = build_schedule(3, duration=1200, kill_every=300, restore_after=90, jitter=0.2)
    faults = [f for f in s if f.kind != RESTORE]
    assert [f.kind for f in faults] == [KILL, PREEMPT, KILL]  # the 4th (~1200 s) would return after the end
    for i, f in enumerate(faults):
        assert 0.8 * 300 <= f.at - i * 300 <= 1.2 * 300
        back = [r for r in s if r.kind == RESTORE and r.victim == f.victim]
        assert len(back) == 1 and back[0].at == pytest.approx(f.at + 90, abs=0.11)
    assert all(f.at + 0 <= 1200 for f in s)
    assert [f.at for f in s] == sorted(f.at for f in s)


def test_short_schedule_has_one_fault_and_its_return() -> None:
    s = build_schedule(1, duration=60, kill_every=30, restore_after=10, jitter=0.0)
    assert [(f.at, f.kind) for f in s] == [(30.0, KILL), (40.0, RESTORE)]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"duration": 0}, "duration"),
    ({"kill_every": -1}, "kill_every"),
    ({"restore_after": 0}, "restore_after"),
    ({"jitter": 0.5}, "jitter"),
    ({"restore_after": 250}, "restore_after"),  # would come after the next fault (300 * 0.6 = 180)
])
def test_bad_schedule_input_names_the_field(kwargs: dict[str, float], field: str) -> None:
    args = {"duration": 1200.0, "kill_every": 300.0, "restore_after": 90.0, "jitter": 0.2, **kwargs}
    with pytest.raises(GoodputInputError, match=field):
        build_schedule(0, **args)


# ---- the breakdown ----------------------------------------------------------------------------------

def one_loss_run() -> tuple[list[LossRecord], list[Fault], dict[int, GenerationMarks]]:
    """Generation 0 trains steps 1..10 (1 s each; the gap after step 5 is 3 s: a save blocked 2 s); its
    node dies at 22.5; generation 1 restored step 6 (31 -> 33) and trains 7..12. Pods, restore marks as seen."""
    gen0 = [rec(i, 10.0 + i, 0) for i in range(1, 6)] + [rec(i, 12.0 + i, 0) for i in range(6, 11)]
    gen1 = [rec(i, 28.0 + i, 1) for i in range(7, 13)]  # step 7 at 35 ... step 12 at 40
    faults = [Fault(22.5, KILL, "tpu-1-1"), Fault(30.0, RESTORE, "tpu-1-1")]
    marks = {0: GenerationMarks(pods_created=2.0, pods_running=6.0),
             1: GenerationMarks(detected=25.0, pods_created=27.0, pods_running=30.0, restore_began=31.0, restored=33.0)}
    return gen0 + gen1, faults, marks


def test_breakdown_of_a_hard_loss_with_known_answer() -> None:
    records, faults, marks = one_loss_run()
    g = compute_goodput(records, faults, start=0.0, end=42.0, marks=marks)
    assert g.buckets == pytest.approx({
        "productive": 12.0,  # steps 1..6 of gen 0 and 7..12 of gen 1, 1 s each
        "checkpoint_blocking": 2.0,  # the 3 s gap after step 5, less the 1 s median step
        "lost_steps_redone": 4.0,  # steps 7..10 of gen 0, trained again by gen 1
        "detection": 2.5,  # fault 22.5 -> the operator reacted 25
        "hang": 0.0,
        "teardown": 2.0,  # 25 -> new pods 27
        "scheduling": 6.0 + 3.0,  # job applied 0 -> gen 0 running 6; new pods 27 -> running 30
        "jax_startup": 4.0 + 1.0 + 1.0,  # running 6 -> step 1 began 10; running 30 -> restore 31; 33 -> step 7 began 34
        "restore": 2.0,  # restore began 31 -> ended 33
        "other": 0.5 + 2.0,  # last step 22 -> fault 22.5; last step 40 -> end 42
    })
    assert sum(g.buckets.values()) == pytest.approx(g.wall_seconds) == 42.0
    assert g.goodput == pytest.approx(12 / 42)
    assert (g.final_step, g.steps_trained, g.steps_lost, g.generations, g.faults) == (12, 16, 4, 2, 1)


def test_device_weighted_goodput_counts_a_second_at_half_the_devices_half() -> None:
    """Issue 39: gen 1 of the same run on 4 of 8 devices. The operator's accounting: each generation's own
    steps at its share, the redone ones taken off at the share of the generation that first trained them."""
    from dataclasses import replace

    records, faults, marks = one_loss_run()
    records = [replace(r, devices=4) if r.generation == 1 else r for r in records]
    g = compute_goodput(records, faults, 0.0, 42.0, marks)
    assert g.goodput == pytest.approx(12 / 42)  # the plain figure does not change
    assert g.device_weighted_goodput == pytest.approx((10 * 1.0 + 6 * 0.5 - 4 * 1.0) / 42)
    declared = compute_goodput(records, faults, 0.0, 42.0, marks, full_devices=16)
    assert declared.device_weighted_goodput == pytest.approx((10 * 0.5 + 6 * 0.25 - 4 * 0.5) / 42)
    at_full = compute_goodput(one_loss_run()[0], faults, 0.0, 42.0, marks)
    assert at_full.device_weighted_goodput == pytest.approx(at_full.goodput)
    with pytest.raises(GoodputInputError, match="full_devices must be >= 1, got 0"):
        compute_goodput(records, faults, 0.0, 42.0, marks, full_devices=0)


def test_the_table_and_json_lead_with_the_device_weighted_figure() -> None:
    from resilax_bench.goodput import render_table, summarize

    records, faults, marks = one_loss_run()
    g = compute_goodput([r if r.generation == 0 else LossRecord(r.step, r.loss, 1, 4, r.time) for r in records],
                        faults, 0.0, 42.0, marks)
    row = summarize("resilax", g, faults, 0.0, marks)
    assert list(row)[:3] == ["variant", "device_weighted_goodput", "goodput"]
    assert row["device_weighted_goodput"] == round(9 / 42, 4)
    table = render_table({"variants": [row, {**row, "variant": "old", "device_weighted_goodput": None}]})
    lines = table.splitlines()
    assert lines[2] == "| **device-weighted goodput** | **21.4%** | – |"
    assert lines[3] == "| goodput (plain) | 28.6% | 28.6% |"


def test_nothing_lost_when_the_new_generation_resumes_at_the_last_step() -> None:
    records, faults, marks = one_loss_run()
    gen1 = [rec(i, 24.0 + i, 1) for i in range(11, 17)]  # restored step 10: 11..16 at 35..40
    g = compute_goodput([r for r in records if r.generation == 0] + gen1, faults, 0.0, 42.0, marks)
    assert g.steps_lost == 0 and g.buckets["lost_steps_redone"] == 0.0
    assert g.buckets["productive"] == pytest.approx(16.0)
    assert g.final_step == 16


def test_a_missing_mark_extends_the_segment_before_it() -> None:
    records, faults, marks = one_loss_run()
    marks[1] = GenerationMarks(detected=25.0, pods_created=None, pods_running=30.0, restored=None)
    g = compute_goodput(records, faults, 0.0, 42.0, marks)
    assert g.buckets["teardown"] == pytest.approx(5.0)  # 25 -> running 30 (no pods-created mark)
    assert g.buckets["jax_startup"] == pytest.approx(4.0 + 4.0)  # 30 -> first step 34 (no restore line)
    assert g.buckets["restore"] == 0.0
    assert sum(g.buckets.values()) == pytest.approx(42.0)


def test_a_pause_without_a_fault_starts_at_the_last_step() -> None:
    records, _, marks = one_loss_run()  # e.g. a grow-back: the operator restarted the job on its own
    g = compute_goodput(records, [], 0.0, 42.0, marks)
    assert g.buckets["detection"] == pytest.approx(3.0)  # last step 22 -> reacted 25
    assert g.buckets["other"] == pytest.approx(2.0)
    assert g.faults == 0


def test_records_outside_the_window_are_not_counted_and_no_records_is_all_other() -> None:
    records, faults, marks = one_loss_run()
    g = compute_goodput(records, faults, 0.0, 30.0, marks)
    assert g.generations == 1 and g.steps_lost == 0 and g.final_step == 10
    empty = compute_goodput([], faults, 0.0, 10.0)
    assert empty.goodput == 0.0 and empty.buckets["other"] == 10.0
    assert set(empty.buckets) == set(BUCKETS)
    with pytest.raises(GoodputInputError, match="end"):
        compute_goodput(records, faults, 5.0, 5.0)


# ---- the operator's reaction to a generation (the harness's `detected` mark) ------------------------------

def snap(t: float, phase: str, generation: int) -> JobSnapshot:
    return JobSnapshot(time=t, phase=phase, generation=generation)


# The 20-minute run of 2026-12-04 (08:14 UTC), seconds since its start: generation 2 (steps 284.7-347.6)
# grew back when the node returned (346.2): GrowBack 347.3, final save, generation 3's pods at 349;
# the next fault (a preemption notice) came at 641.9, reacted to at 642.2.
GROW_BACK_SNAPSHOTS = [snap(279.0, "Running", 2), snap(347.5, "Resizing", 2), snap(349.6, "Running", 3),
                       snap(642.2, "Saving", 3)]
GROW_BACK_EVENTS = [TimelineEvent(t, "event", f"{reason}: ...") for t, reason in (
    (279.0, "WorkersRunning"), (347.3, "GrowBack"), (349.2, "FinalSaveDone"), (349.4, "GenerationCreated"),
    (641.9, "PreemptionNotice"), (642.2, "FinalSaveDone"))]


@pytest.mark.parametrize(("previous", "steps", "until", "want"), [
    pytest.param(2, [284.7, 300.0, 347.6], 349.0, 347.3, id="grow-back-reaction-before-the-last-step"),
    pytest.param(2, [284.7, 300.0, 347.6], 641.0, 347.3, id="not-the-next-faults-reaction"),
    pytest.param(3, [366.0, 641.9], 645.0, 641.9, id="preemption-notice"),
    pytest.param(2, [], 349.0, 347.3, id="a-generation-that-never-stepped-from-its-start"),
    pytest.param(3, [366.0, 600.0], 340.0, None, id="nothing-in-the-window"),
])
def test_the_reaction_to_a_generation_is_the_first_after_it_trained_before_the_next_began(
        previous: int, steps: list[float], until: float, want: float | None) -> None:
    assert find_reaction(previous, steps, 279.5, until, GROW_BACK_SNAPSHOTS, GROW_BACK_EVENTS) == want


def test_a_hard_loss_reaction_is_the_transition_not_the_wait_before_it() -> None:
    """The survivors exit 76 at once (PeerLost at 112.8: the operator waits for the cause); the NodeLost
    event at 128.3 starts the transition, one second within generation 2's pods created at 128
    (whole seconds): that is the reaction (a 6-minute run of 2026-12-04 09:37 UTC)."""
    events = [TimelineEvent(112.8, "warning", "PeerLost: worker g1-s0-h1 stopped because a peer ..."),
              TimelineEvent(128.3, "warning", "NodeLost: node tpu-slice-1-h1 ..."),
              TimelineEvent(128.8, "event", "GenerationCreated: generation 2 ...")]
    assert find_reaction(1, [45.2, 112.1], 3.2, 128.0, [snap(129.0, "Running", 2)], events) == 128.3


# ---- the two variants' jobs -------------------------------------------------------------------------

def test_the_restart_baseline_has_no_local_tier_no_final_save_no_elastic_and_both_specs_parse() -> None:
    from resilax_bench.goodput import build_variant_job
    from resilax_operator.spec import parse_spec

    resilax = build_variant_job("resilax", "goodput-resilax", "/tmp/ckpt", 0.3)
    restart = build_variant_job("restart", "goodput-restart", "/tmp/ckpt", 0.3)
    parsed = {}
    for job in (resilax, restart):
        problems: list = []
        parsed[job["metadata"]["name"]] = parse_spec(job["spec"], problems)
        assert problems == [], problems
    r, b = parsed["goodput-resilax"], parsed["goodput-restart"]
    assert r.checkpoint.local is not None and r.elastic is not None and r.recovery.in_place_auto
    assert not b.recovery.in_place_auto
    assert r.checkpoint.final_save.on_preemption and r.checkpoint.final_save.on_resize
    assert b.checkpoint.local is None and b.elastic is None
    assert not b.checkpoint.final_save.on_preemption and not b.checkpoint.final_save.on_resize
    assert (b.slices.count, b.checkpoint.storage) == (r.slices.count, r.checkpoint.storage) == (2, "/tmp/ckpt")
    with pytest.raises(ValueError, match="variant"):
        build_variant_job("jobset", "x", "/tmp/ckpt", 0.3)


def test_the_jobs_train_examples_train_py_unless_the_transformer_is_asked_for() -> None:
    from resilax_bench.goodput import build_variant_job, parse_args

    default = build_variant_job("resilax", "g", "/tmp/ckpt", 0.3)["spec"]["template"]["spec"]["containers"][0]
    assert default["command"][:2] == ["python", "examples/train.py"]
    args = parse_args(["--example", "transformer", "--example-args", "--preset cpu-small --lr 0.001"])
    job = build_variant_job("restart", "g", "/tmp/ckpt", 0.0, args.example, args.example_args)
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["python", "examples/transformer.py"]
    assert command[-4:] == ["--preset", "cpu-small", "--lr", "0.001"]
    assert parse_args([]).example == "train"


def test_each_hard_fault_gets_the_time_to_the_next_generations_first_step() -> None:
    """Issue 39's "hard loss to the spare's first step": from the kill at 22.5 to generation 1's step 7 at
    35.0 is 12.5 s; a second kill with no newer generation after it has none."""
    from resilax_bench.goodput_model import Recovery, recoveries

    records, faults, _ = one_loss_run()
    faults = [*faults, Fault(39.5, KILL, "tpu-0-0"), Fault(5.0, RESTORE, "x")]
    assert recoveries(records, faults, start=2.0) == [
        Recovery(at=20.5, kind=KILL, seconds=12.5, devices=records[-1].devices, full=records[0].devices),
        Recovery(at=37.5, kind=KILL, seconds=None, devices=None, full=records[0].devices)]
    assert recoveries([], faults, start=0.0)[0].seconds is None


def test_the_train_example_runs_compute_bound_by_default_so_half_the_devices_make_a_step_twice_as_long() -> None:
    """Issue 39: the bench's step is compute-bound: examples/train.py sleeps step x full / current devices."""
    import importlib.util

    from resilax_bench.goodput import build_variant_job, parse_args
    from resilax_bench.goodput_variants import FULL_DEVICES

    args = parse_args([])
    assert args.step_model == "compute-bound"
    job = build_variant_job("resilax", "g", "/tmp/ckpt", 0.3, args.example, args.example_args,
                            compute_bound=args.step_model == "compute-bound")
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--full-devices") + 1] == str(FULL_DEVICES) == "8"
    fixed = build_variant_job("resilax", "g", "/tmp/ckpt", 0.3)["spec"]["template"]["spec"]["containers"][0]
    assert "--full-devices" not in fixed["command"]
    assert parse_args(["--example", "transformer"]).step_model == "fixed"
    with pytest.raises(SystemExit):
        parse_args(["--example", "transformer", "--step-model", "compute-bound"])
    with pytest.raises(ValueError, match="computes its own"):
        build_variant_job("resilax", "g", "/tmp/ckpt", 0.3, "transformer", compute_bound=True)

    spec = importlib.util.spec_from_file_location("train_example", Path(__file__).parents[2] / "examples" / "train.py")
    assert spec is not None and spec.loader is not None
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    assert train.step_sleep(0.3, 8, 8) == pytest.approx(0.3)
    assert train.step_sleep(0.3, 8, 4) == pytest.approx(0.6)
    assert train.step_sleep(0.3, 0, 4) == pytest.approx(0.3)


def test_a_saved_variant_is_computed_again_with_the_reactions_found_again(tmp_path) -> None:
    """`--recompute`: the files GoodputRun.save_variant writes, read back; a wrong saved `detected`
    (as the 20-minute run's grow-back had) is replaced by the reaction found again."""
    import json
    from dataclasses import asdict

    from resilax_bench.goodput import recompute, render_table

    records, faults, marks = one_loss_run()
    marks[1] = GenerationMarks(detected=99.0, pods_created=27.0, pods_running=30.0, restore_began=31.0, restored=33.0)
    folder = tmp_path / "resilax"
    folder.mkdir()
    (folder / "marks.json").write_text(json.dumps({"start": 0.0, "end": 42.0,
                                                   "marks": {g: asdict(m) for g, m in marks.items()}}))
    for name, items in (("losses", records), ("faults", faults), ("snapshots", [snap(25.0, "Recovering", 0)]),
                        ("events", [])):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(asdict(i)) + "\n" for i in items))
    out = recompute(folder)
    assert out["variant"] == "resilax" and out["marks"][1]["detected"] == 25.0
    assert out["buckets_seconds"]["detection"] == 2.5 and out["buckets_seconds"]["teardown"] == 2.0
    assert out["recoveries"] == [{"at": 22.5, "kind": KILL, "seconds": 12.5, "devices": 8, "full": 8}]
    table = render_table({"variants": [out]})
    assert "| hard fault → next generation's first step | @22s: 12.5 s at 8/8 devices |" in table
    assert "| machine load (1-min average: median, max) | – |" in table  # a saved run has none recorded
    loaded = render_table({"variants": [{**out, "load_1min": {"median": 12.04, "max": 28.3, "samples": 21}}]})
    assert "| machine load (1-min average: median, max) | 12.0, 28.3 |" in loaded


def test_a_generation_started_in_place_counts_its_kept_pods_from_its_restart() -> None:
    """An in-place restart keeps pods created (and started) for an earlier generation: counted from their
    creation, the new generation would have begun before the old one ended (JAX start-up of minutes).
    They count from the RestartingInPlace Event; a pod created for the new generation keeps its time."""
    events = [TimelineEvent(273.0, "event", "RestartingInPlace: generation 2: restarting in place after ..."),
              TimelineEvent(273.0, "event", "NodeLost: node n hosting generation 1 ...")]
    assert pod_marks(2, 0.0, 1.0, events) == (273.0, 273.0)  # both pods kept
    assert pod_marks(2, 0.0, 276.0, events) == (273.0, 276.0)  # a new pod started after the restart
    assert pod_marks(3, 366.0, 367.0, events) == (366.0, 367.0)  # a generation of new pods
    assert pod_marks(1, 0.0, 1.0, events) == (0.0, 1.0)  # another generation's restart changes nothing


# ---- the projection onto another trainer start (issue 38) ----------------------------------------------

def test_a_projection_puts_the_given_trainer_starts_in_place_and_adds_up() -> None:
    from resilax_bench.goodput_model import ProjectedGeneration, project_goodput

    # 1000 s: generation 1 from 0; a hard loss at 300, reaction at 310, pods at 315/317 on half the
    # devices; the node back, a grow-back reaction at 500 (the job trained until then), pods 502/503.
    gens = [ProjectedGeneration(1, 0.0, 0.0, 0.0, 1.0, 1.0),
            ProjectedGeneration(2, 300.0, 310.0, 315.0, 317.0, 0.5),
            ProjectedGeneration(3, 500.0, 500.0, 502.0, 503.0, 1.0)]
    p = project_goodput(1000.0, gens, [40.0, 20.0, 20.0], {"checkpoint_blocking": 10.0, "lost_steps_redone": 5.0})
    trained = [300.0 - 41.0, 500.0 - 337.0, 1000.0 - 523.0]  # 259, 163, 477 = 899
    assert p.buckets["detection"] == pytest.approx(10.0)
    assert p.buckets["waiting"] == pytest.approx(5.0 + 2.0)
    assert p.buckets["scheduling"] == pytest.approx(1.0 + 2.0 + 1.0)
    assert p.buckets["trainer_start"] == pytest.approx(80.0)
    assert p.buckets["productive"] == pytest.approx(sum(trained) - 15.0)
    assert sum(p.buckets.values()) == pytest.approx(1000.0)  # every second in one bucket
    kept = (sum(trained) - 15.0) / sum(trained)
    assert p.device_weighted_goodput == pytest.approx(
        (trained[0] + 0.5 * trained[1] + trained[2]) * kept / 1000.0)
    assert p.goodput == pytest.approx(884.0 / 1000.0)


def test_a_start_longer_than_its_generation_trains_nothing_and_bad_inputs_are_named() -> None:
    from resilax_bench.goodput_model import ProjectedGeneration, project_goodput

    gens = [ProjectedGeneration(1, 0.0, 0.0, 0.0, 0.0, 1.0), ProjectedGeneration(2, 100.0, 100.0, 101.0, 101.0, 1.0)]
    p = project_goodput(120.0, gens, [200.0, 5.0], {})
    assert p.buckets["trainer_start"] == pytest.approx(100.0 + 5.0)
    assert p.buckets["productive"] == pytest.approx(120.0 - 106.0)
    with pytest.raises(GoodputInputError, match=r"starts\[1\] must be >= 0 seconds, got -1"):
        project_goodput(120.0, gens, [1.0, -1.0], {})
    with pytest.raises(GoodputInputError, match="starts: 1 given for 2 generations"):
        project_goodput(120.0, gens, [1.0], {})


def test_the_recorded_generations_stop_at_a_hard_loss_or_at_the_reaction_and_shrink_until_grow_back() -> None:
    from resilax_bench.goodput_model import build_projected_generations

    marks = {"1": {"detected": None, "pods_created": -0.2, "pods_running": 0.1},
             "2": {"detected": 263.9, "pods_created": 263.9, "pods_running": 264.0},
             "3": {"detected": 347.2, "pods_created": 348.9, "pods_running": 349.0},
             "4": {"detected": 641.7, "pods_created": 643.2, "pods_running": 643.2}}
    faults = [{"at": 256.6, "kind": KILL}, {"at": 346.6, "kind": RESTORE}, {"at": 641.7, "kind": PREEMPT}]
    gens = build_projected_generations(marks, faults, elastic=True)
    assert [(g.stopped_previous, g.detected, g.devices_share) for g in gens] == [
        (0.0, 0.0, 1.0), (256.6, 263.9, 0.5), (347.2, 347.2, 1.0), (641.7, 641.7, 0.5)]
    assert (gens[0].pods_created, gens[0].pods_running) == (0.0, 0.1)
    assert [g.devices_share for g in build_projected_generations(marks, faults, elastic=False)] == [1.0] * 4


def test_the_projection_of_a_recorded_run_on_its_own_starts_gives_back_its_goodput() -> None:
    """The check of the accounting on the 20-minute run of 2026-12-06 (seed 1), and a faster start
    that can only raise goodput."""
    import json
    from pathlib import Path

    from resilax_bench.goodput_model import project_testbed_run

    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    testbed = json.loads((results / "goodput-20min-2026-12-06-seed1.json").read_text())
    costs = {"first_start": ("cold", 20.0), "resilax": ("restore-overlap", 3.0), "baseline": ("restore", 3.0)}
    rows = {r["variant"]: r for r in project_testbed_run(testbed, costs)}
    assert rows["resilax"]["testbed_model_goodput"] == pytest.approx(rows["resilax"]["recorded_goodput"], abs=0.01)
    assert rows["restart"]["testbed_model_goodput"] == pytest.approx(rows["restart"]["recorded_goodput"], abs=0.02)
    # The shrunk generations (about 250 s at half the devices) weigh half.
    assert rows["resilax"]["testbed_model_device_weighted_goodput"] < rows["resilax"]["testbed_model_goodput"] - 0.08
    assert rows["restart"]["device_weighted_goodput"] == rows["restart"]["goodput"]
    slower = {**costs, "resilax": ("restore", 60.0)}
    assert project_testbed_run(testbed, slower)[0]["goodput"] < rows["resilax"]["goodput"]


def test_the_spare_variant_is_projected_with_resilax_starts_at_full_size() -> None:
    """resilax-spare restarts as Resilax does (the `resilax` phase, not the baseline's) and never
    shrinks: it took the baseline's phase before (2026-12-07)."""
    import json
    from pathlib import Path

    from resilax_bench.goodput_model import project_testbed_run

    results = Path(__file__).resolve().parents[2] / "bench" / "results"
    testbed = json.loads((results / "goodput-20min-2026-12-07-43397fa-seed1.json").read_text())
    assert [v["variant"] for v in testbed["variants"]] == ["resilax-spare"]
    costs = {"first_start": ("cold", 30.0), "resilax": ("prefetch", 12.0), "baseline": ("restore", 16.0)}
    [row] = project_testbed_run(testbed, costs)
    assert (row["restart_phase"], row["restart_s"]) == ("prefetch", 12.0)
    assert row["device_weighted_goodput"] == row["goodput"]
    assert row["testbed_model_goodput"] == pytest.approx(row["recorded_goodput"], abs=0.01)


def test_the_restart_json_gives_the_phases_the_projection_uses() -> None:
    from resilax_bench.goodput_model import restart_costs

    def phase(total: float) -> dict:
        return {"parts": [{"part": "open the devices (jax.devices())", "seconds": 6.0},
                          {"part": "launch to first step done", "seconds": total}]}

    result = {"phases": {"cold": phase(50.0), "warm": phase(18.0), "restore": phase(25.0),
                         "restore-overlap": phase(21.0), "prefetch": {"skipped": "no API"}}}
    assert restart_costs(result) == {"first_start": ("cold", 50.0), "resilax": ("restore-overlap", 21.0),
                                     "baseline": ("restore", 25.0)}
    result["phases"]["prefetch"] = phase(19.0)
    assert restart_costs(result)["resilax"] == ("prefetch", 19.0)
    with pytest.raises(GoodputInputError, match="no measured phase for first_start"):
        restart_costs({"phases": {"cold": {"error": "OOM"}}})


# ---- issue 39: victims from the seed, three variants --------------------------------------------------

def test_victims_vary_with_the_seed_and_always_include_process_0() -> None:
    from resilax_bench.goodput_variants import PROCESSES, plan_victims

    plans = {seed: plan_victims(seed, 3) for seed in range(1, 9)}
    assert plans[1] == plan_victims(1, 3)  # the same seed, the same victims
    assert len(set(plans.values())) > 1, plans  # other seeds, other victims
    for plan in plans.values():
        assert len(plan) == 3 and 0 in plan and all(0 <= p < PROCESSES for p in plan), plan
    assert plan_victims(1, 0) == () and plan_victims(5, 1) == (0,) and plan_victims(2, 4, processes=1) == (0,) * 4
    with pytest.raises(GoodputInputError, match="processes"):
        plan_victims(1, 2, processes=0)


def test_the_victims_leave_the_schedule_as_it_was() -> None:
    """The victims have their own random stream: the 20-minute runs' fault times stay comparable."""
    assert build_schedule(1, 1200.0) == build_schedule(1, 1200.0)
    assert [f.at for f in build_schedule(1, 1200.0)] == [f.at for f in build_schedule(1, 1200.0)]


def test_the_three_variants_jobs_and_the_spare_one_fails_clearly_without_spares() -> None:
    from resilax_bench.goodput_variants import VARIANTS, build_variant_job, spare_problem

    assert VARIANTS == ("restart", "resilax", "resilax-spare")
    restart, shrink, spare = (build_variant_job(v, f"g-{v}", "/tmp/ckpt", 0.3)["spec"] for v in VARIANTS)
    assert restart["recovery"]["inPlace"] == "Never" and "elastic" not in restart  # explicit, whatever the default
    assert shrink["recovery"]["inPlace"] == "Auto" and "spareSlices" not in shrink["recovery"]
    assert spare["recovery"]["spareSlices"] == 1 and spare["elastic"] == shrink["elastic"]
    assert spare["checkpoint"] == shrink["checkpoint"]
    without = "spec:\n  versions:\n  - schema:\n      openAPIV3Schema:\n        properties:\n          spec:\n" \
              "            properties:\n              recovery:\n                properties:\n" \
              "                  inPlace: {type: string}\n"
    message = spare_problem(VARIANTS, without)
    assert message is not None and "spec.recovery.spareSlices" in message and "--variants restart,resilax" in message
    assert spare_problem(VARIANTS, without.replace("inPlace", "spareSlices")) is None
    assert spare_problem(("restart", "resilax"), without) is None


def test_the_harness_refuses_the_spare_variant_before_starting_anything(tmp_path, monkeypatch, capsys) -> None:
    from resilax_bench import goodput, goodput_variants

    crd = tmp_path / "crd.yaml"
    crd.write_text("spec: {versions: []}\n")
    monkeypatch.setattr(goodput_variants, "CRD_FILE", crd)
    assert goodput.main(["--variants", "resilax-spare", "--json", str(tmp_path / "out.json")]) == 2
    assert "spareSlices" in capsys.readouterr().err and not (tmp_path / "out.json").exists()
