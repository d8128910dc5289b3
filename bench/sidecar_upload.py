"""Upload throughput of the sidecar's uploader: one local step to a local folder and to fake-gcs-server.

Runs the real `Uploader.run_once` (copy with N workers, verify, marker, create-only commit) on a
synthetic step of random bytes, each target and concurrency interleaved and repeated, and prints MB/s.

    python bench/sidecar_upload.py [--mib 128] [--file-mib 4] [--concurrency 1,4,8] [--repeat 2]
    python bench/sidecar_upload.py --trainer [--mib 128] [--repeat 3]

`--trainer` measures instead what the training loop sees: resilax_ckpt's `save()` (the blocking part of
an async save) and `save()` + `wait()` (until committed) for a float32 state of `--mib` MiB, saved to the
local tier (a folder in /dev/shm, as `checkpoint.local.medium: Memory`), to a disk folder, and straight
to gs:// on fake-gcs-server, interleaved.

fake-gcs-server is the local cluster's build (resilax_local.binaries), started here on a free port with
the in-memory backend. Its numbers measure the sidecar plus gcsfs plus the emulator on this machine,
not real GCS.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from resilax_local.processes import free_port
from resilax_sidecar.config import SidecarConfig
from resilax_sidecar.metrics import SidecarMetrics
from resilax_sidecar.store import BlobStore, GcsStore, LocalFolderStore
from resilax_sidecar.uploader import Uploader


def start_fake_gcs() -> tuple[subprocess.Popen[bytes], str]:
    from resilax_local.binaries import ensure_fake_gcs_server

    port = free_port()
    proc = subprocess.Popen(
        [str(ensure_fake_gcs_server()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
         "-port", str(port), "-log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            urllib.request.urlopen(f"{url}/storage/v1/b", timeout=1).close()
            return proc, url
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("fake-gcs-server did not start")


def create_bucket(url: str) -> str:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    req = urllib.request.Request(f"{url}/storage/v1/b", data=json.dumps({"name": name}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(req, timeout=10).close()
    return name


def write_step(local: Path, step: int, total_mib: int, file_mib: int) -> int:
    folder = local / str(step)
    n_files = max(1, total_mib // file_mib)
    for i in range(n_files):
        path = folder / "params" / f"leaf{i}" / "c" / "0"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(file_mib << 20))
    (folder / "_METADATA.json").write_text(json.dumps({"step": step, "generation": 0}))
    (folder / "_COMMIT").write_text(json.dumps({"generation": 0}))
    return n_files * (file_mib << 20)


def upload_once(local: Path, store: BlobStore, concurrency: int, workdir: Path) -> float:
    config = SidecarConfig(control_dir=workdir / "control", checkpoint_dir=store.url, local_dir=local,
                           upload_concurrency=concurrency)
    uploader = Uploader(config, store, SidecarMetrics())
    started = time.perf_counter()
    uploader.run_once()
    seconds = time.perf_counter() - started
    assert uploader.state.newest_persisted is not None, "the step was not committed"
    return seconds


def bench_trainer(mib: int, repeat: int, url: str, work: Path) -> None:
    """Blocking time of resilax_ckpt saves with and without the local tier (see the module docstring)."""
    os.environ.update(TENSORSTORE_GCS_HTTP_URL=url, GOOGLE_AUTH_TOKEN_FOR_TESTING="bench")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import numpy as np
    import resilax_ckpt as rc

    floats = (mib << 20) // 4
    state = {"w": np.random.default_rng(0).standard_normal(floats, dtype=np.float32)}
    shm = Path(tempfile.mkdtemp(prefix="resilax-bench-local-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    results: dict[str, list[tuple[float, float]]] = {}
    try:
        for r in range(repeat):
            for target in ("local tier (/dev/shm)", "disk folder", "gs:// (fake-gcs-server)"):
                if target.startswith("local"):
                    root, local_tier = str(shm / f"r{r}"), True
                elif target.startswith("disk"):
                    root, local_tier = str(work / f"disk-{r}"), False
                else:
                    root, local_tier = f"gs://{create_bucket(url)}/run", False
                with rc.CheckpointManager(root, rc.ManagerOptions(local_tier=local_tier)) as mgr:
                    started = time.perf_counter()
                    mgr.save(1, {"params": state}, force=True)
                    blocked = time.perf_counter() - started
                    mgr.wait()
                    committed = time.perf_counter() - started
                results.setdefault(target, []).append((blocked, committed))
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    print(f"resilax_ckpt save of {mib} MiB float32, {repeat} runs each; seconds (median): save() returns / committed")
    for target, runs in results.items():
        blocked = statistics.median(b for b, _ in runs)
        committed = statistics.median(c for _, c in runs)
        print(f"  {target:<24} {blocked:6.3f} / {committed:6.2f}  ({mib / 1.048576 / committed:.0f} MB/s to commit)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="size of the step (MiB)")
    parser.add_argument("--file-mib", type=int, default=4, help="size of each file (MiB)")
    parser.add_argument("--concurrency", default="1,4,8", help="worker counts to try")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--targets", default="folder,gcs")
    parser.add_argument("--trainer", action="store_true", help="measure the trainer's blocking time instead")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    targets = args.targets.split(",")

    work = Path(tempfile.mkdtemp(prefix="resilax-bench-upload-"))
    fake = None
    try:
        if args.trainer:
            fake, url = start_fake_gcs()
            os.environ.update(STORAGE_EMULATOR_HOST=url, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
            bench_trainer(args.mib, args.repeat, url, work)
            return 0
        local = work / "local"
        nbytes = write_step(local, 1, args.mib, args.file_mib)
        if "gcs" in targets:
            fake, url = start_fake_gcs()
            os.environ.update(STORAGE_EMULATOR_HOST=url, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false",
                              TENSORSTORE_GCS_HTTP_URL=url, GOOGLE_AUTH_TOKEN_FOR_TESTING="bench")
        results: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.repeat):
            for concurrency in concurrencies:
                for target in targets:  # interleaved: the machine's speed drifts
                    if target == "folder":
                        dest = work / f"persistent-{uuid.uuid4().hex[:6]}"
                        store: BlobStore = LocalFolderStore(dest)
                    else:
                        store = GcsStore(f"gs://{create_bucket(url)}/run")
                    seconds = upload_once(local, store, concurrency, work)
                    results.setdefault((target, concurrency), []).append(nbytes / seconds / 1e6)
                    if target == "folder":
                        shutil.rmtree(dest)
                    else:
                        store.delete_prefix("1")
        print(f"step of {nbytes / 2**20:.0f} MiB in {max(1, args.mib // args.file_mib)} files of {args.file_mib} MiB; "
              f"{args.repeat} runs each; MB/s (median, min-max)")
        for (target, concurrency), rates in sorted(results.items()):
            print(f"  {target:<7} concurrency {concurrency:>2}: {statistics.median(rates):7.1f}  "
                  f"({min(rates):.1f}-{max(rates):.1f})")
    finally:
        if fake is not None:
            fake.terminate()
            fake.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
