"""`kubectl resilax timeline`, `save` and `web` apart from the API: the views of a fixed status.history
(history_fixtures.py, the agreed shape), the choice of the worker to ask for a save and what its answer
says, and the static page's HTML."""

from __future__ import annotations

import json
import re
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from history_fixtures import HISTORY, NOW, job
from resilax_operator import api
from resilax_operator.kubectl import plugin as kubectl_plugin
from resilax_operator.kubectl import timeline, timeline_page
from resilax_operator.kubectl.client import PluginError
from resilax_operator.status_fields.history import HistoryEntry


def _generations() -> list[HistoryEntry]:
    return timeline.parse_history(job())


def test_history_entries_parse_into_generations_and_odd_entries_are_left_out() -> None:
    gens = _generations()
    assert [g.generation for g in gens] == [1, 2, 3]
    first, second, current = gens
    assert timeline.shape_text(first) == "2 x 2x4 (4 hosts)" and timeline.end_kind(first) == "fault"
    assert first.lost_steps == 90 and first.checkpoints == (100, 200, 300, 400, 500)
    assert timeline.restored_text(first) == "fresh" and timeline.steps_text(first) == "1-590"
    assert timeline.restored_text(second) == "500 (persistent)" and timeline.end_kind(second) == "planned"
    assert current.end is None and timeline.end_kind(current) == "running" and current.in_place
    assert timeline.restored_text(current) == "1080 (peer)" and current.pools == ("pool-a", "pool-b")
    # The startup is scheduling + jaxStartup + restore of the generation's goodput.
    assert timeline.startup_seconds(current, NOW) == 10.0 and timeline.startup_seconds(first, NOW) == 5.0
    odd = [{"generation": "x", "start": "2026-12-04T12:00:00Z"}, {"generation": 4}, "junk",
           {"generation": 5, "start": "2026-12-04T12:29:00Z"}]
    parsed = timeline.parse_history(job(history=[*odd, HISTORY[0]]))
    assert [g.generation for g in parsed] == [1, 5]
    assert timeline.shape_text(parsed[1]) == "0 x ? (0 hosts)" and timeline.steps_text(parsed[1]) == "-"
    assert timeline.goodput_ratio(parsed[1]) is None


@pytest.mark.parametrize(("reason", "kind"), [
    ("NodeLost", "fault"), ("WorkerFailed", "fault"), ("PodLost", "fault"), ("Failed", "fault"),
    ("PreemptionNotice", "notice"), ("MaintenanceScheduled", "notice"),
    ("Completed", "planned"), ("Resized", "planned"), ("GrowBack", "planned"), ("Suspended", "planned"),
    (None, "fault"),
], ids=lambda x: str(x))
def test_each_end_reason_has_its_kind(reason: str | None, kind: str) -> None:
    g = HistoryEntry(1, NOW, "2x4", 1, 2, end=NOW + timedelta(seconds=1), end_reason=reason or "")
    assert timeline.end_kind(g) == kind


def test_the_plot_places_start_up_checkpoints_and_the_gaps_a_fault_cost() -> None:
    plot = timeline.build_plot("t", _generations(), NOW)
    one, two, three = plot.bars
    assert (one.start, one.first_step_at, one.end) == (0.0, 5.0, 600.0)
    assert (two.start, two.first_step_at, two.end) == (640.0, 650.0, 1240.0)
    assert (three.start, three.first_step_at, three.end) == (1260.0, 1270.0, 1800.0)  # runs until now
    assert plot.span == 1800.0
    # A checkpoint sits by its step on the line from the first step to the last one.
    assert two.checkpoints[-1] == (1080, 1240.0)
    assert two.checkpoints[0][1] == pytest.approx(650.0 + (600 - 501) / (1080 - 501) * 590.0)
    # Each gap runs from a generation's end to the next one's first step, named by the end's reason.
    assert plot.gaps == ((600.0, 650.0, "NodeLost"), (1240.0, 1270.0, "GrowBack"))
    assert timeline.build_plot("t", [], NOW).bars == ()


def test_the_text_gantt_has_a_row_per_generation_with_its_end_and_checkpoints() -> None:
    lines = timeline.build_gantt("team-a/llama", _generations(), NOW)
    assert lines[0] == "team-a/llama: 3 generations over 30m00s, from 2026-12-04 12:00:00Z"
    rows = [line for line in lines if re.match(r"^\s+\d\s+\d x ", line)]
    assert len(rows) == 3
    bars = [row.split("|")[1] for row in rows]
    assert all(len(bar) == timeline.GANTT_WIDTH for bar in bars)
    # The end glyphs: a fault, a planned end, still running.
    assert [bar.rstrip()[-1] for bar in bars] == ["X", "]", ">"]
    # Row 1 ends before row 2 starts (the NodeLost gap), and row 3 reaches the right edge (now).
    assert len(bars[0].rstrip()) <= len(bars[1]) - len(bars[1].lstrip())
    assert bars[2].endswith(">")
    # Every checkpoint of generation 1 is a `+` (they fall in distinct columns here).
    assert bars[0].count("+") == 5
    assert rows[0].endswith("| NodeLost after 10m00s") and rows[1].endswith("| GrowBack after 10m00s")
    assert rows[2].endswith("| running")
    assert "500 (persistent)" in rows[1] and "1080 (peer)" in rows[2] and "501-1080" in rows[1]
    notes = lines[lines.index(next(x for x in lines if "start-up" in x)) + 1:]
    assert len(notes) == 3
    assert notes[0].strip().startswith("1  X NodeLost at 12:10:00Z: node tpu-1")
    assert "(90 steps lost)" in notes[0] and "checkpoints: 100, 200, 300, 400, 500" in notes[0]
    assert "restarted in place" in notes[2]
    assert timeline.build_gantt("a/b", [], NOW) == [
        "a/b: no history yet (status.history is filled by the operator from its first generation on)"]


@pytest.mark.parametrize(("start", "first_at", "end", "kind", "saves", "row"), [
    (0, 0, 9, "running", (), "=========>"),
    (0, 3, 9, "fault", (), "...======X"),
    (2, 2, 5, "planned", ((7, 4.0),), "  ==+]    "),
    (5, 5, 9, "notice", (), "     ====!"),
], ids=["running", "startup-fault", "checkpoint-planned", "notice"])
def test_a_bar_row(start: float, first_at: float, end: float, kind: str, saves: tuple[tuple[int, float], ...],
                   row: str) -> None:
    bar = timeline.Bar(1, "", start, first_at, end, kind, None, "", None, None, "fresh", saves)
    assert timeline.build_bar_row(bar, span=10.0, width=10) == row


JOB_UID = "0b6c2f0e-1111-4c1e-9d53-6f4b8f3f0a01"


def _pod(name: str, process: str, phase: str = "Running", ip: str | None = "240.1.1.2", port: int | None = 8490,
         deleting: bool = False, owner: str | None = JOB_UID, generation: str = "3") -> dict[str, Any]:
    sidecar: dict[str, Any] = {"name": api.SIDECAR_CONTAINER,
                               "ports": [] if port is None else [{"name": "sidecar", "containerPort": port}]}
    meta: dict[str, Any] = {"name": name, "labels": {api.LABEL_PROCESS: process, api.LABEL_GENERATION: generation,
                                                     api.LABEL_JOB: "llama"}}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": api.API_VERSION, "kind": api.KIND, "name": "llama", "uid": owner,
                                    "controller": True}]
    if deleting:
        meta["deletionTimestamp"] = "2026-12-04T12:00:00Z"
    return {"metadata": meta, "spec": {"initContainers": [sidecar], "containers": [{"name": "trainer"}]},
            "status": {"phase": phase, **({"podIP": ip} if ip else {})}}


@pytest.mark.parametrize(("pods", "expected"), [
    ([_pod("w-1", "1"), _pod("w-0", "0")], ("w-0", 8490)),
    ([_pod("w-0", "0", phase="Pending"), _pod("w-1", "1", port=8500)], ("w-1", 8500)),
    ([_pod("w-0", "0", ip=None), _pod("w-1", "1")], ("w-1", 8490)),
    ([_pod("w-0", "0", deleting=True), _pod("w-1", "1")], ("w-1", 8490)),
    ([_pod("w-0", "0", port=None), _pod("w-1", "1")], ("w-1", 8490)),
    ([_pod("squat-0", "0", owner=None), _pod("w-1", "1")], ("w-1", 8490)),
    ([_pod("squat-0", "0", owner="another-uid"), _pod("w-1", "1")], ("w-1", 8490)),
    ([_pod("old-0", "0", generation="2"), _pod("w-1", "1")], ("w-1", 8490)),
], ids=["process-0-first", "running-only", "with-an-ip", "not-deleting", "with-a-sidecar-port",
        "a-squatter-with-the-labels", "another-jobs-pod", "another-generation"])
def test_the_save_goes_to_a_running_worker_with_a_sidecar(pods: list[dict[str, Any]], expected: tuple[str, int]) -> None:
    assert kubectl_plugin.plan_save_target("team-a/llama", 3, pods, JOB_UID) == expected


def test_no_worker_to_ask_is_an_error_naming_the_generation() -> None:
    with pytest.raises(PluginError, match=r"team-a/llama: no running worker of generation 3 .* \(1 pods"):
        kubectl_plugin.plan_save_target("team-a/llama", 3, [_pod("w-0", "0", phase="Pending")], JOB_UID)
    with pytest.raises(PluginError, match=r"only a pod the job owns, uid " + JOB_UID):
        kubectl_plugin.plan_save_target("team-a/llama", 3, [_pod("squat-0", "0", owner=None)], JOB_UID)


@pytest.mark.parametrize(("outcome", "before", "expected"), [
    ({"status": "pending"}, 10, (False, "")),
    ({"status": "committed", "step": 42, "persisted": True}, 40,
     (True, "jaxjob a/b: step 42 committed, persisted; the newest saved step was 40")),
    ({"status": "committed", "step": 42, "persisted": False}, None,
     (True, "jaxjob a/b: step 42 committed, in the local tier (the upload follows); the newest saved step was none")),
    ({"status": "committed", "step": 40, "persisted": True}, 40,
     (True, "jaxjob a/b: step 40 committed, persisted; the newest saved step was 40 (no newer step to save)")),
], ids=["pending", "newer", "local-first", "same-step"])
def test_what_the_save_outcome_says(outcome: dict[str, Any], before: int | None, expected: tuple[bool, str]) -> None:
    assert kubectl_plugin.describe_save("a/b", outcome, before) == expected


def test_a_failed_save_is_an_error_with_the_trainers_reason() -> None:
    with pytest.raises(PluginError, match="the save failed: disk full"):
        kubectl_plugin.describe_save("a/b", {"status": "failed", "error": "disk full"}, 3)


def test_the_page_embeds_every_jobs_bars_and_no_string_can_close_its_script() -> None:
    jobs = [job(), job(name="empty", history=[], phase="Pending"),
            job(name="</script><b>x", namespace="team-b", history=HISTORY[:1])]
    data = timeline_page.build_page_data(jobs, NOW)
    assert [j["job"] for j in data["jobs"]] == ["team-a/empty", "team-a/llama", "team-b/</script><b>x"]
    llama = data["jobs"][1]
    assert [g["generation"] for g in llama["generations"]] == [1, 2, 3] and llama["span"] == 1800.0
    page = timeline_page.build_page(data)
    assert page.count("</script>") == 2  # the data's and the code's own, none from a name
    embedded = page.split('id="timeline-data">', 1)[1].split("</script>", 1)[0]
    assert json.loads(embedded) == json.loads(json.dumps(data))


def test_completion_of_a_file_argument_lets_the_shell_offer_files(capsys: pytest.CaptureFixture[str]) -> None:
    assert kubectl_plugin.plan_completion(["timeline", "llama", "--png", ""]) == ("file", "", {})
    assert kubectl_plugin.plan_completion(["web", ""]) == ("file", "", {})
    assert kubectl_plugin.complete_main(["web", "x"]) == 0
    assert capsys.readouterr().out.splitlines() == [":0"]


@pytest.mark.parametrize("argv", [["status", "llama", "--png", "x.png"], ["timeline", "llama", "-A"]],
                         ids=["png-without-timeline", "all-namespaces-without-web"])
def test_options_of_another_command_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as e:
        kubectl_plugin.parse_args(argv)
    assert e.value.code == 2


def test_without_matplotlib_the_png_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from resilax_operator.kubectl import timeline_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the extra sees
    with pytest.raises(timeline_plot.MissingPlotExtraError, match=r"pip install 'resilax\[plot\]'"):
        timeline_plot.render_png(timeline.build_plot("t", _generations(), NOW), tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


@pytest.mark.slow  # matplotlib's first import builds its font cache
def test_the_png_is_drawn(tmp_path: Path) -> None:
    from resilax_operator.kubectl import timeline_plot

    path = tmp_path / "t.png"
    timeline_plot.render_png(timeline.build_plot("JAXJob team-a/llama", _generations(), NOW), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
