"""Log lines as collectors read them: with `--log-format json` (the chart's default) every line the
operator, the sidecar and the node sweeper write is one JSON object with a `severity` (Cloud Logging's
names), and no line carries a bearer token.

Each component runs as its entry point does in its container (a subprocess of `resilax`); the token
is one the component really holds: the operator's in its kubeconfig, the sidecar's in its token file
(and sent to it by a client, right and wrong), the sweeper's in the token file it sends to the API server.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from resilax_local.processes import free_port

SEVERITIES = {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
TOKEN = "tok-L0gs-never-carry-this-9f3c2a"


def _resilax(*args: str) -> list[str]:
    exe = Path(sys.executable).with_name("resilax")
    return [str(exe), *args] if exe.exists() else [
        sys.executable, "-c", "import sys; from resilax_operator.cli import main; sys.exit(main())", *args]


def _json_lines(text: str) -> list[dict[str, object]]:
    """Every line of `text` as a JSON object with a severity (a failure names the first line that is not)."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "no log line"
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}")
        assert isinstance(record, dict) and record.get("severity") in SEVERITIES, line
        assert isinstance(record.get("message"), str) and record.get("timestamp"), line
        out.append(record)
    assert TOKEN not in text
    return out


def _wait(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def test_operator_lines_are_kopf_json_with_severity(tmp_path: Path) -> None:
    """No API server answers: the operator logs its start, then warns at every failed watch."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "x",
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{free_port()}",
                                               "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": TOKEN}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": "default"}}]}))
    log = tmp_path / "operator.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(_resilax("operator", "--kubeconfig", str(kubeconfig), "--namespace", "default",
                                         "--standalone", "--log-format", "json"),
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait(lambda: '"severity": "WARNING"' in log.read_text(errors="replace"), 60, "a warning from the operator")
        finally:
            proc.kill()  # its watches retry until stopped; the lines so far are what is checked
            proc.wait(10)
    text = log.read_text()
    records = _json_lines(text[:text.rindex("\n") + 1])  # a line cut by the kill is not the formatter's
    assert any(str(r["message"]).startswith("starting: namespaces default") for r in records), records[:3]
    assert {"INFO", "WARNING"} <= {r["severity"] for r in records}


def test_sidecar_lines_are_json_with_severity(tmp_path: Path) -> None:
    """Requests with the right token and a wrong one (a warning or an error on the way), then SIGTERM."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    env = {**os.environ, "RESILAX_CONTROL_DIR": str(tmp_path / "control"), "RESILAX_SIDECAR_TOKEN_FILE": str(token_file),
           "RESILAX_SIDECAR_PORT": str(port), "RESILAX_SIDECAR_HOST": "127.0.0.1",
           "RESILAX_LOCAL_DIR": str(tmp_path / "local"), "RESILAX_CHECKPOINT_DIR": str(tmp_path / "persistent"),
           "RESILAX_SIDECAR_LOG_LEVEL": "DEBUG", "RESILAX_SIDECAR_LOG_FORMAT": "json",
           "RESILAX_SIDECAR_GRACE_SECONDS": "5"}
    log = tmp_path / "sidecar.log"
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def post(token: str) -> int:
        request = urllib.request.Request(f"{url}/v1/save", data=b"{}", method="POST",
                                         headers={"Authorization": f"Bearer {token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    with log.open("wb") as out:
        proc = subprocess.Popen(_resilax("sidecar"), env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            _wait(ready, 90, "the sidecar's /readyz")
            assert post(TOKEN[::-1]) in (401, 403)
            post(TOKEN)  # no trainer: refused or queued, either way logged
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    records = _json_lines(log.read_text())
    assert {r["logger"] for r in records} >= {"resilax_sidecar.app"}, records[:3]


class _JobsApi(http.server.BaseHTTPRequestHandler):
    """The API server as the sweeper sees it: 404 for the job `gone`, 403 for anything else (a warning)."""

    tokens: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        self.tokens.append(self.headers.get("Authorization", ""))
        self.send_response(404 if self.path.endswith("/gone") else 403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def jobs_api() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _JobsApi)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


def test_node_sweeper_lines_are_json_with_severity(tmp_path: Path, jobs_api: str) -> None:
    from resilax_sidecar.node_sweep import write_owner_marker

    root = tmp_path / "root"
    for job in ("gone", "denied"):
        folder = root / f"ml_{job}_uid-{job}"
        folder.mkdir(parents=True)
        write_owner_marker(folder, "ml", job, f"uid-{job}")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    _JobsApi.tokens = []
    done = subprocess.run(_resilax("node-sweep", "--root", str(root), "--api-server", jobs_api, "--token-file",
                                   str(token_file), "--confirm-after", "0.1", "--log-format", "json"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(_JobsApi.tokens) >= 2 and set(_JobsApi.tokens) == {f"Bearer {TOKEN}"}  # it held and sent the token
    records = _json_lines(done.stdout + done.stderr)
    assert {"INFO", "WARNING"} <= {r["severity"] for r in records}, records
