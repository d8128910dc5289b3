"""Restore-side array reading, common to both chunk backends: every byte read once, into the memory
the restored array will use.

Per leaf, this process reads the distinct boxes its target shards need (`planning.plan_read_boxes`:
replicas on several local devices share one buffer). Each box gets one 64-byte-aligned host buffer
(`aligned_empty`): XLA:CPU then *aliases* it in `jax.device_put` instead of copying (checked on jax
0.10.2; NumPy's and tensorstore's own buffers are 16-byte aligned, which XLA copies). On GPU/TPU the
same call is a real host-to-device transfer and the buffer is freed once it is done.

The buffers are filled chunk by chunk: each saved chunk the boxes overlap is read exactly once
(`plan_chunk_tasks`), by the backend's `ChunkReader` (backends.py: our own file reader for local
folders, file_reader.py; tensorstore for gs://, tensorstore_io.py), which also verifies each chunk's
checksum and raises the typed errors naming the file. The reads run on the process's reader pool of
`io_concurrency` threads (`read_pool`: kept between restores and started ahead of the first by
`warm_read_pool`, since starting 32 threads took ~0.1 s of a 0.6 s restore on 2 loaded cores). A read straight into box buffers is queued at once (its memory is the
restored state's own); a read that needs memory of its own (a scratch buffer, or tensorstore's
buffers: `ChunkReader.buffered_bytes`) counts against the in-flight byte limit.
Once a leaf's reads are done it is cast (once) if the target asks for another dtype and becomes a
jax.Array with one batched `device_put` and `make_array_from_single_device_arrays`. Box buffers of
4 MiB and more take no transparent huge pages (`_no_huge_pages`; why, with figures:
docs/benchmarks.md, "Measurements behind the fast path").
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from resilax_ckpt import chunk_format, planning, staging
from resilax_ckpt.inflight import InflightLimiter

ALIGNMENT = 64
"""Bytes: XLA:CPU aliases a host buffer aligned to this instead of copying it."""
DIRECT_MIN_BYTES = chunk_format.DIRECT_MIN_BYTES
"""Buffers of at least this size are aligned for O_DIRECT reads into them."""
DIRECT_ALIGN = chunk_format.DIRECT_ALIGN


def aligned_empty(shape: Sequence[int], dtype: Any, align: int | None = None) -> np.ndarray:
    """An uninitialized C-order array whose data starts at a multiple of `align` bytes: by default
    ALIGNMENT, and DIRECT_ALIGN when it has at least DIRECT_MIN_BYTES (so O_DIRECT can read into
    it), without transparent huge pages (`_no_huge_pages`)."""
    dtype = np.dtype(dtype)
    nbytes = planning.box_size(tuple((0, int(d)) for d in shape)) * dtype.itemsize
    if align is None:
        align = DIRECT_ALIGN if nbytes >= DIRECT_MIN_BYTES else ALIGNMENT
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    out = raw[offset:offset + nbytes]
    if nbytes >= NUMPY_HUGE_PAGE_BYTES:
        _no_huge_pages(out)
    return out.view(dtype).reshape(tuple(shape))


NUMPY_HUGE_PAGE_BYTES = 4 << 20
"""NumPy asks the kernel for transparent huge pages for allocations of this size and more."""


def _no_huge_pages(buf: np.ndarray) -> None:
    """Undo NumPy's `madvise(MADV_HUGEPAGE)` on the whole pages of a not yet touched buffer: on a
    host whose THP `defrag` is `madvise` (the kernel's default) the first touch of such memory may
    stall while the kernel compacts memory for huge pages (and where the host takes back freed
    huge-page-sized blocks, as on our VM, faulting huge pages in is several times slower), and a
    restored buffer is written once by a copy from a staging buffer, which huge pages do not speed
    up (staging.py). Figures: docs/benchmarks.md, "Measurements behind the fast path"."""
    madvise = staging.libc_madvise()
    if madvise is None or not hasattr(mmap, "MADV_NOHUGEPAGE"):  # not Linux
        return
    page = mmap.PAGESIZE
    start = -(-buf.ctypes.data // page) * page
    end = (buf.ctypes.data + buf.nbytes) // page * page
    if end > start:
        madvise(start, end - start, mmap.MADV_NOHUGEPAGE)  # best effort: an error leaves huge pages on


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
                cast = aligned_empty(buf.shape, self.dtype)
                np.copyto(cast, buf, casting="unsafe")
                self.buffers[box] = cast
        if self.sharding is None:
            (self.result,) = self.buffers.values()
        else:
            self.result = _build_array(self.leaf.shape, self.sharding, self.buffers, self.devices)
        self.buffers = {}


def _build_array(shape: Sequence[int], sharding: Any, buffers: dict[planning.Box, np.ndarray],
                 devices: dict[planning.Box, list[Any]]) -> Any:
    """One batched device_put of every box onto its devices (XLA:CPU aliases the aligned buffers)
    and the global array from the single-device arrays."""
    import jax

    sources, targets = [], []
    for box, devs in devices.items():
        for device in devs:
            sources.append(buffers[box])
            targets.append(device)
    placed = jax.device_put(sources, targets)
    by_device = dict(zip(targets, placed, strict=True))
    ordered = [by_device[d] for d in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, ordered)


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
        return aligned_empty((nbytes,), np.uint8)

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
                io_concurrency: int = 32) -> None:
    """Read, per leaf, the boxes this process's target shards need (each saved chunk once) through the
    chunk backend and fill each `LeafRead.result`. Errors name the leaf, the chunk and the file:
    MissingChunkError (a chunk file is missing), ChecksumMismatchError (a crc32c does not match),
    CorruptCheckpointError (a file is truncated or damaged), StorageError (reading failed)."""
    total = sum(planning.box_size(tuple((0, d) for d in r.leaf.shape)) * np.dtype(r.leaf.dtype).itemsize
                for r in reads)
    limit = planning.scaled_inflight_limit(max_inflight_bytes, total)
    runner = backend.open_reader(reads, step_path, limit)
    limiter = InflightLimiter(limit)
    executor = read_pool(io_concurrency)
    futures: list[concurrent.futures.Future[Any]] = []
    try:
        for index, read in enumerate(reads):
            read.plan_boxes()
            stored = np.dtype(read.leaf.dtype)
            read.buffers = {box: aligned_empty(planning.box_shape(box), stored) for box in read.devices}
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
        limiter.drain()
    finally:
        limiter.cancel()  # what has not started
        concurrent.futures.wait(futures)  # and what has: no read of this restore outlives it
        runner.close()


def _one_done(read: LeafRead) -> None:
    read.remaining -= 1
    if read.remaining == 0:
        read.finish()
