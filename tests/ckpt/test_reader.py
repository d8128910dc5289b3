"""The restore-side reader (reader.py) on real files with real tensorstore: aligned buffers that
XLA:CPU aliases, the direct file path against the tensorstore path, resharding, dtype casts, and
clear errors for missing or truncated chunk files."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import resilax_ckpt as rc
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt.chunks import backends, chunk_format, chunk_writer, file_reader, reader, staging
from resilax_ckpt.errors import CorruptCheckpointError, IncompleteStepError
from resilax_ckpt.manager import read_metadata
from resilax_ckpt.storage import LocalStorage

STEP = 3


def mesh(shape, names=("a", "b")):
    n = int(np.prod(shape))
    return jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names[: len(shape)])


def raw_values():
    rng = np.random.default_rng(7)
    return {
        "f32": rng.standard_normal((16, 8), dtype=np.float32),
        "bf16": rng.standard_normal((8, 16), dtype=np.float32).astype(ml_dtypes.bfloat16),
        "i32": rng.integers(-1000, 1000, (16, 4), dtype=np.int32),
        "flags": rng.integers(0, 2, (8, 8)).astype(bool),
        "vec": rng.standard_normal((24,), dtype=np.float32),
        "odd": rng.standard_normal((12, 5), dtype=np.float32),
        "scalar": np.array(2.5, np.float32),
        "rep": rng.standard_normal((4, 6), dtype=np.float32),
        "host": rng.integers(0, 9, (6, 10), dtype=np.int32),
    }


SAVE_SPECS = {  # on mesh (4, 2) unless noted: sharded, mixed, replicated, 0-d, 1-d, 3 devices
    "f32": P("a", "b"),
    "bf16": P("b", "a"),
    "i32": P("a", None),
    "flags": P(None, "b"),
    "vec": P("a"),
    "scalar": P(),
    "rep": P(),
}


@pytest.fixture(scope="module", params=["shard-files", "chunk-files"])
def saved(tmp_path_factory, request):
    """One step holding every kind of leaf; `odd` is sharded on 3 devices (chunks of 4 rows), so 2-
    and 4-device targets cut its chunks unevenly; `host` is a NumPy array (one chunk). Saved both
    ways: each multi-chunk array as one shard file (the default) and as one file per chunk."""
    if len(jax.devices()) < 8:
        pytest.fail("needs 8 fake CPU devices (tests/ckpt/conftest.py)")
    root = str(tmp_path_factory.mktemp("reader"))
    raw = raw_values()
    m = mesh((4, 2))
    params = {k: jax.device_put(raw[k], NamedSharding(m, spec)) for k, spec in SAVE_SPECS.items()}
    m3 = jax.sharding.Mesh(np.array(jax.devices()[:3]), ("c",))
    params["odd"] = jax.device_put(raw["odd"], NamedSharding(m3, P("c", None)))
    params["host"] = raw["host"]
    opt = {"mu": jax.device_put(raw["f32"] * 2, NamedSharding(m, P("a", "b")))}
    options = rc.ManagerOptions(shard_files=request.param == "shard-files")
    with rc.CheckpointManager(root, options) as mgr:
        mgr.save(STEP, {"params": params, "opt_state": opt}, force=True)
        mgr.wait()
    return root, raw


def step_path(root):
    return os.path.join(root, str(STEP))


def read_with(root, targets, use_tensorstore, item="params"):
    """`reader.read_leaves` on `targets` ({key: sharding or None, or (sharding, dtype)})."""
    meta = read_metadata(LocalStorage(), step_path(root))
    leaves = {leaf.keystr: leaf for leaf in meta.items[item].leaves}
    reads = []
    for key, want in targets.items():
        sharding, dtype = want if isinstance(want, tuple) else (want, None)
        leaf = leaves[f"['{key}']"]
        reads.append(reader.LeafRead(item, leaf, np.dtype(dtype or leaf.dtype), sharding))
    backend = backends.for_storage(LocalStorage(), rc.ManagerOptions(io_concurrency=4, fsync=False),
                                   use_tensorstore=use_tensorstore)
    reader.read_leaves(reads, step_path(root), backend, 1 << 20, io_concurrency=4)
    return {key: r.result for key, r in zip(targets, reads, strict=True)}


def assert_bit_identical(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("shape", [(), (1,), (3,), (7, 5), (2, 3, 4)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32, np.bool_])
def test_aligned_empty_is_aligned_and_sized(shape, dtype):
    buf = reader.aligned_empty(shape, dtype)
    assert buf.ctypes.data % reader.ALIGNMENT == 0
    assert buf.shape == shape and buf.dtype == np.dtype(dtype) and buf.flags.c_contiguous


def test_large_buffers_are_page_aligned_and_aliased_by_xla():
    # From DIRECT_MIN_BYTES on, a buffer is a memory map of its own (no transparent huge pages):
    # page-aligned for O_DIRECT, and still kept by XLA:CPU as the device buffer (no copy).
    buf = reader.aligned_empty((256, 512), np.float32)
    assert buf.nbytes >= reader.DIRECT_MIN_BYTES
    assert buf.ctypes.data % reader.DIRECT_ALIGN == 0 and buf.flags.writeable and buf.flags.c_contiguous
    buf[...] = np.arange(buf.size, dtype=np.float32).reshape(buf.shape)
    devices = jax.devices()[:2]
    placed = jax.device_put([buf, buf], devices)
    assert [p.unsafe_buffer_pointer() for p in placed] == [buf.ctypes.data] * 2
    del buf
    np.testing.assert_array_equal(np.asarray(placed[1]), np.arange(256 * 512, dtype=np.float32).reshape(256, 512))


def vm_flags(address):
    """The VmFlags of the mapping holding `address` (/proc/self/smaps), None when unknown."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                low, high = (int(x, 16) for x in fields[0].split("-"))
                inside = low <= address < high
            elif inside and fields[0] == "VmFlags:":
                return set(fields[1:])
    return None


def test_large_buffers_take_no_transparent_huge_pages():
    # NumPy advises huge pages from 4 MiB on; a restore buffer undoes that (the kernel's compaction
    # for them stalls a fresh process's first touch).
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("no /proc/self/smaps")
    buf = reader.aligned_empty((16 << 20,), np.uint8)
    flags = vm_flags(buf.ctypes.data + (8 << 20))
    assert flags is not None and "nh" in flags and "hg" not in flags, flags


TARGETS = {
    "4x2-as-saved": ((4, 2), {"f32": P("a", "b"), "bf16": P("b", "a"), "i32": P("a", None),
                              "flags": P(None, "b"), "vec": P("a"), "scalar": P(), "rep": P(),
                              "odd": P("a", None), "host": P("b", None)}),
    "2x4-transposed": ((2, 4), {"f32": P("b", "a"), "bf16": P("a", "b"), "i32": P(None, "b"),
                                "flags": P("b", None), "vec": P("b"), "scalar": P(), "rep": P("a", None),
                                "odd": P("b", None), "host": P("a", None)}),
    "8x1": ((8, 1), {"f32": P("a", None), "bf16": P(None, "a"), "i32": P("a", "b"), "flags": P(),
                     "vec": P("a"), "scalar": P(), "rep": P(None, "b"), "odd": P(None, "b"),
                     "host": P(None, None)}),
    "4-devices": ((2, 2), {"f32": P("a", "b"), "bf16": P("b", None), "i32": P(("a", "b"), None),
                           "flags": P("a", "b"), "vec": P(("a", "b")), "scalar": P(), "rep": P("a", "b"),
                           "odd": P(("a", "b"), None), "host": P("a", "b")}),
}


@pytest.mark.parametrize("name", list(TARGETS))
def test_direct_and_tensorstore_paths_are_bit_identical(saved, name):
    root, raw = saved
    mesh_shape, specs = TARGETS[name]
    m = mesh(mesh_shape)
    targets = {key: NamedSharding(m, spec) for key, spec in specs.items()}
    direct = read_with(root, targets, use_tensorstore=False)
    via_ts = read_with(root, targets, use_tensorstore=True)
    for key, sharding in targets.items():
        assert direct[key].sharding == sharding and via_ts[key].sharding == sharding
        assert_bit_identical(direct[key], raw[key])
        assert_bit_identical(via_ts[key], raw[key])
        for a, b in zip(direct[key].addressable_shards, via_ts[key].addressable_shards, strict=True):
            assert a.device == b.device and a.index == b.index
            assert_bit_identical(a.data, b.data)


def test_host_numpy_without_target_from_both_paths(saved):
    root, raw = saved
    for use_ts in (False, True):
        out = read_with(root, dict.fromkeys(raw), use_tensorstore=use_ts)
        for key, value in out.items():
            assert isinstance(value, np.ndarray)
            assert value.ctypes.data % reader.ALIGNMENT == 0
            assert_bit_identical(value, raw[key])


def test_restored_shards_alias_aligned_buffers_and_replicas_share_one(saved):
    """XLA:CPU keeps the aligned host buffer as the device buffer (no second copy); the replicas of
    a box on several devices of this process are one buffer."""
    root, raw = saved
    m = mesh((4, 2))
    out = read_with(root, {"f32": NamedSharding(m, P("a", None)), "rep": NamedSharding(m, P())},
                    use_tensorstore=False)
    pointers = {s.device: s.data.unsafe_buffer_pointer() for s in out["f32"].addressable_shards}
    assert all(p % reader.ALIGNMENT == 0 for p in pointers.values())
    by_box: dict[tuple, set[int]] = {}
    for s in out["f32"].addressable_shards:
        by_box.setdefault(str(s.index), set()).add(pointers[s.device])
    assert len(by_box) == 4 and all(len(p) == 1 for p in by_box.values())  # 2 devices per box, 1 buffer
    assert len({s.data.unsafe_buffer_pointer() for s in out["rep"].addressable_shards}) == 1
    # Shared buffers are safe to donate: XLA copies an external buffer instead of writing into it.
    bumped = jax.jit(lambda x: x + 1, donate_argnums=0)(out["rep"])
    for shard in bumped.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), raw["rep"] + 1)


@pytest.mark.parametrize("use_ts", [False, True], ids=["direct", "tensorstore"])
def test_dtype_cast_reads_raw_then_casts_once(saved, use_ts):
    root, raw = saved
    m = mesh((2, 4))
    out = read_with(root, {
        "f32": (NamedSharding(m, P("b", "a")), jnp.bfloat16),
        "i32": (NamedSharding(m, P("a", None)), np.float32),
        "bf16": (NamedSharding(m, P()), np.float32),
        "flags": (None, np.int32),
    }, use_tensorstore=use_ts)
    assert_bit_identical(out["f32"], raw["f32"].astype(ml_dtypes.bfloat16))
    assert_bit_identical(out["i32"], raw["i32"].astype(np.float32))
    assert_bit_identical(out["bf16"], raw["bf16"].astype(np.float32))
    assert_bit_identical(out["flags"], raw["flags"].astype(np.int32))
    assert out["f32"].dtype == jnp.bfloat16


@pytest.fixture
def copy_of(saved, tmp_path):
    root, raw = saved
    dst = str(tmp_path / "copy")
    shutil.copytree(root, dst)
    return dst, raw


def leaf_meta(root, key, item="params"):
    meta = read_metadata(LocalStorage(), step_path(root))
    return next(leaf for leaf in meta.items[item].leaves if leaf.keystr == f"['{key}']")


def chunk_file(root, item, key, *chunk):
    """The file holding chunk `chunk` of leaf `key`: its chunk file, or the shard file holding it."""
    leaf = leaf_meta(root, key, item)
    rel, _ = chunk_format.ArrayFiles.of(leaf).locate(chunk)
    return os.path.join(root, str(STEP), item, leaf.dir, *rel)


def test_missing_chunk_file_is_an_error_naming_it(copy_of):
    root, _ = copy_of
    path = chunk_file(root, "params", "f32", 1, 0)
    os.remove(path)
    m = mesh((4, 2))
    target = {"params": {"f32": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(m, P("a", "b")))}}
    with rc.CheckpointManager(root) as mgr, pytest.raises(rc.MissingChunkError) as err:
        mgr.restore(STEP, target=target, items=["params"])
    assert path in str(err.value) and "missing" in str(err.value)
    assert isinstance(err.value, IncompleteStepError)
    # Resharded (the chunk is sliced into several boxes), without a target, through tensorstore: the same.
    with pytest.raises(rc.MissingChunkError, match=path):
        read_with(root, {"f32": NamedSharding(mesh((2, 4)), P("b", "a"))}, use_tensorstore=False)
    with pytest.raises(rc.MissingChunkError, match=path):
        read_with(root, {"f32": None}, use_tensorstore=False)
    with pytest.raises(rc.MissingChunkError, match=path):
        read_with(root, {"f32": None}, use_tensorstore=True)


@pytest.mark.parametrize("how", ["truncated", "empty", "too long"])
def test_chunk_file_of_the_wrong_size_is_an_error_naming_it(copy_of, how):
    root, _ = copy_of
    path = chunk_file(root, "params", "f32", 2, 1)
    with open(path, "rb") as f:
        data = f.read()
    expected = chunk_format.ArrayFiles.of(leaf_meta(root, "f32")).file_size()  # a chunk: 4 x 4 x 4 bytes
    assert len(data) == expected
    with open(path, "wb") as f:
        f.write({"truncated": data[:-4], "empty": b"", "too long": data + b"\0" * 4}[how])
    size = os.path.getsize(path)
    m = mesh((4, 2))
    for sharding in (NamedSharding(m, P("a", "b")), NamedSharding(mesh((2, 4)), P("b", "a")), None):
        with pytest.raises(CorruptCheckpointError, match=re.escape(f"{path} has {size} bytes, expected {expected}")):
            read_with(root, {"f32": sharding}, use_tensorstore=False)


def test_params_only_restore_reads_no_other_item(copy_of):
    root, raw = copy_of
    shutil.rmtree(os.path.join(root, str(STEP), "opt_state"))
    m = mesh((2, 4))
    target = {"params": {"f32": jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=NamedSharding(m, P("b", "a"))),
                         "vec": jax.ShapeDtypeStruct((24,), jnp.float32, sharding=NamedSharding(m, P("b")))}}
    with rc.CheckpointManager(root) as mgr:
        out = mgr.restore(STEP, target=target, items=["params"])
        assert list(out) == ["params"]
        assert_bit_identical(out["params"]["f32"], raw["f32"])
        assert_bit_identical(out["params"]["vec"], raw["vec"])
        with pytest.raises(IncompleteStepError, match="opt_state"):
            mgr.restore(STEP, items=["opt_state"])


def test_an_all_zero_shard_restores(tmp_path):
    m = mesh((4, 2))
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    value[:2, :4] = 0  # shard (0, 0) is all zeros: tensorstore does not store a chunk equal to the fill value
    with rc.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"params": {"w": jax.device_put(value, NamedSharding(m, P("a", "b")))}}, force=True)
        mgr.wait()
        out = mgr.restore(1, target={"params": {"w": jax.ShapeDtypeStruct(
            (8, 8), jnp.float32, sharding=NamedSharding(m, P("a", "b")))}})
    assert_bit_identical(out["params"]["w"], value)


@pytest.mark.parametrize("spec, in_place", [(P("a", "b"), True), (P("b", "a"), False)])
def test_only_reads_that_need_a_scratch_buffer_count_against_the_inflight_limit(saved, spec, in_place):
    # A read straight into box buffers takes no memory of its own, so it is not held back; a read
    # into a scratch buffer (here: resharding f32 onto transposed specs) counts its chunk file.
    root, raw = saved
    meta = read_metadata(LocalStorage(), step_path(root))
    leaf = next(lf for lf in meta.items["params"].leaves if lf.keystr == "['f32']")
    read = reader.LeafRead("params", leaf, np.dtype(leaf.dtype), NamedSharding(mesh((4, 2)), spec))
    read.plan_boxes()
    read.buffers = {box: reader.aligned_empty([b - a for a, b in box], np.float32) for box in read.devices}
    tasks = reader.plan_chunk_tasks(read)
    runner = file_reader.FileChunkReader([os.path.join(step_path(root), "params", leaf.dir)],
                                     [chunk_format.ArrayFiles.of(leaf)], reader.ScratchPool(0), True)
    jobs = runner.jobs(0, tasks)
    assert sorted(t.chunk for job in jobs for t in job) == sorted(t.chunk for t in tasks)
    chunk_bytes = int(np.prod(leaf.chunks)) * 4
    assert [runner.buffered_bytes(j) for j in jobs] == [0 if in_place else chunk_bytes] * len(jobs)
    got = read_with(root, {"f32": NamedSharding(mesh((4, 2)), spec)}, use_tensorstore=False)["f32"]
    assert_bit_identical(got, raw["f32"])


def test_shard_files_are_read_in_runs_of_whole_chunks_one_request_each(tmp_path, monkeypatch):
    # 8 chunks of 64 KiB in one shard file, restored onto the save's sharding: one request (preadv)
    # for all, or one per run of at most RUN_BYTES and RUN_CHUNKS; resharded, each chunk is read
    # alone into a scratch buffer. A request's bytes are what the calls record: with O_DIRECT it
    # goes through a staging buffer (one iovec), else straight into the box buffers (one per chunk).
    m = mesh((4, 2))
    value = np.random.default_rng(4).standard_normal((256, 512), dtype=np.float32)
    with rc.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(STEP, {"params": {"w": jax.device_put(value, NamedSharding(m, P("a", "b")))}}, force=True)
        mgr.wait()
    leaf = leaf_meta(str(tmp_path), "w")
    assert leaf.shard == (256, 512) and leaf.chunks == (64, 256)
    stride = chunk_format.ArrayFiles.of(leaf).stride  # a chunk, its checksum, padding to the next block
    assert stride == (64 << 10) + 4096
    calls = []
    real_preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: calls.append(sum(len(b) for b in bufs))
                        or real_preadv(fd, bufs, offset))
    small = 16 << 10  # a checksum or a shard index, read apart (as a block with O_DIRECT)
    # (RUN_CHUNKS counts iovecs: with checksums a chunk takes two, its data and its checksum's block)
    for run_bytes, run_chunks, runs in ((file_reader.RUN_BYTES, file_reader.RUN_CHUNKS, [8]), (3 * stride, 1024, [2, 3, 3]),
                                        (file_reader.RUN_BYTES, 10, [3, 5])):
        monkeypatch.setattr(file_reader, "RUN_BYTES", run_bytes)
        monkeypatch.setattr(file_reader, "RUN_CHUNKS", run_chunks)
        calls.clear()
        got = read_with(str(tmp_path), {"w": NamedSharding(m, P("a", "b"))}, use_tensorstore=False)["w"]
        assert_bit_identical(got, value)
        assert sorted(c // stride for c in calls if c > small) == sorted(runs)  # in any order: 4 reader threads
        assert len([c for c in calls if c <= small]) == 1  # the shard index, checked once
    calls.clear()
    got = read_with(str(tmp_path), {"w": NamedSharding(mesh((8, 1)), P("a", None))}, use_tensorstore=False)["w"]
    assert_bit_identical(got, value)
    assert [c >> 16 for c in calls if c > small] == [1] * 8  # each chunk alone (64 KiB)...
    assert len([c for c in calls if c <= small]) == 8 + 1  # ...then its checksum; and the index once


@pytest.mark.parametrize("huge_pages", [True, False], ids=["staged", "straight"])
def test_direct_reads_fill_views_across_staging_buffers(tmp_path, monkeypatch, huge_pages):
    # A run of views whose edges fall inside and across staging buffers, read from an O_DIRECT file
    # at a page offset: every view gets exactly its bytes, through staging or straight.
    if not chunk_writer.use_direct_io(str(tmp_path), True):
        pytest.skip(f"{tmp_path} is on a memory filesystem (no O_DIRECT)")
    monkeypatch.setattr(file_reader.staging, "huge_pages", lambda: huge_pages)
    page = reader.DIRECT_ALIGN
    sizes = [page, staging.BUFFER_BYTES - 2 * page, 3 * page, staging.BUFFER_BYTES + page, 5 * page]
    data = np.random.default_rng(9).integers(0, 256, sum(sizes) + 2 * page, dtype=np.uint8)
    path = str(tmp_path / "f")
    data.tofile(path)
    raws = [np.empty(n + page, np.uint8) for n in sizes]
    views = [raw[-raw.ctypes.data % page:][:n] for raw, n in zip(raws, sizes, strict=True)]  # page-aligned
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        file_reader._read_direct(fd, views, page, path)
    finally:
        os.close(fd)
    starts = np.cumsum([page, *sizes])
    for view, start, n in zip(views, starts, sizes, strict=False):
        assert view.tobytes() == data[start:start + n].tobytes()


def test_staging_buffers_are_huge_page_aligned_reused_and_limited():
    with staging.borrowed() as first:
        address = first.ctypes.data
        assert first.nbytes == staging.BUFFER_BYTES and address % staging.HUGE_PAGE_BYTES == 0
        if staging.huge_pages() and os.path.exists("/proc/self/smaps"):
            flags = vm_flags(address)
            assert flags is not None and "hg" in flags, flags
    with staging.borrowed() as again:
        assert again.ctypes.data == address  # the pool's warm buffer, not a new one
    # At most MAX_BUFFERS are out at once: one more borrower waits until one comes back.
    with contextlib.ExitStack() as stack:
        held = [stack.enter_context(staging.borrowed()) for _ in range(staging.MAX_BUFFERS)]
        assert len({b.ctypes.data for b in held}) == staging.MAX_BUFFERS
        got = threading.Event()

        def borrow():
            with staging.borrowed():
                got.set()

        waiter = threading.Thread(target=borrow)
        waiter.start()
        assert not got.wait(0.2)
        stack.close()
        assert got.wait(30)
        waiter.join()


def chunk_files_under(folder):
    return sorted(os.path.join(d, f) for d, _, names in os.walk(folder) for f in names
                  if f"{os.sep}c{os.sep}" in os.path.join(d, f) + os.sep)


def evict(files):
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_pages(path):
    """How many of the file's pages are in the page cache (mincore of a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    pages = -(-size // os.sysconf("SC_PAGE_SIZE"))
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    finally:
        os.close(fd)
    try:
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        return sum(v & 1 for v in vec)
    finally:
        libc.munmap(addr, size)


@pytest.mark.parametrize("shard_files", [True, False], ids=["shard-files", "chunk-files"])
@pytest.mark.parametrize("direct_io", [True, False])
def test_direct_io_restores_bit_exact_without_filling_the_page_cache(tmp_path, direct_io, shard_files):
    # On a disk, chunk files of 64 KiB and more are read with O_DIRECT: only a part's unaligned tail
    # goes through the page cache. `rows` has chunks of 280000 bytes (68 pages and a partial one),
    # `grid` of exactly 64 KiB. Resharding reads `grid` into scratch buffers, and parts of `rows`
    # straight into box buffers at offsets mostly not congruent to theirs modulo a page (buffered).
    # In shard files, `grid`'s chunks are read as saved in runs of several chunks per request.
    if not chunk_writer.use_direct_io(str(tmp_path), True):
        pytest.skip(f"{tmp_path} is on a memory filesystem (no O_DIRECT)")
    m = mesh((4, 2))
    rng = np.random.default_rng(3)
    values = {"rows": rng.standard_normal((4, 70000), dtype=np.float32),
              "grid": rng.standard_normal((256, 512), dtype=np.float32)}
    saved_specs = {"rows": P("a"), "grid": P("a", "b")}
    options = rc.ManagerOptions(direct_io=direct_io, shard_files=shard_files)
    with rc.CheckpointManager(str(tmp_path), options=options) as mgr:
        mgr.save(1, {"params": {k: jax.device_put(v, NamedSharding(m, saved_specs[k])) for k, v in values.items()}},
                 force=True)
        mgr.wait()
        files = chunk_files_under(os.path.join(str(tmp_path), "1"))
        assert len(files) == (2 if shard_files else 4 + 8)
        chunks_in = {f: (4 if "rows" in f else 8) if shard_files else 1 for f in files}
        for specs in (saved_specs, {"rows": P(None, ("a", "b")), "grid": P("b", "a")}):
            evict(files)
            assert sum(map(cached_pages, files)) == 0
            target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(m, specs[k]))
                      for k, v in values.items()}
            out = mgr.restore(1, target={"params": target})["params"]
            for k, v in values.items():
                assert_bit_identical(out[k], v)
                assert out[k].sharding == target[k].sharding
            cached = {os.path.relpath(f, str(tmp_path)): cached_pages(f) for f in files}
            pages = {os.path.relpath(f, str(tmp_path)): -(-os.path.getsize(f) // 4096) for f in files}
            if not direct_io:
                assert cached == pages
            elif specs is saved_specs:  # all read in place: at most each chunk's partial last page cached
                assert all(n <= chunks_in[os.path.join(str(tmp_path), f)] for f, n in cached.items()), cached
                assert all(n == 0 for f, n in cached.items() if "grid" in f), cached  # whole pages
            else:  # grid read whole into scratch buffers: directly (rows: mostly buffered, see above)
                assert all(n == 0 for f, n in cached.items() if "grid" in f), cached
