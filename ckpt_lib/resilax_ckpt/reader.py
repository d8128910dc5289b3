"""Restore-side array reading, common to both chunk backends: every byte read once, into the memory
the restored array will use.

Per leaf, this process reads the distinct boxes its target shards need (`planning.plan_read_boxes`:
replicas on several local devices share one buffer). Where the boxes go depends on the devices:
- CPU devices: each box gets a fresh 64-byte-aligned host buffer (`aligned_empty`): XLA:CPU then
  *aliases* it in `jax.device_put` instead of copying (checked on jax 0.10.2; NumPy's and
  tensorstore's own buffers are 16-byte aligned, which XLA copies), so the buffer *is* the restored
  array and is never reused.
- Accelerators (`reuses_host_buffers`): the boxes are read into the process's *host ring*
  (`HostRing`, one region of `ManagerOptions.restore_host_buffer_bytes`, 512 MiB by default, kept
  for the life of the process): each leaf takes one piece, its `device_put` copies it to the
  devices, and the piece is given back once that transfer is done (`HostLease`). So a restore
  touches no fresh memory beyond the ring (on a TPU v5e, faulting 2 GiB of fresh buffers in was 86%
  of a cold restore's main thread), and a state bigger than the ring streams through it: when it is
  full, the restore waits for the oldest leaf's transfer. A restored array on CPU devices that
  aliased the ring (`restore_reuse_host_buffers=True` forces the ring there, for tests, with a
  device-side copy standing for the transfer) would retire the ring instead of having it reused.
`host_buffer_counts` counts the allocations of restored data, for tests.

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
are queued), so a leaf's transfer overlaps the reads of the later ones. Box buffers of
4 MiB and more take no transparent huge pages (`_no_huge_pages`; why, with figures:
docs/benchmarks.md, "Measurements behind the fast path").
"""

from __future__ import annotations

import collections
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


# ---------------------------------------------------------------- host buffers of restores

_counts_lock = threading.Lock()
_counts = {"allocations": 0, "bytes": 0}


def box_buffer(shape: Sequence[int], dtype: Any, align: int | None = None) -> np.ndarray:
    """A fresh `aligned_empty` for restored data, counted (`host_buffer_counts`)."""
    out = aligned_empty(shape, dtype, align)
    if not out.nbytes:
        return out
    with _counts_lock:
        _counts["allocations"] += 1
        _counts["bytes"] += out.nbytes
    return out


def host_buffer_counts() -> dict[str, int]:
    """The host buffers this process's restores allocated so far for restored data (box buffers,
    cast buffers, the ring): {"allocations", "bytes"}. Tests check reuse by these counts."""
    with _counts_lock:
        return dict(_counts)


DEFAULT_HOST_RING_BYTES = 512 << 20
"""ManagerOptions.restore_host_buffer_bytes's default."""


class HostRing:
    """One page-aligned region of host memory, lent out in pieces in allocation order and taken back
    in any order (a piece's space is free again once every older piece is back too)."""

    def __init__(self, nbytes: int) -> None:
        self.buf = box_buffer((nbytes,), np.uint8, DIRECT_ALIGN)
        _populate(self.buf)
        self.nbytes = nbytes
        self._live: collections.deque[list[int]] = collections.deque()  # [start, end, returned]

    def take(self, nbytes: int) -> int | None:
        """The offset of `nbytes` (a multiple of DIRECT_ALIGN) of free space, or None when there is none."""
        tail, head = (self._live[0][0], self._live[-1][1]) if self._live else (0, 0)
        if not self._live:
            if nbytes > self.nbytes:
                return None
            start = 0
        elif self._live[-1][0] >= tail:  # not wrapped: free at [head, end) and [0, tail)
            if self.nbytes - head >= nbytes:
                start = head
            elif tail >= nbytes:
                start = 0
            else:
                return None
        elif tail - head >= nbytes:  # wrapped: free at [head, tail)
            start = head
        else:
            return None
        self._live.append([start, start + nbytes, 0])
        return start

    def give(self, start: int) -> None:
        for piece in self._live:
            if piece[0] == start and not piece[2]:
                piece[2] = 1
                break
        while self._live and self._live[0][2]:
            self._live.popleft()

    def idle(self) -> bool:
        return not self._live


MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault a range's pages in, writable, in one call."""


def _populate(buf: np.ndarray) -> None:
    """Fault the whole pages of a not yet touched buffer in with one `madvise(MADV_POPULATE_WRITE)`
    (best effort: older kernels refuse it and the pages fault in on first touch): the kernel fills
    them in bulk instead of one trap per page (512 MiB on this VM under load: 1.28 s against
    2.0-2.4 s touched page by page), with the GIL released."""
    madvise = staging.libc_madvise()
    if madvise is None or not hasattr(mmap, "MADV_HUGEPAGE"):  # not Linux
        return
    page = mmap.PAGESIZE
    start = -(-buf.ctypes.data // page) * page
    end = (buf.ctypes.data + buf.nbytes) // page * page
    if end > start:
        madvise(start, end - start, MADV_POPULATE_WRITE)


_ring: HostRing | None = None
_ring_busy = False
_ring_warming = False
_ring_lock = threading.Lock()
_ring_warmed = threading.Condition(_ring_lock)


def ring_expected(reuse: bool | None) -> bool:
    """Whether this process's restores will read into the host ring without being forced to: auto
    (`reuse` None) and JAX's backend already started, on accelerators. Starts no backend."""
    if reuse is not None:
        return False
    try:
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            return False
    except (ImportError, AttributeError):  # another JAX: no warming rather than starting a backend
        return False
    import jax

    return jax.default_backend() != "cpu"


def warm_host_ring(nbytes: int) -> threading.Thread | None:
    """Allocate the process's host ring of `nbytes` and fault it in on a background thread (the
    Restorer does, at the manager's creation, when `ring_expected`), so that the first restore finds
    it ready; a restore that starts meanwhile waits for it. None when there is nothing to do."""
    global _ring_busy, _ring_warming
    nbytes = -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN
    with _ring_lock:
        if nbytes <= 0 or _ring_busy or (_ring is not None and _ring.nbytes >= nbytes):
            return None
        _ring_busy = _ring_warming = True

    def build() -> None:
        global _ring, _ring_busy, _ring_warming
        try:
            with _ring_lock:
                _ring = None  # the old one's memory goes first
            ring = HostRing(nbytes)
            with _ring_lock:
                _ring = ring
        finally:
            with _ring_lock:
                _ring_busy = _ring_warming = False
                _ring_warmed.notify_all()

    thread = threading.Thread(target=build, name="resilax-host-ring-warm", daemon=True)
    thread.start()
    return thread


def release_host_buffers() -> None:
    """Drop the process's host ring (when no restore uses it); the next restore onto accelerators
    allocates a new one."""
    global _ring
    with _ring_lock:
        if not _ring_busy:
            _ring = None


def reuses_host_buffers(sharding: Any, reuse: bool | None) -> bool:
    """Whether a leaf restored onto `sharding` reads into the host ring: `reuse` True or False
    decides; None (auto): when `device_put` copies to the devices (not CPU devices, whose
    `device_put` aliases the buffer; not host memory kinds)."""
    if sharding is None or reuse is False:
        return False
    if reuse:
        return True
    kind = getattr(sharding, "memory_kind", None)
    return (kind in (None, "device")
            and all(d.platform != "cpu" for d in sharding.addressable_devices))


class HostLease:
    """One restore's use of the process's host ring (read_leaves): each leaf's boxes in one piece,
    the piece given back once the leaf's transfers are done and no array it built aliases it."""

    def __init__(self, want: int, limit: int) -> None:
        global _ring, _ring_busy
        self.ring: HostRing | None = None
        self._holds = False
        """Whether this lease holds the process's ring (and frees it in `close`)."""
        self._placed: collections.deque[tuple[int, list[Any]]] = collections.deque()
        size = min(limit, -(-want // DIRECT_ALIGN) * DIRECT_ALIGN)
        if size <= 0:
            return
        with _ring_lock:
            while _ring_warming:  # warm_host_ring is faulting it in: faster than faulting anew
                _ring_warmed.wait()
            if _ring_busy:  # another restore of this process holds it: fresh buffers
                return
            if _ring is None or _ring.nbytes < size:
                _ring = None  # the old one's memory goes before the new one's is touched
                _ring = HostRing(size)
            _ring_busy = self._holds = True
            self.ring = _ring

    def take(self, read: LeafRead, stored: np.dtype) -> bool:
        """Put `read`'s boxes in the ring; False when it has no room now."""
        if self.ring is None:
            return False
        sizes = [planning.box_size(box) * stored.itemsize for box in read.devices]
        rounded = [-(-n // DIRECT_ALIGN) * DIRECT_ALIGN for n in sizes]
        start = self.ring.take(sum(rounded))
        if start is None:
            return False
        pos = start
        for (box, n), r in zip(zip(read.devices, sizes, strict=True), rounded, strict=True):
            read.buffers[box] = self.ring.buf[pos:pos + n].view(stored).reshape(planning.box_shape(box))
            pos += r
        read.lease, read.region = self, start
        return True

    def placed(self, start: int, arrays: list[Any]) -> None:
        """The leaf in the piece at `start` was put on its devices as `arrays` (transfers maybe in flight)."""
        self._placed.append((start, arrays))

    def give_oldest(self) -> bool:
        """Wait for the oldest placed leaf's transfers and give its piece back; False when none is placed."""
        if not self._placed:
            return False
        start, arrays = self._placed.popleft()
        self._give(start, arrays)
        return True

    def fits(self, read: LeafRead, stored: np.dtype) -> bool:
        """Whether `read`'s boxes fit the ring at all (False: no ring, empty boxes, or too big even for
        an empty ring)."""
        need = sum(-(-planning.box_size(b) * stored.itemsize // DIRECT_ALIGN) * DIRECT_ALIGN for b in read.devices)
        return self.ring is not None and 0 < need <= self.ring.nbytes

    def _give(self, start: int, arrays: list[Any]) -> None:
        global _ring
        import jax

        jax.block_until_ready(arrays)
        ring = self.ring
        if ring is None:
            return
        lo, hi = ring.buf.ctypes.data, ring.buf.ctypes.data + ring.nbytes
        for array in arrays:  # an array on CPU devices that aliases the ring must keep its memory
            if any(d.platform == "cpu" for d in array.devices()) and lo <= array.unsafe_buffer_pointer() < hi:
                with _ring_lock:
                    if _ring is ring:
                        _ring = None  # never lent again: the arrays keep it alive
                self.ring = None
                return
        ring.give(start)

    def close(self, pieces: list[int]) -> None:
        """Give every piece back once its leaf's transfers are done: those placed, and `pieces` of
        leaves never placed (a failed restore, whose reads have all ended); then free the ring for
        the process's next restore."""
        global _ring, _ring_busy
        try:
            while self._placed:
                start, arrays = self._placed.popleft()
                try:
                    self._give(start, arrays)
                except Exception:  # a failed transfer: the piece is ours again either way
                    if self.ring is not None:
                        self.ring.give(start)
            for start in pieces:
                if self.ring is not None:
                    self.ring.give(start)
        finally:
            if self.ring is not None and not self.ring.idle():  # should not happen: start over
                with _ring_lock:
                    if _ring is self.ring:
                        _ring = None
            if self._holds:
                with _ring_lock:
                    _ring_busy = self._holds = False


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
    """In a forked child: the parent's threads are not there (nor its restore that held the ring)."""
    global _pools_lock, _ring, _ring_busy, _ring_warming, _ring_lock, _ring_warmed
    _pools.clear()
    _pools_lock = threading.Lock()
    _ring, _ring_busy, _ring_warming, _ring_lock = None, False, False, threading.Lock()
    _ring_warmed = threading.Condition(_ring_lock)


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
                host_buffer_bytes: int = DEFAULT_HOST_RING_BYTES) -> None:
    """Read, per leaf, the boxes this process's target shards need (each saved chunk once) through the
    chunk backend and fill each `LeafRead.result`. Errors name the leaf, the chunk and the file:
    MissingChunkError (a chunk file is missing), ChecksumMismatchError (a crc32c does not match),
    CorruptCheckpointError (a file is truncated or damaged), StorageError (reading failed).
    Leaves that `reuses_host_buffers(sharding, reuse_host_buffers)` are read into the process's host
    ring of up to `host_buffer_bytes` (module docstring); each leaf is put on its devices as soon as
    its reads are done, while later leaves are read."""
    total = sum(planning.box_size(tuple((0, d) for d in r.leaf.shape)) * np.dtype(r.leaf.dtype).itemsize
                for r in reads)
    limit = planning.scaled_inflight_limit(max_inflight_bytes, total)
    for read in reads:
        read.plan_boxes()
    ring_reads = [r for r in reads if reuses_host_buffers(r.sharding, reuse_host_buffers)]
    lease = None
    if ring_reads and host_buffer_bytes > 0:
        lease = HostLease(sum(-(-planning.box_size(b) * np.dtype(r.leaf.dtype).itemsize // DIRECT_ALIGN)
                              * DIRECT_ALIGN for r in ring_reads for b in r.devices), host_buffer_bytes)
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
            if read.region < 0:
                read.buffers = {box: box_buffer(planning.box_shape(box), stored) for box in read.devices}
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
