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


def _log_pod(name: str, generation: int, phase: str, state: dict[str, Any] | None,
             last: dict[str, Any] | None = None) -> dict[str, Any]:
    """Process 0's worker pod of job `j` (owner uid u1), its trainer container in `state`."""
    statuses = [{"name": "trainer", "state": state, "lastState": last or {}}] if state is not None else []
    return {"metadata": {"name": name, "uid": f"uid-{name}", "ownerReferences": [
                {"uid": "u1", "controller": True, "kind": "JAXJob", "apiVersion": "resilax.dev/v1alpha1", "name": "j"}],
                "labels": {api.LABEL_PROCESS: "0", api.LABEL_GENERATION: str(generation)}},
            "spec": {"containers": [{"name": "resilax-sidecar"}, {"name": "trainer"}]},
            "status": {"phase": phase, "containerStatuses": statuses}}


WAITING = 'container "trainer" in pod "j-g2-s0-h0" is waiting to start: PodInitializing'


@pytest.mark.parametrize(("phase", "state", "last", "expected"), [
    ("Pending", None, None, ("wait", "Pending")),  # not placed yet, or no status from the kubelet yet
    ("Pending", {"waiting": {"reason": "ContainerCreating"}}, None, ("wait", "ContainerCreating")),
    ("Pending", {"waiting": {"reason": "PodInitializing"}}, None, ("wait", "PodInitializing")),
    ("Running", {"running": {"startedAt": "t"}}, None, ("read", "")),
    ("Running", {"waiting": {"reason": "CrashLoopBackOff"}}, {"terminated": {"exitCode": 1}}, ("read", "")),
    ("Failed", {"terminated": {"exitCode": 1}}, None, ("read", "")),
    ("Failed", {"waiting": {"reason": "ContainerCreating"}}, None,
     ("skip", "the pod is Failed and its container trainer never ran")),
])
def test_logs_waits_for_a_trainer_that_has_not_started(phase: str, state: dict[str, Any] | None,
                                                        last: dict[str, Any] | None, expected: tuple[str, str]) -> None:
    from resilax_operator.kubectl.logs import plan_log_read

    assert plan_log_read(_log_pod("j-g2-s0-h0", 2, phase, state, last), "trainer") == expected


@pytest.mark.parametrize(("status", "message", "expected"), [
    (400, WAITING, True),  # the kubelet: the container has not started
    (400, 'container "trainer" in pod "j-g2-s0-h0" is not available', True),
    (404, 'pod "j-g2-s0-h0" does not exist', True),  # a kubelet that has not admitted the pod yet
    (400, 'previous terminated container "trainer" in pod "j-g2-s0-h0" not found', False),
    (403, 'pods "j-g2-s0-h0" is forbidden: User "u" cannot get resource "pods/log"', False),
    (500, "dial tcp 10.0.0.1:10250: connect: connection refused", False),
])
def test_only_a_not_started_container_is_retried_quietly(status: int, message: str, expected: bool) -> None:
    from resilax_operator.kubectl.logs import is_log_not_ready

    assert is_log_not_ready(status, message) is expected


class _ScriptedLogAPI:
    """The plugin's JobAPI as `run_logs` uses it, answering from a script: each look at the job and
    its pods takes the next state; a log read of a trainer that has not started answers as the
    kubelet does (400 "is waiting to start"), through the API server."""

    def __init__(self, looks: list[tuple[int, str, list[dict[str, Any]]]], logs: dict[str, list[str]]) -> None:
        self.looks, self.logs, self.look, self.reads = looks, logs, -1, []

    def get_job(self, namespace: str, name: str) -> dict[str, Any]:
        self.look = min(self.look + 1, len(self.looks) - 1)
        generation, phase, _ = self.looks[self.look]
        return {"metadata": {"uid": "u1"}, "status": {"generation": generation, "phase": phase}}

    def worker_pods(self, namespace: str, job: str, generation: int) -> list[dict[str, Any]]:
        return [p for p in self.looks[self.look][2] if p["metadata"]["labels"][api.LABEL_GENERATION] == str(generation)]

    def pod_log(self, namespace: str, pod: str, container: str, follow: bool) -> Any:
        from resilax_operator.kubectl.client import PluginError

        self.reads.append(pod)
        if pod not in self.logs:
            message = f'container "{container}" in pod "{pod}" is waiting to start: PodInitializing'
            raise PluginError(f"log of {namespace}/{pod}: 400 {message}", 400, message)
        return iter(self.logs[pod])


def test_logs_follow_waits_quietly_for_the_next_generations_trainer(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """CI 2026-12-07: generation 2's pod was there before its trainer started; its log read answered an
    error and `logs -f` ended there. Now it waits (no error printed) and prints generation 2's log."""
    from resilax_operator.kubectl import logs

    monkeypatch.setattr(logs, "LOGS_POLL_SECONDS", 0.0)
    g1 = _log_pod("j-g1-s0-h0", 1, "Running", {"running": {"startedAt": "t"}})
    g2_pending = _log_pod("j-g2-s0-h0", 2, "Pending", {"waiting": {"reason": "PodInitializing"}})
    g2_stale = _log_pod("j-g2-s0-h0", 2, "Running", {"running": {"startedAt": "t"}})  # read before the kubelet ran it
    g2 = _log_pod("j-g2-s0-h0", 2, "Running", {"running": {"startedAt": "t"}})
    kube = _ScriptedLogAPI([(1, "Running", [g1]), (2, "Running", [g2_pending]), (2, "Running", [g2_pending]),
                            (2, "Running", [g2_stale]), (2, "Running", [g2]), (2, "Succeeded", [])],
                           {"j-g1-s0-h0": ["step 1", "step 2"]})
    real_log = kube.pod_log

    def log_once_started(namespace: str, pod: str, container: str, follow: bool) -> Any:
        if pod == "j-g2-s0-h0" and kube.look >= 4:
            kube.logs[pod] = ["step 3"]
        return real_log(namespace, pod, container, follow)

    monkeypatch.setattr(kube, "pod_log", log_once_started)
    logs.run_logs(kube, "ns", "j", 0, follow=True)  # type: ignore[arg-type]
    out, err = capsys.readouterr()
    assert out.splitlines() == ["step 1", "step 2", "step 3"]
    assert err.splitlines() == ["==> ns/j-g1-s0-h0 (trainer, generation 1, process 0)",
                                "==> ns/j-g2-s0-h0 (trainer, generation 2, process 0)"]
    assert kube.reads == ["j-g1-s0-h0", "j-g2-s0-h0", "j-g2-s0-h0"]  # never while the pod said waiting


def test_logs_without_follow_says_the_trainer_has_not_started() -> None:
    from resilax_operator.kubectl import logs
    from resilax_operator.kubectl.client import PluginError

    pending = _log_pod("j-g2-s0-h0", 2, "Pending", {"waiting": {"reason": "ContainerCreating"}})
    with pytest.raises(PluginError, match=r"^ns/j-g2-s0-h0: no log of container trainer: it has not started yet "
                                          r"\(ContainerCreating\); -f waits for it$"):
        logs.run_logs(_ScriptedLogAPI([(2, "Running", [pending])], {}), "ns", "j", 0, follow=False)  # type: ignore[arg-type]
    stale = _log_pod("j-g2-s0-h0", 2, "Running", {"running": {"startedAt": "t"}})
    with pytest.raises(PluginError, match="400 container \"trainer\" in pod \"j-g2-s0-h0\" is waiting to start"):
        logs.run_logs(_ScriptedLogAPI([(2, "Running", [stale])], {}), "ns", "j", 0, follow=False)  # type: ignore[arg-type]


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
