"""The per-host local fast tier: every process writes every shard it holds, its own metadata and
commit marker; the union of the hosts' folders is a complete persistent step (what the sidecar's
uploader builds)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
import resilax_ckpt as rc
from ckpt_procs import run_processes
from ckpt_worker import expected, global_mesh, make_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt import layout


def test_single_process_local_tier_writes_all_replicas_and_restores(tmp_path, devices):
    mesh = global_mesh([4, 2])
    opts = rc.ManagerOptions(local_tier=True, async_save=False)
    with rc.CheckpointManager(str(tmp_path), opts) as mgr:
        mgr.save(1, {"params": make_state(1, mesh), "meta": {"a": 1}})
        assert mgr.steps() == [1]
        names = sorted(os.listdir(tmp_path / "1"))
        assert names == ["_COMMIT", "_METADATA.json", "meta.json", "params"]
        marker = json.loads((tmp_path / "1" / "_COMMIT").read_text())
        assert (marker["process"], marker["process_count"]) == (0, 1), "the sidecar uploads it as this process"
        out = mgr.restore(1)
        for name, value in expected(1).items():
            np.testing.assert_array_equal(out["params"][name], value)
    # a lost chunk is reported, not read as zeros
    chunk_dir = tmp_path / "1" / "params" / "w" / "c"
    victim = next(p for p in chunk_dir.rglob("*") if p.is_file())
    victim.unlink()
    with pytest.raises(rc.IncompleteStepError, match="restore from the persistent tier"):
        rc.CheckpointManager(str(tmp_path), opts).restore(1)


def merge_like_the_uploader(local_dirs: list[str], step: int, root: str, generation: int = 0) -> None:
    """What resilax_sidecar's uploader does: copy each host's files into the attempt
    <root>/<step>/<attempt>/ (identical names carry identical bytes), map _METADATA.<id>.json to
    _METADATA.json, skip the local markers, then write _COMMIT naming the attempt (write-once uploads;
    the library reads what the marker names)."""
    attempt = layout.upload_attempt_name(0, generation, step)
    dest = os.path.join(root, str(step), attempt)
    for folder in local_dirs:
        src = os.path.join(folder, str(step))
        for dirpath, _, files in os.walk(src):
            rel = os.path.relpath(dirpath, src)
            for name in files:
                if name.startswith("_COMMIT"):
                    continue
                target = "_METADATA.json" if rel == "." and name.startswith("_METADATA.") else name
                os.makedirs(os.path.join(dest, rel), exist_ok=True)
                shutil.copyfile(os.path.join(dirpath, name), os.path.join(dest, rel, target))
    with open(os.path.join(root, str(step), "_COMMIT"), "w") as f:
        f.write(f'{{"generation": {generation}, "attempt": "{attempt}"}}')


@pytest.mark.slow
def test_two_hosts_local_tier_then_merged_to_persistent(tmp_path, devices):
    local = str(tmp_path / "local{pid}")
    opts = {"local_tier": True}
    saved = run_processes({"scenario": "save", "root": local, "mesh": [4, 2], "steps": [2], "options": opts},
                          num_processes=2)
    assert [r["steps"] for r in saved] == [[2], [2]]
    for pid in (0, 1):
        names = set(os.listdir(tmp_path / f"local{pid}" / "2"))
        assert {f"_COMMIT.{pid}", f"_METADATA.{pid}.json", "meta.json", "params", "data"} <= names
        marker = json.loads((tmp_path / f"local{pid}" / "2" / f"_COMMIT.{pid}").read_text())
        assert (marker["process"], marker["process_count"]) == (pid, 2)
    # each host restores its own shards from its own folder
    restored = run_processes({"scenario": "restore", "root": local, "mesh": [4, 2], "options": opts},
                             num_processes=2)
    assert [r["data"] for r in restored] == [{"process": 0, "step": 2}, {"process": 1, "step": 2}]

    persistent = str(tmp_path / "persistent")
    merge_like_the_uploader([local.format(pid=0), local.format(pid=1)], 2, persistent)
    mgr = rc.CheckpointManager(persistent)
    assert mgr.steps() == [2]
    m = global_mesh([2, 4])
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(m, P(*("b", "a")[: v.ndim])))
                         for k, v in expected(2).items()}}
    out = mgr.restore(target=target)
    for name, value in expected(2).items():
        np.testing.assert_array_equal(np.asarray(out["params"][name]), value)
    assert out["data"] == {"process": 0, "step": 2}
    mgr.close()


def test_two_tiers_restore_prefers_local_and_falls_back_to_persistent(tmp_path, devices):
    mesh = global_mesh([4, 2])
    persistent = str(tmp_path / "persistent")
    env = {"RESILAX_CHECKPOINT_DIR": persistent, "RESILAX_LOCAL_DIR": str(tmp_path / "hostA"),
           "RESILAX_GENERATION": "3", "RESILAX_KEEP_LAST": "1"}
    with rc.CheckpointManager.from_env(env, async_save=False) as mgr:
        assert mgr._options.local_tier and mgr._options.keep_last is None  # the sidecar does retention
        for step in (1, 2):
            mgr.save(step, {"params": make_state(step, mesh), "meta": {"step": step}})
        assert os.listdir(os.path.join(persistent, "_fences")) == ["3.json"]
    merge_like_the_uploader([str(tmp_path / "hostA")], 1, persistent, generation=3)  # the sidecar uploaded it

    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
                         for k, v in expected(1).items()}}
    with rc.CheckpointManager.from_env(env) as mgr:
        assert mgr.steps() == [1, 2] and mgr.persistent_steps() == [1] and mgr.latest_step() == 2
        assert mgr.restore(target=target)["meta"] == {"step": 2}  # from the local tier
    # a new host: nothing local, so the persistent tier's step 1
    other = dict(env, RESILAX_LOCAL_DIR=str(tmp_path / "hostB"))
    with rc.CheckpointManager.from_env(other) as mgr:
        out = mgr.restore(target=target)
        assert out["meta"] == {"step": 1}
        np.testing.assert_array_equal(np.asarray(out["params"]["w"]), expected(1)["w"])
    # a local step missing a chunk this process needs is skipped, not read as zeros
    chunk = next(p for p in (tmp_path / "hostA" / "2" / "params" / "w" / "c").rglob("*") if p.is_file())
    chunk.unlink()
    with rc.CheckpointManager.from_env(env) as mgr:
        assert mgr.restore(target=target)["meta"] == {"step": 1}


@pytest.mark.slow
def test_two_hosts_agree_on_a_step_every_host_can_read(tmp_path, devices):
    local = str(tmp_path / "local{pid}")
    persistent = str(tmp_path / "persistent")
    run_processes({"scenario": "save", "root": local, "mesh": [4, 2], "steps": [1, 2],
                   "options": {"local_tier": True}}, num_processes=2)
    merge_like_the_uploader([local.format(pid=0), local.format(pid=1)], 1, persistent)
    shutil.rmtree(tmp_path / "local1" / "2")  # host 1 lost its newest local step
    restored = run_processes({"scenario": "restore", "root": local, "persistent": persistent, "mesh": [4, 2],
                              "options": {"local_tier": True}}, num_processes=2)
    assert [r["step"] for r in restored] == [1, 1]


@pytest.mark.slow
def test_latest_from_env_is_the_agreed_step_and_each_process_names_its_tier(tmp_path, devices):
    """RESILAX_RESTORE_STEP=latest gives the step every process can read, not each one's newest: host 0
    holds steps 1 and 2 locally, host 1 (a replacement node) nothing; the persistent tier has 1. Both
    restore 1, host 0 from its local tier and host 1 from the persistent tier, and host 0's step 2 (a
    timeline this generation abandons) is withdrawn before the generation can save step 2 again."""
    local = str(tmp_path / "local{pid}")
    persistent = str(tmp_path / "persistent")
    run_processes({"scenario": "save", "root": local, "mesh": [4, 2], "steps": [1, 2],
                   "options": {"local_tier": True}}, num_processes=2)
    merge_like_the_uploader([local.format(pid=0), local.format(pid=1)], 1, persistent)
    shutil.rmtree(tmp_path / "local1")  # host 1 is a new node: its local tier is empty
    restored = run_processes({"scenario": "restore", "root": local, "persistent": persistent, "mesh": [4, 2],
                              "latest_from_env": True, "options": {"local_tier": True}}, num_processes=2)
    assert [r["own_latest"] for r in restored] == [2, 1]  # what each process alone would pick
    assert [r["agreed"] for r in restored] == [1, 1]
    assert [r["step"] for r in restored] == [1, 1]
    assert [r["restored_from"] for r in restored] == ["local", "persistent"]
    # the report (restore.json, status.history's restoredFrom): the farthest tier any process needed
    assert [(r["report"]["source"], r["report"]["generation"]) for r in restored] == [("persistent", 0)] * 2
    assert restored[0]["steps"] == [1]  # step 2 withdrawn on host 0
    assert not (tmp_path / "local0" / "2").exists()


def test_restore_withdraws_newer_local_steps_before_they_can_be_saved_again(tmp_path, devices):
    """A generation that restores an older step may save the step numbers the local tier already
    holds: the old step's commit marker is gone before any of its files can be rewritten, and the new
    save of that number commits cleanly with the new bytes."""
    mesh = global_mesh([4, 2])
    persistent = str(tmp_path / "persistent")
    env = {"RESILAX_CHECKPOINT_DIR": persistent, "RESILAX_LOCAL_DIR": str(tmp_path / "host"),
           "RESILAX_GENERATION": "1"}
    with rc.CheckpointManager.from_env(env, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"params": make_state(step, mesh), "meta": {"step": step, "gen": 1}})
    merge_like_the_uploader([str(tmp_path / "host")], 1, persistent, generation=1)
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
                         for k, v in expected(1).items()}}
    env2 = dict(env, RESILAX_GENERATION="2", RESILAX_RESTORE_STEP="1")
    with rc.CheckpointManager.from_env(env2, async_save=False) as mgr:
        assert mgr.restored_from is None
        step = mgr.restore_step_from_env(env2, target=target)
        assert step == 1
        out = mgr.restore(step, target=target)
        assert out["meta"] == {"step": 1, "gen": 1} and mgr.restored_from == "local"
        assert mgr.steps() == [1]
        assert sorted(os.listdir(tmp_path / "host")) == ["1"]
        mgr.save(2, {"params": make_state(20, mesh), "meta": {"step": 2, "gen": 2}})
        assert mgr.steps() == [1, 2]
    with rc.CheckpointManager.from_env(dict(env, RESILAX_GENERATION="3")) as mgr:
        assert mgr.restore_step_from_env({"RESILAX_RESTORE_STEP": "latest"}, target=target) == 2
        out = mgr.restore(2, target=target)
        assert out["meta"] == {"step": 2, "gen": 2}
        np.testing.assert_array_equal(np.asarray(out["params"]["w"]), expected(20)["w"])


def truncate(path) -> None:
    """Cut a file to half its length, as a full disk or a crash mid-write leaves it."""
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def a_chunk(step_dir) -> str:
    """One chunk file of the array "w" of a step folder (the local tier's, or a persistent attempt's)."""
    return str(next(p for p in sorted((step_dir / "params" / "w" / "c").rglob("*")) if p.is_file()))


def test_two_tiers_an_unreadable_newest_step_falls_back_to_its_persistent_copy_then_to_an_older_step(
        tmp_path, devices):
    """Item 4 of issue 16 for the local tier: a truncated chunk in the newest local step is reported
    naming the file, the local copy is marked bad (kept, hidden, never uploaded) and the persistent
    tier's copy of the same step restores; when that copy is truncated too, the step is skipped on both
    tiers (marked bad in the persistent tier, kept) and the next older step restores."""
    mesh = global_mesh([4, 2])
    persistent = tmp_path / "persistent"
    env = {"RESILAX_CHECKPOINT_DIR": str(persistent), "RESILAX_LOCAL_DIR": str(tmp_path / "host"),
           "RESILAX_GENERATION": "1"}
    with rc.CheckpointManager.from_env(env, async_save=False) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"params": make_state(step, mesh), "meta": {"step": step}})
    for step in (2, 3):
        merge_like_the_uploader([str(tmp_path / "host")], step, str(persistent), generation=1)
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
                         for k, v in expected(1).items()}}
    local_chunk = a_chunk(tmp_path / "host" / "3")
    truncate(local_chunk)

    with rc.CheckpointManager.from_env(dict(env, RESILAX_GENERATION="2")) as mgr:
        out = mgr.restore(target=target)
        assert out["meta"] == {"step": 3} and mgr.restored_from == "persistent"
        np.testing.assert_array_equal(np.asarray(out["params"]["w"]), expected(3)["w"])
        [entry] = mgr.restore_report["skipped"]
        assert entry["step"] == 3 and entry["tier"] == "local" and local_chunk in entry["reason"], entry
        assert mgr.restore_report["step"] == 3
        assert mgr.steps() == [1, 2], "the unreadable local step is still visible"
    assert os.path.exists(local_chunk), "the bad local step was deleted"
    assert local_chunk in (tmp_path / "host" / "_bad" / "3.json").read_text()

    attempt = layout.upload_attempt_name(0, 1, 3)
    persistent_chunk = a_chunk(persistent / "3" / attempt)
    truncate(persistent_chunk)
    with rc.CheckpointManager.from_env(dict(env, RESILAX_GENERATION="3")) as mgr:
        step = mgr.restore_step_from_env({}, target=target)  # "latest": what examples/train.py does
        assert step == 3
        out = mgr.restore(step, target=target)
        assert out["meta"] == {"step": 2} and mgr.restored_from == "local"
        np.testing.assert_array_equal(np.asarray(out["params"]["w"]), expected(2)["w"])
        [entry] = mgr.restore_report["skipped"]
        assert entry["step"] == 3 and entry["tier"] == "all" and persistent_chunk in entry["reason"], entry
        assert mgr.persistent_steps() == [2]
    assert persistent_chunk in (persistent / "_bad" / "3.json").read_text()
    assert os.path.exists(persistent_chunk)


def test_two_tiers_a_local_step_missing_a_chunk_is_skipped_and_named_but_not_marked_bad(tmp_path, devices):
    """A chunk missing on this host is not proof of damage (after a change of mesh another host holds
    it): the step is not read locally, the report names the file under "local_misses", nothing is
    marked bad, and the newest step the tiers can serve (here an older one) restores."""
    mesh = global_mesh([4, 2])
    persistent = tmp_path / "persistent"
    env = {"RESILAX_CHECKPOINT_DIR": str(persistent), "RESILAX_LOCAL_DIR": str(tmp_path / "host"),
           "RESILAX_GENERATION": "1"}
    with rc.CheckpointManager.from_env(env, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"params": make_state(step, mesh), "meta": {"step": step}})
    merge_like_the_uploader([str(tmp_path / "host")], 1, str(persistent), generation=1)
    victim = a_chunk(tmp_path / "host" / "2")
    os.remove(victim)
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
                         for k, v in expected(1).items()}}
    with rc.CheckpointManager.from_env(dict(env, RESILAX_GENERATION="2")) as mgr:
        out = mgr.restore(target=target)
        assert out["meta"] == {"step": 1}
        report = mgr.restore_report
        assert report["skipped"] == [] and report["step"] == 1
        [miss] = report["local_misses"]
        assert miss["step"] == 2 and victim in miss["reason"], report
    assert not (tmp_path / "host" / "_bad").exists()


@pytest.mark.slow
def test_two_hosts_agree_to_skip_a_step_one_host_cannot_read(tmp_path, devices):
    """Two processes: host 1's newest local step has a truncated chunk and the persistent tier never
    got that step; host 0 could read its own copy, yet both skip it (every process restores the same
    step) and both report why, naming host 1's file."""
    local = str(tmp_path / "local{pid}")
    persistent = str(tmp_path / "persistent")
    run_processes({"scenario": "save", "root": local, "mesh": [4, 2], "steps": [1, 2],
                   "options": {"local_tier": True}}, num_processes=2)
    merge_like_the_uploader([local.format(pid=0), local.format(pid=1)], 1, persistent)
    victim = a_chunk(tmp_path / "local1" / "2")
    truncate(victim)
    restored = run_processes({"scenario": "restore", "root": local, "persistent": persistent, "mesh": [4, 2],
                              "latest_from_env": True, "options": {"local_tier": True}}, num_processes=2)
    assert [r["agreed"] for r in restored] == [2, 2]
    assert [r["step"] for r in restored] == [1, 1]
    for r in restored:
        [entry] = r["report"]["skipped"]
        assert entry["step"] == 2 and entry["tier"] == "all" and victim in entry["reason"], r["report"]
    assert (tmp_path / "local1" / "_bad" / "2.json").is_file()
    assert not (tmp_path / "local0" / "_bad").exists()


def test_cleanup_leaves_uploads_in_progress_and_deletes_only_attempts_no_marker_names(tmp_path):
    """What a starting primary does on a persistent root the sidecars upload to: an attempt holding an
    `_UPLOADED.*` marker (an upload in progress, no `_COMMIT` yet) is left alone; in a committed step
    only entries of the attempt form that its marker does not name go; a step committed in place (files
    beside `_COMMIT`) and foreign files are untouched; item names of the attempt form are refused."""
    from resilax_ckpt import commit
    from resilax_ckpt.storage import LocalStorage

    storage, root = LocalStorage(fsync=False), str(tmp_path)

    def put(rel: str, data: bytes = b"x") -> None:
        storage.write_bytes(os.path.join(root, rel), data)

    uploading = layout.upload_attempt_name(0, 1, 5)
    put(f"5/{uploading}/_WRITER.0", b"")
    put(f"5/{uploading}/_UPLOADED.0", b"{}")
    won, stale = layout.upload_attempt_name(0, 2, 6), layout.upload_attempt_name(0, 1, 6)
    put(f"6/{won}/params/w/c/0")
    put(f"6/{stale}/params/w/c/0")
    put("6/notes.txt", b"someone's")
    put("6/_COMMIT", f'{{"generation": 2, "attempt": "{won}"}}'.encode())
    put("7/_COMMIT", b'{"generation": 2}')
    put("7/params/w/c/0")
    assert commit.clean_leftovers(storage, root, 2) == []
    assert commit.clean_stale_attempts(storage, root, [6, 7]) == [f"6/{stale}"]
    assert sorted(os.listdir(tmp_path / "6")) == sorted(["_COMMIT", won, "notes.txt"])
    assert sorted(os.listdir(tmp_path / "5" / uploading)) == ["_UPLOADED.0", "_WRITER.0"]
    assert commit.step_data_path(storage, root, 6) == os.path.join(root, "6", won)
    assert commit.step_data_path(storage, root, 7) == os.path.join(root, "7")
    with pytest.raises(ValueError, match="attempt prefix"):
        layout.validate_item_name(won)
