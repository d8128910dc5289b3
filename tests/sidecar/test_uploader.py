"""The uploader against real stores (a folder, fake-gcs-server): copy, verify, markers, create-only
commit, several processes, fences, retries with back-off, retention."""

from __future__ import annotations

import collections
import json
import shutil
import threading
from pathlib import Path

import pytest
from resilax_ckpt import layout
from resilax_ckpt.metadata import StepMetadata
from resilax_ckpt.saving import retention
from resilax_sidecar.config import SidecarConfig
from resilax_sidecar.errors import StoreError, VerifyError
from resilax_sidecar.metrics import SidecarMetrics
from resilax_sidecar.store import BlobStore, GcsStore, LocalFolderStore
from resilax_sidecar.uploader import Uploader, plan_retry_wait
from sidecar_harness import attempt_files, committed_attempt, step_files, wait_until, write_local_step


def make_config(tmp_path: Path, **overrides) -> SidecarConfig:
    values = {
        "control_dir": tmp_path / "control",
        "checkpoint_dir": str(tmp_path / "persistent"),
        "local_dir": tmp_path / "local",
        "poll_seconds": 0.05,
        "retry_initial_seconds": 0.05,
        "retry_max_seconds": 0.2,
        "upload_concurrency": 4,
    }
    values.update(overrides)
    (tmp_path / "local").mkdir(parents=True, exist_ok=True)
    return SidecarConfig(**values)  # type: ignore[arg-type]


def committed_files(store: BlobStore, step: int) -> dict[str, int]:
    """The files of a committed step: those of the attempt its `_COMMIT` names."""
    return attempt_files(store, step)


def only_attempt(store: BlobStore, step: int) -> str:
    """The one attempt under an uncommitted step folder."""
    attempts = [n for n in store.list_dir(str(step)) if layout.is_attempt_name(n)]
    assert len(attempts) == 1, store.list_dir(str(step))
    return attempts[0]


class FailingStore:
    """The real store, with the first `failures` uploads raising (a storage outage), or corrupting
    what they write (a bad copy)."""

    def __init__(self, inner: BlobStore, failures: int, corrupt: bool = False) -> None:
        self._inner = inner
        self.url = inner.url
        self.failures = failures
        self.corrupt = corrupt
        self.calls = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def upload_file(self, local_path: Path, key: str) -> None:
        with self._lock:
            self.calls += 1
            fail = self.failures > 0
            self.failures -= 1 if fail else 0
        if fail and self.corrupt:
            self._inner.write_bytes(key, b"truncated")
            return
        if fail:
            raise StoreError(f"{self.url}: upload {key!r} failed: injected outage")
        self._inner.upload_file(local_path, key)


@pytest.fixture(params=["folder", pytest.param("gcs", marks=pytest.mark.gcs)])
def store(request, tmp_path) -> BlobStore:
    if request.param == "folder":
        return LocalFolderStore(tmp_path / "persistent")
    request.getfixturevalue("gcs_env")
    return GcsStore(f"{request.getfixturevalue('gcs_bucket')}/runs/job")


def test_a_local_step_is_copied_verified_marked_and_committed(tmp_path, store):
    config = make_config(tmp_path, checkpoint_dir=store.url, verify="md5")
    files = step_files(6, 70_000)
    write_local_step(config.local_dir, 10, files, generation=0)
    metrics = SidecarMetrics()
    uploader = Uploader(config, store, metrics)
    uploader.run_once()

    # Write-once: everything is in one attempt prefix; `_COMMIT`, beside it, names it.
    attempt = committed_attempt(store, 10)
    assert attempt == layout.upload_attempt_name(0, 0, 10)
    assert store.list_dir("10") == sorted(["_COMMIT", attempt])
    remote = committed_files(store, 10)
    assert set(remote) == {*files, "_METADATA.json", "_WRITER.0", "_UPLOADED.0"}
    for key, data in files.items():
        assert store.read_bytes(f"10/{attempt}/{key}") == data
    local_commit = json.loads((config.local_dir / "10" / "_COMMIT").read_bytes())
    # The library's own marker content, plus the attempt.
    assert json.loads(store.read_bytes("10/_COMMIT")) == {**local_commit, "step": 10, "era": 0, "attempt": attempt}
    marker = json.loads(store.read_bytes(f"10/{attempt}/_UPLOADED.0"))
    assert marker["generation"] == 0 and marker["files"]["_METADATA.json"] > 0
    assert uploader.state.newest_persisted == 10 and uploader.state.newest_local == 10
    assert metrics.uploads._value.get() == 1
    assert metrics.upload_bytes._value.get() == sum(len(d) for d in files.values()) + len(
        (config.local_dir / "10" / "_METADATA.json").read_bytes()
    )
    assert metrics.lag_steps._value.get() == 0

    # A second pass changes nothing and copies nothing.
    uploader.run_once()
    assert metrics.uploads._value.get() == 1 and metrics.commits._value.get() == 1
    # The library's reader finds the files where the marker says (resilax_ckpt.commit.step_data_path).
    from resilax_ckpt import commit, storage

    root = store.url
    assert commit.step_data_path(storage.open_storage(root), root, 10) == f"{root}/10/{attempt}"


def test_only_the_newest_new_step_is_uploaded(tmp_path):
    config = make_config(tmp_path)
    store = LocalFolderStore(tmp_path / "persistent")
    for step in (10, 20, 30):
        write_local_step(config.local_dir, step, step_files(2, 100, seed=step))
    uploader = Uploader(config, store, SidecarMetrics())
    uploader.run_once()
    assert uploader.state.committed_steps == [30]
    write_local_step(config.local_dir, 40, step_files(2, 100, seed=40))
    uploader.run_once()
    assert uploader.state.committed_steps == [30, 40]


def test_several_processes_combine_into_one_step_and_the_last_one_commits(tmp_path):
    store = LocalFolderStore(tmp_path / "persistent")
    shared = {"state/zarr.json": b'{"shape": [8]}'}
    uploaders = []
    for pid in range(3):
        config = make_config(tmp_path / f"host{pid}", checkpoint_dir=store.url, process_id=pid, num_processes=3)
        files = {**shared, f"state/leaf/c/{pid}": bytes([pid]) * 1000, f"state/process_{pid}.json": b"{}"}
        write_local_step(config.local_dir, 5, files, generation=2)
        # resilax_ckpt's local metadata carries each host's own save time: not the same bytes.
        meta = config.local_dir / "5" / "_METADATA.json"
        meta.write_bytes(meta.read_bytes().replace(b'"step"', b'"time": ' + str(1.5**pid).encode() + b', "step"'))
        uploaders.append(Uploader(config, store, SidecarMetrics()))
    uploaders[2].run_once()
    uploaders[0].run_once()
    assert store.stat("5/_COMMIT") is None, "committed before every process uploaded"
    assert len(store.list_dir("5")) == 1, "the hosts' uploads of one save did not meet in one attempt"
    uploaders[1].run_once()
    assert store.stat("5/_COMMIT") is not None
    assert {f"state/leaf/c/{p}" for p in range(3)} <= set(committed_files(store, 5))
    assert sum(u.metrics.commits._value.get() for u in uploaders) == 1
    uploaders[0].run_once()  # sees the commit; nothing more to do
    assert uploaders[0].state.newest_persisted == 5


def test_processes_sharing_one_host_folder_upload_their_own_metadata_as_the_step_metadata(tmp_path):
    store = LocalFolderStore(tmp_path / "persistent")
    local = tmp_path / "host"
    uploaders = []
    for pid in range(2):
        write_local_step(local, 3, {f"state/c/{pid}": b"x" * 10}, process_id=pid)
        config = make_config(tmp_path, local_dir=local, process_id=pid, num_processes=2)
        uploaders.append(Uploader(config, store, SidecarMetrics()))
    for u in uploaders:
        u.run_once()
    names = set(committed_files(store, 3))
    assert {"_METADATA.json", "state/c/0", "state/c/1"} <= names
    assert not any(n.startswith(("_METADATA.0", "_METADATA.1", "_COMMIT.")) for n in names)


def test_markers_of_another_save_of_the_same_step_never_commit_it(tmp_path):
    store = LocalFolderStore(tmp_path / "persistent")
    # Process 1's marker left by generation 1's save of step 7, which never committed, in the attempt
    # generation 2's save uses (as if a sidecar wrote a wrong marker there).
    attempt = layout.upload_attempt_name(0, 2, 7)
    store.write_bytes(f"7/{attempt}/_UPLOADED.1", json.dumps({"generation": 1, "files": {}}).encode())
    config = make_config(tmp_path, process_id=0, num_processes=2, generation=2)
    write_local_step(config.local_dir, 7, step_files(2, 100), generation=2)
    uploader = Uploader(config, store, SidecarMetrics())
    uploader.run_once()
    assert store.stat("7/_COMMIT") is None


def test_a_file_deleted_after_its_marker_blocks_the_commit_until_copied_again(tmp_path):
    store = LocalFolderStore(tmp_path / "persistent")
    config0 = make_config(tmp_path / "h0", checkpoint_dir=store.url, process_id=0, num_processes=2)
    config1 = make_config(tmp_path / "h1", checkpoint_dir=store.url, process_id=1, num_processes=2)
    write_local_step(config0.local_dir, 9, {"a/0": b"0" * 50})
    write_local_step(config1.local_dir, 9, {"a/1": b"1" * 50})
    uploader0 = Uploader(config0, store, SidecarMetrics())
    uploader0.run_once()
    attempt = only_attempt(store, 9)
    store.delete(f"9/{attempt}/a/0")
    uploader1 = Uploader(config1, store, SidecarMetrics())
    uploader1.run_once()
    assert store.stat("9/_COMMIT") is None
    # Process 0's sidecar notices its file is gone, withdraws its marker, copies it again, commits.
    uploader0.run_once()
    assert store.stat("9/_COMMIT") is None and store.stat(f"9/{attempt}/_UPLOADED.0") is None
    uploader0.run_once()
    assert store.read_bytes(f"9/{attempt}/a/0") == b"0" * 50 and committed_attempt(store, 9) == attempt


def test_a_newer_generations_fence_stops_the_commit(tmp_path):
    store = LocalFolderStore(tmp_path / "persistent")
    store.write_bytes("_fences/3.json", json.dumps({"generation": 3, "latest_step": 5}).encode())
    config = make_config(tmp_path, generation=2)
    write_local_step(config.local_dir, 8, step_files(1, 10), generation=2)
    uploader = Uploader(config, store, SidecarMetrics())
    with pytest.raises(StoreError, match="fenced out"):
        uploader.run_once()
    assert store.stat("8/_COMMIT") is None


def test_storage_errors_are_retried_with_back_off_and_counted(tmp_path, store):
    config = make_config(tmp_path, checkpoint_dir=store.url, upload_concurrency=1)
    files = step_files(3, 1000)
    write_local_step(config.local_dir, 4, files)
    flaky = FailingStore(store, failures=3)
    metrics = SidecarMetrics()
    uploader = Uploader(config, flaky, metrics)
    stop = threading.Event()
    thread = threading.Thread(target=uploader.run_forever, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_until(lambda: uploader.state.newest_persisted == 4, 60, "the step to be committed")
    finally:
        stop.set()
        uploader.wake()
        thread.join(10)
    assert metrics.upload_failures._value.get() == 3
    assert "injected outage" in (uploader.state.last_error or "")
    assert uploader.state.consecutive_failures == 0
    attempt = committed_attempt(store, 4)
    for key, data in files.items():
        assert store.read_bytes(f"4/{attempt}/{key}") == data


@pytest.mark.parametrize(("backoff", "draw", "wait"), [(8.0, 0.0, 4.0), (8.0, 0.5, 6.0), (8.0, 0.999, 7.996)],
                         ids=["least", "middle", "most"])
def test_the_retry_wait_is_half_the_back_off_plus_a_random_half(backoff, draw, wait):
    assert plan_retry_wait(backoff, draw) == pytest.approx(wait)


def test_failed_passes_wait_a_jittered_exponential_back_off(tmp_path):
    """After a storage incident, sidecars that failed together retry spread over the back-off window:
    each failed pass waits half its back-off plus a drawn share of the other half (injected draws)."""
    store = LocalFolderStore(tmp_path / "persistent")
    config = make_config(tmp_path, checkpoint_dir=store.url, upload_concurrency=1, retry_initial_seconds=1.0,
                         retry_max_seconds=4.0)
    write_local_step(config.local_dir, 4, step_files(1, 100))
    draws = iter([0.0, 1.0, 0.5, 0.25])
    uploader = Uploader(config, FailingStore(store, failures=4), SidecarMetrics(), draw=lambda: next(draws))
    waits = [uploader.tick() for _ in range(4)]
    assert waits == pytest.approx([0.5, 2.0, 3.0, 2.5])  # back-off 1, 2, 4, 4 (the max)
    assert uploader.tick() == config.poll_seconds and uploader.state.newest_persisted == 4


def test_a_bad_copy_fails_verification_and_is_redone(tmp_path):
    store = LocalFolderStore(tmp_path / "persistent")
    config = make_config(tmp_path, upload_concurrency=1)
    write_local_step(config.local_dir, 4, {"a": b"x" * 1000})
    uploader = Uploader(config, FailingStore(store, failures=1, corrupt=True), SidecarMetrics())
    with pytest.raises(VerifyError, match="after upload"):
        uploader.run_once()
    attempt = only_attempt(store, 4)
    assert store.stat("4/_COMMIT") is None and store.stat(f"4/{attempt}/_UPLOADED.0") is None
    uploader.run_once()
    assert store.read_bytes(f"4/{attempt}/a") == b"x" * 1000 and committed_attempt(store, 4) == attempt


def test_a_stale_upload_of_the_same_step_is_never_written_into(tmp_path):
    """Write-once: a file of the same name and size left by an older, uncommitted upload of step 6 (in
    its own attempt) is not replaced; the new save goes into an attempt of its own, which `_COMMIT`
    names. Not one write touches the old attempt; cleanup removes it whole once no marker names it."""
    store = LocalFolderStore(tmp_path / "persistent")
    old_attempt = layout.upload_attempt_name(0, 1, 6)  # generation 1's upload, never committed
    store.write_bytes(f"6/{old_attempt}/_WRITER.0", b"")
    store.write_bytes(f"6/{old_attempt}/a", b"y" * 100)

    class Recording(FailingStore):
        """Every key written or deleted, in order."""

        def __init__(self, inner: BlobStore) -> None:
            super().__init__(inner, failures=0)
            self.touched: list[str] = []

        def upload_file(self, local_path: Path, key: str) -> None:
            self.touched.append(f"upload {key}")
            super().upload_file(local_path, key)

        def write_bytes(self, key: str, data: bytes) -> None:
            self.touched.append(f"write {key}")
            self._inner.write_bytes(key, data)

        def create_bytes(self, key: str, data: bytes) -> bool:
            self.touched.append(f"create {key}")
            return self._inner.create_bytes(key, data)

        def delete_prefix(self, prefix: str) -> None:
            self.touched.append(f"delete_prefix {prefix}")
            self._inner.delete_prefix(prefix)

    recording = Recording(store)
    config = make_config(tmp_path)
    write_local_step(config.local_dir, 6, {"a": b"x" * 100}, generation=2)
    uploader = Uploader(config, recording, SidecarMetrics())
    uploader.run_once()
    attempt = committed_attempt(store, 6)
    assert attempt != old_attempt and attempt == layout.upload_attempt_name(0, 2, 6)
    assert store.read_bytes(f"6/{attempt}/a") == b"x" * 100
    # The old attempt was never written; process 0's pass deleted it whole after the commit.
    old = [t for t in recording.touched if old_attempt in t]
    assert old == [f"delete_prefix 6/{old_attempt}"], recording.touched
    assert recording.touched.index(old[0]) > recording.touched.index("create 6/_COMMIT")
    assert store.list_dir("6") == sorted(["_COMMIT", attempt])
    # A second upload of step 6 by the same save writes nothing.
    before = len(recording.touched)
    uploader.run_once()
    assert recording.touched[before:] == []


def test_a_committed_step_is_never_written_again_by_another_save_of_it(tmp_path):
    """Step 6 is committed by generation 2; generation 3 saved step 6 again (e.g. after restoring
    step 5) and its uploader runs: it writes nothing, the committed bytes and marker stay as they were."""
    store = LocalFolderStore(tmp_path / "persistent")
    first = make_config(tmp_path / "g2", checkpoint_dir=store.url, generation=2)
    write_local_step(first.local_dir, 6, {"a": b"x" * 100}, generation=2)
    Uploader(first, store, SidecarMetrics()).run_once()
    commit_before = store.read_bytes("6/_COMMIT")
    files_before = {k: store.read_bytes(f"6/{committed_attempt(store, 6)}/{k}") for k in committed_files(store, 6)}
    later = make_config(tmp_path / "g3", checkpoint_dir=store.url, generation=3)
    write_local_step(later.local_dir, 6, {"a": b"z" * 100}, generation=3)
    uploader = Uploader(later, store, SidecarMetrics())
    assert uploader.upload_step(uploader.read_local_step(6)) is True  # committed (by generation 2)
    assert store.read_bytes("6/_COMMIT") == commit_before
    attempt = committed_attempt(store, 6)
    assert {k: store.read_bytes(f"6/{attempt}/{k}") for k in committed_files(store, 6)} == files_before
    assert store.list_dir("6") == sorted(["_COMMIT", attempt]), "generation 3 wrote under step 6"


def test_retention_on_both_tiers(tmp_path):
    store = LocalFolderStore(tmp_path / "persistent")
    config = make_config(tmp_path, keep_last=2)
    metrics = SidecarMetrics()
    uploader = Uploader(config, store, metrics)
    for step in (1, 2, 3, 4):
        write_local_step(config.local_dir, step, step_files(1, 10, seed=step))
        uploader.run_once()
    assert uploader.state.committed_steps == [3, 4]
    assert sorted(store.list_dir("")) == ["3", "4"]
    assert sorted(p.name for p in config.local_dir.iterdir()) == ["3", "4"]
    assert metrics.retention_deletes.labels(tier="persistent")._value.get() == 2
    assert metrics.retention_deletes.labels(tier="local")._value.get() == 2


def test_persistent_retention_keeps_the_best_steps_by_their_metadata_metrics(tmp_path):
    """RESILAX_KEEP_BEST: the persistent tier keeps the 2 lowest losses (from each uploaded step's
    `_METADATA.json`), the newest, and by keep_last the newest step saved without the metric; the
    local tier keeps its newest `local_keep_last`. A restarted sidecar reads the metrics back."""
    reads: list[str] = []

    class CountingStore(LocalFolderStore):
        def read_bytes(self, key: str) -> bytes:
            reads.append(key)
            return super().read_bytes(key)

    store = CountingStore(tmp_path / "persistent")
    best = retention.KeepBest(2, "loss", "min")
    config = make_config(tmp_path, keep_last=1, local_keep_last=1, keep_best=best)
    losses = {1: 0.5, 2: 0.9, 3: 0.2, 4: None, 5: 0.8, 6: 0.7}
    uploader = Uploader(config, store, SidecarMetrics())
    for step, loss in losses.items():
        meta = StepMetadata(step, 0, 1, {}, metrics={} if loss is None else {"loss": loss}).to_bytes()
        write_local_step(config.local_dir, step, step_files(1, 10, seed=step), metadata=meta)
        if step == 6:  # a restarted sidecar: the metrics come from the uploaded metadata again
            uploader = Uploader(config, store, SidecarMetrics())
        uploader.run_once()
        if step == 4:  # 4 has no loss: kept while it is the newest
            assert sorted(map(int, store.list_dir(""))) == [1, 3, 4]
    # best 2: 3 (0.2) and 1 (0.5); the newest: 6; 4 (no loss) aged out by keep_last=1.
    assert sorted(map(int, store.list_dir(""))) == [1, 3, 6]
    assert sorted(p.name for p in config.local_dir.iterdir()) == ["6"]
    # each step's metadata is read once per sidecar life (steps are write-once), not once per pass:
    # steps 1-5 by the first sidecar, 1, 3, 5, 6 by the restarted one
    metadata_reads = collections.Counter(k.split("/")[0] for k in reads if k.endswith(layout.METADATA_FILE))
    assert metadata_reads == {"1": 2, "2": 1, "3": 2, "4": 1, "5": 2, "6": 1}, metadata_reads


def test_a_transient_metadata_read_error_never_deletes_the_best_step(tmp_path):
    """Issue 40, item 3: keep_last=2 and the best 1 by loss; a restarted sidecar's first read of the
    best step's metadata fails (a 503 is an OSError). That pass keeps the step rather than ranking it
    as "no metrics"; the next pass reads it again and keeps it as the best while the others age out."""
    failures: list[str] = []

    class FlakyStore(LocalFolderStore):
        def read_bytes(self, key: str) -> bytes:
            if key.startswith("1/") and key.endswith(layout.METADATA_FILE) and arm and not failures:
                failures.append(key)
                raise StoreError(f"{self.url}: read {key!r} failed: HttpError: 503 Service Unavailable")
            return super().read_bytes(key)

    arm = False
    store = FlakyStore(tmp_path / "persistent")
    config = make_config(tmp_path, keep_last=2, keep_best=retention.KeepBest(1, "loss", "min"))
    uploader = Uploader(config, store, SidecarMetrics())
    for step, loss in {1: 0.1, 2: 0.5, 3: 0.9, 4: 0.8}.items():
        meta = StepMetadata(step, 0, 1, {}, metrics={"loss": loss}).to_bytes()
        write_local_step(config.local_dir, step, step_files(1, 10, seed=step), metadata=meta)
        if step == 3:  # a restarted sidecar: it reads the metrics back from the uploaded metadata
            uploader, arm = Uploader(config, store, SidecarMetrics()), True
        uploader.run_once()
        if step == 3:
            assert failures and sorted(map(int, store.list_dir(""))) == [1, 2, 3]  # 1 unread: kept
    assert len(failures) == 1
    assert sorted(map(int, store.list_dir(""))) == [1, 3, 4]  # read again: the best; 2 aged out


def test_only_process_0_trims_the_persistent_tier(tmp_path):
    store = LocalFolderStore(tmp_path / "persistent")
    for step in (1, 2, 3):
        store.write_bytes(f"{step}/_COMMIT", b'{"generation": 0}')
    config = make_config(tmp_path, keep_last=1, process_id=1, num_processes=2)
    Uploader(config, store, SidecarMetrics()).run_once()
    assert sorted(store.list_dir("")) == ["1", "2", "3"]


def test_abandoned_partial_uploads_older_than_every_kept_step_are_cleared(tmp_path):
    """Only partial uploads a sidecar provably wrote (its `_WRITER.<i>` marker) are cleared; step-like
    folders of someone else's (an Orbax step, a year) are never touched."""
    store = LocalFolderStore(tmp_path / "persistent")
    store.write_bytes("1/_WRITER.0", b"")  # a sidecar's upload, never committed
    store.write_bytes("1/a", b"partial")
    store.write_bytes("2/_CHECKPOINT_METADATA", b"{}")  # an Orbax step beside ours
    store.write_bytes("3/notes.txt", b"mine")
    config = make_config(tmp_path, keep_last=1)
    write_local_step(config.local_dir, 5, step_files(1, 10))
    Uploader(config, store, SidecarMetrics()).run_once()
    assert store.list_dir("") == ["2", "3", "5"]
    assert store.read_bytes("2/_CHECKPOINT_METADATA") == b"{}" and store.read_bytes("3/notes.txt") == b"mine"


def test_a_commit_the_fences_hide_older_than_every_kept_step_is_cleared_but_a_bad_step_is_kept(tmp_path):
    """A stale generation's commit that landed after a newer generation's fence is never visible; once
    it is older than every kept step, process 0's retention deletes it (marker first). A step a restore
    marked bad is hidden too, but kept."""
    store = LocalFolderStore(tmp_path / "persistent")
    store.write_bytes("_fences/2.json", json.dumps({"generation": 2, "latest_step": 1}).encode())
    stale = layout.upload_attempt_name(0, 1, 3)
    store.write_bytes(f"3/{stale}/a", b"stale")
    store.write_bytes("3/_COMMIT", json.dumps({"generation": 1, "attempt": stale}).encode())
    store.write_bytes("2/_COMMIT", json.dumps({"generation": 2}).encode())
    store.write_bytes("2/a", b"bad")
    store.write_bytes("_bad/2.json", b'{"step": 2, "reason": "truncated"}')
    config = make_config(tmp_path, keep_last=1, generation=2)
    write_local_step(config.local_dir, 5, step_files(1, 10), generation=2)
    uploader = Uploader(config, store, SidecarMetrics())
    uploader.run_once()
    assert uploader.state.committed_steps == [5]
    assert sorted(store.list_dir("")) == ["2", "5", "_bad", "_fences"]
    assert store.read_bytes("2/a") == b"bad"


@pytest.mark.parametrize("urgent", [True, False], ids=["final-save-coming", "routine"])
def test_a_newer_local_step_supersedes_the_upload_in_flight_only_before_a_final_save(tmp_path, urgent):
    store = LocalFolderStore(tmp_path / "persistent")
    config = make_config(tmp_path, upload_concurrency=1)
    write_local_step(config.local_dir, 10, step_files(20, 100, seed=10))

    class SaveLandsDuringUpload(FailingStore):
        def upload_file(self, local_path, key):
            if self.calls == 2:  # the trainer commits step 20 locally while step 10 is being copied
                write_local_step(config.local_dir, 20, step_files(2, 100, seed=20))
            super().upload_file(local_path, key)

    ticks = iter(range(10**6))
    metrics = SidecarMetrics()
    uploader = Uploader(config, SaveLandsDuringUpload(store, failures=0), metrics, clock=lambda: float(next(ticks)))
    if urgent:
        uploader.urgent.set()
    uploader.run_once()
    if urgent:
        assert store.stat("10/_COMMIT") is None
        assert store.stat(f"10/{only_attempt(store, 10)}/_UPLOADED.0") is None
        assert len(store.list_files("10")) < 21, "step 10 was copied to the end"
    else:
        # Routine saves never starve the persistent tier: the upload in flight finishes first.
        assert uploader.state.committed_steps == [10]
    uploader.run_once()
    assert uploader.state.committed_steps == ([20] if urgent else [10, 20])
    assert metrics.upload_failures._value.get() == 0


def test_create_only_lets_exactly_one_of_racing_writers_win(store):
    """GCS: ifGenerationMatch=0, which fake-gcs-server v1.56.1 enforces; a folder: link()."""
    results: list[bool] = []
    barrier = threading.Barrier(6)

    def race(i: int) -> None:
        barrier.wait()
        results.append(store.create_bytes("3/_COMMIT", f"writer {i}".encode()))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == [False] * 5 + [True]
    winner = store.read_bytes("3/_COMMIT")
    assert winner.startswith(b"writer ")
    assert store.create_bytes("3/_COMMIT", b"late") is False and store.read_bytes("3/_COMMIT") == winner


def test_a_local_step_deleted_during_its_upload_is_dropped_without_a_failure(tmp_path):
    store = LocalFolderStore(tmp_path / "persistent")
    config = make_config(tmp_path, upload_concurrency=1)
    write_local_step(config.local_dir, 10, step_files(5, 100))

    class RetentionDuringUpload(FailingStore):
        def upload_file(self, local_path, key):
            if self.calls == 1:  # the trainer's local retention removes step 10 mid-upload
                shutil.rmtree(config.local_dir / "10")
            super().upload_file(local_path, key)

    metrics = SidecarMetrics()
    uploader = Uploader(config, RetentionDuringUpload(store, failures=0), metrics)
    uploader.run_once()
    assert store.stat("10/_COMMIT") is None and metrics.upload_failures._value.get() == 0


def test_local_keep_last_trims_the_local_tier_apart_from_the_persistent_one(tmp_path):
    store = LocalFolderStore(tmp_path / "persistent")
    config = make_config(tmp_path, keep_last=None, local_keep_last=2)
    uploader = Uploader(config, store, SidecarMetrics())
    for step in (1, 2, 3, 4):
        write_local_step(config.local_dir, step, step_files(1, 10, seed=step))
        uploader.run_once()
    assert sorted(p.name for p in config.local_dir.iterdir()) == ["3", "4"]
    assert sorted(store.list_dir("")) == ["1", "2", "3", "4"]  # keep_last unset: the persistent tier keeps all


def test_persist_every_steps_uploads_multiples_and_requested_steps_only(tmp_path):
    """The persistent tier lags the local one by design: steps 5, 6, 7 stay local (and the newest of them
    is not protected from local retention, it is never going to be uploaded), a requested step goes up."""
    store = LocalFolderStore(tmp_path / "persistent")
    config = make_config(tmp_path, persist_every_steps=4, local_keep_last=2)
    uploader = Uploader(config, store, SidecarMetrics())
    for step in range(1, 8):
        write_local_step(config.local_dir, step, step_files(1, 10, seed=step))
        uploader.run_once()
    assert uploader.state.committed_steps == [4]
    assert uploader.state.newest_local == 7 and uploader.state.newest_persisted == 4
    assert sorted(p.name for p in config.local_dir.iterdir()) == ["6", "7"]
    assert not uploader.persists(7)
    uploader.requested_steps.add(7)  # a final save answered step 7
    uploader.run_once()
    assert uploader.state.committed_steps == [4, 7]


def test_the_final_save_a_trainer_stopped_after_is_uploaded_at_once(tmp_path):
    """Graceful node shutdown: the trainer's own SIGTERM save (step 7, no request) is recorded in
    `stopped.json`; the uploader takes it at its next pass, while the trainer is still shutting down,
    although `persistEverySteps: 4` keeps 5 and 6 local."""
    from resilax_ckpt.control.requests import write_stop_record

    store = LocalFolderStore(tmp_path / "persistent")
    config = make_config(tmp_path, persist_every_steps=4)
    uploader = Uploader(config, store, SidecarMetrics())
    for step in range(4, 8):
        write_local_step(config.local_dir, step, step_files(1, 10, seed=step))
    uploader.run_once()
    assert uploader.state.committed_steps == [4]
    write_stop_record(str(config.control_dir), 7, sigterm=True)
    uploader.run_once()
    assert uploader.state.committed_steps == [4, 7]
    assert not uploader.persists(6) and uploader.urgent.is_set()


def test_a_local_step_a_restore_marked_bad_is_never_uploaded(tmp_path):
    """resilax_ckpt's two-tier restore marks a local step it could not read `<local>/_bad/<step>.json`:
    the sidecar leaves it out of its uploads (a corrupt copy never reaches the persistent tier), and
    local retention ages it out like any other step."""
    store = LocalFolderStore(tmp_path / "persistent")
    config = make_config(tmp_path, keep_last=2)
    for step in (5, 6):
        write_local_step(config.local_dir, step, step_files(1, 10, seed=step))
    (config.local_dir / "_bad").mkdir()
    (config.local_dir / "_bad" / "6.json").write_text('{"step": 6, "reason": "chunk file ... truncated"}')
    uploader = Uploader(config, store, SidecarMetrics())
    uploader.run_once()
    assert uploader.state.committed_steps == [5] and store.list_dir("") == ["5"]
    assert uploader.state.newest_local == 5
    for step in (7, 8):
        write_local_step(config.local_dir, step, step_files(1, 10, seed=step))
        uploader.run_once()
    assert sorted(p.name for p in config.local_dir.iterdir() if p.name.isdigit()) == ["7", "8"]


def test_a_link_or_a_fifo_in_a_local_step_is_never_followed_nor_waited_on(tmp_path):
    """Issue 40: the trainer owns the local tier. A data file that is a link (here to a file the sidecar
    may read and the trainer may not) is never uploaded through it, and a FIFO named as the metadata or
    as the commit marker never blocks the pass: the step is not uploaded, the error says why, and the
    uploader carries on."""
    import os

    from resilax_sidecar.upload_scan import NotRegularFileError

    store = LocalFolderStore(tmp_path / "persistent")
    config = make_config(tmp_path)
    uploader = Uploader(config, store, SidecarMetrics())
    write_local_step(config.local_dir, 4, step_files(2, 64))
    uploader.run_once()
    assert uploader.state.committed_steps == [4]

    secret = tmp_path / "node-secret"
    secret.write_bytes(b"not the trainer's to read")
    linked = write_local_step(config.local_dir, 8, step_files(2, 64))
    data = next(p for p in sorted(linked.rglob("*")) if p.is_file() and not p.name.startswith("_"))
    data.unlink()
    data.symlink_to(secret)
    with pytest.raises(NotRegularFileError, match="is not a regular file"):
        uploader.run_once()
    assert uploader.state.committed_steps == [4] and store.stat("8/_COMMIT") is None
    assert secret.read_bytes() == b"not the trainer's to read"
    shutil.rmtree(linked)

    folder = write_local_step(config.local_dir, 12, step_files(2, 64))
    (folder / layout.METADATA_FILE).unlink()
    os.mkfifo(folder / layout.METADATA_FILE)  # nobody ever writes it: a read would wait forever
    outcome: list[BaseException | None] = []

    def one_pass() -> None:
        try:
            uploader.run_once()
            outcome.append(None)
        except BaseException as e:  # handed to the test's thread
            outcome.append(e)

    worker = threading.Thread(target=one_pass, daemon=True)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the pass blocked on a FIFO named as the metadata"
    assert outcome and isinstance(outcome[0], NotRegularFileError), outcome
    assert store.stat("12/_COMMIT") is None
    shutil.rmtree(folder)
    # A commit marker that is a link (to a committed step's marker) commits nothing.
    folder = write_local_step(config.local_dir, 16, step_files(2, 64))
    (folder / layout.COMMIT_FILE).unlink()
    (folder / layout.COMMIT_FILE).symlink_to(config.local_dir / "4" / layout.COMMIT_FILE)
    uploader.run_once()
    assert store.stat("16/_COMMIT") is None
    shutil.rmtree(folder)
    write_local_step(config.local_dir, 20, step_files(2, 64))
    uploader.run_once()  # and it carries on with the next good step
    assert uploader.state.committed_steps == [4, 20]


def test_a_step_is_known_never_to_commit_while_a_lost_process_of_its_generation_has_not_uploaded(tmp_path):
    """`lost_uploads` (the final save's early end, app.Sidecar._wait_persisted): only the lost processes
    of the step's own generation count, never this process, never one that uploaded before it died."""
    store = LocalFolderStore(tmp_path / "persistent")
    configs = [make_config(tmp_path / f"h{p}", checkpoint_dir=store.url, process_id=p, num_processes=2, generation=3)
               for p in range(2)]
    for config in configs:
        write_local_step(config.local_dir, 9, {f"a/{config.process_id}": b"x" * 50}, generation=3)
    first = Uploader(configs[0], store, SidecarMetrics())
    first.run_once()
    assert store.stat("9/_COMMIT") is None
    assert first.lost_uploads(9, {3: [1]}) == [1]
    assert first.lost_uploads(9, {3: [1, 0, 7]}) == [1]  # itself and a process the save never had: not counted
    assert first.lost_uploads(9, {2: [1], 4: [1]}) == []  # another generation numbers its processes otherwise
    assert first.lost_uploads(9, {}) == []
    Uploader(configs[1], store, SidecarMetrics()).run_once()  # process 1 uploaded after all: it commits
    assert store.stat("9/_COMMIT") is not None
    assert first.lost_uploads(9, {3: [1]}) == []
