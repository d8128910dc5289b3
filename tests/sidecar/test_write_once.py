"""Write-once uploads (issue 16, item 2, the sidecar's half): a stale generation's uploaders keep
uploading the same step numbers after a newer generation committed them. The committed bytes stay
checksum-equal, no stale step becomes visible, and what the stale uploads left is removed later —
on a folder and on gs:// (fake-gcs-server), with two uploaders (processes) per generation, and on gs://
with real `resilax sidecar` processes (one frozen with SIGSTOP mid-upload)."""

from __future__ import annotations

import hashlib
import json
import signal
import threading
from pathlib import Path

import pytest
from resilax_ckpt import commit, layout
from resilax_ckpt.history import fencing
from resilax_ckpt.storage import open_storage
from resilax_sidecar.config import SidecarConfig
from resilax_sidecar.errors import StoreError
from resilax_sidecar.metrics import SidecarMetrics
from resilax_sidecar.store import BlobStore, GcsStore, LocalFolderStore
from resilax_sidecar.uploader import Uploader
from sidecar_harness import build_sidecar_env, committed_attempt, step_files, wait_until, write_local_step


@pytest.fixture(params=["folder", pytest.param("gcs", marks=pytest.mark.gcs)])
def store(request, tmp_path) -> BlobStore:
    if request.param == "folder":
        return LocalFolderStore(tmp_path / "persistent")
    request.getfixturevalue("gcs_env")
    return GcsStore(f"{request.getfixturevalue('gcs_bucket')}/runs/zombie")


class PausingStore:
    """The real store; the `pause_after`-th file upload (or the commit) waits until `resume` is set,
    as a process frozen by a partition would."""

    def __init__(self, inner: BlobStore, pause_after: int | None = None, pause_commit: bool = False) -> None:
        self._inner = inner
        self.url = inner.url
        self.pause_after = pause_after
        self.pause_commit = pause_commit
        self.uploads = 0
        self.paused = threading.Event()
        self.resume = threading.Event()
        self.written_after_resume: list[str] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)

    def _pause(self) -> None:
        self.paused.set()
        assert self.resume.wait(120), "never resumed"

    def upload_file(self, local_path: Path, key: str) -> None:
        with self._lock:
            self.uploads += 1
            pause = self.uploads == self.pause_after
        if pause:
            self._pause()
        self._inner.upload_file(local_path, key)
        self._note(key)

    def _note(self, key: str) -> None:
        if self.resume.is_set():
            with self._lock:
                self.written_after_resume.append(key)

    def write_bytes(self, key: str, data: bytes) -> None:
        self._inner.write_bytes(key, data)
        self._note(key)

    def create_bytes(self, key: str, data: bytes) -> bool:
        if self.pause_commit and key.endswith("/_COMMIT"):
            self._pause()
        return self._inner.create_bytes(key, data)


def host_files(seed: int, pid: int) -> dict[str, bytes]:
    """One host's files of a step: a shared array header and this host's own chunks."""
    return {"params/w/zarr.json": b'{"shape": [4, 8]}',
            f"params/w/c/{pid}/0": bytes([seed, pid]) * 4096,
            f"params/w/c/{pid}/1": bytes([pid, seed]) * 4096}


def uploaders(tmp_path: Path, store: BlobStore, generation: int, steps: dict[int, int],
              wrap=lambda s, pid: s) -> list[Uploader]:
    """A generation's two sidecars, each with its own local tier holding `steps` (step -> seed)."""
    out = []
    for pid in range(2):
        config = SidecarConfig(control_dir=tmp_path / f"g{generation}h{pid}" / "control",  # type: ignore[call-arg]
                               checkpoint_dir=store.url, local_dir=tmp_path / f"g{generation}h{pid}" / "local",
                               process_id=pid, num_processes=2, generation=generation, upload_concurrency=2)
        for step, seed in steps.items():
            write_local_step(config.local_dir, step, host_files(seed, pid), generation=generation)
        out.append(Uploader(config, wrap(store, pid), SidecarMetrics()))
    return out


def write_fence(store: BlobStore, generation: int, latest: int | None) -> None:
    """What the newer generation's primary writes at start (resilax_ckpt.history.fencing.write_fence)."""
    body = {"era": 0, "generation": generation, "latest_step": latest}
    store.write_bytes(f"{layout.FENCES_DIR}/{fencing.fence_name((0, generation))}", json.dumps(body).encode())


def snapshot(store: BlobStore, step: int) -> dict[str, str]:
    """SHA-256 of `_COMMIT` and of every object in the attempt it names."""
    attempt = committed_attempt(store, step)
    out = {"_COMMIT": hashlib.sha256(store.read_bytes(f"{step}/_COMMIT")).hexdigest()}
    for key in store.list_files(f"{step}/{attempt}"):
        out[f"{attempt}/{key}"] = hashlib.sha256(store.read_bytes(f"{step}/{attempt}/{key}")).hexdigest()
    return out


def visible(store: BlobStore) -> list[int]:
    """The steps the library's readers see (resilax_ckpt.commit.list_visible)."""
    return commit.list_visible(open_storage(store.url), store.url)


def run_catching(uploader: Uploader, errors: list[BaseException]) -> None:
    """One pass; its error recorded (run_forever would record it and retry)."""
    try:
        uploader.run_once()
    except BaseException as e:
        errors.append(e)


def run_all(group: list[Uploader]) -> list[BaseException]:
    """One pass of each uploader, all at once; their errors."""
    errors: list[BaseException] = []
    threads = [threading.Thread(target=run_catching, args=(u, errors)) for u in group]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return errors


def test_a_stale_generation_uploading_the_same_steps_never_changes_a_committed_one(tmp_path, store):
    store.write_bytes("2024/notes.txt", b"not Resilax's")  # foreign data beside the steps
    # Generation 1 commits step 10, then starts uploading its step 20 and freezes mid-copy.
    zombies = uploaders(tmp_path, store, 1, {10: 1}, wrap=lambda s, pid: PausingStore(s, pause_after=2))
    for z in zombies:
        z.store.pause_after = None  # type: ignore[attr-defined]
    assert run_all(zombies) == [] and visible(store) == [10]
    for pid, z in enumerate(zombies):
        write_local_step(z.local_dir, 20, host_files(1, pid), generation=1)
        z.store.pause_after = z.store.uploads + 2  # type: ignore[attr-defined]
    zombie_errors: list[BaseException] = []
    frozen = [threading.Thread(target=run_catching, args=(z, zombie_errors)) for z in zombies]
    for t in frozen:
        t.start()
    for z in zombies:
        assert z.store.paused.wait(60)  # type: ignore[attr-defined]

    # Generation 2 starts (its fence: step 10 was the newest committed), saves step 20 with other
    # bytes and its sidecars commit it.
    write_fence(store, 2, 10)
    newer = uploaders(tmp_path, store, 2, {20: 2})
    assert run_all(newer) == []
    assert visible(store) == [10, 20]
    committed = snapshot(store, 20)
    won = committed_attempt(store, 20)
    assert won == layout.upload_attempt_name(0, 2, 20)

    # The stale uploaders wake up and finish their upload of step 20, then go on with step 30 and
    # upload step 20 once more.
    for z in zombies:
        z.store.resume.set()  # type: ignore[attr-defined]
    for t in frozen:
        t.join(120)
    # A stale pass may fail (process 0's cleanup can delete the attempt under process 1's copy): the
    # sidecar records and retries it; what matters is what reaches the store.
    print("stale passes:", zombie_errors)
    for pid, z in enumerate(zombies):
        write_local_step(z.local_dir, 30, host_files(1, pid), generation=1)
    errors = run_all(zombies)
    assert errors and all(isinstance(e, StoreError) and "fenced out" in str(e) for e in errors), errors
    for z in zombies:
        assert z.upload_step(z.read_local_step(20)) is True  # committed, by generation 2: nothing written

    # The committed step is byte-for-byte what generation 2 committed; no stale step is visible.
    assert snapshot(store, 20) == committed
    for pid in range(2):
        for key, data in host_files(2, pid).items():
            assert store.read_bytes(f"20/{won}/{key}") == data
    assert visible(store) == [10, 20]
    assert store.stat("30/_COMMIT") is None
    stale = layout.upload_attempt_name(0, 1, 20)
    late = [k for z in zombies for k in z.store.written_after_resume if k.startswith(f"20/{stale}/")]  # type: ignore[attr-defined]
    assert any(k.endswith("/_UPLOADED.0") for k in late) and any("/params/" in k for k in late), (
        "the stale uploaders wrote nothing after the commit (the test tests nothing)")
    root = store.url
    assert commit.step_data_path(open_storage(root), root, 20) == f"{root}/20/{won}"

    # Cleanup later (a restarted sidecar of process 0, or the library at the next generation's start)
    # removes the attempt no marker names; foreign data is untouched.
    uploaders(tmp_path / "restart", store, 2, {})[0].run_once()
    assert store.list_dir("20") == sorted(["_COMMIT", won])
    assert snapshot(store, 20) == committed
    assert store.read_bytes("2024/notes.txt") == b"not Resilax's"


def test_a_stale_commit_that_landed_after_the_fence_is_hidden_and_replaced_by_the_newer_save(tmp_path, store):
    """Generation 1's sidecars passed the fence check before generation 2's fence appeared and created
    `_COMMIT` of step 30 after it: the fence hides that commit; generation 2's upload of step 30 goes
    into an attempt of its own and re-points the marker; the stale attempt's bytes are never written
over, and cleanup removes that attempt once no marker names it."""
    zombies = uploaders(tmp_path, store, 1, {30: 1}, wrap=lambda s, pid: PausingStore(s, pause_commit=pid == 0))
    zombies[1].run_once()  # uploads; waits for process 0's upload to commit
    frozen = threading.Thread(target=zombies[0].run_once)  # uploads, checks the fences, freezes
    frozen.start()
    assert zombies[0].store.paused.wait(60)  # type: ignore[attr-defined]
    write_fence(store, 2, None)  # generation 2 starts: nothing was committed
    zombies[0].store.resume.set()  # type: ignore[attr-defined]
    frozen.join(120)
    stale = layout.upload_attempt_name(0, 1, 30)
    assert committed_attempt(store, 30) == stale, "the stale commit did not land (the test tests nothing)"
    stale_bytes = {k: store.read_bytes(f"30/{stale}/{k}") for k in store.list_files(f"30/{stale}")}
    assert visible(store) == []

    newer = uploaders(tmp_path, store, 2, {30: 2})
    assert run_all(newer) == []
    won = committed_attempt(store, 30)
    assert won == layout.upload_attempt_name(0, 2, 30) and visible(store) == [30]
    for pid in range(2):
        for key, data in host_files(2, pid).items():
            assert store.read_bytes(f"30/{won}/{key}") == data
    # The stale attempt's bytes were never written over; cleanup (process 0's pass after the commit, or
    # a restarted one's) removes the attempt no marker names.
    left = {k: store.read_bytes(f"30/{stale}/{k}") for k in store.list_files(f"30/{stale}")}
    assert all(stale_bytes[k] == v for k, v in left.items())
    uploaders(tmp_path / "restart", store, 2, {})[0].run_once()
    assert store.list_dir("30") == sorted(["_COMMIT", won])


@pytest.mark.gcs
@pytest.mark.slow
def test_a_frozen_sidecar_process_of_an_old_generation_wakes_after_a_newer_commit_and_changes_nothing(
        tmp_path, sidecar_env, start_sidecar, gcs_bucket, gcs_env):
    """The same through real `resilax sidecar` processes on fake-gcs-server: generation 1's sidecar is
    frozen (SIGSTOP, as a partition would) in the middle of its upload of step 12; generation 2 starts
    (its fence), saves step 12 with other bytes, and its sidecar commits it. Woken (SIGCONT), the old
    sidecar finishes copying step 12 into its own attempt, then uploads its step 13: the committed
    objects keep their SHA-256, step 13 is fenced out, only step 12 is visible."""
    persistent = f"{gcs_bucket}/zombie"
    store = GcsStore(persistent)
    old_files = step_files(240, 32 * 1024, seed=1)
    env1 = {**sidecar_env, **gcs_env, "RESILAX_LOCAL_DIR": str(tmp_path / "g1"), "RESILAX_CHECKPOINT_DIR": persistent,
            "RESILAX_GENERATION": "1", "RESILAX_SIDECAR_UPLOAD_CONCURRENCY": "1"}
    write_local_step(tmp_path / "g1", 12, old_files, generation=1)
    old = start_sidecar(env1)
    wait_until(lambda: len(store.list_files("12")) >= 20, 60, "the old upload to be under way", interval=0.01)
    old.signal(signal.SIGSTOP)
    try:
        assert store.stat("12/_COMMIT") is None and len(store.list_files("12")) < len(old_files), "finished too soon"
        write_fence(store, 2, None)  # generation 2's primary, at start: nothing committed
        new_files = step_files(20, 32 * 1024, seed=2)
        write_local_step(tmp_path / "g2", 12, new_files, generation=2)
        (tmp_path / "s2").mkdir()
        env2 = {**build_sidecar_env(tmp_path / "s2"), **gcs_env, "RESILAX_LOCAL_DIR": str(tmp_path / "g2"),
                "RESILAX_CHECKPOINT_DIR": persistent, "RESILAX_GENERATION": "2"}
        new = start_sidecar(env2)
        wait_until(lambda: store.stat("12/_COMMIT") is not None, 60, "generation 2's commit of step 12")
        won = committed_attempt(store, 12)
        assert won == layout.upload_attempt_name(0, 2, 12)
        committed = snapshot(store, 12)
        new.close()  # after its pass: its cleanup of the old partial attempt does not race the old upload
    finally:
        resumed_at = len(old.log())
        old.signal(signal.SIGCONT)
    stale = layout.upload_attempt_name(0, 1, 12)
    wait_until(lambda: old.get("/v1/state").body["newest_persisted_step"] == 12, 120, "the old sidecar to see step 12")
    # Woken, the old sidecar went on with its upload into its own attempt: it finished it (then found
    # step 12 committed by another save), or a file it had in flight was gone when it verified it
    # (generation 2's process 0 deleted the old partial attempt at its commit) and the retried pass
    # found step 12 committed. Either way it wrote only under 12/<its attempt>.
    after = old.log()[resumed_at:]
    finished = f"/12/{stale} in" in after and "step 12: already committed by another save" in after
    interrupted = f"'12/{stale}/" in after and "after upload" in after
    assert finished or interrupted, after[-3000:]
    write_local_step(tmp_path / "g1", 13, step_files(3, 1024, seed=13), generation=1)
    wait_until(lambda: "fenced out" in (old.get("/v1/state").body["last_error"] or ""), 60, "step 13 to be refused")

    assert snapshot(store, 12) == committed
    for key, data in new_files.items():
        assert store.md5(f"12/{won}/{key}") == hashlib.md5(data).hexdigest(), key
    assert store.stat("13/_COMMIT") is None
    assert visible(store) == [12]
