"""The demo's story from recorded events and loss lines (pure; no cluster, no clock)."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import resilax_local
from resilax_local.demo.timeline import (
    Fault,
    GenerationSummary,
    JobSnapshot,
    LossRecord,
    PlotSpan,
    TimelineEvent,
    Transition,
    build_generations,
    build_plot_data,
    build_timeline,
    build_transitions,
    check_loss_continuity,
    collapse_checkpoints,
    describe_pause,
    merge_loss_records,
    parse_event,
    parse_loss_lines,
    parse_snapshot,
    parse_timestamp,
    plan_snapshot_events,
    step_at,
)

T0 = 1_000_000.0


def rec(step: int, gen: int, t: float, loss: float | None = None, devices: int = 8) -> LossRecord:
    return LossRecord(step=step, loss=1.0 / step if loss is None else loss, generation=gen, devices=devices,
                      time=T0 + t)


def story() -> tuple[list[LossRecord], list[Fault]]:
    """Generation 1 (8 devices) trains 1-27 and loses a node at +40 s; generation 2 (4 devices) restores
    step 20 and trains 21-120; the node returns at +80 s; generation 3 (8 devices) restores 120 after a
    final save and finishes at 200."""
    g1 = [rec(s, 1, 30 + s * 0.3) for s in range(1, 28)]
    g2 = [rec(s, 2, 75 + (s - 21) * 0.3, devices=4) for s in range(21, 121)]
    g3 = [rec(s, 3, 150 + (s - 121) * 0.3) for s in range(121, 201)]
    faults = [Fault(T0 + 40, "kill-node", "tpu-slice-1-h1"), Fault(T0 + 80, "restore-node", "tpu-slice-1-h1")]
    return g1 + g2 + g3, faults


# ---- parsing -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "want"), [
    pytest.param('{"step": 3, "loss": 0.5, "generation": 1, "devices": 8, "time": 12.5}\n',
                 [LossRecord(3, 0.5, 1, 8, 12.5)], id="one-line"),
    pytest.param("INFO starting\n{not json\n"
                 '{"step": 1, "loss": 1, "generation": 0, "devices": 4, "time": 1}\n'
                 '{"step": 2, "loss": 1}\n[1, 2]\n{"step": "x", "loss": 1, "generation": 0, "devices": 4, "time": 1}\n',
                 [LossRecord(1, 1.0, 0, 4, 1.0)], id="noise-and-partial-records-skipped"),
    pytest.param("", [], id="empty"),
])
def test_parse_loss_lines(text: str, want: list[LossRecord]) -> None:
    assert parse_loss_lines(text) == want


def test_merge_keeps_one_record_per_generation_and_step_in_time_order() -> None:
    a, b, c = rec(2, 1, 2.0), rec(1, 1, 1.0), rec(2, 2, 5.0, loss=9)
    assert merge_loss_records([a, b, a, c, rec(2, 1, 7.0)]) == [b, a, c]


@pytest.mark.parametrize(("value", "want"), [
    ("1970-01-01T00:00:10Z", 10.0),
    ("1970-01-01T00:00:10.250000Z", 10.25),
    ("1970-01-01T01:00:00+01:00", 0.0),
    ("", None), (None, None), ("yesterday", None),
])
def test_parse_timestamp(value: str | None, want: float | None) -> None:
    assert parse_timestamp(value) == want


FULL_STATUS = {
    "phase": "Running", "generation": 2, "shape": {"topology": "2x4", "count": 1, "hosts": 2},
    "checkpoint": {"step": 20, "committed": True, "tier": "persistent"}, "restoreStep": 20, "restarts": 1,
    "transition": {"kind": "NodeLoss"},
    "conditions": [{"type": "Degraded", "message": "x"}, {"type": "Ready", "reason": "WorkersRunning",
                                                            "message": "2 workers running"}],
}


@pytest.mark.parametrize(("body", "want"), [
    pytest.param({}, JobSnapshot(time=5.0, phase="-"), id="no-status-yet"),
    pytest.param({"status": FULL_STATUS},
                 JobSnapshot(time=5.0, phase="Running", generation=2, topology="2x4", count=1, hosts=2,
                             checkpoint_step=20, checkpoint_tier="persistent", restore_step=20, restarts=1,
                             transition="NodeLoss", message="2 workers running"), id="full"),
    pytest.param({"status": {"phase": "Saving", "checkpoint": {"step": 30, "committed": False}}},
                 JobSnapshot(time=5.0, phase="Saving"), id="uncommitted-step-not-shown"),
])
def test_parse_snapshot(body: dict, want: JobSnapshot) -> None:
    assert parse_snapshot(5.0, body) == want


@pytest.mark.parametrize(("body", "want"), [
    pytest.param({"reason": "NodeLost", "type": "Warning", "message": "node  tpu-slice-1-h1\nUnknown",
                  "lastTimestamp": "1970-01-01T00:00:10Z"},
                 TimelineEvent(10.0, "warning", "NodeLost: node tpu-slice-1-h1 Unknown"), id="warning"),
    pytest.param({"reason": "GenerationCreated", "type": "Normal", "eventTime": "1970-01-01T00:00:11.5Z",
                  "lastTimestamp": None}, TimelineEvent(11.5, "event", "GenerationCreated"), id="event-time"),
    pytest.param({"reason": "X", "metadata": {"creationTimestamp": "1970-01-01T00:00:12Z"}},
                 TimelineEvent(12.0, "event", "X"), id="creation-time-fallback"),
    pytest.param({"reason": "X"}, None, id="no-time"),
])
def test_parse_event(body: dict, want: TimelineEvent | None) -> None:
    assert parse_event(body) == want


# ---- snapshots to events -------------------------------------------------------------------------

RUN1 = JobSnapshot(time=1.0, phase="Running", generation=1, topology="2x4", count=2, hosts=4, checkpoint_step=10)


@pytest.mark.parametrize(("prev", "cur", "want"), [
    pytest.param(None, JobSnapshot(time=1.0, phase="Pending"), ["phase - -> Pending"], id="first"),
    pytest.param(None, JobSnapshot(time=1.0, phase="-"), [], id="no-status-yet"),
    pytest.param(JobSnapshot(time=0.0, phase="Pending"), RUN1,
                 ["phase Pending -> Running", "generation generation 1: 2 x 2x4, 4 hosts",
                  "checkpoint step 10 committed"], id="first-generation"),
    pytest.param(None, JobSnapshot(time=1.0, phase="Pending", generation=1, count=1, topology="2x4", restore_step=0),
                 ["phase - -> Pending", "generation generation 1: 1 x 2x4, from scratch"], id="restore-none"),
    pytest.param(RUN1, JobSnapshot(time=2.0, phase="Recovering", generation=1, topology="2x4", count=2, hosts=4,
                                   checkpoint_step=10, transition="NodeLoss"),
                 ["phase Running -> Recovering (NodeLoss)"], id="recovering-says-why"),
    pytest.param(RUN1, JobSnapshot(time=2.0, phase="Running", generation=2, topology="2x4", count=1, hosts=2,
                                   checkpoint_step=20, checkpoint_tier="persistent", restore_step=20,
                                   transition="NodeLoss"),
                 ["generation generation 2: 1 x 2x4, 2 hosts, restore step 20",
                  "checkpoint step 20 committed (persistent)"], id="new-generation-restores"),
    pytest.param(RUN1, RUN1, [], id="nothing-changed"),
    pytest.param(RUN1, JobSnapshot(time=2.0, phase="Running", generation=1, topology="2x4", count=1,
                                   checkpoint_step=10), ["shape shape 1 x 2x4"], id="shape-without-generation"),
])
def test_plan_snapshot_events(prev: JobSnapshot | None, cur: JobSnapshot, want: list[str]) -> None:
    assert [f"{e.kind} {e.text}" for e in plan_snapshot_events(prev, cur)] == want


# ---- generations, transitions, steps lost --------------------------------------------------------

def test_generations_from_the_loss_lines() -> None:
    records, _ = story()
    assert [(g.generation, g.devices, g.first_step, g.last_step, g.restored_step)
            for g in build_generations(records)] == [(1, 8, 1, 27, 0), (2, 4, 21, 120, 20), (3, 8, 121, 200, 120)]


def gen(n: int, first: int, last: int, t0: float, t1: float, devices: int = 8) -> GenerationSummary:
    return GenerationSummary(n, devices, first, last, T0 + t0, T0 + t1)


KILL = Fault(T0 + 40, "kill-node", "n1")
BACK = Fault(T0 + 80, "restore-node", "n1")


@pytest.mark.parametrize(("before", "after", "faults", "lost", "cause", "pause"), [
    pytest.param(gen(1, 1, 27, 30, 38), gen(2, 21, 120, 75, 105), [KILL, BACK], 7, KILL, 35.0,
                 id="hard-loss-repeats-steps-since-the-last-checkpoint"),
    pytest.param(gen(2, 21, 120, 75, 105), gen(3, 121, 200, 150, 174), [KILL, BACK], 0, BACK, 70.0,
                 id="grow-back-after-a-final-save-loses-nothing"),
    pytest.param(gen(1, 1, 27, 30, 38), gen(2, 28, 40, 50, 60), [], 0, None, 12.0,
                 id="no-fault-pause-from-the-last-step"),
    pytest.param(gen(1, 1, 27, 30, 38), gen(2, 1, 40, 50, 60), [KILL], 27, KILL, 10.0,
                 id="no-checkpoint-restarts-from-scratch"),
])
def test_transitions(before: GenerationSummary, after: GenerationSummary, faults: list[Fault], lost: int,
                     cause: Fault | None, pause: float) -> None:
    (t,) = build_transitions([before, after], faults)
    assert t == Transition(before, after, cause)
    assert t.steps_lost == lost
    assert t.pause_seconds == pytest.approx(pause)


def test_transition_cause_is_the_newest_fault_in_between() -> None:
    early = Fault(T0 + 35, "kill-node", "a")
    (t,) = build_transitions([gen(1, 1, 27, 30, 38), gen(2, 21, 40, 75, 80)], [early, KILL, BACK])
    assert t.cause == KILL


@pytest.mark.parametrize(("records", "missing", "recomputed", "mismatched", "ok"), [
    pytest.param(story()[0], (), tuple(range(21, 28)), (), True, id="story-continuous"),
    pytest.param([rec(1, 1, 1), rec(2, 1, 2), rec(4, 2, 5)], (3,), (), (), False, id="gap"),
    pytest.param([rec(1, 1, 1), rec(2, 1, 2, loss=0.5), rec(2, 2, 5, loss=0.5003)], (), (2,), (), True,
                 id="reshard-rounding-tolerated"),
    pytest.param([rec(1, 1, 1), rec(2, 1, 2, loss=0.5), rec(2, 2, 5, loss=0.7)], (), (2,), (2,), False,
                 id="different-loss-after-restore"),
    pytest.param([], (), (), (), True, id="nothing"),
])
def test_loss_continuity(records: list[LossRecord], missing: tuple[int, ...], recomputed: tuple[int, ...],
                         mismatched: tuple[int, ...], ok: bool) -> None:
    c = check_loss_continuity(records)
    assert c.missing_steps == missing
    assert c.recomputed_steps == recomputed
    assert tuple(m[0] for m in c.mismatches) == mismatched
    assert c.ok is ok


# ---- plot data -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("t", "want"), [(0.0, 0.0), (40.0, 27.0), (80.0, 37.0), (1000.0, 200.0)])
def test_step_at(t: float, want: float) -> None:
    records, _ = story()
    assert step_at(records, T0 + t) == want


def test_plot_data_one_series_per_generation_and_a_marker_per_fault() -> None:
    records, faults = story()
    data = build_plot_data(records, faults, start=T0)
    assert [(s.generation, s.devices, s.steps[0], s.steps[-1], len(s.losses)) for s in data.series] == [
        (1, 8, 1, 27, 27), (2, 4, 21, 120, 100), (3, 8, 121, 200, 80)]
    assert data.series[1].times[0] == pytest.approx(75.0)
    assert [(m.time, m.step, m.label) for m in data.markers] == [
        (40.0, 27.0, "kill-node tpu-slice-1-h1"), (80.0, 37.0, "restore-node tpu-slice-1-h1")]


def test_plot_spans_are_the_pauses_between_generations() -> None:
    records, faults = story()
    data = build_plot_data(records, faults, start=T0)
    assert data.spans == (
        PlotSpan(40.0, 75.0, 20, "35 s, 8->4 devices, 7 steps lost"),
        PlotSpan(80.0, 150.0, 120, "70 s, 4->8 devices, 0 steps lost"),
    )


def ev(t: float, kind: str, text: str) -> TimelineEvent:
    return TimelineEvent(T0 + t, kind, text)


@pytest.mark.parametrize(("events", "want"), [
    pytest.param([ev(1, "checkpoint", "step 10 committed (persistent)"),
                  ev(2, "checkpoint", "step 20 committed (persistent)"),
                  ev(3, "checkpoint", "step 30 committed (persistent)"), ev(4, "phase", "x"),
                  ev(5, "checkpoint", "step 40 committed")],
                 ["+1.0 checkpoint steps 10 to 30 committed (persistent): 3 checkpoints seen, the last at +3.0s",
                  "+4.0 phase x", "+5.0 checkpoint step 40 committed"], id="a-run-of-three"),
    pytest.param([ev(1, "checkpoint", "step 10 committed"), ev(2, "checkpoint", "step 20 committed")],
                 ["+1.0 checkpoint step 10 committed", "+2.0 checkpoint step 20 committed"], id="two-kept"),
    pytest.param([], [], id="empty"),
])
def test_collapse_checkpoints(events: list[TimelineEvent], want: list[str]) -> None:
    assert [f"{e.time - T0:+.1f} {e.kind} {e.text}" for e in collapse_checkpoints(events, T0)] == want


@pytest.mark.parametrize(("events", "want"), [
    pytest.param([ev(20, "phase", "Pending -> Running"), ev(61, "phase", "Running -> Recovering"),
                  ev(70, "generation", "generation 2: 1 x 2x4")],
                 "operator reacted after 21.0 s, new generation created 9.0 s later (old one torn down), "
                 "its first step 5.0 s after that (pods started, JAX start-up, restore)", id="split"),
    pytest.param([ev(20, "phase", "Running -> Recovering")], "", id="no-generation-event"),
    pytest.param([ev(45, "generation", "generation 2: 1 x 2x4"), ev(61, "phase", "Running -> Saving")], "",
                 id="created-before-any-reaction-is-not-split"),
])
def test_describe_pause(events: list[TimelineEvent], want: str) -> None:
    t = Transition(gen(1, 1, 27, 30, 38), gen(2, 21, 40, 75, 80), KILL)
    assert describe_pause(t, events) == want


# ---- the text ------------------------------------------------------------------------------------

def test_timeline_tells_the_whole_story_in_time_order() -> None:
    records, faults = story()
    snapshots = [
        JobSnapshot(T0 + 2, "Pending"),
        JobSnapshot(T0 + 20, "Running", 1, "2x4", 2, 4),
        JobSnapshot(T0 + 37, "Running", 1, "2x4", 2, 4, checkpoint_step=20),
        JobSnapshot(T0 + 60, "Recovering", 1, "2x4", 2, 4, checkpoint_step=20, transition="NodeLoss"),
        JobSnapshot(T0 + 70, "Running", 2, "2x4", 1, 2, checkpoint_step=20, restore_step=20, restarts=1),
        JobSnapshot(T0 + 150, "Running", 3, "2x4", 2, 4, checkpoint_step=120, restore_step=120, restarts=2),
        JobSnapshot(T0 + 180, "Succeeded", 3, "2x4", 2, 4, checkpoint_step=200, restore_step=120, restarts=2),
    ]
    events = [TimelineEvent(T0 + 58, "warning", "NodeLost: tpu-slice-1-h1 Unknown")]
    lines = build_timeline(T0, snapshots, faults, records, events=events)
    text = "\n".join(lines)
    body = lines[1:lines.index("")]
    times = [float(line.split("s", 1)[0]) for line in body]
    assert times == sorted(times)
    for expected in [
        "+40.0s  fault      kill-node tpu-slice-1-h1",
        "+58.0s  warning    NodeLost: tpu-slice-1-h1 Unknown",
        "+60.0s  phase      Running -> Recovering (NodeLoss)",
        "+70.0s  generation generation 2: 1 x 2x4, 2 hosts, restore step 20",
        "+75.0s  train      generation 2 first step 21 on 4 devices (restored step 20)",
        "+180.0s  phase      Running -> Succeeded",
        "generation 1 -> 2 (kill-node tpu-slice-1-h1 at +40.0s): 8 -> 4 devices, last step 27, restored 20, "
        "steps lost 7, next step after 35.0 s",
        "generation 2 -> 3 (restore-node tpu-slice-1-h1 at +80.0s): 4 -> 8 devices, last step 120, restored 120, "
        "steps lost 0, next step after 70.0 s",
        "steps 1-200: 0 missing, 7 trained again after a restore, 0 with a different loss the second time "
        "-> one continuous curve",
    ]:
        assert expected in text, expected


def test_timeline_with_nothing_recorded() -> None:
    lines = build_timeline(T0, [], [], [])
    assert "  none" in lines and "  no steps logged" in lines


def test_timeline_names_missing_steps() -> None:
    lines = build_timeline(T0, [], [], [rec(1, 1, 1), rec(4, 1, 2), rec(5, 1, 3), rec(7, 1, 4)])
    assert "  missing: 2-3, 6" in lines


# ---- purity --------------------------------------------------------------------------------------

def test_timeline_module_is_pure() -> None:
    path = Path(resilax_local.__file__).parent / "demo" / "timeline.py"
    tree = ast.parse(path.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"time", "os", "subprocess", "kopf", "kubernetes", "matplotlib", "resilax_local.cluster",
                           "resilax_local.node", "..cluster", "..node"}
    text = path.read_text()
    for call in ("time.time(", "datetime.now(", "open(", ".read_text(", ".write_text(", "os.environ"):
        assert call not in text, call


def test_loss_lines_of_the_example_match_the_parser() -> None:
    """examples/train.py prints exactly the keys the parser needs."""
    source = (Path(__file__).resolve().parents[2] / "examples" / "train.py").read_text()
    for key in ("step", "loss", "generation", "devices", "time"):
        assert f'"{key}"' in source
    assert json.loads('{"step": 1, "loss": 0.1, "generation": 0, "devices": 8, "time": 1.0}')


def test_timeline_ends_with_the_operators_goodput_account() -> None:
    goodput = {"ratio": 0.75, "wallSeconds": 200.0, "lostSteps": 7, "asOf": "2026-12-04T09:00:00Z",
               "breakdown": {"productive": 150.0, "checkpointBlocking": 2.0, "lostStepsRedone": 3.5, "detection": 20.0,
                             "hang": 0.0, "teardown": 5.0, "scheduling": 4.0, "jaxStartup": 12.0, "restore": 2.5, "other": 1.0}}
    lines = build_timeline(T0, [], [], [], goodput=goodput)
    section = lines[lines.index("Goodput (the operator's account: status.goodput)") + 1:]
    assert section[0] == ("  goodput 75.0% of 200 s since the first generation was created "
                          "(as of 2026-12-04T09:00:00Z; 7 steps trained again)")
    assert "    detection                          20.0 s   10.0%" in section
    assert "    productive (steps that count)     150.0 s   75.0%" in section
    assert len(section) == 11
    assert build_timeline(T0, [], [], [])[-1].startswith("  not reported")
