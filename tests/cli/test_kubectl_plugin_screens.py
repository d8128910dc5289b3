"""The kubectl plugin's screens, from JAXJob bodies as the operator writes them (no cluster)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.kubectl import plugin as kubectl_plugin
from resilax_operator.status_fields import goodput as gp

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


def _job(**status: object) -> dict[str, object]:
    return {"apiVersion": f"{api.GROUP}/{api.VERSION}", "kind": api.KIND,
            "metadata": {"name": "llama", "namespace": "team-a"}, "spec": {}, "status": status}


def _goodput() -> dict[str, object]:
    ledger = gp.advance(None, gp.GenerationMarks(1, created=0.0, running=2.0, first_step=1, first_step_time=5.0,
                                                 last_step=11, last_step_time=15.0), start=0.0)
    return st.build_goodput(st.GoodputRecord(ledger, datetime.fromtimestamp(20, UTC)))


def test_status_screen_shows_phase_generation_shape_steps_goodput_and_last_fault() -> None:
    job = _job(phase="Running", generation=3, shape={"topology": "2x4", "count": 2, "hosts": 4},
               generationStartTime=st.format_time(NOW - timedelta(minutes=7, seconds=3)),
               checkpoint={"step": 10, "time": st.format_time(NOW - timedelta(seconds=42)), "committed": True,
                           "tier": "persistent"},
               goodput=_goodput(), restarts=2,
               conditions=[{"type": "Ready", "status": "True", "reason": "Running", "message": ""}])
    events = [
        {"type": "Normal", "reason": "GenerationCreated", "message": "generation 3",
         "lastTimestamp": "2026-12-04T11:55:00Z"},
        {"type": "Warning", "reason": "NodeLost", "message": "node tpu-1 is Unknown",
         "lastTimestamp": "2026-12-04T11:50:00Z"},
        {"type": "Warning", "reason": "PreemptionNotice", "message": "older", "lastTimestamp": "2026-12-04T10:00:00Z"},
    ]
    screen = kubectl_plugin.build_status_screen(job, events, NOW)
    lines = dict(line.split(":", 1) for line in screen.splitlines())
    assert lines["JAXJob"].strip() == "team-a/llama"
    assert lines["Phase"].strip() == "Running"
    assert lines["Generation"].strip() == "3 (started 7m3s ago)"
    assert lines["Shape"].strip() == "2 x 2x4 (4 hosts)"
    # The step the trainer reached (the goodput ledger's last step), as of the goodput's asOf.
    assert lines["Step"].strip() == f"11 (as of {kubectl_plugin._age(datetime.fromtimestamp(20, UTC), NOW)} ago)"
    assert lines["Saved step"].strip() == "10 (persistent, 42s ago)"
    assert lines["Goodput"].strip() == "55.0% of 20 s"
    assert lines["Restarts"].strip() == "2"
    assert lines["Last fault"].strip().startswith("NodeLost at 2026-12-04T11:50:00Z")
    assert lines["Conditions"].strip() == "Ready (Running)"


def test_a_transition_in_progress_is_the_last_fault_and_a_new_job_shows_dashes() -> None:
    moving = _job(phase="Recovering", generation=1,
                  transition={"kind": "NodeLoss", "generation": 1, "message": "node tpu-1 lost"})
    assert kubectl_plugin.last_fault(moving["status"], []) == "NodeLoss (in progress, generation 1): node tpu-1 lost"  # type: ignore[arg-type]
    # After its final save a rollback goes on in place: no transition left, and none of its Events is a Warning.
    in_place = _job(phase="Recovering", generation=2,
                    inPlace={"kind": "Rollback", "from": 1, "generation": 2, "phase": "Stopping",
                             "message": "restore.step 8: generation 1 saves, generation 2 restores 8"})
    events = [{"type": "Warning", "reason": "NodeLost", "message": "old", "lastTimestamp": "2026-12-04T10:00:00Z"}]
    assert kubectl_plugin.last_fault(in_place["status"], events) == (  # type: ignore[arg-type]
        "Rollback (in progress in place, generation 1 -> 2): restore.step 8: generation 1 saves, generation 2 restores 8")
    screen = kubectl_plugin.build_status_screen(_job(), [], NOW)
    assert "Phase:      Pending" in screen and "Saved step: none" in screen and "Last fault: none" in screen
    suspended = _job(phase="Running", generation=1)
    suspended["spec"] = {"suspend": True}
    assert "Running (suspend requested)" in kubectl_plugin.build_status_screen(suspended, [], NOW)


def test_goodput_screen_lists_every_bucket_with_its_share() -> None:
    screen = kubectl_plugin.build_goodput_screen(_job(goodput=_goodput()))
    assert screen.splitlines()[0].startswith("team-a/llama: goodput 55.0% of 20 s wall time")
    rows = {line.split()[0]: line.split()[1:] for line in screen.splitlines()[2:]}
    assert set(rows) == set(st.BREAKDOWN_KEYS.values())
    assert rows["productive"] == ["11.0", "55.0%"]
    assert rows["scheduling"] == ["2.0", "10.0%"]
    assert "no goodput yet" in kubectl_plugin.build_goodput_screen(_job())
    shrunk = _job(goodput={**_goodput(), "deviceRatio": 0.4125})  # issue 26 item 5: both figures shown
    assert kubectl_plugin.build_goodput_screen(shrunk).splitlines()[0].startswith(
        "team-a/llama: goodput 55.0% of 20 s wall time, 41.2% device-weighted (as of")


@pytest.mark.parametrize(("suspend", "value"), [(True, True), (False, False)], ids=["suspend", "resume"])
def test_suspend_and_resume_patch_spec_suspend_only(suspend: bool, value: bool) -> None:
    assert kubectl_plugin.build_suspend_patch(suspend) == {"spec": {"suspend": value}}


def test_resilax_job_dispatches_to_the_plugin() -> None:
    from resilax_operator import cli

    assert cli.SUBCOMMANDS["job"][0] == "resilax_operator.kubectl.plugin:main"
    with pytest.raises(SystemExit) as e:
        kubectl_plugin.parse_args(["frobnicate", "llama"])
    assert e.value.code == 2


@pytest.mark.parametrize(("words", "expected"), [
    ([""], ("command", "", {})),
    (["st"], ("command", "st", {})),
    (["status", ""], ("job", "", {})),
    (["status", "-n", "team-a", "ll"], ("job", "ll", {"-n": "team-a"})),
    (["--namespace=team-a", "goodput", ""], ("job", "", {"--namespace": "team-a"})),
    (["status", "-n", ""], ("namespace", "", {})),
    (["status", "--context", ""], ("none", "", {})),
    (["status", "llama", ""], ("none", "", {})),
    (["status", "--"], ("none", "--", {})),
], ids=["nothing", "a-command", "a-job", "a-job-in-ns", "ns-first", "a-namespace", "a-context", "done", "a-flag"])
def test_completion_plans_what_follows(words: list[str], expected: tuple[str, str, dict[str, str]]) -> None:
    assert kubectl_plugin.plan_completion(words) == expected


def test_completion_of_commands_prints_cobras_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    assert kubectl_plugin.complete_main(["s"]) == 0
    assert capsys.readouterr().out.splitlines() == ["status", "save", "suspend", ":4"]


def test_output_documents_round_trip_and_the_list_table() -> None:
    """`-o json|yaml` (kubectl/output.py): each read command's document parses back equal; `list` without
    -A leaves out the namespace column; a control character from the cluster stays escaped."""
    import json

    import yaml
    from resilax_operator.kubectl import output as out

    job = {"metadata": {"namespace": "ml", "name": "llama", "uid": "u1"}, "spec": {"suspend": False},
           "status": {"phase": "Running", "generation": 3, "shape": {"topology": "2x4", "count": 2, "hosts": 4},
                      "checkpoint": {"step": 40}, "goodput": {"ratio": 0.9}, "history": [{"generation": 3}],
                      "lastValidSpec": {"generation": 1, "spec": {}}}}
    docs = [out.build_status_data(job, "NodeLoss \x1b[31m"), out.build_goodput_data(job), out.build_timeline_data(job),
            out.build_list_data([job]), out.build_version_data()]
    for doc in docs:
        assert json.loads(out.render(doc, "json")) == doc
        assert yaml.safe_load(out.render(doc, "yaml")) == doc
    assert "\x1b" not in out.render(docs[0], "json") and "\x1b" not in out.render(docs[0], "yaml")
    assert "lastValidSpec" not in docs[0]["status"]
    assert docs[3]["items"][0] == {"namespace": "ml", "name": "llama", "uid": "u1", "phase": "Running", "generation": 3,
                                   "count": 2, "topology": "2x4", "savedStep": 40, "goodput": 0.9, "created": None}
    assert out.build_list_screen([job], all_namespaces=False).splitlines() == [
        "NAME    PHASE     GENERATION   SHAPE     SAVED   GOODPUT", "llama   Running   3            2 x 2x4   40      90.0%"]
    assert out.build_list_screen([job], all_namespaces=True).startswith("NAMESPACE")
    assert out.build_list_screen([], all_namespaces=True) == "No JAXJobs found."


@pytest.mark.parametrize("argv", [["list", "llama"], ["status"], ["save", "llama", "-o", "json"],
                                  ["status", "llama", "-A"], ["version", "-o", "xml"]],
                         ids=["list-with-name", "status-without-name", "output-on-a-write", "A-on-status", "bad-format"])
def test_bad_plugin_arguments_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        kubectl_plugin.parse_args(argv)
    assert info.value.code == 2 and "kubectl resilax" in capsys.readouterr().err


def test_status_screen_names_the_nodes_kept_out_after_a_failed_health_check() -> None:
    job = _job(phase="Running", generation=2, unhealthyNodes=[
        {"node": "tpu-slice-0-h1", "part": "matmul", "reason": "wrong checksum", "failures": 2,
         "lastFailureTime": "2026-12-04T11:58:00Z", "generation": 2, "pod": "llama-g2-s0-h1"}])
    lines = dict(line.split(":", 1) for line in kubectl_plugin.build_status_screen(job, [], NOW).splitlines())
    assert lines["Kept out"].strip() == "tpu-slice-0-h1 (matmul, 2x)"
    assert "Kept out" not in kubectl_plugin.build_status_screen(_job(), [], NOW)


def test_logs_picks_process_n_of_the_newest_generation_the_job_owns() -> None:
    from resilax_operator.kubectl.logs import plan_log_pod

    def pod(name: str, generation: int, process: int, owner: str = "u1", deleting: bool = False) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": name, "uid": f"uid-{name}", "ownerReferences": [
            {"uid": owner, "controller": True, "kind": "JAXJob", "apiVersion": "resilax.dev/v1alpha1", "name": "j"}],
            "labels": {api.LABEL_PROCESS: str(process), api.LABEL_GENERATION: str(generation)}}
        if deleting:
            meta["deletionTimestamp"] = "2026-12-06T00:00:00Z"
        return {"metadata": meta, "spec": {"containers": [{"name": "resilax-sidecar"}, {"name": "trainer"}]}}

    pods = [pod("j-g1-s0-h0", 1, 0), pod("j-g2-s0-h0", 2, 0), pod("j-g2-s0-h1", 2, 1), pod("x-g3-s0-h0", 3, 0, "other"),
            pod("j-g3-s0-h0", 3, 0, deleting=True)]
    assert plan_log_pod(pods, 0, "u1") == ("j-g2-s0-h0", "uid-j-g2-s0-h0", "trainer")
    assert plan_log_pod(pods, 1, "u1") == ("j-g2-s0-h1", "uid-j-g2-s0-h1", "trainer")
    assert plan_log_pod(pods, 2, "u1") is None


def test_status_screen_shows_the_spare_slices() -> None:
    job = _job(phase="Running", generation=2, spares={"desired": 1, "ready": 1, "pools": ["tpu-slice-0"], "takenTotal": 1,
                                                      "lastTaken": {"generation": 2, "pools": ["tpu-slice-1"]}})
    lines = dict(line.split(":", 1) for line in kubectl_plugin.build_status_screen(job, [], NOW).splitlines())
    assert lines["Spares"].strip() == "1/1 ready on tpu-slice-0, 1 taken"
    waiting = _job(phase="Suspended", spares={"desired": 1, "ready": 0, "pools": [], "takenTotal": 0,
                                             "message": "the job is suspended (spec.suspend)"})
    lines = dict(line.split(":", 1) for line in kubectl_plugin.build_status_screen(waiting, [], NOW).splitlines())
    assert lines["Spares"].strip() == "0/1 ready (the job is suspended (spec.suspend)), 0 taken"
    assert "Spares" not in kubectl_plugin.build_status_screen(_job(), [], NOW)
