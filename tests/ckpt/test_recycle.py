"""The save side on local folders: our own chunk files (read back by tensorstore and by restore),
all-zero shards, and recycling of the steps retention retires (stale files, crashes, leftovers)."""

from __future__ import annotations

import json
import os
import pathlib
import signal

import ckpt_worker
import jax
import ml_dtypes
import numpy as np
import pytest
import resilax_ckpt as rc
import tensorstore as ts
from ckpt_procs import WorkerFailed, run_processes
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt import commit, layout
from resilax_ckpt import tensorstore_io as tsio
from resilax_ckpt.chunks import chunk_format, chunk_writer, staging


def mesh(shape=(4, 2)):
    return jax.sharding.Mesh(np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape), ("a", "b"))


def put(value, spec, m=None):
    return jax.device_put(value, NamedSharding(m or mesh(), P(*spec)))


def files_of(folder):
    out = set()
    for top, _, files in os.walk(folder):
        for f in files:
            out.add(os.path.relpath(os.path.join(top, f), folder).replace(os.sep, "/"))
    return out


def mixed_state(step):
    """float32/bfloat16/int32/bool leaves: sharded, replicated, 0-d, 1-d, host NumPy, all zeros."""
    rng = np.random.default_rng(step)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    return {
        "w": put(w, ("a", "b")),
        "h": put(rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16), ("a", None)),
        "i": put(np.arange(32, dtype=np.int32).reshape(8, 4) * (step + 1), (None, "b")),
        "mask": put(rng.random(8) > 0.5, ("a",)),
        "rep": put(np.full((4,), step, np.float32), ()),
        "zero_d": put(np.float32(step + 0.5), ()),
        "zeros": put(np.zeros((8, 8), np.float32), ("a", "b")),
        "host": np.arange(10, dtype=np.int32) - step,
        "host_scalar": np.array(7, np.int32),
    }


def host(tree):
    return jax.tree_util.tree_map(np.asarray, tree)


def assert_equal_trees(got, want):
    for key, value in want.items():
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value), err_msg=key)
        assert np.asarray(got[key]).dtype == np.asarray(value).dtype, key


# ---------------------------------------------------------------- our chunk files are zarr3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int32", "bool", "int8", "float64", "uint16"])
@pytest.mark.parametrize(("shape", "chunks"), [((), ()), ((7,), (7,)), ((5, 3), (2, 3)), ((4, 6), (2, 3))])
@pytest.mark.parametrize("checksum", ["crc32c", ""])
def test_zarr_json_is_byte_for_byte_tensorstores(tmp_path, dtype, shape, chunks, checksum):
    spec = tsio.build_array_spec({"driver": "file", "path": str(tmp_path) + "/"}, shape, dtype, chunks, (), checksum)
    ts.open(spec, create=True, open=True).result()
    assert (tmp_path / "zarr.json").read_bytes() == chunk_format.zarr_json(shape, dtype, chunks, (), bool(checksum))


@pytest.mark.parametrize("dtype", ["float32", "bool", "uint16"])
@pytest.mark.parametrize(("shape", "chunks", "shard"), [((8, 6), (2, 3), (8, 6)), ((5, 3), (2, 3), (4, 3))])
@pytest.mark.parametrize("checksum", ["crc32c", ""])
def test_sharded_zarr_json_is_tensorstores_and_our_shard_files_read_back_through_it(tmp_path, dtype, shape,
                                                                                    chunks, shard, checksum):
    # The same sharded array written by tensorstore and by our own layout (ArrayFiles: chunks at
    # page strides, the index at the end, a missing inner chunk where the shard overhangs the array):
    # tensorstore reads ours, through our zarr.json, to the same values.
    spec = tsio.build_array_spec({"driver": "file", "path": str(tmp_path / "ts") + "/"}, shape, dtype, chunks, shard,
                                 checksum)
    theirs = ts.open(spec, create=True, open=True).result()
    ours_json = chunk_format.zarr_json(shape, dtype, chunks, shard, bool(checksum))
    assert (tmp_path / "ts" / "zarr.json").read_bytes() == ours_json
    rng = np.random.default_rng(5)
    value = (rng.random(shape) > 0.5) if dtype == "bool" else rng.integers(0, 1000, shape).astype(dtype)
    theirs[...].write(value).result()
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "zarr.json").write_bytes(ours_json)
    files = chunk_format.ArrayFiles(shape, np.dtype(dtype).itemsize, chunks, shard, bool(checksum))
    for index in np.ndindex(*chunk_format.chunk_grid(shape, chunks)):
        box = tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(index, chunks, shape, strict=True))
        _, chunk = chunk_format.chunk_data(box, value[tuple(slice(a, b) for a, b in box)], shape, chunks)
        key, offset = files.locate(index)
        path = str(ours.joinpath(*key))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        chunk_writer.write_chunk_file(path, chunk, offset=offset, size=None, checksum=files.checksum)
    for key in files.file_keys():
        path = str(ours.joinpath(*key))
        chunk_writer.write_chunk_file(path, np.frombuffer(files.shard_index(key), np.uint8),
                                      offset=files.index_offset, size=files.file_size())
    assert files_of(ours) - {"zarr.json"} == files_of(tmp_path / "ts") - {"zarr.json"}
    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(ours) + "/"}}, open=True).result()
    np.testing.assert_array_equal(store.read().result(), value)


def test_chunk_keys_match_tensorstores_including_0d_and_uneven_grids(tmp_path):
    for name, shape, chunks in (("s", (), ()), ("v", (5,), (2,)), ("m", (5, 3), (2, 2))):
        folder = tmp_path / name
        spec = tsio.build_array_spec({"driver": "file", "path": str(folder) + "/"}, shape, "int32", chunks)
        store = ts.open(spec, create=True, open=True).result()
        store[...].write(np.ones(shape, np.int32)).result()
        want = {"/".join(k) for k in chunk_format.all_chunk_keys(shape, chunks)}
        assert files_of(folder) - {"zarr.json"} == want, name


@pytest.mark.parametrize("shard_files", [True, False])
def test_saved_chunk_files_read_back_by_tensorstore_without_assumed_metadata_and_by_restore(tmp_path, devices,
                                                                                          shard_files):
    tree = mixed_state(3)
    tree["big"] = put(np.random.default_rng(1).standard_normal((256, 512)).astype(np.float32), ("a", "b"))
    with rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(async_save=False, shard_files=shard_files)) as mgr:
        mgr.save(3, {"p": tree})
        got = mgr.restore(3)["p"]
        assert_equal_trees(got, host(tree))
        meta = json.loads((tmp_path / "3" / layout.METADATA_FILE).read_bytes())
        for leaf in meta["items"]["p"]["leaves"]:
            if leaf["kind"] != "array":
                continue
            path = tmp_path / "3" / "p" / leaf["dir"]
            store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path) + "/"}},
                            open=True).result()  # reads zarr.json: no assumed metadata
            key = leaf["keystr"].strip("[]'")
            np.testing.assert_array_equal(store.read().result(), np.asarray(tree[key]), err_msg=key)
            # Every chunk is stored (also the all-zero ones): a file of exactly the chunk's bytes, or
            # one shard file per process (here one) holding them all and the shard index.
            files = chunk_format.ArrayFiles(tuple(leaf["shape"]), np.dtype(tree[key].dtype).itemsize,
                                            tuple(leaf["chunks"]), tuple(leaf.get("shard", ())),
                                            leaf["checksum"] == "crc32c")
            assert files.checksum, key
            sharded = key in ("w", "h", "i", "mask", "zeros", "big")  # several chunks
            assert bool(files.shard) is (shard_files and sharded), key
            assert files_of(path) == {"zarr.json"} | {"/".join(k) for k in files.file_keys()}, key
            assert len(files.file_keys()) == (1 if files.shard else np.prod(chunk_format.chunk_grid(
                leaf["shape"], leaf["chunks"]) or [1])), key
            for rel in files.file_keys():
                assert os.path.getsize(path.joinpath(*rel)) == files.file_size(), (key, rel)


def test_edge_chunk_of_an_uneven_grid_is_padded_like_tensorstores(tmp_path):
    data = np.arange(15, dtype=np.float32).reshape(5, 3)
    index, chunk = chunk_format.chunk_data(((4, 5), (0, 3)), data[4:], (5, 3), (2, 3))
    assert index == (2, 0) and chunk.shape == (2, 3)
    chunk_writer.write_chunk_file(str(tmp_path / "ours"), chunk)
    spec = tsio.build_array_spec({"driver": "file", "path": str(tmp_path / "ts") + "/"}, (5, 3), "float32", (2, 3))
    ts.open(spec, create=True, open=True).result()[4:5].write(data[4:]).result()
    assert (tmp_path / "ours").read_bytes() == (tmp_path / "ts" / "c" / "2" / "0").read_bytes()
    with pytest.raises(rc.StorageError, match=r"not one chunk of the grid \(2, 3\)"):
        chunk_format.chunk_data(((1, 3), (0, 3)), data[1:3], (5, 3), (2, 3))


def test_write_chunk_file_rewrites_in_place_and_truncates(tmp_path):
    path = str(tmp_path / "f")
    chunk_writer.write_chunk_file(path, np.arange(100, dtype=np.int64))
    inode = os.stat(path).st_ino
    chunk_writer.write_chunk_file(path, np.arange(3, dtype=np.int16))
    assert os.stat(path).st_ino == inode
    assert np.fromfile(path, np.int16).tolist() == [0, 1, 2]


@pytest.mark.parametrize("nbytes", [chunk_format.DIRECT_MIN_BYTES, 100_003, 2 * staging.BUFFER_BYTES + 4096 + 5])
def test_direct_writes_are_exact_also_for_unaligned_sizes_and_rewrites(tmp_path, nbytes):
    if not chunk_writer.use_direct_io(str(tmp_path), True):
        pytest.skip(f"{tmp_path} is on {chunk_writer.filesystem_type(str(tmp_path))}: no direct I/O there")
    path = str(tmp_path / "c" / "0")
    data = np.random.default_rng(nbytes).integers(0, 256, nbytes + 4096, dtype=np.uint8)
    assert chunk_writer._write_direct(path, data, 0, data.nbytes)  # the filesystem took O_DIRECT
    inode = os.stat(path).st_ino
    assert pathlib.Path(path).read_bytes() == data.tobytes()
    chunk_writer.write_chunk_file(path, data[:nbytes], direct=True)  # a shorter rewrite, in place
    assert os.stat(path).st_ino == inode
    assert pathlib.Path(path).read_bytes() == data[:nbytes].tobytes()


def test_direct_io_only_on_disks_and_only_when_asked(tmp_path):
    fs = chunk_writer.filesystem_type(str(tmp_path / "not" / "yet"))
    assert fs is not None
    assert chunk_writer.use_direct_io(str(tmp_path), False) is False
    if os.path.isdir("/dev/shm") and chunk_writer.filesystem_type("/dev/shm") == "tmpfs":
        assert chunk_writer.use_direct_io("/dev/shm/resilax-test", True) is False


def test_direct_and_buffered_saves_write_the_same_bytes(tmp_path, devices):
    state = mixed_state(3)
    state["big"] = put(np.random.default_rng(0).standard_normal((512, 256)).astype(np.float32), ("a", "b"))
    for name, direct in (("direct", True), ("buffered", False)):
        with rc.CheckpointManager(str(tmp_path / name), options=rc.ManagerOptions(direct_io=direct)) as mgr:
            mgr.save(1, {"params": state}, force=True)
            mgr.wait()
    chunks = sorted(f for f in files_of(tmp_path / "direct" / "1") if "/c" in f)
    assert chunks == sorted(f for f in files_of(tmp_path / "buffered" / "1") if "/c" in f)
    assert any(os.path.getsize(tmp_path / "direct" / "1" / f) >= chunk_format.DIRECT_MIN_BYTES for f in chunks)
    for f in chunks:
        assert (tmp_path / "direct" / "1" / f).read_bytes() == (tmp_path / "buffered" / "1" / f).read_bytes(), f
    got = rc.restore(str(tmp_path / "direct" / "1"), items=["params"])["params"]
    assert_equal_trees(got, host(state))


def test_kernel_release_parsing_for_the_durability_mode():
    assert chunk_writer._kernel_at_least("6.18.44-fc-v1098", (5, 8))
    assert chunk_writer._kernel_at_least("5.8.0", (5, 8))
    assert not chunk_writer._kernel_at_least("5.4.0-100-generic", (5, 8))
    assert not chunk_writer._kernel_at_least("4.19", (5, 8))


def _record_syncs(monkeypatch):
    """Wrap the real fsync/fdatasync to record which paths they synced."""
    synced = []
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)

        def call(fd, real=real, name=name):
            synced.append((name, os.readlink(f"/proc/self/fd/{fd}")))
            return real(fd)

        monkeypatch.setattr(os, name, call)
    return synced


def _nested_files(root):
    files = []
    for rel in ("a/zarr.json", "a/c/0/0", "a/c/1/0", "b/c"):
        path = os.path.join(root, rel)
        chunk_writer.write_chunk_file(path, np.arange(8, dtype=np.int32))
        files.append(path)
    return files


@pytest.mark.skipif(not os.path.exists("/proc/self/fd"), reason="needs /proc")
def test_fdatasync_mode_syncs_every_file_then_every_folder_up_to_the_step(tmp_path, monkeypatch):
    monkeypatch.setattr(chunk_writer, "durability_mode", lambda: "fdatasync")
    step = str(tmp_path / "step")
    files = _nested_files(step)
    synced = _record_syncs(monkeypatch)
    chunk_writer.make_durable(step, files)
    assert [p for kind, p in synced if kind == "fdatasync"] == files
    folders = {p for kind, p in synced if kind == "fsync"}
    assert folders == {step, f"{step}/a", f"{step}/a/c", f"{step}/a/c/0", f"{step}/a/c/1", f"{step}/b"}


@pytest.mark.skipif(chunk_writer.durability_mode() != "syncfs", reason="needs Linux >= 5.8")
def test_syncfs_mode_flushes_once_and_names_a_missing_folder(tmp_path, monkeypatch):
    step = str(tmp_path / "step")
    files = _nested_files(step)
    synced = _record_syncs(monkeypatch)
    chunk_writer.make_durable(step, files)
    assert synced == []  # one syncfs, no per-file syncs
    assert np.fromfile(files[1], np.int32).tolist() == list(range(8))
    with pytest.raises(OSError, match=f"syncfs of the filesystem of {tmp_path}/gone"):
        chunk_writer.make_durable(str(tmp_path / "gone"), files)


# ---------------------------------------------------------------- all-zero shards


def test_all_zero_shards_round_trip_through_tensorstore_on_a_local_path(tmp_path):
    # The tensorstore path (gs://, or dtypes chunk_writer leaves to tensorstore) stores zero chunks.
    spec = tsio.build_array_spec({"driver": "file", "path": str(tmp_path) + "/"}, (4, 4), "float32", (2, 2))
    ts.open(spec, create=True, open=True).result()[...].write(np.zeros((4, 4), np.float32)).result()
    assert len(files_of(tmp_path)) == 5
    store = ts.open(spec, open=True, assume_metadata=True).result()
    np.testing.assert_array_equal(store.read().result(), np.zeros((4, 4), np.float32))


@pytest.mark.gcs
def test_all_zero_shards_round_trip_on_gcs(gcs_root, devices):
    zeros = {"nu": put(np.zeros((16, 8), np.float32), ("a", "b")), "b": np.zeros(4, np.int32)}
    with rc.CheckpointManager(gcs_root, rc.ManagerOptions(async_save=False)) as mgr:
        mgr.save(1, {"opt": zeros})
        got = mgr.restore(1)["opt"]
    assert_equal_trees(got, host(zeros))


# ---------------------------------------------------------------- recycling


def test_retention_recycles_the_retired_step_and_rewrites_its_files_in_place(tmp_path, devices):
    root = tmp_path / "ck"
    opts = rc.ManagerOptions(keep_last=1, async_save=True)
    with rc.CheckpointManager(str(root), opts) as mgr:
        mgr.save(1, {"p": mixed_state(1)})
        mgr.wait()
        inode = os.stat(root / "1" / "p" / "w" / "c" / "0" / "0").st_ino
        mgr.save(2, {"p": mixed_state(2), "meta": {"step": 2}})
        mgr.wait()
        assert sorted(os.listdir(root)) == [".recycle-1", "2", "_RESILAX.json", "_fences"]
        assert mgr.steps() == [2]
        mgr.save(3, {"p": mixed_state(3)})
        mgr.wait()
        assert sorted(os.listdir(root)) == [".recycle-2", "3", "_RESILAX.json", "_fences"]
        assert os.stat(root / "3" / "p" / "w" / "c" / "0" / "0").st_ino == inode  # step 1's file
        assert mgr.steps() == [3] and mgr.latest_step() == 3
        assert_equal_trees(mgr.restore(3)["p"], host(mixed_state(3)))
        # No file of the recycled step survives that step 3 lacks (step 2 had the JSON item meta).
        meta = rc.manager.read_metadata(mgr._storage, str(root / "3"))
        assert files_of(root / "3") == commit.expected_files(meta) | {layout.METADATA_FILE, layout.COMMIT_FILE}
        with pytest.raises(rc.StepNotFoundError):
            mgr.restore(2)


def test_steady_saves_of_one_tree_recycle_without_walking_the_folder(tmp_path, devices, monkeypatch):
    """A recycled step of the same tree holds only files the new step rewrites: its metadata says
    so, and no walk of the folder runs (counted; on a TPU v5e host the walks cost ~0.5 s a save).
    A changed tree, or a recycled folder without readable metadata, is still walked and pruned."""
    walks: list[str] = []
    real_prune = commit.prune_to
    monkeypatch.setattr(commit, "prune_to", lambda folder, expected: (walks.append(folder), real_prune(folder, expected))[1])
    root = tmp_path / "ck"
    with rc.CheckpointManager(str(root), rc.ManagerOptions(keep_last=1, async_save=False)) as mgr:
        for step in range(1, 5):
            mgr.save(step, {"p": mixed_state(step)})
        assert walks == []
        inode = os.stat(root / ".recycle-3" / "p" / "w" / "c" / "0" / "0").st_ino
        mgr.save(5, {"p": mixed_state(5)})
        assert os.stat(root / "5" / "p" / "w" / "c" / "0" / "0").st_ino == inode  # rewritten in place
        assert walks == []
        mgr.save(6, {"p": {"w": mixed_state(6)["w"]}})  # fewer leaves: the recycled folder is pruned
        assert len(walks) == 1
        os.remove(root / ".recycle-5" / layout.METADATA_FILE)  # no metadata: pruned whatever it holds
        (root / ".recycle-5" / "stray").write_bytes(b"x")
        mgr.save(7, {"p": mixed_state(7)})
        assert len(walks) == 2
        meta = rc.manager.read_metadata(mgr._storage, str(root / "7"))
        assert files_of(root / "7") == commit.expected_files(meta) | {layout.METADATA_FILE, layout.COMMIT_FILE}
        assert_equal_trees(mgr.restore(7)["p"], host(mixed_state(7)))


def test_recycled_folder_with_another_tree_leaves_no_stale_file(tmp_path, devices):
    root = tmp_path / "ck"
    big = {"a": put(np.ones((16, 8), np.float32), ("a", "b")), "b": put(np.ones((8,), np.int32), ("a",)),
           "c": np.arange(5), "s": put(np.ones((4,), np.float32), ("a",))}
    # A changed tree: fewer leaves, another chunk grid for "a", "s" now 0-d (`c` becomes a file).
    small = {"a": put(np.full((16, 8), 2, np.float32), (None, "a")), "s": put(np.float32(3), ())}
    with rc.CheckpointManager(str(root), rc.ManagerOptions(keep_last=1, async_save=False)) as mgr:
        mgr.save(1, {"p": big, "extra": {"x": 1}, "pp": rc.PerProcess({"i": 0})})
        mgr.save(2, {"p": big})
        mgr.save(3, {"p": small})  # takes .recycle-1
        meta = rc.manager.read_metadata(mgr._storage, str(root / "3"))
        assert files_of(root / "3") == commit.expected_files(meta) | {layout.METADATA_FILE, layout.COMMIT_FILE}
        assert not os.path.exists(root / "3" / "extra.json")
        assert_equal_trees(mgr.restore(3)["p"], host(small))
        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(root / "3" / "p" / "a") + "/"}},
                        open=True).result()
        assert store.chunk_layout.read_chunk.shape == (16, 2)


def test_recycled_folder_whose_old_chunks_held_data_restores_zeros(tmp_path, devices):
    root = tmp_path / "ck"
    ones = {"nu": put(np.ones((16, 8), np.float32), ("a", "b")), "h": np.ones(6, np.float32)}
    zeros = {"nu": put(np.zeros((16, 8), np.float32), ("a", "b")), "h": np.zeros(6, np.float32)}
    with rc.CheckpointManager(str(root), rc.ManagerOptions(keep_last=1, async_save=False)) as mgr:
        mgr.save(1, {"opt": ones})
        mgr.save(2, {"opt": ones})
        mgr.save(3, {"opt": zeros})  # rewrites step 1's files
        assert_equal_trees(mgr.restore(3)["opt"], host(zeros))


def test_recycle_pool_sizes_and_zero_disables(tmp_path, devices):
    # Each save takes the one retired before it, so the pool holds only the newest retired step.
    for pool, want in ((0, []), (1, [".recycle-3"]), (2, [".recycle-3"])):
        root = tmp_path / f"pool{pool}"
        with rc.CheckpointManager(str(root), rc.ManagerOptions(keep_last=1, recycle_pool=pool,
                                                               async_save=False)) as mgr:
            for step in (1, 2, 3, 4):
                mgr.save(step, {"p": {"w": put(np.full((8, 8), step, np.float32), ("a",))}})
            assert mgr.steps() == [4]
            np.testing.assert_array_equal(mgr.restore(4)["p"]["w"], np.full((8, 8), 4, np.float32))
        assert sorted(n for n in os.listdir(root) if n.startswith(".recycle")) == want, pool
    # keep_last=1 and several steps retired by one save (a smaller keep): the pool caps them.
    root = tmp_path / "capped"
    with rc.CheckpointManager(str(root), rc.ManagerOptions(async_save=False)) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, {"p": {"w": put(np.full((8, 8), step, np.float32), ("a",))}})
    with rc.CheckpointManager(str(root), rc.ManagerOptions(keep_last=1, recycle_pool=2, async_save=False)) as mgr:
        mgr.save(5, {"p": {"w": put(np.full((8, 8), 5, np.float32), ("a",))}})
        assert mgr.steps() == [5]
    assert sorted(n for n in os.listdir(root) if n.startswith(".recycle")) == [".recycle-1", ".recycle-2"]
    with pytest.raises(rc.InvalidOptionsError, match=r"recycle_pool: -1 must be >= 0"):
        rc.ManagerOptions(recycle_pool=-1)
    with pytest.raises(rc.InvalidOptionsError, match=r"write_threads: 0 must be >= 1"):
        rc.ManagerOptions(write_threads=0)


def test_stale_recycle_folders_at_start_are_trimmed_to_the_pool_and_reused(tmp_path, devices):
    root = tmp_path / "ck"
    for step in (3, 5, 9):  # leftovers of an earlier job: a half-written, marker-carrying mess
        folder = root / layout.recycle_name(step) / "p" / "w" / "c"
        folder.mkdir(parents=True)
        (folder / "7").write_bytes(b"garbage")
        (root / layout.recycle_name(step) / layout.COMMIT_FILE).write_text("{}")
        (root / layout.recycle_name(step) / "p" / "w" / "zarr.json").write_text("{}")
    with rc.CheckpointManager(str(root), rc.ManagerOptions(keep_last=1, async_save=False)) as mgr:
        assert sorted(n for n in os.listdir(root) if n.startswith(".")) == [".recycle-9"]
        assert mgr.steps() == []
        w = np.arange(64, dtype=np.float32).reshape(8, 8)
        mgr.save(10, {"p": {"w": put(w, ("a", "b"))}})  # takes .recycle-9
        assert not [n for n in os.listdir(root) if n.startswith(".recycle")]
        np.testing.assert_array_equal(mgr.restore(10)["p"]["w"], w)
        assert not os.path.exists(root / "10" / "p" / "w" / "c" / "7")
    with rc.CheckpointManager(str(root), rc.ManagerOptions(recycle_pool=0)) as mgr:
        assert mgr.steps() == [10]


@pytest.mark.gcs
def test_gcs_retention_deletes_and_never_recycles(gcs_root, devices):
    with rc.CheckpointManager(gcs_root, rc.ManagerOptions(keep_last=1, async_save=False)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"p": {"w": put(np.full((8, 8), step, np.float32), ("a",))}})
        assert mgr.steps() == [3]
        names = mgr._storage.list_dir(gcs_root)
        assert not [n for n in names if n.startswith(layout.RECYCLE_PREFIX)]
        np.testing.assert_array_equal(mgr.restore(3)["p"]["w"], np.full((8, 8), 3, np.float32))


PHASES = ["before_writes", "mid_writes", "after_writes", "before_commit", "after_commit"]


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_kill_during_a_recycling_save_leaves_the_last_commit_intact(tmp_path, devices, phase):
    root = str(tmp_path / "ck")
    m = ckpt_worker.global_mesh([4, 2])
    opts = rc.ManagerOptions(keep_last=1, async_save=False)
    with rc.CheckpointManager(root, opts) as mgr:
        mgr.save(1, {"params": ckpt_worker.make_state(1, m)})
        mgr.save(2, {"params": ckpt_worker.make_state(2, m)})
    assert ".recycle-1" in os.listdir(root)
    with pytest.raises(WorkerFailed) as failed:
        run_processes({"scenario": "save", "root": root, "mesh": [4, 2], "steps": [3],
                       "options": {"keep_last": 1}}, env={"RESILAX_CKPT_TEST_CRASH_AT": phase})
    assert failed.value.code == -signal.SIGKILL
    mgr = rc.CheckpointManager(root, opts)  # a new generation's start cleans the leftovers
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")]
    want = [2, 3] if phase == "after_commit" else [2]
    assert mgr.steps() == want
    for step in want:
        out = mgr.restore(step, items=["params"])
        for name, value in ckpt_worker.expected(step).items():
            np.testing.assert_array_equal(np.asarray(out["params"][name]), value)
    # And the next save recycles what is left and restores exactly.
    mgr.save(4, {"params": ckpt_worker.make_state(4, m)})
    out = mgr.restore(4, items=["params"])
    for name, value in ckpt_worker.expected(4).items():
        np.testing.assert_array_equal(np.asarray(out["params"][name]), value)
    assert mgr.steps() == [want[-1], 4]  # retention keeps the step restored last
    mgr.close()


@pytest.mark.slow
def test_two_processes_recycle_a_shared_folder(tmp_path):
    root = str(tmp_path / "ck")
    results = run_processes({"scenario": "save", "root": root, "mesh": [4, 2],
                             "steps": [1, 2, 3, 4], "options": {"keep_last": 1}}, num_processes=2)
    assert all(r["steps"] == [4] for r in results)
    assert sorted(os.listdir(root)) == [".recycle-3", "4", "_RESILAX.json", "_fences"]
    with rc.CheckpointManager(root) as mgr:
        out = mgr.restore(4, items=["params", "data"])
        for name, value in ckpt_worker.expected(4).items():
            np.testing.assert_array_equal(np.asarray(out["params"][name]), value)
        meta = rc.manager.read_metadata(mgr._storage, os.path.join(root, "4"))
        assert files_of(os.path.join(root, "4")) == (
            commit.expected_files(meta) | {layout.METADATA_FILE, layout.COMMIT_FILE})
