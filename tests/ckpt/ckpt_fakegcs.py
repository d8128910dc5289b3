"""fake-gcs-server for the gs:// tests: built from its Go module when missing (cached), started on a
free loopback port with an in-memory backend."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

VERSION = "v1.56.1"
MODULE = "github.com/fsouza/fake-gcs-server"


def fake_gcs_server_binary() -> Path:
    """The fake-gcs-server binary: localcluster's builder if it exists, else `go install` into
    ~/.cache/resilax/bin/fake-gcs-server-<version>/ (only when missing)."""
    with contextlib.suppress(ImportError, AttributeError):
        from resilax_local import binaries  # type: ignore[import-not-found]

        for name in ("fake_gcs_server", "fake_gcs_server_binary", "ensure_fake_gcs_server"):
            fn = getattr(binaries, name, None)
            if callable(fn):
                path = Path(fn())
                if path.exists():
                    return path
    cache = Path(os.environ.get("RESILAX_CACHE", Path.home() / ".cache" / "resilax"))
    gobin = cache / "bin" / f"fake-gcs-server-{VERSION}"
    binary = gobin / "fake-gcs-server"
    if binary.exists():
        return binary
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("fake-gcs-server is missing and `go` is not on PATH to build it (Go 1.26 needed)")
    gobin.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, GOBIN=str(gobin), GOFLAGS="-mod=mod")
    subprocess.run([go, "install", f"{MODULE}@{VERSION}"], check=True, env=env, timeout=1800, cwd=gobin)
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class FakeGcsServer:
    process: subprocess.Popen[bytes]
    port: int
    _buckets: itertools.count = dataclasses.field(default_factory=itertools.count)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "test-token",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def create_bucket(self) -> str:
        name = f"bucket-{os.getpid()}-{next(self._buckets)}"
        body = json.dumps({"name": name}).encode()
        req = urllib.request.Request(f"{self.url}/storage/v1/b?project=test", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
        return name

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)


def start_fake_gcs_server() -> FakeGcsServer:
    binary = fake_gcs_server_binary()
    port = free_port()
    process = subprocess.Popen(
        [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port", str(port),
         "-public-host", f"127.0.0.1:{port}", "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server = FakeGcsServer(process, port)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{server.url}/storage/v1/b?project=test", timeout=2) as resp:
                resp.read()
            return server
        except OSError:
            if process.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {process.returncode}") from None
            time.sleep(0.1)
    server.stop()
    raise RuntimeError("fake-gcs-server did not answer within 30 s")
