"""Host buffers reused across checkpoint operations (issue 37), counted, not timed.

Restore (`test_restore_*`): a restore onto accelerators reads into the process's host ring
(reader.py) and reuses it; on CPU devices the same path is forced by
`ManagerOptions(restore_reuse_host_buffers=True)`, a device-side copy standing for the transfer. A
reused buffer never aliases a restored array the caller still holds.

Save (`test_save_*`, at the end): a host transfer on CPU devices copies into the manager's reused
arena (staging.HostArena), and the writes' staging buffers come from one pool."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import resilax_ckpt as rc
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt.chunks import checksums, chunk_writer, host_ring, staging
from resilax_ckpt.errors import ChecksumMismatchError, CorruptCheckpointError

# ---------------------------------------------------------------- restore


def restore_state(step: int, devices):
    """Four leaves of 8 KiB on a (4, 2) mesh (boxes of 1 KiB: a 4 KiB piece of the ring each), a
    replicated one, a bf16 one restored as float32, a host array and a scalar."""
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(4, 2), ("a", "b"))
    rng = np.random.default_rng(step)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    return {
        "layers": [put(rng.standard_normal((64, 32), dtype=np.float32), P("a", "b")) for _ in range(4)],
        "bias": put(rng.standard_normal((40,), dtype=np.float32), P()),
        "emb": put(rng.integers(-9, 9, (16, 24), dtype=np.int32), P(None, "b")),
        "host": rng.standard_normal((5, 7)).astype(np.float32),
        "count": step,
    }


def host_copy(tree):
    return jax.tree_util.tree_map(lambda x: np.array(x, copy=True), tree)


def assert_same(tree, expected):
    for got, want in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)  # bit-exact (no tolerance)


def allocations() -> int:
    return host_ring.host_buffer_counts()["allocations"]


def ring_options(**kw) -> rc.ManagerOptions:
    return rc.ManagerOptions(restore_reuse_host_buffers=True, recycle_pool=0, **kw)


def test_restore_reuses_the_host_ring_from_the_second_restore_on(tmp_path, devices):
    host_ring.release_host_buffers()
    with rc.CheckpointManager(str(tmp_path), ring_options()) as mgr:
        mgr.save(1, restore_state(1, devices))
        mgr.wait()
        target = restore_state(0, devices)
        expected = host_copy(restore_state(1, devices))
        before = allocations()
        assert_same(mgr.restore(1, target), expected)
        first = allocations() - before
        assert first >= 1  # the ring (and the host array, which is the caller's own)
        for _ in range(3):
            before = allocations()
            assert_same(mgr.restore(1, target), expected)
            assert allocations() - before == first - 1  # the ring again; only the host leaf is new


def test_restore_reuses_ring_pieces_within_one_restore_when_the_ring_is_smaller_than_the_state(tmp_path, devices):
    """A ring of 3 leaves' pieces for 6 sharded leaves: later leaves reuse the pieces of earlier ones
    once their transfers are done (with wrap-around), and nothing is allocated besides the ring."""
    host_ring.release_host_buffers()
    with rc.CheckpointManager(str(tmp_path), ring_options(restore_host_buffer_bytes=3 * 8 * 4096)) as mgr:
        state = restore_state(1, devices)
        del state["host"]
        mgr.save(1, state)
        mgr.wait()
        target = restore_state(0, devices)
        del target["host"]
        expected = host_copy(state)
        before = allocations()
        assert_same(mgr.restore(1, target), expected)
        assert allocations() - before == 1  # the ring only, though the state is twice its size
        before = allocations()
        assert_same(mgr.restore(1, target), expected)
        assert allocations() == before


def test_restore_never_changes_a_held_result_when_later_restores_reuse_its_buffers(tmp_path, devices):
    host_ring.release_host_buffers()
    with rc.CheckpointManager(str(tmp_path), ring_options(restore_host_buffer_bytes=2 * 8 * 4096)) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, restore_state(step, devices))
        mgr.wait()
        target = restore_state(0, devices)
        held = mgr.restore(1, target)
        before = allocations()
        second = mgr.restore(2, target)
        third = mgr.restore(3, target)
        assert allocations() - before == 2  # the host leaves: the sharded ones went through the ring
        assert_same(held, host_copy(restore_state(1, devices)))
        assert_same(second, host_copy(restore_state(2, devices)))
        assert_same(third, host_copy(restore_state(3, devices)))


def test_restore_onto_cpu_devices_by_default_leaves_the_read_buffers_to_the_arrays(tmp_path, devices):
    """Auto mode on CPU devices: device_put aliases the read buffer, so every restore allocates its
    own (the restored arrays are those buffers) and held results stay as they were."""
    host_ring.release_host_buffers()
    with rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(recycle_pool=0)) as mgr:
        mgr.save(1, restore_state(1, devices))
        mgr.save(2, restore_state(2, devices))
        mgr.wait()
        target = restore_state(0, devices)
        held = mgr.restore(1, target)
        before = allocations()
        second = mgr.restore(2, target)
        assert allocations() - before >= 4 * 8  # every box of every sharded layer: fresh
        shard = second["layers"][0].addressable_shards[0].data
        assert host_ring.host_buffer_counts()["bytes"] > 0 and shard.unsafe_buffer_pointer() % host_ring.ALIGNMENT == 0
        assert_same(held, host_copy(restore_state(1, devices)))
        assert_same(second, host_copy(restore_state(2, devices)))


def test_restore_results_survive_the_deletion_and_recycling_of_their_step(tmp_path, devices):
    """Restored arrays hold no file pages: the step's files deleted, or rewritten in place by
    recycling, leave a held result unchanged (and nothing is truncated under it)."""
    host_ring.release_host_buffers()
    opts = rc.ManagerOptions(keep_last=1, recycle_pool=1)
    with rc.CheckpointManager(str(tmp_path), opts) as mgr:
        mgr.save(1, restore_state(1, devices))
        mgr.wait()
        held = mgr.restore(1, restore_state(0, devices))
        mgr.save(2, restore_state(2, devices))
        mgr.wait()
        mgr.restore(2, restore_state(0, devices))  # step 1 no longer the restored (protected) step
        for step in (3, 4, 5):  # step 1's files recycled into a later step, then deleted
            mgr.save(step, restore_state(step, devices))
            mgr.wait()
        assert 1 not in mgr.steps()
        assert_same(held, host_copy(restore_state(1, devices)))


def test_restore_after_a_failed_restore_reuses_the_ring(tmp_path, devices):
    """A checksum failure midway gives every piece back: the next restore reads into the same ring."""
    host_ring.release_host_buffers()
    with rc.CheckpointManager(str(tmp_path), ring_options()) as mgr:
        mgr.save(1, restore_state(1, devices))
        mgr.save(2, restore_state(2, devices))
        mgr.wait()
        target = restore_state(0, devices)
        mgr.restore(2, target)
        chunk = next(os.path.join(d, f) for d, _, fs in sorted(os.walk(tmp_path / "1" / "layers" / "2"))
                     for f in sorted(fs) if os.path.getsize(os.path.join(d, f)) >= 1024)
        with open(chunk, "r+b") as f:  # flip a byte of a chunk's data (same size: a checksum failure)
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises((ChecksumMismatchError, CorruptCheckpointError)):
            mgr.restore(1, target)
        before = allocations()
        assert_same(mgr.restore(2, target), host_copy(restore_state(2, devices)))
        assert allocations() - before == 1  # the host leaf; the ring was given back whole


def test_restore_finds_the_ring_a_manager_warmed_and_allocates_nothing(tmp_path, devices):
    """warm_host_ring (the Restorer calls it at the manager's creation on accelerators: never on CPU
    devices in auto mode) allocates and faults the ring in ahead; the first restore then reuses it."""
    host_ring.release_host_buffers()
    assert not host_ring.ring_expected(None)  # CPU devices: auto mode does not warm
    assert not host_ring.ring_expected(True)  # forced (tests): the ring is sized by the restore instead
    ring_bytes = 64 * 4096
    before = allocations()
    warming = host_ring.warm_host_ring(ring_bytes)
    assert warming is not None
    with rc.CheckpointManager(str(tmp_path), ring_options(restore_host_buffer_bytes=ring_bytes)) as mgr:
        state = restore_state(1, devices)
        del state["host"]
        mgr.save(1, state)
        mgr.wait()
        target = restore_state(0, devices)
        del target["host"]
        assert_same(mgr.restore(1, target), host_copy(state))  # may start while the ring is warming: waits
    warming.join()
    assert allocations() - before == 1  # the warmed ring, nothing by the restore
    assert host_ring.warm_host_ring(ring_bytes) is None  # already there


@pytest.mark.gcs
def test_restore_from_gcs_reuses_the_ring_and_keeps_a_held_result(gcs_root, devices):
    """tensorstore's reads (gs://) fill ring pieces as the file reader's do."""
    host_ring.release_host_buffers()
    with rc.CheckpointManager(gcs_root, ring_options(restore_host_buffer_bytes=2 * 8 * 4096)) as mgr:
        mgr.save(1, restore_state(1, devices))
        mgr.save(2, restore_state(2, devices))
        mgr.wait()
        target = restore_state(0, devices)
        held = mgr.restore(1, target)
        before = allocations()
        second = mgr.restore(2, target)
        assert allocations() - before == 1  # the host leaf
        assert_same(held, host_copy(restore_state(1, devices)))
        assert_same(second, host_copy(restore_state(2, devices)))


def test_restore_host_ring_lends_pieces_in_order_and_takes_them_back_in_any_order():
    ring = host_ring.HostRing(4 * 4096)
    a, b, c = ring.take(4096), ring.take(2 * 4096), ring.take(4096)
    assert (a, b, c) == (0, 4096, 3 * 4096)
    assert ring.take(4096) is None  # full
    ring.give(b)  # out of order: a still holds the front
    assert ring.take(4096) is None
    ring.give(a)  # a and b back: [0, 3 pages) free again, in front of c
    assert ring.take(3 * 4096) == 0  # wraps around to the start
    assert ring.take(4096) is None
    ring.give(c)
    ring.give(0)
    assert ring.idle()
    assert ring.take(5 * 4096) is None  # bigger than the ring


def test_restore_host_ring_is_held_by_one_restore_at_a_time():
    """A restore that finds the ring held (another thread's restore) reads into fresh buffers, and its
    end does not free the ring under the one that holds it."""
    host_ring.release_host_buffers()
    first = host_ring.HostLease(4 * 4096, 1 << 20)
    assert first.ring is not None
    second = host_ring.HostLease(4 * 4096, 1 << 20)
    assert second.ring is None
    second.close([])
    assert host_ring.HostLease(4 * 4096, 1 << 20).ring is None  # still held by `first`
    first.close([])
    third = host_ring.HostLease(4 * 4096, 1 << 20)
    assert third.ring is first.ring  # the same memory again
    third.close([])


@pytest.mark.parametrize(("pieces", "set_bytes", "slots", "ring"), [
    ([], 512, 2, 0),
    ([100, 300, 200], 1000, 2, 600),  # the set size, capped at the state
    ([100, 300, 200], 400, 2, 500),  # the two largest pieces, when bigger than the set size
    ([100, 300, 200], 2000, 2, 600),
    ([800], 100, 2, 800),  # one leaf: itself
    ([800, 800, 800], 0, 2, 1600),
    ([100, 300, 200], 400, 1, 400),  # the restore's own: the set size holds the largest
    ([100, 300, 200], 200, 1, 300),  # the largest piece, when bigger than the set size
    ([800, 800, 800], 0, 1, 800),
], ids=["none", "set-size-capped", "two-largest", "whole-state", "one-leaf", "three-equal", "one-slot-set-size",
        "one-slot-largest", "one-slot-three-equal"])
def test_the_ring_holds_the_largest_leaves_when_they_are_bigger_than_its_set_size(pieces, set_bytes, slots, ring):
    assert host_ring.plan_ring_bytes(pieces, set_bytes, slots) == ring


@pytest.mark.parametrize("ahead", [True, False], ids=["ring-faulted-ahead-as-the-prefetch-does", "restore-alone"])
def test_restore_reads_the_next_big_leaf_while_the_one_before_is_transferred(tmp_path, devices, monkeypatch, ahead):
    """Ordering, not timing: with leaves bigger than the ring's set size and a ring of two leaves faulted
    in ahead (the restore prefetch's, during start-up), the second leaf gets its ring piece before the
    restore waits for any transfer. A restore alone faults a ring of one leaf (faulting costs more than
    the overlap saves on the TPU host): it waits for the first leaf's transfer first."""
    host_ring.release_host_buffers()
    if ahead:
        warming = host_ring.warm_host_ring(2 * 8 * 4096)  # what the prefetch faults: two leaves' pieces
        assert warming is not None
        warming.join()
    events: list[str] = []
    take, give_oldest = host_ring.HostLease.take, host_ring.HostLease.give_oldest

    def logged_take(self, read, stored):
        got = take(self, read, stored)
        events.append(f"take {read.name} {got}")
        return got

    def logged_give_oldest(self):
        events.append("wait for the oldest transfer")
        return give_oldest(self)

    monkeypatch.setattr(host_ring.HostLease, "take", logged_take)
    monkeypatch.setattr(host_ring.HostLease, "give_oldest", logged_give_oldest)
    with rc.CheckpointManager(str(tmp_path), ring_options(restore_host_buffer_bytes=4096)) as mgr:
        state = {"layers": restore_state(1, devices)["layers"]}
        mgr.save(1, state)
        mgr.wait()
        target = {"layers": restore_state(0, devices)["layers"]}
        assert_same(mgr.restore(1, target), host_copy(state))
    successes = [i for i, e in enumerate(events) if e.endswith("True")]
    first_wait = events.index("wait for the oldest transfer")
    assert len(successes) == 4, events
    if ahead:
        assert successes[1] < first_wait, events  # two leaves in the ring before any wait
    else:
        assert successes[0] < first_wait < successes[1], events  # one leaf, then its transfer's wait


def test_restore_leaf_bigger_than_the_ring_gets_a_ring_of_its_size_not_fresh_buffers(tmp_path, devices):
    """A ring set to one 4 KiB piece and leaves of 32 KiB pieces (8 boxes of 1 KiB, each page-rounded):
    the ring grows to the largest leaf's pieces, once, and every leaf streams through it (no fresh
    buffer read into while the devices wait); the next restore allocates nothing."""
    host_ring.release_host_buffers()
    with rc.CheckpointManager(str(tmp_path), ring_options(restore_host_buffer_bytes=4096)) as mgr:
        state = restore_state(1, devices)
        del state["host"]
        mgr.save(1, state)
        mgr.wait()
        target = restore_state(0, devices)
        del target["host"]
        expected = host_copy(state)
        before = host_ring.host_buffer_counts()
        assert_same(mgr.restore(1, target), expected)
        after = host_ring.host_buffer_counts()
        assert (after["allocations"] - before["allocations"], after["bytes"] - before["bytes"]) == (1, 8 * 4096)
        assert after["populated_bytes"] - before["populated_bytes"] == 8 * 4096  # faulted in before any read
        before = allocations()
        assert_same(mgr.restore(1, target), expected)
        assert allocations() == before


def test_populate_pages_touches_every_page_in_user_space_where_madvise_is_refused(monkeypatch):
    """Where `madvise(MADV_POPULATE_WRITE)` returns -1 (gVisor, old kernels) every page of the buffer,
    the partial ones at both ends too, is written once (and counted); where it works, nothing is touched."""
    page = os.sysconf("SC_PAGE_SIZE")
    raw = np.ones(5 * page + 300, np.uint8)
    buf = raw[123:123 + 4 * page + 7]  # starts and ends inside a page
    monkeypatch.setattr(staging, "libc_madvise", lambda: (lambda addr, length, advice: -1))
    before = host_ring.host_buffer_counts()
    host_ring.populate_pages(buf)
    after = host_ring.host_buffer_counts()
    assert after["touched_bytes"] - before["touched_bytes"] == buf.nbytes
    assert after["populated_bytes"] - before["populated_bytes"] == buf.nbytes
    start = buf.ctypes.data
    pages_written = {(start + i) // page for i in np.flatnonzero(buf == 0)}
    assert pages_written == {a // page for a in range(start, start + buf.nbytes)}
    assert (raw[:123] == 1).all() and (raw[123 + buf.nbytes:] == 1).all()  # nothing outside the buffer
    monkeypatch.setattr(staging, "libc_madvise", lambda: (lambda addr, length, advice: 0))
    buf[:] = 1
    before = host_ring.host_buffer_counts()
    host_ring.populate_pages(buf)
    assert host_ring.host_buffer_counts()["touched_bytes"] == before["touched_bytes"]
    assert (buf == 1).all()


def test_restore_host_buffer_bytes_is_validated():
    with pytest.raises(rc.InvalidOptionsError, match="restore_host_buffer_bytes: -1 must be >= 0"):
        rc.ManagerOptions(restore_host_buffer_bytes=-1)


# ---------------------------------------------------------------- save (helper ckpt-save)


def _state(devices: list[jax.Device], step: int) -> dict[str, jax.Array]:
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(4, 2), ("a", "b"))
    big = np.arange(256 * 1024, dtype=np.float32).reshape(512, 512) + step  # 1 MiB, direct writes where allowed
    return {"w": jax.device_put(big, NamedSharding(mesh, P("a", "b"))),
            "b": jax.device_put(np.full((8,), step, np.int32), NamedSharding(mesh, P("a")))}


def test_save_host_transfers_reuse_their_host_buffers(tmp_path, devices):
    """A host transfer on CPU devices copies each shard into the manager's arena: the first save
    allocates it, the next saves of the same state reuse it."""
    arenas = staging.HostArena.total_allocations
    with rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(device_copy="host_transfer")) as mgr:
        for step in range(1, 5):
            mgr.save(step, _state(devices, step))
        mgr.wait()
        assert staging.HostArena.total_allocations - arenas == 1
        assert mgr.save_report is not None and mgr.save_report["device_copy"] == "host_transfer"
        for step in (1, 4):
            np.testing.assert_array_equal(np.asarray(mgr.restore(step)["w"]), np.asarray(_state(devices, step)["w"]))


def test_save_staging_buffers_are_reused_by_later_saves(tmp_path, devices):
    """The writes' staging buffers (direct I/O, non-contiguous data) come from one pool: four saves of
    eight direct chunk writes each (32 borrows) allocate at most one buffer per writer thread, however
    many of those threads happened to write at once (once a save ran, later saves with more writes in
    flight at once than it had may still add one: counting per save was flaky under load)."""
    before = staging.pool_allocations()
    opts = rc.ManagerOptions()
    assert chunk_writer.use_direct_io(str(tmp_path), opts.direct_io), "no direct writes here: nothing borrowed"
    with rc.CheckpointManager(str(tmp_path), opts) as mgr:
        for step in range(1, 5):
            mgr.save(step, _state(devices, step))
        mgr.wait()
    assert staging.pool_allocations() - before <= opts.write_threads


def test_save_writes_non_contiguous_data_without_a_whole_copy(tmp_path):
    """write_chunk_file writes a strided array piece by piece through a staging buffer: the file
    holds its C-order bytes and their crc32c."""
    data = np.arange(3 * 1024 * 700, dtype=np.float32).reshape(3 * 1024, 700)[:, ::2].T  # 350 x 3072, strided
    assert not data.flags.c_contiguous and data.nbytes > staging.BUFFER_BYTES
    path = str(tmp_path / "chunk")
    chunk_writer.write_chunk_file(path, data, fsync=False, checksum=True)
    with open(path, "rb") as f:
        raw = f.read()
    want = np.ascontiguousarray(data).tobytes()
    assert raw[:-checksums.CRC_BYTES] == want
    assert raw[-checksums.CRC_BYTES:] == checksums.encode(checksums.crc32c(want))


@pytest.mark.parametrize(("make", "bounced"), [
    # a slice along a non-leading axis: contiguous rows of 8 KiB, written with pwritev, no copy
    (lambda: np.arange(1100 * 4096, dtype=np.float32).reshape(1100, 4096)[:, :2048], False),
    # a 3-d slice whose trailing two axes stay contiguous (blocks of 16 KiB)
    (lambda: np.arange(6 * 5 * 64 * 64, dtype=np.uint16).reshape(6, 5, 64, 64)[:, 1:4], False),
    # bf16 rows (ml_dtypes), sliced on the leading axis of a column slice
    (lambda: np.ones((64, 8192), jnp.bfloat16)[::2, :4096], False),
    # transposed: no contiguous block, so the staging buffer (counted)
    (lambda: np.arange(512 * 300, dtype=np.float32).reshape(512, 300).T, True),
    # rows of 64 bytes: below MIN_BLOCK_BYTES, the staging buffer
    (lambda: np.arange(4096 * 32, dtype=np.float32).reshape(4096, 32)[:, :16], True),
])
def test_save_non_contiguous_chunks_avoid_the_bounce_copy_where_the_layout_allows(tmp_path, make, bounced):
    """Chunks made of contiguous blocks go straight from the array to the file (no copy through the
    staging buffer: counted by chunk_writer.bounced_writes, not timed); the file holds the C-order
    bytes and their crc32c either way, and reads back through the chunk reader's format."""
    data = make()
    assert not data.flags.c_contiguous
    before = chunk_writer.bounced_writes()
    path = str(tmp_path / "chunk")
    chunk_writer.write_chunk_file(path, data, fsync=False, checksum=True)
    after = chunk_writer.bounced_writes()
    assert after["writes"] - before["writes"] == (1 if bounced else 0)
    assert after["bytes"] - before["bytes"] == (data.nbytes if bounced else 0)
    if bounced:
        assert after["layout"]
    with open(path, "rb") as f:
        raw = f.read()
    want = np.ascontiguousarray(data).tobytes()
    assert raw[:-checksums.CRC_BYTES] == want
    assert raw[-checksums.CRC_BYTES:] == checksums.encode(checksums.crc32c(want))


def test_save_pwritev_short_writes_are_completed(tmp_path, monkeypatch):
    """A short pwritev (a signal, a full pipe of a FUSE disk) is completed block by block."""
    import os as os_module

    real = os_module.pwritev
    monkeypatch.setattr(chunk_writer.os, "pwritev", lambda fd, buffers, offset: real(fd, buffers[:1], offset) // 2)
    data = np.arange(8 * 2048, dtype=np.float32).reshape(8, 2048)[:, :1024]
    path = str(tmp_path / "chunk")
    chunk_writer.write_chunk_file(path, data, fsync=False)
    with open(path, "rb") as f:
        assert f.read() == np.ascontiguousarray(data).tobytes()
