"""The per-host local fast tier: every process writes every shard it holds, its own metadata and
commit marker; the union of the hosts' folders is a complete persistent step (what the sidecar's
uploader builds)."""

from __future__ import annotations

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


def test_single_process_local_tier_writes_all_replicas_and_restores(tmp_path, devices):
    mesh = global_mesh([4, 2])
    opts = rc.ManagerOptions(local_tier=True, async_save=False)
    with rc.CheckpointManager(str(tmp_path), opts) as mgr:
        mgr.save(1, {"params": make_state(1, mesh), "meta": {"a": 1}})
        assert mgr.steps() == [1]
        names = sorted(os.listdir(tmp_path / "1"))
        assert names == ["_COMMIT", "_METADATA.json", "meta.json", "params"]
        out = mgr.restore(1)
        for name, value in expected(1).items():
            np.testing.assert_array_equal(out["params"][name], value)
    # a lost chunk is reported, not read as zeros
    chunk_dir = tmp_path / "1" / "params" / "w" / "c"
    victim = next(p for p in chunk_dir.rglob("*") if p.is_file())
    victim.unlink()
    with pytest.raises(rc.IncompleteStepError, match="restore from the persistent tier"):
        rc.CheckpointManager(str(tmp_path), opts).restore(1)


def merge_like_the_uploader(local_dirs: list[str], step: int, root: str) -> None:
    """What resilax_sidecar's uploader does: copy each host's files into <root>/<step>/ (identical
    names carry identical bytes), map _METADATA.<id>.json to _METADATA.json, skip the local markers,
    then write _COMMIT."""
    dest = os.path.join(root, str(step))
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
    with open(os.path.join(dest, "_COMMIT"), "w") as f:
        f.write('{"generation": 0}')


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
