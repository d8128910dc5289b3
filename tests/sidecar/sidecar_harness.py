"""Helpers of the sidecar tests: fake-gcs-server, a real `resilax sidecar` process, local steps.

The fixtures built on them are in conftest.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from resilax_local.processes import free_port
from resilax_local.testing import wait_for

REPO = Path(__file__).resolve().parents[2]


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    """`resilax_local.testing.wait_for` (the one bounded wait) in this harness's argument order."""
    return wait_for(predicate, timeout=timeout, interval=interval, message=what)


# ---- fake-gcs-server: the shared `fake_gcs` and `gcs_bucket` fixtures (resilax_local.pytest_plugin) ----


@pytest.fixture
def gcs_env(fake_gcs: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The emulator's variables (STORAGE_EMULATOR_HOST, TENSORSTORE_GCS_HTTP_URL, ...), set in this
    test process too (for in-process GcsStore)."""
    for key, value in fake_gcs.env.items():
        monkeypatch.setenv(key, value)
    env: dict[str, str] = dict(fake_gcs.env)
    return env


# ---- local steps as the checkpoint library leaves them ---------------------------------------------------


def write_local_step(
    local_dir: Path,
    step: int,
    files: Mapping[str, bytes],
    generation: int = 0,
    process_id: int | None = None,
    metadata: bytes | None = None,
) -> Path:
    """A locally committed step: files, metadata and `_COMMIT` in a `.tmp-` folder renamed into place
    (resilax_ckpt's local commit), or, with `process_id`, per-process markers in a shared folder.
    `metadata`: the `_METADATA.json` bytes (default: a stand-in naming the files)."""
    meta = metadata or json.dumps({"version": 1, "step": step, "generation": generation,
                                   "files": sorted(files)}).encode()
    commit = json.dumps({"generation": generation, "time": time.time()}).encode()
    final = local_dir / str(step)
    work = local_dir / f".tmp-{step}-g{generation}" if process_id is None else final
    for rel, data in files.items():
        path = work / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    if process_id is None:
        (work / "_METADATA.json").write_bytes(meta)
        (work / "_COMMIT").write_bytes(commit)
        work.rename(final)
    else:
        (work / f"_METADATA.{process_id}.json").write_bytes(meta)
        (work / f"_COMMIT.{process_id}").write_bytes(commit)
    return final


def committed_attempt(store: Any, step: int) -> str:
    """The attempt prefix the persistent `<step>/_COMMIT` names (write-once uploads)."""
    attempt = json.loads(store.read_bytes(f"{step}/_COMMIT"))["attempt"]
    assert isinstance(attempt, str) and attempt.startswith("a-e"), attempt
    return attempt


def attempt_files(store: Any, step: int) -> dict[str, int]:
    """Name -> size of the files of the attempt `<step>/_COMMIT` names, relative to that attempt."""
    return {k: v.size for k, v in store.list_files(f"{step}/{committed_attempt(store, step)}").items()}


def step_files(n: int, size: int, seed: int = 0) -> dict[str, bytes]:
    """`n` files of `size` bytes under one item folder, distinct contents."""
    return {f"state/leaf{i}/c/0": bytes([(seed + i) % 256]) * size + f"{seed}:{i}".encode() for i in range(n)}


# ---- a real sidecar process ----------------------------------------------------------------------------


@dataclass
class HttpResult:
    status: int
    body: Any
    headers: Mapping[str, str] = field(default_factory=dict)


def http(method: str, url: str, body: Any = None, token: str | None = None, raw: bytes | None = None,
         headers: Mapping[str, str] | None = None) -> HttpResult:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    for key, value in (headers or {}).items():
        req.add_header(key, value)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, payload, headers = resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as e:
        status, payload, headers = e.code, e.read(), dict(e.headers)
    ctype = headers.get("Content-Type", "")
    parsed: Any = json.loads(payload) if ctype.startswith("application/json") else payload.decode()
    return HttpResult(status, parsed, headers)


class SidecarProcess:
    """`resilax sidecar` as the pod runs it, on a free port, logging to a file."""

    def __init__(self, env: Mapping[str, str], log_path: Path) -> None:
        self.port = int(env["RESILAX_SIDECAR_PORT"])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115
        resilax = Path(sys.executable).with_name("resilax")
        cmd = [str(resilax), "sidecar"] if resilax.exists() else [
            sys.executable, "-c", "import sys; from resilax_operator.cli import main; sys.exit(main())", "sidecar"
        ]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 90) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"sidecar exited with {self.proc.returncode}:\n{self.log()}")
            try:
                return http("GET", f"{self.url}/readyz").status == 200  # the persistent tier is open
            except OSError:
                return False

        wait_until(up, timeout, "the sidecar's /readyz")

    def get(self, path: str) -> HttpResult:
        return http("GET", self.url + path)

    def post(self, path: str, body: Any = None, token: str | None = None, raw: bytes | None = None,
             headers: Mapping[str, str] | None = None) -> HttpResult:
        return http("POST", self.url + path, body, token, raw, headers)

    def metric(self, name: str, labels: str = "") -> float:
        """One sample's value from /metrics (0 when absent)."""
        text = self.get("/metrics").body
        want = f"{name}{{{labels}}}" if labels else name
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


TOKEN = "s3cret-token-for-tests"


def build_sidecar_env(tmp_path: Path) -> dict[str, str]:
    """A minimal environment: control folder, token file, a free port, quick polling."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    return {
        "RESILAX_CONTROL_DIR": str(tmp_path / "control"),
        "RESILAX_SIDECAR_TOKEN_FILE": str(token_file),
        "RESILAX_SIDECAR_PORT": str(free_port()),
        "RESILAX_SIDECAR_HOST": "127.0.0.1",
        "RESILAX_SIDECAR_POLL_SECONDS": "0.2",
        "RESILAX_SIDECAR_RETRY_INITIAL_SECONDS": "0.2",
        "RESILAX_SIDECAR_RETRY_MAX_SECONDS": "1",
        "RESILAX_SIDECAR_LOG_LEVEL": "DEBUG",
    }


@pytest.fixture
def sidecar_env(tmp_path: Path) -> dict[str, str]:
    return build_sidecar_env(tmp_path)


@pytest.fixture
def start_sidecar(tmp_path: Path) -> Iterator[Any]:
    """Start sidecars (`start_sidecar(env)`); each is stopped at the end of the test."""
    started: list[SidecarProcess] = []

    def start(env: Mapping[str, str], ready: bool = True) -> SidecarProcess:
        proc = SidecarProcess(env, tmp_path / f"sidecar-{len(started)}.log")
        started.append(proc)
        if ready:
            proc.wait_ready()
        return proc

    yield start
    for proc in started:
        with contextlib.suppress(Exception):
            proc.close()


# ---- the trainer ------------------------------------------------------------------------------------


class TrainerProcess:
    """tests/sidecar/sidecar_trainer.py: a real training loop with resilax_ckpt."""

    def __init__(self, env: Mapping[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115
        script = Path(__file__).with_name("sidecar_trainer.py")
        full_env = {**os.environ, "JAX_PLATFORMS": "cpu", **env}
        self.proc = subprocess.Popen(
            [sys.executable, str(script)], env=full_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 60) -> None:
        def seen() -> bool:
            if self.proc.poll() is not None and text not in self.log():
                raise AssertionError(f"trainer exited with {self.proc.returncode}:\n{self.log()}")
            return text in self.log()

        wait_until(seen, timeout, f"{text!r} from the trainer", interval=0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture
def start_trainer(tmp_path: Path) -> Iterator[Any]:
    started: list[TrainerProcess] = []

    def start(env: Mapping[str, str]) -> TrainerProcess:
        proc = TrainerProcess(env, tmp_path / f"trainer-{len(started)}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        with contextlib.suppress(Exception):
            proc.close()
