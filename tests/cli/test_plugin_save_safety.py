"""`kubectl resilax save` hands the job's token only to a pod the job owns, and follows no path the
sidecar chose (issue 40, item 4). The real plugin (`main`, the kubernetes client, a kubeconfig)
against a small HTTP server on 127.0.0.1 that answers as the API server and its pod proxy would, and
records every request it gets: which path, and whether it carried the token."""

from __future__ import annotations

import base64
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from resilax_operator import api
from resilax_operator.kubectl import plugin as kubectl_plugin
from resilax_operator.kubectl.client import SIDECAR_ANSWER_CAP

NS, JOB, UID, GENERATION, PORT = "ml", "llama", "0b6c2f0e-1111-4c1e-9d53-6f4b8f3f0a01", 3, 8490
TOKEN = "s3cret-job-token"
SAVE_ID = "20261206T180000-manual-1a2b3c4d"


def pod(name: str, process: str, owner: str | None = UID, generation: int = GENERATION) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NS, "labels": {
        api.LABEL_JOB: JOB, api.LABEL_GENERATION: str(generation), api.LABEL_PROCESS: process}}
    if owner is not None:
        meta["ownerReferences"] = [{"apiVersion": api.API_VERSION, "kind": api.KIND, "name": JOB, "uid": owner,
                                    "controller": True}]
    return {"metadata": meta, "status": {"phase": "Running", "podIP": "10.0.0.9"},
            "spec": {"initContainers": [{"name": api.SIDECAR_CONTAINER,
                                         "ports": [{"name": "sidecar", "containerPort": PORT}]}],
                     "containers": [{"name": "trainer"}]}}


class FakeApiServer:
    """Answers the plugin's calls from `pods` and `save_answer`; records (method, path, token sent)."""

    def __init__(self) -> None:
        self.pods: list[dict[str, Any]] = []
        self.save_answer: bytes = json.dumps({"id": SAVE_ID, "status": "pending"}).encode()
        self.requests: list[tuple[str, str, str | None]] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                server.requests.append((self.command, self.path, self.headers.get(api.SIDECAR_TOKEN_HEADER)))
                status, body = server.route(self.command, self.path)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def route(self, method: str, path: str) -> tuple[int, bytes]:
        plain = path.split("?", 1)[0]
        proxy = f"/api/v1/namespaces/{NS}/pods/w-1:{PORT}/proxy"
        if plain == f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/{JOB}":
            return 200, json.dumps({"apiVersion": api.API_VERSION, "kind": api.KIND,
                                    "metadata": {"name": JOB, "namespace": NS, "uid": UID},
                                    "status": {"generation": GENERATION, "checkpoint": {"step": 10}}}).encode()
        if plain == f"/api/v1/namespaces/{NS}/pods":
            return 200, json.dumps({"kind": "PodList", "items": self.pods}).encode()
        if plain == f"/api/v1/namespaces/{NS}/secrets/{JOB}-resilax-token":
            return 200, json.dumps({"data": {api.TOKEN_KEY: base64.b64encode(TOKEN.encode()).decode()}}).encode()
        if method == "POST" and plain == f"{proxy}/v1/save":
            return 202, self.save_answer
        if method == "GET" and plain == f"{proxy}/v1/save/{SAVE_ID}":
            return 200, json.dumps({"id": SAVE_ID, "status": "committed", "step": 12, "persisted": True}).encode()
        return 404, b'{"kind":"Status","reason":"NotFound","code":404}'

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_api(tmp_path: Path) -> Iterator[tuple[FakeApiServer, str]]:
    server = FakeApiServer()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server.url}}],
        "users": [{"name": "admin", "user": {"token": "admins-own-credentials"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "admin", "namespace": NS}}]}))
    yield server, str(kubeconfig)
    server.close()


def save(kubeconfig: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = kubectl_plugin.main(["save", JOB, "--kubeconfig", kubeconfig, "--timeout", "30"])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_squatter_pod_with_the_jobs_labels_gets_no_token(fake_api, capsys) -> None:
    """A tenant's pod carries the job's labels (job, generation, process 0, a sidecar port): the plugin
    asks the job's own worker (owned by the JAXJob's uid), and with only squatters it asks nobody."""
    server, kubeconfig = fake_api
    server.pods = [pod("squat-0", "0", owner=None), pod("squat-1", "0", owner="another-jobs-uid"),
                   pod("old-0", "0", generation=GENERATION - 1), pod("w-1", "1")]
    code, out, err = save(kubeconfig, capsys)
    assert code == 0, err
    assert f"jaxjob {NS}/{JOB}: step 12 committed, persisted" in out
    with_token = [(m, p) for m, p, token in server.requests if token is not None]
    assert with_token == [("POST", f"/api/v1/namespaces/{NS}/pods/w-1:{PORT}/proxy/v1/save")]
    assert all(token == TOKEN for _, _, token in server.requests if token is not None)
    assert not [p for _, p, _ in server.requests if "squat" in p or "old-0" in p]

    server.requests.clear()
    server.pods = [pod("squat-0", "0", owner=None), pod("squat-1", "0", owner="another-jobs-uid")]
    code, out, err = save(kubeconfig, capsys)
    assert code == kubectl_plugin.EXIT_ERROR
    assert f"no running worker of generation {GENERATION}" in err and f"only a pod the job owns, uid {UID}" in err
    assert [token for _, _, token in server.requests if token is not None] == []
    assert not [p for _, p, _ in server.requests if "/proxy" in p or "/secrets/" in p]


@pytest.mark.parametrize("hostile_id", [
    "../../../../api/v1/namespaces/kube-system/services/https:dashboard:443/proxy/steal",
    "..%2F..%2F..%2Fapi%2Fv1%2Fsecrets",
    "x/../../../../../api/v1/nodes",
    "ok?watch=1",
    "\x1b]0;pwned\x07",
    "a" * 81,
    12,
], ids=["dot-dot", "encoded", "inner-dot-dot", "query", "escape-sequence", "too-long", "not-a-string"])
def test_a_hostile_save_id_never_leaves_the_pods_proxy_path(fake_api, capsys, hostile_id: object) -> None:
    """The sidecar (the job's code, not the user's) answers the save with an id that would steer the
    next poll, sent with the user's own credentials, elsewhere: refused, and nothing but the plugin's
    own paths is ever asked for. The id is printed escaped."""
    server, kubeconfig = fake_api
    server.pods = [pod("w-1", "1")]
    server.save_answer = json.dumps({"id": hostile_id, "status": "pending"}).encode()
    code, _out, err = save(kubeconfig, capsys)
    assert code == kubectl_plugin.EXIT_ERROR
    assert "not a save request id" in err and "not followed" in err
    assert "\x1b" not in err and "\x07" not in err
    allowed = {f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/{JOB}", f"/api/v1/namespaces/{NS}/pods",
               f"/api/v1/namespaces/{NS}/secrets/{JOB}-resilax-token",
               f"/api/v1/namespaces/{NS}/pods/w-1:{PORT}/proxy/v1/save"}
    asked = [p.split("?", 1)[0] for _, p, _ in server.requests]
    assert set(asked) <= allowed, asked
    assert asked.count(f"/api/v1/namespaces/{NS}/pods/w-1:{PORT}/proxy/v1/save") == 1


def test_an_oversized_sidecar_answer_is_not_read(fake_api, capsys) -> None:
    server, kubeconfig = fake_api
    server.pods = [pod("w-1", "1")]
    server.save_answer = b'{"id": "' + b"a" * SIDECAR_ANSWER_CAP + b'"}'
    code, _out, err = save(kubeconfig, capsys)
    assert code == kubectl_plugin.EXIT_ERROR
    assert f"the answer is over {SIDECAR_ANSWER_CAP} bytes" in err


@pytest.mark.parametrize(("message", "shown"), [
    ("node lost\x1b[2J\x1b]0;owned\x07", "node lost\\x1b[2J\\x1b]0;owned\\x07"),
    ("line\rover\nnext", "line\\rover\\nnext"),
    ("bidi \u202ereversed", "bidi \\u202ereversed"),
    ("plain ünïcode", "plain ünïcode"),
], ids=["ansi-and-osc", "cr-and-lf", "bidi-override", "printable"])
def test_event_and_transition_messages_are_printed_with_control_characters_escaped(message: str, shown: str) -> None:
    transition = {"transition": {"kind": "NodeLoss", "generation": 2, "message": message}}
    assert kubectl_plugin.last_fault(transition, []) == f"NodeLoss (in progress, generation 2): {shown}"
    event = {"type": "Warning", "reason": "Fault", "lastTimestamp": "2026-12-06T18:00:00Z", "message": message}
    assert kubectl_plugin.last_fault({}, [event]) == f"Fault at 2026-12-06T18:00:00Z: {shown}"
    assert kubectl_plugin.escape_controls(f"a\n{message}", keep_newlines=True).startswith("a\n")
