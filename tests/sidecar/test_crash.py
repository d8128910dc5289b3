"""`resilax sidecar` killed (SIGKILL) in the middle of an upload to fake-gcs-server: no partial step
ever looks committed, and the next sidecar finishes the upload, re-copying only what is missing."""

from __future__ import annotations

import hashlib
import json
import signal
import threading

import pytest
from resilax_sidecar.store import GcsStore
from sidecar_harness import committed_attempt, step_files, wait_until, write_local_step

pytestmark = pytest.mark.gcs


def test_sigkill_mid_upload_never_exposes_a_partial_step_and_the_next_start_completes_it(
    tmp_path, sidecar_env, start_sidecar, gcs_bucket, gcs_env
):
    persistent = f"{gcs_bucket}/run"
    local = tmp_path / "local"
    files = step_files(240, 32 * 1024)
    write_local_step(local, 12, files, generation=0)
    total = len(files) + 1  # + _METADATA.json
    env = {
        **sidecar_env,
        **gcs_env,
        "RESILAX_LOCAL_DIR": str(local),
        "RESILAX_CHECKPOINT_DIR": persistent,
        "RESILAX_SIDECAR_UPLOAD_CONCURRENCY": "1",
    }
    store = GcsStore(persistent)

    # Someone reading the persistent tier all along: whenever _COMMIT exists, every file is there.
    violations: list[str] = []
    stop_watching = threading.Event()

    def watch() -> None:
        reader = GcsStore(persistent)
        while not stop_watching.is_set():
            listing = reader.list_files("12")
            if "_COMMIT" in listing:
                # Write-once uploads: the files are in the attempt the marker names.
                attempt = json.loads(reader.read_bytes("12/_COMMIT"))["attempt"]
                data = [k for k in listing if k.startswith(f"{attempt}/") and not k.split("/")[1].startswith("_")]
                if len(data) < len(files):
                    violations.append(f"_COMMIT naming {attempt} with only {len(data)} data objects")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        first = start_sidecar(env)
        n_before = wait_until(
            lambda: (n := len(store.list_files("12"))) >= 20 and n,
            60,
            "the upload to be under way",
            interval=0.01,
        )
        first.signal(signal.SIGKILL)
        assert first.wait(10) == -signal.SIGKILL
        partial = store.list_files("12")
        # + the attempt's _WRITER.0 marker
        assert n_before <= len(partial) < total + 1, f"the upload finished before the kill ({len(partial)} files)"
        assert "_COMMIT" not in partial and not any(k.endswith("/_UPLOADED.0") for k in partial)

        second = start_sidecar(env)
        wait_until(lambda: store.stat("12/_COMMIT") is not None, 60, "the resumed upload to commit")
        state = second.get("/v1/state").body
        assert state["newest_persisted_step"] == 12 and state["newest_local_step"] == 12
        copied = second.metric("resilax_sidecar_upload_bytes_total")
        assert 0 < copied < sum(len(d) for d in files.values()), "the resumed upload re-copied everything"
    finally:
        stop_watching.set()
        watcher.join(10)
    assert not violations, violations
    attempt = committed_attempt(store, 12)  # the killed sidecar's attempt, resumed by the next one
    assert store.list_dir("12") == sorted(["_COMMIT", attempt])
    for key, data in files.items():
        assert store.md5(f"12/{attempt}/{key}") == hashlib.md5(data).hexdigest(), key
