"""The sidecar's peak memory while it uploads one big file, against its idle memory.

Starts a real `resilax sidecar` (local tier + persistent tier: a folder, or gs:// on fake-gcs-server),
waits until it is ready and idle, reads its RSS, resets its peak (`/proc/<pid>/clear_refs`, 5), writes
one locally committed step holding `--files` files (default 1) of `--mib` MiB of random bytes, waits until
`/v1/state` shows the step persisted, and reads the peak (`VmHWM`). Prints the idle RSS, the peak and
their difference, in MiB, per target and round.

    python bench/sidecar_memory.py [--mib 256] [--files 1] [--targets folder,gcs] [--rounds 2]

Linux only (procfs). fake-gcs-server is the local cluster's build (resilax_local.binaries).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from resilax_local.processes import free_port


def proc_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return dict(json.loads(resp.read()))


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def start_fake_gcs(work: Path) -> tuple[subprocess.Popen[bytes], dict[str, str], str]:
    from resilax_local.binaries import ensure_fake_gcs_server

    port = free_port()
    proc = subprocess.Popen(
        [str(ensure_fake_gcs_server()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
         "-port", str(port), "-log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).status == 200, 30, "fake-gcs-server")
    bucket = f"mem-{uuid.uuid4().hex[:8]}"
    req = urllib.request.Request(f"{url}/storage/v1/b?project=p", data=json.dumps({"name": bucket}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=10).close()
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "x",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false", "GOOGLE_CLOUD_PROJECT": "p"}
    return proc, env, f"gs://{bucket}/run"


def one_round(target: str, mib: int, files: int, work: Path, gcs: tuple[dict[str, str], str] | None
              ) -> dict[str, Any]:
    local = work / "local"
    control = work / "control"
    persistent = str(work / "persistent") if gcs is None else gcs[1] + f"-{uuid.uuid4().hex[:6]}"
    (work / "token").write_text("bench-token\n")
    port = free_port()
    env = {**os.environ, **(gcs[0] if gcs else {}), "RESILAX_LOCAL_DIR": str(local),
           "RESILAX_CONTROL_DIR": str(control), "RESILAX_CHECKPOINT_DIR": persistent,
           "RESILAX_SIDECAR_TOKEN_FILE": str(work / "token"), "RESILAX_SIDECAR_HOST": "127.0.0.1",
           "RESILAX_SIDECAR_PORT": str(port), "RESILAX_SIDECAR_POLL_SECONDS": "0.2"}
    resilax = Path(sys.executable).with_name("resilax")
    log = open(work / "sidecar.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([str(resilax), "sidecar"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: urllib.request.urlopen(f"{base}/readyz", timeout=2).status == 200, 120, "the sidecar")
        time.sleep(3)  # idle passes (every 0.2 s) before the baseline
        idle = proc_kib(proc.pid, "VmRSS")
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        step = local / "100"
        tmp = local / ".tmp-100"
        (tmp / "state" / "w" / "c").mkdir(parents=True)
        for i in range(files):
            with open(tmp / "state" / "w" / "c" / str(i), "wb") as f:
                for _ in range(mib):
                    f.write(os.urandom(1 << 20))
        (tmp / "_METADATA.json").write_text(json.dumps({"version": 1, "step": 100, "generation": 0}))
        (tmp / "_COMMIT").write_text(json.dumps({"generation": 0, "time": time.time()}))
        started = time.monotonic()
        tmp.rename(step)

        wait_for(lambda: get_json(f"{base}/v1/state").get("newest_persisted_step") == 100, 600, "the upload")
        seconds = time.monotonic() - started
        peak = proc_kib(proc.pid, "VmHWM")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return {"target": target, "files": files, "file_mib": mib, "idle_rss_mib": round(idle / 1024, 1),
            "peak_rss_mib": round(peak / 1024, 1), "peak_above_idle_mib": round((peak - idle) / 1024, 1),
            "upload_seconds": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--files", type=int, default=1, help="files of --mib MiB each in the step")
    parser.add_argument("--targets", default="folder,gcs")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    targets = args.targets.split(",")
    fake = None
    gcs = None
    if "gcs" in targets:
        fake, env, url = start_fake_gcs(Path(tempfile.mkdtemp()))
        gcs = (env, url)
    results = []
    try:
        for _ in range(args.rounds):
            for target in targets:
                work = Path(tempfile.mkdtemp(prefix="sidecar-mem-"))
                try:
                    result = one_round(target, args.mib, args.files, work, gcs if target == "gcs" else None)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                print(json.dumps(result), flush=True)
                results.append(result)
    finally:
        if fake is not None:
            fake.terminate()
            fake.wait(10)


if __name__ == "__main__":
    main()
