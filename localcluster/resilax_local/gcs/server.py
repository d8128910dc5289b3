"""fake-gcs-server as a local process: a GCS endpoint for `gs://` tests (tensorstore, gcsfs, the sidecar).

    with FakeGCS().start() as gcs:
        gcs.create_bucket("ckpt")
        os.environ.update(gcs.env)      # STORAGE_EMULATOR_HOST, TENSORSTORE_GCS_HTTP_URL, ...
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import urllib3

from ..binaries import ensure_fake_gcs_server
from ..errors import StartError
from ..processes import PortTaken, on_free_port, spawn, stop_group
from ..tier_guard import refuse_in_fast_tier


class FakeGCS:
    """One fake-gcs-server on 127.0.0.1 (HTTP, in-memory unless `data_dir` is given)."""

    def __init__(self, log_dir: Path | None = None, data_dir: Path | None = None) -> None:
        self.port = 0
        """Its port, chosen free at `start` (again when another program took it first)."""
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="resilax-fake-gcs-"))
        self.data_dir = data_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self._http = urllib3.PoolManager(retries=False)
        self._buckets = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What clients need to talk to it instead of Google (tensorstore, gcsfs, google-cloud-storage)."""
        return {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "resilax-local",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }

    def start(self, timeout: float = 30.0) -> FakeGCS:
        refuse_in_fast_tier("fake-gcs-server", "gcs")
        return on_free_port(lambda port: self._start_on(port, timeout))

    def _start_on(self, port: int, timeout: float) -> FakeGCS:
        self.port = port
        log_path = self.log_dir / "fake-gcs-server.log"
        argv = [str(ensure_fake_gcs_server()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                "-public-host", f"127.0.0.1:{self.port}", "-external-url", self.url, "-log-level", "warn"]
        if self.data_dir:
            argv += ["-backend", "filesystem", "-filesystem-root", str(self.data_dir)]
        else:
            argv += ["-backend", "memory"]
        seen = log_path.stat().st_size if log_path.exists() else 0
        self.proc = spawn(argv, log_path)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                if "address already in use" in log_path.read_bytes()[seen:].decode(errors="replace"):
                    raise PortTaken(f"fake-gcs-server: port {port} taken")
                raise StartError(f"fake-gcs-server exited with {code}; see {self.log_dir}")
            try:
                if self._http.request("GET", f"{self.url}/storage/v1/b", timeout=2).status == 200:
                    return self
            except urllib3.exceptions.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise StartError(f"fake-gcs-server did not answer on {self.url} within {timeout:.0f} s")

    def create_bucket(self, name: str | None = None) -> str:
        """Create the bucket `name` (a fresh one when None; an existing one is fine); its name."""
        if name is None:
            self._buckets += 1
            name = f"bucket-{os.getpid()}-{self._buckets}"
        resp = self._http.request("POST", f"{self.url}/storage/v1/b?project=resilax-local",
                                  body=json.dumps({"name": name}).encode(),
                                  headers={"Content-Type": "application/json"})
        if resp.status not in (200, 409):
            raise StartError(f"creating bucket {name!r}: HTTP {resp.status} {resp.data.decode(errors='replace')}")
        return name

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc.pid, timeout=5.0, proc=self.proc)
            self.proc = None

    def __enter__(self) -> FakeGCS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
