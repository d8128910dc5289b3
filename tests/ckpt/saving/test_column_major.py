"""Column-major leaves stored in the order they land (issue 37): a TPU lays some leaves out column
major (the bench's (52992, 1472) float32 `embed`), their host copies land with Fortran strides, and
a save stores their chunks through zarr3's `transpose` codec, so the writer writes the landed bytes
as they are (no bounce copy). On CPU devices `RESILAX_CKPT_FORCE_COLUMN_MAJOR=1` makes the shards
land so (host_layout.FORCE_COLUMN_MAJOR_ENV). Every reader gets the values back bit-exact: the
file backend's own reader onto the save's mesh, onto another mesh and to the host, through the host
ring, the restore prefetch's reads, the local tier, and tensorstore as a plain zarr3 reader."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import resilax_ckpt as rc
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt import tensorstore_io as tsio
from resilax_ckpt.chunks import backends, chunk_format, chunk_writer, reader
from resilax_ckpt.errors import MetadataError
from resilax_ckpt.metadata import ItemMetadata, LeafMetadata, StepMetadata
from resilax_ckpt.restoring import read_ahead
from resilax_ckpt.restoring.step_reader import read_metadata
from resilax_ckpt.saving.device_snapshot import FORCE_ACCELERATOR_ENV
from resilax_ckpt.saving.host_layout import FORCE_COLUMN_MAJOR_ENV
from resilax_ckpt.storage import LocalStorage

# ---------------------------------------------------------------- pure: the order and the zarr.json


@pytest.mark.parametrize(("ndim", "major_to_minor", "want"), [
    (2, (1, 0), (1, 0)),          # column major: Fortran order
    (2, (0, 1), ()),              # row major: the plain `bytes` codec
    (3, (2, 1, 0), (2, 1, 0)),
    (3, (0, 2, 1), (0, 2, 1)),    # any permutation the layout gives
    (1, (0,), ()),
    (2, None, ()),                # no layout known
    (2, (0, 0), ()),              # not a permutation
], ids=["col-major", "row-major", "3d-reversed", "3d-perm", "1d", "unknown", "bad"])
def test_plan_transpose(ndim, major_to_minor, want):
    assert chunk_format.plan_transpose(ndim, major_to_minor) == want


@pytest.mark.parametrize("transpose", [(1, 0), (2, 0, 1)], ids=["2d", "3d"])
@pytest.mark.parametrize("sharded", [False, True], ids=["chunk-files", "shard-files"])
@pytest.mark.parametrize("checksum", ["crc32c", ""])
@pytest.mark.parametrize("dtype", ["float32", "bool", "bfloat16"])
def test_transposed_zarr_json_is_tensorstores_and_its_chunks_are_the_transposed_bytes(tmp_path, transpose, sharded,
                                                                                       checksum, dtype):
    shape, chunks = ((8, 6), (4, 6)) if len(transpose) == 2 else ((4, 6, 2), (2, 6, 2))
    shard = tuple(shape) if sharded else ()
    spec = tsio.build_array_spec({"driver": "file", "path": str(tmp_path) + "/"}, shape, dtype, chunks, shard,
                                 checksum, transpose)
    store = ts.open(spec, create=True, open=True).result()
    assert (tmp_path / "zarr.json").read_bytes() == chunk_format.zarr_json(shape, dtype, chunks, shard,
                                                                           bool(checksum), transpose)
    if sharded:
        return
    value = np.arange(np.prod(shape)).reshape(shape).astype(jnp.dtype(dtype))
    store.write(value).result()
    raw = tmp_path.joinpath("c", *["0"] * len(shape)).read_bytes()
    first = value[tuple(slice(0, c) for c in chunks)]
    assert raw[:first.nbytes] == np.ascontiguousarray(first.transpose(transpose)).tobytes()


def test_metadata_is_version_4_only_when_a_leaf_is_transposed():
    plain = LeafMetadata(keystr="['w']", path=[["d", "w"]], kind="array", dir="w", shape=(4, 2), dtype="float32",
                         chunks=(4, 2))
    turned = LeafMetadata(**{**plain.__dict__, "transpose": (1, 0)})
    for leaf, version in ((plain, 3), (turned, 4)):
        meta = StepMetadata(step=1, generation=1, process_count=1,
                            items={"s": ItemMetadata(kind="pytree", leaves=(leaf,))})
        raw = meta.to_bytes()
        assert json.loads(raw)["version"] == version
        assert StepMetadata.from_bytes(raw, "x") == meta
    raw = json.loads(meta.to_bytes())
    raw["items"]["s"]["leaves"][0]["transpose"] = [1, 1]
    bad = json.dumps(raw).encode()
    with pytest.raises(MetadataError, match="not a permutation"):
        StepMetadata.from_bytes(bad, "x")


# ---------------------------------------------------------------- saves and restores


def state(devices, step: int) -> dict[str, jax.Array]:
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(4, 2), ("a", "b"))
    rng = np.random.default_rng(step)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return {
        "embed": put(rng.standard_normal((512, 96), dtype=np.float32), P("a", "b")),  # 48 KiB chunks
        "big": put(rng.standard_normal((256, 512), dtype=np.float32), P("a")),  # 128 KiB: direct I/O
        "cube": put(rng.integers(-99, 99, (8, 4, 6), dtype=np.int32), P(None, "b")),
        "half": put(rng.standard_normal((16, 8)).astype(jnp.bfloat16), P()),
        "bias": put(rng.standard_normal((24,), dtype=np.float32), P("a")),
    }


def host(tree):
    return {k: np.array(v, copy=True) for k, v in tree.items()}


def assert_bit_exact(got, want):
    for key, value in want.items():
        g = np.asarray(got[key])
        assert g.dtype == value.dtype and g.shape == value.shape, key
        assert np.ascontiguousarray(g).tobytes() == np.ascontiguousarray(value).tobytes(), key


TRANSPOSE = {"['embed']": [1, 0], "['big']": [1, 0], "['cube']": [2, 1, 0], "['half']": [1, 0], "['bias']": None}


@pytest.fixture
def column_major(monkeypatch):
    monkeypatch.setenv(FORCE_COLUMN_MAJOR_ENV, "1")


@pytest.mark.parametrize(("device_copy", "accelerator"), [
    ("auto", False),            # CPU: the lazy views of the on-device copy
    ("host_transfer", False),   # CPU: the arena
    ("on_device", True),        # the accelerator's drain, forced on CPU
], ids=["cpu-copy", "host-transfer", "accelerator-drain"])
@pytest.mark.parametrize("shard_files", [True, False], ids=["shard-files", "chunk-files"])
def test_column_major_leaves_are_written_without_a_bounce_and_restore_bit_exact(
        tmp_path, devices, column_major, monkeypatch, device_copy, accelerator, shard_files):
    if accelerator:
        monkeypatch.setenv(FORCE_ACCELERATOR_ENV, "1")
    root = str(tmp_path / "ckpt")
    opts = rc.ManagerOptions(device_copy=device_copy, shard_files=shard_files, direct_io=False)
    before = chunk_writer.bounced_writes()
    with rc.CheckpointManager(root, opts) as mgr:
        for step in (1, 2):
            mgr.save(step, {"state": state(devices, step)})
        mgr.wait()
        assert chunk_writer.bounced_writes()["writes"] == before["writes"]  # every chunk written as it landed
        with open(os.path.join(root, "2", "_METADATA.json")) as f:
            meta = json.load(f)
        assert meta["version"] == 4
        assert {leaf["keystr"]: leaf.get("transpose") for leaf in meta["items"]["state"]["leaves"]} == TRANSPOSE
        want = host(state(devices, 2))
        assert_bit_exact(mgr.restore(2)["state"], want)  # onto the save's mesh
        other = jax.sharding.Mesh(np.array(devices[:8]).reshape(2, 4), ("a", "b"))
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other, P(*reversed(
            [None] * (v.ndim - 2) + ["a", "b"])) if v.ndim >= 2 else P("b"))) for k, v in want.items()}
        restored = mgr.restore(2, {"state": target})["state"]
        assert_bit_exact(restored, want)  # onto another mesh: sub-boxes of chunks
        assert all(restored[k].sharding == target[k].sharding for k in want)
        to_host = {k: np.zeros(v.shape, v.dtype) for k, v in want.items()}
        assert_bit_exact(mgr.restore(2, {"state": to_host})["state"], want)  # to host NumPy
    with rc.CheckpointManager(root, rc.ManagerOptions(restore_reuse_host_buffers=True)) as mgr:
        for _ in range(2):  # through the host ring, twice (the second reuses it)
            assert_bit_exact(mgr.restore(2)["state"], want)
    for key in want:  # tensorstore reads the arrays as plain zarr3, through their own zarr.json
        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{root}/2/state/{key}/"}},
                        open=True).result()
        assert_bit_exact({key: store.read().result()}, {key: want[key]})


def test_a_chunk_file_of_a_column_major_leaf_holds_its_fortran_order_bytes(tmp_path, devices, column_major):
    root = str(tmp_path / "ckpt")
    with rc.CheckpointManager(root, rc.ManagerOptions(shard_files=False)) as mgr:
        mgr.save(1, {"state": state(devices, 1)})
        mgr.wait()
    embed = np.asarray(state(devices, 1)["embed"])
    with open(os.path.join(root, "1", "state", "embed", "c", "1", "0"), "rb") as f:  # rows 128-255, columns 0-47
        raw = f.read()
    assert raw[:-4] == np.asfortranarray(embed[128:256, :48]).tobytes(order="F")


@pytest.mark.parametrize("use_tensorstore", [False, True], ids=["file-reader", "tensorstore-reader"])
def test_prefetch_reads_of_a_column_major_leaf_are_bit_exact(tmp_path, devices, column_major, use_tensorstore):
    """The restore prefetch's reads (read_ahead.BoxesRead through reader.read_leaves): the whole array,
    a box inside one chunk, a box across chunks; and find_box's part of a held box."""
    root = str(tmp_path / "ckpt")
    with rc.CheckpointManager(root, rc.ManagerOptions()) as mgr:
        mgr.save(1, {"state": state(devices, 1)})
        mgr.wait()
    want = np.asarray(state(devices, 1)["embed"])
    meta = read_metadata(LocalStorage(), os.path.join(root, "1"))
    leaf = next(leaf for leaf in meta.items["state"].leaves if leaf.keystr == "['embed']")
    assert leaf.transpose == (1, 0)
    boxes = [((0, 512), (0, 96)), ((130, 250), (10, 40)), ((100, 300), (40, 60))]
    reads = [read_ahead.BoxesRead("state", leaf, [box]) for box in boxes]
    backend = backends.for_storage(LocalStorage(), rc.ManagerOptions(io_concurrency=4, fsync=False),
                                   use_tensorstore=use_tensorstore)
    reader.read_leaves(reads, os.path.join(root, "1"), backend, 1 << 20, io_concurrency=4)
    for read, box in zip(reads, boxes, strict=True):
        index = tuple(slice(a, b) for a, b in box)
        np.testing.assert_array_equal(read.result[box], want[index])
    part = read_ahead.find_box(reads[0].result, ((5, 9), (3, 90)))
    np.testing.assert_array_equal(part, want[5:9, 3:90])


def test_local_tier_and_tensorstore_written_steps_of_column_major_leaves_restore_bit_exact(tmp_path, devices,
                                                                                          column_major):
    """The local tier (every replica written by every process) and a step that tensorstore writes (a
    dtype our files do not hold sends the whole step through it) store the same transposed chunks."""
    tree = state(devices, 3)
    with rc.CheckpointManager(str(tmp_path / "local"), rc.ManagerOptions(local_tier=True, async_save=False)) as mgr:
        mgr.save(3, {"state": tree})
        assert_bit_exact(mgr.restore(3)["state"], host(tree))
    mixed = {**tree, "z": jax.device_put(np.ones((4, 6), np.complex64) * 1j, tree["half"].sharding)}
    with rc.CheckpointManager(str(tmp_path / "ts"), rc.ManagerOptions()) as mgr:
        mgr.save(3, {"state": mixed})
        mgr.wait()
        assert_bit_exact(mgr.restore(3)["state"], host(mixed))
    meta = read_metadata(LocalStorage(), str(tmp_path / "ts" / "3"))
    assert {leaf.keystr: leaf.transpose for leaf in meta.items["state"].leaves}["['z']"] == (1, 0)
