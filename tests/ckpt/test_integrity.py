"""Storage integrity (issue 16): a checkpoint root is shared ground, and a re-created job keeps going.

- Foreign entries (an Orbax step `1/_CHECKPOINT_METADATA`, `2024/notes.txt`, a README, a half-written
  folder of someone else's) survive open, saves, retention, leftovers cleanup and close, on a local
  folder, in the local tier and on gs:// (fake-gcs-server).
- A save whose step folder is taken by someone else's data fails, naming the folder and the fix, and
  the folder is left as it was.
- A JAXJob deleted and re-applied (a new uid: its generations restart at 1) on the same storage
  resumes from the last committed step and commits again; a worker of the old job never commits.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
import resilax_ckpt as rc
from ckpt_procs import snapshot_files
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt import commit, layout
from resilax_ckpt.history import fencing
from resilax_ckpt.storage import open_storage

FOREIGN = {
    "1/_CHECKPOINT_METADATA": b'{"item_handlers": {}}',
    "1/default/array_metadatas/process_0": b"orbax",
    "2024/notes.txt": b"a team's notes",
    "README": b"do not delete",
    "7/half-written-by-someone.bin": b"\x00" * 10,
}


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))


def _state(step: int) -> dict:
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + step
    return {"params": {"w": jax.device_put(w, NamedSharding(_mesh(), P("a", "b")))}, "meta": {"step": step}}


def _put_foreign(root: str) -> None:
    storage = open_storage(root)
    for key, data in FOREIGN.items():
        storage.write_bytes(storage.join(root, key), data)


def _assert_foreign_intact(root: str) -> None:
    storage = open_storage(root)
    for key, data in FOREIGN.items():
        assert storage.read_bytes(storage.join(root, key)) == data, f"{key} was changed or deleted"


def _save_restore_with_retention(root: str) -> None:
    with rc.CheckpointManager(root, rc.ManagerOptions(keep_last=1)) as mgr:
        for step in (2, 3, 4, 5):  # retention deletes 2..4 as 3..5 commit
            assert mgr.save(step, _state(step))
        mgr.wait()
        assert mgr.steps() == [5]
        out = mgr.restore()
        np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.asarray(_state(5)["params"]["w"]))
    # a second open (a new generation) cleans leftovers: still nothing foreign is touched
    with rc.CheckpointManager(root, rc.ManagerOptions(keep_last=1, generation=2)) as mgr:
        assert mgr.steps() == [5]


def test_foreign_entries_survive_saves_retention_and_cleanup_on_a_local_folder(tmp_path: Path, devices) -> None:
    root = str(tmp_path / "shared")
    _put_foreign(root)
    _save_restore_with_retention(root)
    _assert_foreign_intact(root)
    marker = json.loads((tmp_path / "shared" / layout.ROOT_MARKER).read_text())
    assert marker["written_by"] == "resilax" and marker["format"] == 1


@pytest.mark.gcs
def test_foreign_entries_survive_saves_retention_and_cleanup_on_gcs(gcs_root: str, devices) -> None:
    _put_foreign(gcs_root)
    _save_restore_with_retention(gcs_root)
    _assert_foreign_intact(gcs_root)
    storage = open_storage(gcs_root)
    assert storage.exists(storage.join(gcs_root, layout.ROOT_MARKER))


def test_foreign_entries_survive_the_local_tier_cleanup(tmp_path: Path, devices) -> None:
    local, persistent = str(tmp_path / "local"), str(tmp_path / "persistent")
    _put_foreign(local)
    opts = rc.ManagerOptions(local_tier=True, keep_last=None, keep_every_steps=None)
    with rc.CheckpointManager(local, opts, persistent_directory=persistent) as mgr:
        mgr.save(3, _state(3))
        mgr.wait()
    # an interrupted local save of ours (a marker of ours, no commit) is cleaned; foreign data is not
    (tmp_path / "local" / "9").mkdir()
    (tmp_path / "local" / "9" / layout.writer_name(0)).write_bytes(b"")
    with rc.CheckpointManager(local, opts, persistent_directory=persistent):
        pass
    assert not (tmp_path / "local" / "9").exists()
    _assert_foreign_intact(local)


@pytest.mark.parametrize("where", ["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_a_step_folder_taken_by_foreign_data_is_refused_and_left_alone(where: str, tmp_path: Path, request,
                                                                        devices) -> None:
    root = str(tmp_path / "shared") if where == "local" else request.getfixturevalue("gcs_root")
    _put_foreign(root)
    with rc.CheckpointManager(root, rc.ManagerOptions(async_save=False)) as mgr:
        with pytest.raises(rc.ForeignDataError) as caught:
            mgr.save(1, _state(1))
        message = str(caught.value)
        assert "/1" in message and "_CHECKPOINT_METADATA" in message and "never deletes" in message
        assert "folder of its own" in message
        assert mgr.steps() == []
        mgr.save(8, _state(8))  # a free step number works beside the foreign folders
        assert mgr.steps() == [8]
    _assert_foreign_intact(root)


def _manager(root: str, uid: str, generation: int, **kw) -> rc.CheckpointManager:
    return rc.CheckpointManager(root, rc.ManagerOptions(job_uid=uid, generation=generation, async_save=False, **kw))


@pytest.mark.parametrize("where", ["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_a_recreated_job_resumes_and_commits_and_the_old_job_is_fenced(where: str, tmp_path: Path, request,
                                                                        devices) -> None:
    root = str(tmp_path / "run") if where == "local" else request.getfixturevalue("gcs_root")
    # The first JAXJob object reached generation 3.
    for generation in (1, 2):
        with _manager(root, "uid-old", generation) as m:
            m.save(10 * generation, _state(10 * generation))
    zombie = _manager(root, "uid-old", 3)
    zombie.save(30, _state(30))
    # Deleted and re-applied: a new uid, generation 1 again.
    with _manager(root, "uid-new", 1) as new:
        assert new.latest_step() == 30
        out = new.restore()
        assert out["meta"] == {"step": 30}
        new.save(31, _state(31))
        assert new.steps() == [10, 20, 30, 31]
        # A worker of the old job that wakes up now never commits, whatever its generation.
        with pytest.raises(rc.FencedError, match="generation 3 may not commit"):
            zombie.save(40, _state(40))
        assert new.steps() == [10, 20, 30, 31]
    zombie.close()
    storage = open_storage(root)
    fences = fencing.read_fences(storage, root)
    assert max(fences) == (2, 1), fences  # the new job's era outranks the old job's
    # A second start of the same new job keeps its era (the claim is idempotent).
    with _manager(root, "uid-new", 2) as again:
        assert again.latest_step() == 31
    assert max(fencing.read_fences(storage, root)) == (2, 2)


def test_era_claims_are_idempotent_and_ordered(tmp_path: Path) -> None:
    root = str(tmp_path)
    storage = open_storage(root)
    assert fencing.claim_era(storage, root, None) == 0
    assert fencing.claim_era(storage, root, "a") == 1
    assert fencing.claim_era(storage, root, "b") == 2
    assert fencing.claim_era(storage, root, "a") == 1
    # someone else took era 3 in between: the next job gets 4
    storage.write_bytes(storage.join(root, layout.FENCES_DIR, "era-3.json"), json.dumps({"job_uid": "c"}).encode())
    assert fencing.claim_era(storage, root, "d") == 4


@pytest.mark.parametrize(("step", "epoch", "fences", "visible"), [
    (5, (1, 7), {(2, 1): 4}, False),  # the new job started at step 4: the old job's step 5 is hidden
    (4, (1, 7), {(2, 1): 4}, True),
    (5, (2, 1), {(1, 7): None}, True),  # an older era never hides a newer one
    (5, (0, 9), {(1, 1): None}, False),  # fences from before eras are era 0
    (5, 3, {2: None}, True),  # bare generations still work (era 0)
], ids=["old-job-above-start", "old-job-at-start", "older-era", "legacy-vs-era", "legacy"])
def test_decide_visible_orders_epochs(step, epoch, fences, visible) -> None:
    assert fencing.decide_visible(step, epoch, fences) is visible


def test_commit_markers_carry_the_epoch() -> None:
    assert fencing.parse_marker_epoch(commit.build_marker(5, (2, 3))) == (2, 3)
    assert fencing.parse_marker_epoch(json.dumps({"step": 5, "generation": 4}).encode()) == (0, 4)
    assert fencing.parse_marker_epoch(b"") == (-1, -1)


# ---------------------------------------------------------------- fall back, do not brick


def _files(root: Path, step: int, item: str = "params") -> list[Path]:
    return sorted(p for p in (root / str(step) / item).rglob("*") if p.is_file() and p.name != "zarr.json")


@pytest.mark.parametrize("damage", ["truncated", "deleted", "metadata"])
def test_a_damaged_newest_step_falls_back_to_the_previous_one(damage: str, tmp_path: Path, devices) -> None:
    root = tmp_path / "run"
    control = tmp_path / "control"
    with rc.CheckpointManager(str(root), rc.ManagerOptions(async_save=False)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    victim = _files(root, 3)[0]
    if damage == "truncated":
        victim.write_bytes(victim.read_bytes()[:-4])
    elif damage == "deleted":
        victim.unlink()
    else:
        victim = root / "3" / layout.METADATA_FILE
        victim.write_text("{not json")
    before = sorted(str(p.relative_to(root / "3")) for p in (root / "3").rglob("*"))
    with rc.CheckpointManager(str(root), rc.ManagerOptions(async_save=False, control_dir=str(control))) as mgr:
        out = mgr.restore()
        assert out["meta"] == {"step": 2}
        np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.asarray(_state(2)["params"]["w"]))
        report = mgr.restore_report
        assert report is not None and report["step"] == 2
        assert [s["step"] for s in report["skipped"]] == [3]
        assert str(victim) in report["skipped"][0]["reason"], report  # the error names the file
        assert json.loads((control / "restore.json").read_text()) == report
        # marked bad, never deleted: hidden from steps(), its files as they were
        assert mgr.steps() == [1, 2] and mgr.latest_step() == 2
        assert sorted(str(p.relative_to(root / "3")) for p in (root / "3").rglob("*")) == before
        bad = json.loads((root / layout.BAD_DIR / "3.json").read_text())
        assert bad["step"] == 3 and str(victim) in bad["reason"]
        # the job goes on from step 2 and saves step 3 again: the bad step is moved aside, kept
        mgr.save(3, _state(33))
        assert mgr.steps() == [1, 2, 3]
        assert mgr.restore()["meta"] == {"step": 33}
    kept = [p for p in root.iterdir() if p.name.startswith(layout.BAD_PREFIX + "3-")]
    assert len(kept) == 1 and sorted(str(p.relative_to(kept[0])) for p in kept[0].rglob("*")) == before
    assert not (root / layout.BAD_DIR / "3.json").exists()


def test_no_restorable_step_is_an_error_listing_each_step_and_why(tmp_path: Path, devices) -> None:
    root = tmp_path / "run"
    with rc.CheckpointManager(str(root), rc.ManagerOptions(async_save=False)) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    for step in (1, 2):
        (root / str(step) / layout.METADATA_FILE).write_text("{")
    with rc.CheckpointManager(str(root)) as mgr, pytest.raises(rc.CorruptCheckpointError) as caught:
        mgr.restore()
    assert "step 2:" in str(caught.value) and "step 1:" in str(caught.value)
    assert "_METADATA.json" in str(caught.value)


@pytest.mark.slow
def test_processes_agree_on_the_fallback_when_only_one_of_them_cannot_read(tmp_path: Path) -> None:
    """Two JAX processes: a chunk only one of them reads is truncated; both skip the step together."""
    from ckpt_procs import run_processes

    root = tmp_path / "ck"
    run_processes({"scenario": "save", "root": str(root), "mesh": [4, 2], "steps": [3, 4]}, num_processes=2)
    files = sorted(p for p in (root / "4" / "params" / "w").rglob("*") if p.is_file() and p.name != "zarr.json")
    victim = files[-1]  # the last rows of w: process 1's shards
    victim.write_bytes(victim.read_bytes()[:-8])
    results = run_processes({"scenario": "restore", "root": str(root), "mesh": [4, 2]}, num_processes=2)
    assert [r["step"] for r in results] == [3, 3]
    for r in results:
        assert [s["step"] for s in r["report"]["skipped"]] == [4]
        assert str(victim) in r["report"]["skipped"][0]["reason"]
    assert json.loads((root / layout.BAD_DIR / "4.json").read_text())["step"] == 4


# ---------------------------------------------------------------- write-once steps on object stores


def _objects(root: str, step: int) -> dict[str, tuple[str | None, str | None]]:
    """Every object under `<root>/<step>/`: name → (md5, generation)."""
    from resilax_ckpt.storage import GcsStorage

    fs = GcsStorage()._fs
    fs.invalidate_cache()
    prefix = f"{root.removeprefix('gs://')}/{step}/"
    found = fs.find(prefix, detail=True)
    return {name[len(prefix):]: (info.get("md5Hash"), str(info.get("generation")))
            for name, info in found.items()}


@pytest.mark.gcs
@pytest.mark.slow
def test_a_zombie_generation_never_changes_a_committed_step_on_gcs(gcs_root: str) -> None:
    """Two processes of generation 2 commit steps 4 and 5; two processes of a stale generation 1 wake up
    and save steps 5 and 6 again, with other values. The committed step's objects are unchanged (md5 and
    object generation), its marker still names generation 2's attempt, no stale step becomes visible,
    and step 5 restores bit-exact; the next start removes the stale attempt."""
    from ckpt_procs import WorkerFailed, run_processes

    run_processes({"scenario": "save", "root": gcs_root, "mesh": [4, 2], "steps": [4, 5],
                   "options": {"generation": 2}}, num_processes=2)
    storage = open_storage(gcs_root)
    marker = json.loads(storage.read_bytes(f"{gcs_root}/5/{layout.COMMIT_FILE}"))
    won = marker["attempt"]
    assert layout.is_attempt_name(won) and marker["generation"] == 2
    before = _objects(gcs_root, 5)
    assert any(name.startswith(won + "/params/") for name in before)

    with pytest.raises(WorkerFailed, match="may not commit"):
        run_processes({"scenario": "save", "root": gcs_root, "mesh": [4, 2], "steps": [5, 6], "data_offset": 1000,
                       "options": {"generation": 1}}, num_processes=2)

    after = _objects(gcs_root, 5)
    assert {k: v for k, v in after.items() if k.startswith(won + "/") or k == layout.COMMIT_FILE} == before
    stale = {k.split("/")[0] for k in after if layout.is_attempt_name(k.split("/")[0]) and not k.startswith(won)}
    assert stale and all("-g1-" in a for a in stale)  # the zombie wrote only into an attempt of its own
    assert commit.list_visible(storage, gcs_root) == [4, 5]  # no stale step 6, no stale step 5

    results = run_processes({"scenario": "restore", "root": gcs_root, "mesh": [4, 2],
                             "options": {"generation": 3}}, num_processes=2)
    assert [r["step"] for r in results] == [5, 5]  # the worker checks every shard against step 5's values
    assert not [k for k in _objects(gcs_root, 5) if k.split("/")[0] in stale], "a stale attempt outlived a start"


def test_the_example_pattern_falls_back_too(tmp_path: Path, devices) -> None:
    """examples/train.py asks `restore_step_from_env()` for the step ("latest"), then restores that step:
    that is a restore of the newest step, so it falls back like `restore()`; a step asked for by number
    does not."""
    root = tmp_path / "run"
    with rc.CheckpointManager(str(root), rc.ManagerOptions(async_save=False)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    (root / "3" / layout.METADATA_FILE).write_text("{")
    with rc.CheckpointManager(str(root)) as mgr, pytest.raises(rc.MetadataError):
        mgr.restore(3)  # asked for by number: no fallback
    with rc.CheckpointManager(str(root)) as mgr:
        step = mgr.restore_step_from_env({"RESILAX_RESTORE_STEP": "latest"})
        assert step == 3
        out = mgr.restore(step, target=None)
        assert out["meta"] == {"step": 2}  # the loop starts from the state's own step
        assert mgr.restore_report is not None and [s["step"] for s in mgr.restore_report["skipped"]] == [3]


# ---------------------------------------------------------------- checksums


def _state_with_big(step: int) -> dict:
    """`_state` plus `big`: 64 KiB chunks, read with O_DIRECT in runs of whole chunks from shard files."""
    big = np.arange(256 * 512, dtype=np.float32).reshape(256, 512) * 0.5 + step
    return {**_state(step), "big": {"b": jax.device_put(big, NamedSharding(_mesh(), P("a", "b")))}}


def _chunk_files(root: str, step: int, item: str) -> list[str]:
    """The chunk (or shard) files of `item`'s first leaf in the committed step (its attempt on gs://)."""
    storage = open_storage(root)
    data = commit.step_data_path(storage, root, step)
    leaf = storage.join(data, item, storage.list_dir(storage.join(data, item))[0])
    found, todo = [], [storage.join(leaf, "c")]
    while todo:
        folder = todo.pop()
        for name in storage.list_dir(folder):
            path = storage.join(folder, name)
            (todo if not storage.exists(path) or not _is_file(storage, path) else found).append(path)
    return sorted(found)


def _is_file(storage, path: str) -> bool:
    try:
        storage.read_bytes(path)
    except (IsADirectoryError, FileNotFoundError):
        return False
    return True


def _damage(root: str, path: str, how: str) -> None:
    storage = open_storage(root)
    data = storage.read_bytes(path)
    if how == "flipped":  # one bit of the first chunk's data
        storage.write_bytes(path, data[:10] + bytes([data[10] ^ 0x01]) + data[11:])
    elif how == "index":  # one bit of the shard index (local shard files)
        storage.write_bytes(path, data[:-7] + bytes([data[-7] ^ 0x10]) + data[-6:])
    elif how == "truncated":
        storage.write_bytes(path, data[:-4])
    else:
        storage.delete_tree(path)


_DAMAGE_ERRORS = {"flipped": (rc.ChecksumMismatchError, "crc32c mismatch"),
                  "index": (rc.ChecksumMismatchError, "shard index: crc32c mismatch"),
                  "truncated": (rc.CorruptCheckpointError, ""), "deleted": (rc.MissingChunkError, "is missing")}


@pytest.mark.parametrize(("where", "item", "damage"), [
    *[("local", item, damage) for item in ("params", "big") for damage in _DAMAGE_ERRORS],
    *[pytest.param("gcs", "params", damage, marks=pytest.mark.gcs) for damage in ("flipped", "truncated", "deleted")],
])
def test_a_damaged_chunk_is_a_typed_error_naming_the_file_and_restore_falls_back(
        where: str, item: str, damage: str, tmp_path: Path, request, devices) -> None:
    root = str(tmp_path / "run") if where == "local" else request.getfixturevalue("gcs_root")
    with rc.CheckpointManager(root, rc.ManagerOptions(async_save=False)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state_with_big(step))
    meta = json.loads(open_storage(root).read_bytes(
        f"{commit.step_data_path(open_storage(root), root, 3)}/{layout.METADATA_FILE}"))
    assert all(leaf.get("checksum") == "crc32c" for it in ("params", "big")
               for leaf in meta["items"][it]["leaves"])
    victim = _chunk_files(root, 3, item)[0]
    _damage(root, victim, damage)
    error, words = _DAMAGE_ERRORS[damage]
    with rc.CheckpointManager(root, rc.ManagerOptions(async_save=False)) as mgr:
        with pytest.raises(error) as caught:  # asked for by number: the typed error, naming the file
            mgr.restore(3)
        assert victim in str(caught.value) and words in str(caught.value), caught.value
        assert "step 3" in str(caught.value)
        out = mgr.restore()  # the newest step: falls back to step 2
        assert out["meta"] == {"step": 2}
        want = _state_with_big(2)
        for it, key in (("params", "w"), ("big", "b")):
            np.testing.assert_array_equal(np.asarray(out[it][key]), np.asarray(want[it][key]))
        report = mgr.restore_report
        assert report is not None and report["step"] == 2 and [s["step"] for s in report["skipped"]] == [3]
        reason = report["skipped"][0]["reason"]
        assert victim in reason and error.__name__ in reason, reason
        assert mgr.steps() == [1, 2]


def test_checkpoints_without_checksums_still_restore(tmp_path: Path, devices, monkeypatch) -> None:
    """A step saved before checksums (format version 2: no `checksum`, no crc32c codec) restores, on
    our reader and through tensorstore; the switch that saves without them is for benchmarks only."""
    from resilax_ckpt.chunks import backends, checksums, reader
    from resilax_ckpt.manager import read_metadata

    root = tmp_path / "run"
    monkeypatch.setenv(checksums.ENV, "none")
    with rc.CheckpointManager(str(root), rc.ManagerOptions(async_save=False)) as mgr:
        mgr.save(1, _state_with_big(1))
    monkeypatch.delenv(checksums.ENV)
    meta_path = root / "1" / layout.METADATA_FILE
    meta = json.loads(meta_path.read_text())
    assert not any("checksum" in leaf for leaf in meta["items"]["params"]["leaves"])
    assert "crc32c" not in (root / "1" / "params" / "w" / "zarr.json").read_text()
    meta_path.write_text(meta_path.read_text().replace('"version": 3', '"version": 2'))
    want = _state_with_big(1)
    with rc.CheckpointManager(str(root), rc.ManagerOptions(async_save=False)) as mgr:
        out = mgr.restore()
        np.testing.assert_array_equal(np.asarray(out["big"]["b"]), np.asarray(want["big"]["b"]))
        mgr.save(2, want)  # new saves carry checksums again
    assert '"checksum": "crc32c"' in (root / "2" / layout.METADATA_FILE).read_text()
    leaf = read_metadata(open_storage(str(root)), str(root / "1")).items["big"].leaves[0]
    read = reader.LeafRead("big", leaf, np.dtype("float32"), None)
    backend = backends.for_storage(open_storage(str(root)), rc.ManagerOptions(), use_tensorstore=True)
    reader.read_leaves([read], str(root / "1"), backend, 1 << 30)
    np.testing.assert_array_equal(read.result, np.asarray(want["big"]["b"]))


@pytest.mark.parametrize("where", ["local", pytest.param("gcs", marks=pytest.mark.gcs)])
@pytest.mark.parametrize("damage", ["deleted", "garbled"])
def test_a_damaged_json_item_in_the_newest_step_falls_back(damage: str, where: str, tmp_path: Path, request,
                                                           devices) -> None:
    """A JSON item (the step's `meta`) deleted or garbled: the newest step is skipped, naming the file."""
    root = str(tmp_path / "run") if where == "local" else request.getfixturevalue("gcs_root")
    with rc.CheckpointManager(root, rc.ManagerOptions(async_save=False)) as mgr:
        for step in (1, 2):
            mgr.save(step, _state(step))
    storage = open_storage(root)
    victim = storage.join(commit.step_data_path(storage, root, 2), layout.item_json_name("meta"))
    if damage == "deleted":
        storage.delete_tree(victim)
    else:
        storage.write_bytes(victim, b'{"step": ')
    with rc.CheckpointManager(root) as mgr:
        assert mgr.restore()["meta"] == {"step": 1}
        assert mgr.restore_report is not None and [s["step"] for s in mgr.restore_report["skipped"]] == [2]
        assert victim in mgr.restore_report["skipped"][0]["reason"], mgr.restore_report


def test_a_step_tensorstore_writes_on_a_local_folder_is_verified_by_our_reader(tmp_path: Path, devices) -> None:
    """A dtype our chunk files do not hold raw (complex64) makes tensorstore write the step (one file per
    chunk, the same crc32c codec); our reader restores it bit-exact and catches a flipped byte."""
    root = tmp_path / "run"
    value = (np.arange(16 * 8, dtype=np.float32) + 1j * np.arange(16 * 8, dtype=np.float32)).astype(np.complex64)
    c = jax.device_put(value.reshape(16, 8), NamedSharding(_mesh(), P("a", "b")))
    with rc.CheckpointManager(str(root), rc.ManagerOptions(async_save=False)) as mgr:
        for step in (1, 2):
            mgr.save(step, {"params": {"c": c + step}})
    zarr = json.loads((root / "2" / "params" / "c" / "zarr.json").read_text())
    assert [codec["name"] for codec in zarr["codecs"]] == ["bytes", "crc32c"]
    victim = _chunk_files(str(root), 2, "params")[0]
    _damage(str(root), victim, "flipped")
    with rc.CheckpointManager(str(root)) as mgr:
        with pytest.raises(rc.ChecksumMismatchError, match=re.escape(victim)):
            mgr.restore(2)
        out = mgr.restore()
        assert mgr.restore_report is not None and [s["step"] for s in mgr.restore_report["skipped"]] == [2]
    np.testing.assert_array_equal(np.asarray(out["params"]["c"]), np.asarray(c + 1))


# ---------------------------------------------------------------- bad steps are kept (issue 25, item 4)


@pytest.mark.parametrize("where", ["local", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_bad_steps_are_never_deleted(where: str, tmp_path: Path, request, devices) -> None:
    """A step a restore marked bad survives the next starts' cleanup, a re-save of its number (moved
    aside on a folder; on gs:// its attempt stays, recorded in `_kept/`), retention of the re-saved
    step, and the starts after that: every one of its files keeps its bytes."""
    root = str(tmp_path / "run") if where == "local" else request.getfixturevalue("gcs_root")
    storage = open_storage(root)
    with _manager(root, "uid-a", 1, keep_last=3) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    damaged = commit.step_data_path(storage, root, 3)
    storage.write_bytes(storage.join(damaged, layout.METADATA_FILE), b"{not json")
    before = snapshot_files(root, damaged)
    assert any(name.startswith("params/") for name in before)
    with _manager(root, "uid-a", 2, keep_last=3) as mgr:
        assert mgr.restore()["meta"] == {"step": 2}
        assert mgr.steps() == [1, 2]
    with _manager(root, "uid-a", 3, keep_last=3) as mgr:  # the start's cleanup runs first
        assert mgr.steps() == [1, 2]
        assert snapshot_files(root, damaged) == before, "the start's cleanup changed or deleted the bad step"
        mgr.save(3, _state(33))  # the number saved again on the current timeline
        assert mgr.steps() == [1, 2, 3]
        assert rc.restore(storage.join(root, "3"))["meta"] == {"step": 33}
        for step in (4, 5, 6):  # retention (keep 3) deletes steps 1..3, the re-saved 3 among them
            mgr.save(step, _state(step))
        assert mgr.steps() == [4, 5, 6]
    with _manager(root, "uid-a", 4, keep_last=3) as mgr:  # cleanup and stale-attempt cleanup again
        assert mgr.steps() == [4, 5, 6]
    kept = [json.loads(storage.read_bytes(storage.join(root, layout.KEPT_DIR, n)))
            for n in storage.list_dir(storage.join(root, layout.KEPT_DIR))]
    assert [(k["step"], k["why"]) for k in kept] == [(3, "bad")], kept
    assert "not json" in kept[0]["reason"] or "_METADATA" in kept[0]["reason"], kept[0]
    if where == "local":
        aside = [n for n in storage.list_dir(root) if n.startswith(layout.BAD_PREFIX + "3-")]
        assert aside == [kept[0]["folder"]]
        assert snapshot_files(root, storage.join(root, aside[0])) == before
    else:
        assert kept[0]["attempt"] and damaged.endswith("/" + kept[0]["attempt"])
        assert snapshot_files(root, damaged) == before, "the bad step's attempt was changed or deleted"
