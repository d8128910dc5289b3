"""The HTTP API of a real `resilax sidecar` process: auth, JSON errors, requests, state, metrics.

The trainer's side of the request files is played here by writing `results/<id>.json` as
resilax_ckpt does; test_trainer.py runs the real trainer.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from resilax_sidecar import control as sidecar_control
from resilax_sidecar.api_base import TOKEN_HEADER, presented_token
from sidecar_harness import TOKEN, SidecarProcess, build_sidecar_env, http, wait_until


@pytest.fixture
def sidecar(sidecar_env, start_sidecar):
    """A sidecar of this test's own (for tests that change its files or count its metrics)."""
    return start_sidecar(sidecar_env)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One sidecar for the tests that only read, or make requests of their own: (process, env)."""
    tmp_path = tmp_path_factory.mktemp("shared-sidecar")
    env = build_sidecar_env(tmp_path)
    proc = SidecarProcess(env, tmp_path / "sidecar.log")
    try:
        proc.wait_ready()
        yield proc, env
    finally:
        proc.close()


def _assert_json_error(result, status, code):
    assert result.status == status, result.body
    assert set(result.body) == {"error"}
    assert result.body["error"]["code"] == code
    assert isinstance(result.body["error"]["message"], str) and result.body["error"]["message"]
    assert "Traceback" not in json.dumps(result.body)


def test_health_ready_and_metrics(shared):
    sidecar, _ = shared
    assert sidecar.get("/healthz").body == {"status": "ok"}
    assert sidecar.get("/readyz").body == {"status": "ready"}
    text = sidecar.get("/metrics").body
    for name in (
        "resilax_sidecar_uploads_total",
        "resilax_sidecar_upload_bytes_total",
        "resilax_sidecar_upload_seconds_bucket",
        "resilax_sidecar_upload_failures_total",
        "resilax_sidecar_lag_steps",
        'resilax_sidecar_save_requests_total{reason="manual"}',
        "resilax_sidecar_save_request_seconds_bucket",
    ):
        assert name in text, name
    import importlib.metadata

    version = importlib.metadata.version("resilax")
    assert f'resilax_build_info{{component="sidecar",version="{version}"}} 1.0' in text


def test_state_without_tiers(shared):
    sidecar, _ = shared
    state = sidecar.get("/v1/state").body
    assert state["generation"] == 0 and state["process_id"] == 0
    assert state["local_tier"] is False
    assert state["newest_local_step"] is None and state["newest_persisted_step"] is None
    assert state["upload_in_flight"] is None and state["last_error"] is None
    assert state["stopping"] is False


@pytest.mark.parametrize(
    "token, status, code",
    [(None, 401, "unauthorized"), ("wrong-token", 403, "forbidden"), ("", 401, "unauthorized")],
    ids=["no-token", "wrong-token", "empty-token"],
)
def test_unauthorised_save_requests_are_refused(sidecar, sidecar_env, token, status, code):
    result = sidecar.post("/v1/save", {"reason": "manual"}, token=token)
    _assert_json_error(result, status, code)
    if status == 401:
        assert result.headers.get("WWW-Authenticate", "").startswith("Bearer")
    requests = Path(sidecar_env["RESILAX_CONTROL_DIR"]) / "requests"
    assert not requests.exists() or not list(requests.iterdir())
    assert sidecar.metric("resilax_sidecar_http_unauthorized_total") == 1
    assert TOKEN not in sidecar.log() and (not token or token not in sidecar.log())


def test_the_token_in_its_own_header_is_accepted_as_through_the_api_servers_pod_proxy(sidecar):
    """The API server's pod proxy drops `Authorization` (it authenticated the caller with it), so
    `kubectl resilax save` sends the job's token in X-Resilax-Token; a wrong one is refused the same way."""
    own = {TOKEN_HEADER: TOKEN}
    assert sidecar.post("/v1/save", {"reason": "manual"}, headers=own).status == 202
    _assert_json_error(sidecar.post("/v1/save", {}, headers={TOKEN_HEADER: "wrong-token"}), 403, "forbidden")
    # A bearer token, when there is one, is the one checked.
    _assert_json_error(sidecar.post("/v1/save", {}, token="wrong-token", headers=own), 403, "forbidden")
    assert sidecar.metric("resilax_sidecar_http_unauthorized_total") == 2
    assert TOKEN not in sidecar.log()


@pytest.mark.parametrize(("headers", "expected"), [
    ({}, None),
    ({"Authorization": "Bearer abc"}, "abc"),
    ({"Authorization": "bearer  abc "}, "abc"),
    ({"Authorization": "Basic abc"}, None),
    ({"Authorization": "Bearer "}, None),
    ({TOKEN_HEADER: " abc "}, "abc"),
    ({TOKEN_HEADER: ""}, None),
    ({"Authorization": "Bearer abc", TOKEN_HEADER: "def"}, "abc"),
    ({"Authorization": "Basic x", TOKEN_HEADER: "def"}, "def"),
], ids=["none", "bearer", "bearer-spaces", "basic", "empty-bearer", "own", "empty-own", "bearer-first",
        "basic-and-own"])
def test_the_presented_token(headers, expected):
    assert presented_token(headers) == expected


def test_the_token_header_and_the_save_id_format_are_the_ones_the_plugin_uses():
    from resilax_operator import api

    assert api.SIDECAR_TOKEN_HEADER == TOKEN_HEADER
    assert sidecar_control._ID_RE.pattern == api.SAVE_ID_PATTERN  # what kubectl resilax save accepts as an id


def test_without_a_token_file_mutating_calls_are_disabled(sidecar_env, start_sidecar):
    del sidecar_env["RESILAX_SIDECAR_TOKEN_FILE"]
    sidecar = start_sidecar(sidecar_env)
    _assert_json_error(sidecar.post("/v1/save", {}, token=TOKEN), 403, "forbidden")


def test_a_rotated_token_applies_at_once(sidecar, sidecar_env):
    Path(sidecar_env["RESILAX_SIDECAR_TOKEN_FILE"]).write_text("new-token")
    _assert_json_error(sidecar.post("/v1/save", {}, token=TOKEN), 403, "forbidden")
    assert sidecar.post("/v1/save", {}, token="new-token").status == 202


@pytest.mark.parametrize(
    "raw, message",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"reason": "because"}', "reason: 'because' is not one of manual, preemption, resize"),
        (b'{"stop": "yes"}', "stop: 'yes' must be true or false"),
        (b'{"step": 10}', "unknown fields ['step']"),
    ],
    ids=["bad-json", "not-object", "bad-reason", "bad-stop", "unknown-field"],
)
def test_bad_bodies_are_json_400s(shared, raw, message):
    sidecar, _ = shared
    result = sidecar.post("/v1/save", raw=raw, token=TOKEN)
    _assert_json_error(result, 400, "bad_request")
    assert message in result.body["error"]["message"]


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "with-a-length"])
def test_a_body_over_its_cap_is_refused_unread(shared, chunked):
    """Issue 40, item 7: a request body is read up to 64 KiB whether it announces its length or comes
    chunked (it was read up to 16 MiB then); the fetch-chunks body alone may be longer."""
    import http.client

    sidecar, _ = shared
    body = b'{"reason": "manual", "pad": "' + b"x" * (100 * 1024) + b'"}'
    conn = http.client.HTTPConnection("127.0.0.1", sidecar.port, timeout=30)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    try:
        if chunked:
            conn.request("POST", "/v1/save", body=iter([body[i:i + 8192] for i in range(0, len(body), 8192)]),
                         headers=headers, encode_chunked=True)
        else:
            conn.request("POST", "/v1/save", body=body, headers=headers)
        response = conn.getresponse()
        answer = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == 413, answer
    assert answer["error"] == {"code": "request_too_large", "message": "the body must be at most 65536 bytes"}


def test_unknown_paths_methods_and_ids_are_json_errors(shared):
    sidecar, _ = shared
    _assert_json_error(sidecar.get("/nope"), 404, "not_found")
    _assert_json_error(http("DELETE", sidecar.url + "/v1/state"), 405, "method_not_allowed")
    _assert_json_error(sidecar.get("/v1/save/..%2F..%2Fetc"), 400, "bad_request")
    _assert_json_error(sidecar.get("/v1/save/no-such-request"), 404, "not_found")


def test_a_save_request_becomes_a_request_file_and_its_result_is_reported(sidecar, sidecar_env):
    control = Path(sidecar_env["RESILAX_CONTROL_DIR"])
    result = sidecar.post("/v1/save", {"reason": "resize", "stop": True}, token=TOKEN)
    assert result.status == 202 and result.body["status"] == "pending"
    request_id = result.body["id"]
    request = json.loads((control / "requests" / f"{request_id}.json").read_text())
    assert (request["id"], request["reason"], request["stop"]) == (request_id, "resize", True)
    assert [p.name for p in (control / "requests").iterdir()] == [f"{request_id}.json"]  # no temp file left
    assert sidecar.get(f"/v1/save/{request_id}").body["status"] == "pending"

    # The trainer's answer (resilax_ckpt writes it, then removes the request).
    (control / "results").mkdir()
    answer = {"id": request_id, "step": 42, "committed": True, "error": None}
    (control / "results" / f"{request_id}.json").write_text(json.dumps(answer))
    (control / "requests" / f"{request_id}.json").unlink()
    outcome = sidecar.get(f"/v1/save/{request_id}").body
    assert outcome == {"status": "committed", **answer, "persisted": True}  # no local tier: saved = persisted
    assert sidecar.metric("resilax_sidecar_save_requests_total", 'reason="resize"') == 1
    wait_until(lambda: sidecar.metric("resilax_sidecar_save_request_seconds_count") == 1, 10, "the latency sample")
    assert sidecar.get("/v1/state").body["pending_requests"] == []


def test_a_failed_save_is_reported_as_failed(shared):
    sidecar, env = shared
    control = Path(env["RESILAX_CONTROL_DIR"])
    request_id = sidecar.post("/v1/save", {}, token=TOKEN).body["id"]
    (control / "results").mkdir(exist_ok=True)
    answer = {"id": request_id, "step": None, "committed": False, "error": "disk full"}
    (control / "results" / f"{request_id}.json").write_text(json.dumps(answer))
    assert sidecar.get(f"/v1/save/{request_id}").body == {"status": "failed", **answer, "persisted": False}


def test_a_crash_inside_a_handler_is_a_json_500_without_traceback(sidecar, sidecar_env):
    control = Path(sidecar_env["RESILAX_CONTROL_DIR"])
    (control / "requests").write_text("not a folder")  # the request can no longer be written
    result = sidecar.post("/v1/save", {}, token=TOKEN)
    _assert_json_error(result, 500, "internal")
    assert "Traceback" in sidecar.log()  # logged for the operator of the pod, not sent to the caller
    assert sidecar.get("/healthz").status == 200


def test_check_config_prints_the_settings_without_the_token(sidecar_env):
    import os
    import subprocess
    import sys

    code = "import sys; from resilax_operator.cli import main; sys.exit(main(['sidecar', '--check-config']))"
    run = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **sidecar_env}, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert "process 0/1 generation 0" in run.stdout and TOKEN not in run.stdout


def test_a_port_in_use_is_a_clear_start_up_error(shared):
    sidecar, sidecar_env = shared
    import os
    import subprocess
    import sys

    code = "import sys; from resilax_operator.cli import main; sys.exit(main(['sidecar']))"
    run = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **sidecar_env}, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 1
    assert f"cannot listen on RESILAX_SIDECAR_HOST=127.0.0.1 RESILAX_SIDECAR_PORT={sidecar.port}" in run.stderr
    assert "Traceback" not in run.stderr


def test_the_api_serves_while_the_persistent_tier_cannot_be_opened(sidecar_env, start_sidecar):
    env = {**sidecar_env, "RESILAX_CHECKPOINT_DIR": "/proc/no-such-folder/ckpt", "RESILAX_LOCAL_DIR": "/tmp"}
    sidecar = start_sidecar(env, ready=False)
    wait_until(lambda: sidecar.proc.poll() is None and _healthy(sidecar), 60, "/healthz")
    wait_until(lambda: "opening RESILAX_CHECKPOINT_DIR" in sidecar.log(), 60, "the error in the log")
    ready = sidecar.get("/readyz")
    _assert_json_error(ready, 503, "unavailable")
    assert "opening RESILAX_CHECKPOINT_DIR=/proc/no-such-folder/ckpt" in ready.body["error"]["message"]
    assert sidecar.post("/v1/save", {}, token=TOKEN).status == 202  # requests still reach the trainer


def _healthy(sidecar) -> bool:
    try:
        return sidecar.get("/healthz").status == 200
    except OSError:
        return False


def test_state_reports_the_trainers_restore_and_the_steps_it_skipped(shared):
    """The trainer's manager writes `restore.json` into the control folder after a restore of the
    newest step (resilax_ckpt.control.requests); the sidecar reports it as `restore` (the operator's event)."""
    from resilax_ckpt.control.requests import write_restore_report

    sidecar, env = shared
    assert sidecar.get("/v1/state").body["restore"] is None
    report = {"step": 20, "skipped": [{"step": 30, "reason": "CorruptCheckpointError: chunk file x/30/a"}]}
    write_restore_report(env["RESILAX_CONTROL_DIR"], report)
    assert sidecar.get("/v1/state").body["restore"] == report


def test_the_trainers_figures_are_exported_and_reported(shared):
    """The trainer's manager writes `trainer.json` into the control folder (resilax_ckpt.control.trainer_metrics);
    the sidecar exports it as resilax_trainer_* at each scrape and reports it in /v1/state."""
    from prometheus_client.parser import text_string_to_metric_families
    from resilax_ckpt.control.trainer_metrics import TrainerMetrics

    sidecar, env = shared
    clock = [100.0]
    figures = TrainerMetrics(env["RESILAX_CONTROL_DIR"], clock=lambda: clock[0])
    figures.restored(12, 2.5)
    for step in range(13, 40):
        clock[0] += 0.5
        if step == 30:
            figures.waited(0.125)
        figures.step(step)
    figures.saved(0.25, "on_device", 3 << 20)
    scraped = [s for family in text_string_to_metric_families(sidecar.get("/metrics").body) for s in family.samples]
    samples = {s.name: s.value for s in scraped if s.name.startswith("resilax_trainer_")}
    assert samples["resilax_trainer_step"] == 39
    assert samples["resilax_trainer_steps_total"] == 27  # steps 13 to 39 (rate by PromQL)
    assert samples["resilax_trainer_step_seconds"] == 0.5  # this host's own median step (the straggler figure)
    assert samples["resilax_trainer_barrier_wait_seconds_total"] == 0.125
    assert "resilax_trainer_steps_per_second" not in samples
    assert samples["resilax_trainer_saves_total"] == 1
    assert samples["resilax_trainer_save_blocking_seconds_total"] == 0.25
    assert [(s.labels, s.value) for s in scraped if s.name == "resilax_trainer_last_save_device_bytes"] == [
        ({"device_copy": "on_device"}, 3 << 20)]
    assert samples["resilax_trainer_restore_seconds"] == 2.5
    assert samples["resilax_trainer_restores_total"] == 1
    state = sidecar.get("/v1/state").body["trainer"]
    assert state["step"] == 39 and state["restored_step"] == 12
    assert state["step_seconds_p99"] == 0.5 and state["save_seconds_p99"] == 0.25  # the hang timeout's inputs
