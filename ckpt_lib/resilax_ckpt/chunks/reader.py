"""Restore-side array reading, common to both chunk backends: every byte read once, into the memory
the restored array will use.

Per leaf, this process reads the distinct boxes its target shards need (`planning.plan_read_boxes`:
replicas on several local devices share one buffer). Where the boxes go depends on the devices:
- CPU devices: each box gets a fresh 64-byte-aligned host buffer (`host_ring.aligned_empty`):
  XLA:CPU then *aliases* it in `jax.device_put` instead of copying (checked on jax 0.10.2; NumPy's
  and tensorstore's own buffers are 16-byte aligned, which XLA copies), so the buffer *is* the
  restored array and is never reused.
- Accelerators (`host_ring.reuses_host_buffers`): the boxes are read into the process's host ring
  (host_ring.py), one piece per leaf, given back once the leaf's transfer is done; when the ring is
  full, every leaf already read is put on its devices and the restore waits for the oldest transfer.
  A leaf bigger than the ring's set size gets a ring of its size (never fresh memory read into
  while the devices wait: on our gVisor TPU test host that read ran at ~1 GB/s against ~18 GB/s
  into memory already faulted in).

The buffers are filled chunk by chunk: each saved chunk the boxes overlap is read exactly once
(`plan_chunk_tasks`), by the backend's `ChunkReader` (backends.py: our own file reader for local
folders, file_reader.py; tensorstore for gs://, tensorstore_io.py), which also verifies each chunk's
checksum and raises the typed errors naming the file. The reads run on the process's reader pool of
`io_concurrency` threads (`read_pool`: kept between restores and started ahead of the first by
`warm_read_pool`, since starting 32 threads took ~0.1 s of a 0.6 s restore on 2 loaded cores). A read straight into box buffers is queued at once (its memory is the
restored state's own); a read that needs memory of its own (a scratch buffer, or tensorstore's
buffers: `ChunkReader.buffered_bytes`) counts against the in-flight byte limit.
Once a leaf's reads are done it is cast (once) if the target asks for another dtype and becomes a
jax.Array with one batched `device_put` and `make_array_from_single_device_arrays`, issued by the
main thread as soon as it sees the reads done (`InflightLimiter.finish_done` after each leaf's reads
are queued), so a leaf's transfer overlaps the reads of the later ones.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from resilax_ckpt import planning
from resilax_ckpt.chunks import chunk_format
from resilax_ckpt.chunks.host_ring import ALIGNMENT as ALIGNMENT
from resilax_ckpt.chunks.host_ring import (
    DEFAULT_HOST_RING_BYTES,
    HostLease,
    box_buffer,
    plan_ring_bytes,
    populate_pages,
    reuses_host_buffers,
)
from resilax_ckpt.chunks.host_ring import DIRECT_ALIGN as DIRECT_ALIGN
from resilax_ckpt.chunks.host_ring import DIRECT_MIN_BYTES as DIRECT_MIN_BYTES
from resilax_ckpt.chunks.host_ring import aligned_empty as aligned_empty
from resilax_ckpt.chunks.inflight import InflightLimiter


class LeafRead:
    """One leaf to restore: to host NumPy (`sharding=None`) or to a jax.Array with `sharding`
    and `dtype`. `result` holds the value once `read_leaves` returned."""

    def __init__(self, item: str, leaf: Any, dtype: np.dtype, sharding: Any) -> None:
        self.item = item
        self.leaf = leaf
        self.dtype = np.dtype(dtype)
        self.sharding = sharding
        self.result: Any = None
        self.buffers: dict[planning.Box, np.ndarray] = {}
        self.devices: dict[planning.Box, list[Any]] = {}
        self.remaining = 0
        self.lease: HostLease | None = None
        """The restore's lease of the process's host ring when this leaf's boxes are in it."""
        self.region = -1
        """Where this leaf's boxes start in the lease's ring (-1: fresh buffers)."""
        self.copy_on_cpu = False
        """Forced reuse on CPU devices (`reuse_host_buffers=True`): a device-side copy stands for the
        transfer, so that no restored array aliases the ring."""

    @property
    def name(self) -> str:
        return f"{self.item}/{self.leaf.keystr}"

    def plan_boxes(self) -> None:
        """The distinct boxes this process needs, each with the devices that hold it."""
        shape = tuple(self.leaf.shape)
        if self.sharding is None:
            self.devices = {tuple((0, d) for d in shape): []}
        else:
            self.devices = planning.plan_read_boxes(
                self.sharding.addressable_devices_indices_map(shape).items(), shape)

    def finish(self) -> None:
        """Cast if asked, then build the result (called once every chunk read of the leaf is done)."""
        if self.dtype != np.dtype(self.leaf.dtype):
            for box, buf in self.buffers.items():
                cast = box_buffer(buf.shape, self.dtype)
                np.copyto(cast, buf, casting="unsafe")
                self.buffers[box] = cast
        if self.sharding is None:
            (self.result,) = self.buffers.values()
        else:
            self.result, placed = _build_array(self.leaf.shape, self.sharding, self.buffers, self.devices,
                                               self.copy_on_cpu)
            if self.lease is not None and self.region >= 0:
                self.lease.placed(self.region, placed)
        self.buffers = {}


def _build_array(shape: Sequence[int], sharding: Any, buffers: dict[planning.Box, np.ndarray],
                 devices: dict[planning.Box, list[Any]], copy_on_cpu: bool = False) -> tuple[Any, list[Any]]:
    """One batched device_put of every box onto its devices (XLA:CPU aliases the aligned buffers,
    unless `copy_on_cpu`: then each is copied on the device) and the global array from the
    single-device arrays; (the array, the single-device arrays)."""
    import jax

    sources, targets = [], []
    for box, devs in devices.items():
        for device in devs:
            sources.append(buffers[box])
            targets.append(device)
    placed = jax.device_put(sources, targets)
    if copy_on_cpu:
        placed = [x.copy() if all(d.platform == "cpu" for d in x.devices()) else x for x in placed]
    by_device = dict(zip(targets, placed, strict=True))
    ordered = [by_device[d] for d in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, ordered), placed


class ScratchPool:
    """Reusable scratch buffers for chunks that are sliced into several boxes (no page faults per
    chunk); holds at most `limit` bytes of free buffers."""

    def __init__(self, limit: int) -> None:
        self._free: dict[int, list[np.ndarray]] = {}
        self._held = 0
        self._limit = limit
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._held -= nbytes
                return free.pop()
        out = aligned_empty((nbytes,), np.uint8)
        populate_pages(out)  # faulted here, not inside the read into it (host_ring.populate_pages)
        return out

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._held + buf.nbytes <= self._limit:
                self._free.setdefault(buf.nbytes, []).append(buf)
                self._held += buf.nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._held = 0


def subview(array: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
    """`array[index]` as a view, also for 0-d arrays (where `array[()]` is a scalar copy)."""
    full: tuple[Any, ...] = (*index, Ellipsis)
    return array[full]


def is_contiguous(extent: Sequence[int], full: Sequence[int]) -> bool:
    """Whether a sub-block of `extent` is contiguous inside a C-order block of shape `full`: leading
    extents of 1, then at most one partial dimension, then only full dimensions."""
    dim = 0
    while dim < len(extent) and extent[dim] == 1:
        dim += 1
    return all(extent[d] == full[d] for d in range(dim + 1, len(extent)))


def c_offset(start: Sequence[int], full: Sequence[int]) -> int:
    """Element offset of `start` in a C-order block of shape `full`."""
    offset = 0
    for s, n in zip(start, full, strict=True):
        offset = offset * n + s
    return offset


class ChunkTask:
    """One saved chunk and the (box, intersection) pairs that need parts of it."""

    __slots__ = ("chunk", "pairs", "read", "region")

    def __init__(self, read: LeafRead, chunk: tuple[int, ...], region: planning.Box) -> None:
        self.read = read
        self.chunk = chunk
        self.region = region
        """The chunk's box inside the array (edge chunks clipped to the array's shape)."""
        self.pairs: list[tuple[planning.Box, planning.Box]] = []

    def single_box(self) -> np.ndarray | None:
        """The box buffer when the chunk's region is exactly one box (read straight into it)."""
        if len(self.pairs) == 1 and self.pairs[0][0] == self.region:
            return self.read.buffers[self.region]
        return None

    def scatter(self, data: np.ndarray) -> None:
        """Copy each pair's part of the chunk (`data` holds the chunk's region) into its box."""
        for box, inter in self.pairs:
            dst = subview(self.read.buffers[box], planning.offset_index(inter, box))
            np.copyto(dst, subview(data, planning.offset_index(inter, self.region)))


def plan_chunk_tasks(read: LeafRead) -> list[ChunkTask]:
    """The chunks a leaf's boxes overlap, each once, with the part every box needs."""
    shape = tuple(read.leaf.shape)
    chunks = tuple(read.leaf.chunks)
    tasks: dict[tuple[int, ...], ChunkTask] = {}
    for box in read.devices:
        for chunk in planning.chunks_of_box(box, chunks):
            task = tasks.get(chunk)
            if task is None:
                region = tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(chunk, chunks, shape, strict=True))
                task = tasks[chunk] = ChunkTask(read, chunk, region)
            inter = tuple((max(a, r0), min(b, r1)) for (a, b), (r0, r1) in zip(box, task.region, strict=True))
            task.pairs.append((box, inter))
    return list(tasks.values())


class ChunkReader(Protocol):
    """How a chunk backend fills box buffers (backends.py): `jobs` groups a leaf's chunk tasks into
    reads, `buffered_bytes` is the memory a read takes besides the box buffers, `run` reads one job
    (on a reader thread) and raises the typed errors naming the file; `close` releases what the
    reader keeps (scratch buffers)."""

    def jobs(self, index: int, tasks: list[ChunkTask]) -> list[list[ChunkTask]]: ...
    def buffered_bytes(self, job: list[ChunkTask]) -> int: ...
    def run(self, index: int, job: list[ChunkTask]) -> None: ...
    def close(self) -> None: ...


class ChunkBackendReads(Protocol):
    """The read half of a chunk backend (backends.ChunkBackend extends it with `write`): what restore uses."""

    def open_reader(self, reads: list[LeafRead], step_path: str, memory_limit: int) -> ChunkReader:
        """The reader of `reads`' chunks under `step_path` (read_leaves drives it); it keeps at most
        `memory_limit` bytes of scratch buffers."""
        ...


_pools: dict[int, concurrent.futures.ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _forget_pools() -> None:
    """In a forked child: the parent's threads are not there."""
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def read_pool(threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's pool of `threads` reader threads, created once and kept."""
    threads = max(1, threads)
    with _pools_lock:
        pool = _pools.get(threads)
        if pool is None:
            pool = _pools[threads] = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="resilax-read")
        return pool


def warm_read_pool(threads: int) -> None:
    """Start `read_pool(threads)`'s threads in the background (a pool starts one thread per task
    submitted while none is idle: `threads` tasks that wait for each other start them all)."""
    def start_all() -> None:
        pool = read_pool(threads)
        barrier = threading.Barrier(max(1, threads))

        def meet() -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                barrier.wait(timeout=10)

        for _ in range(max(1, threads)):
            pool.submit(meet)

    threading.Thread(target=start_all, name="resilax-read-warm", daemon=True).start()


def read_leaves(reads: list[LeafRead], step_path: str, backend: ChunkBackendReads, max_inflight_bytes: int,
                io_concurrency: int = 32, *, reuse_host_buffers: bool | None = None,
                host_buffer_bytes: int = DEFAULT_HOST_RING_BYTES, populate: bool = False) -> None:
    """Read, per leaf, the boxes this process's target shards need (each saved chunk once) through the
    chunk backend and fill each `LeafRead.result`. Errors name the leaf, the chunk and the file:
    MissingChunkError (a chunk file is missing), ChecksumMismatchError (a crc32c does not match),
    CorruptCheckpointError (a file is truncated or damaged), StorageError (reading failed).
    Leaves that `reuses_host_buffers(sharding, reuse_host_buffers)` are read into the process's host
    ring: the one there if it holds the largest such leaf's boxes (the restore prefetch faults one of two
    leaves), else one of `host_buffer_bytes` or of that leaf when bigger (host_ring.plan_ring_bytes;
    module docstring); each leaf is put on its devices as soon as its reads are done, while later leaves are
    read. With `populate`, fresh box buffers are faulted in (host_ring.populate_pages) by the calling
    thread before their reads are queued (the restore prefetch: no page faults inside `read()`)."""
    total = sum(planning.box_size(tuple((0, d) for d in r.leaf.shape)) * np.dtype(r.leaf.dtype).itemsize
                for r in reads)
    limit = planning.scaled_inflight_limit(max_inflight_bytes, total)
    for read in reads:
        read.plan_boxes()
    ring_reads = [r for r in reads if reuses_host_buffers(r.sharding, reuse_host_buffers)]
    lease = None
    if ring_reads and host_buffer_bytes > 0:
        pieces = [sum(-(-planning.box_size(b) * np.dtype(r.leaf.dtype).itemsize // DIRECT_ALIGN) * DIRECT_ALIGN
                      for b in r.devices) for r in ring_reads]
        lease = HostLease(sum(pieces), plan_ring_bytes(pieces, host_buffer_bytes))
    in_ring = {id(r) for r in ring_reads}
    runner = backend.open_reader(reads, step_path, limit)
    limiter = InflightLimiter(limit)
    executor = read_pool(io_concurrency)
    futures: list[concurrent.futures.Future[Any]] = []
    try:
        for index, read in enumerate(reads):
            stored = np.dtype(read.leaf.dtype)
            if lease is not None and id(read) in in_ring and lease.fits(read, stored):
                # No room in the ring: put every leaf already read on its devices (no waiting, so
                # several transfers are in flight), then wait for the oldest transfer and give its
                # piece back, or, with none placed, for the oldest reads.
                while not lease.take(read, stored):
                    limiter.finish_done()
                    if not lease.give_oldest() and not limiter.finish_oldest():
                        break
            read.copy_on_cpu = read.region >= 0
            if read.region < 0:  # laid out as the chunks are stored: a transposed leaf reads in place too
                read.buffers = {box: chunk_format.empty_in_order(
                    planning.box_shape(box), stored, read.leaf.transpose,
                    lambda shape, dtype: box_buffer(shape, dtype, populate=populate)) for box in read.devices}
            jobs = runner.jobs(index, plan_chunk_tasks(read))
            read.remaining = len(jobs)
            if not jobs:  # empty array
                read.finish()
                continue
            for job in jobs:
                nbytes = runner.buffered_bytes(job)
                limiter.admit(nbytes)
                future = executor.submit(runner.run, index, job)
                futures.append(future)
                chunks = f"chunk {list(job[0].chunk)}" + (f" and {len(job) - 1} more" if len(job) > 1 else "")
                limiter.add(future, nbytes, f"reading {read.name} {chunks} from {step_path}",
                            on_done=lambda _, r=read: _one_done(r))
            limiter.finish_done()  # leaves read by now go to their devices while the next are read
        limiter.drain()
    finally:
        limiter.cancel()  # what has not started
        concurrent.futures.wait(futures)  # and what has: no read of this restore outlives it
        runner.close()
        if lease is not None:  # every transfer from the ring done, the ring free for the next restore
            lease.close([r.region for r in ring_reads if r.region >= 0 and r.result is None])


def _one_done(read: LeafRead) -> None:
    read.remaining -= 1
    if read.remaining == 0:
        read.finish()
