"""Restore-side array reading: every byte read once, into the memory the restored array will use.

Per leaf, this process reads the distinct boxes its target shards need (replicas on several local
devices share one buffer). Each box gets one 64-byte-aligned host buffer (`aligned_empty`): XLA:CPU
then *aliases* it in `jax.device_put` instead of copying (checked on jax 0.10.2; NumPy's and
tensorstore's own buffers are 16-byte aligned, which XLA copies). On GPU/TPU the same call is a
real host-to-device transfer and the buffer is freed once it is done.

The buffers are filled chunk by chunk: each saved chunk the boxes overlap is read exactly once.
- Local folders: the chunk (zarr3 `bytes` codec, little endian, no compression: the chunk's C-order
  bytes, edge chunks padded to the full chunk shape), a whole chunk file or a range of a shard file
  (chunk_writer.ArrayFiles), is read with `os.preadv` straight into the box buffer when the part a
  box needs is contiguous in both the chunk and the buffer (always so when the box is exactly one
  chunk: a restore onto the save's sharding); otherwise (resharding) the chunk is read once into a
  pooled scratch buffer and sliced into every box it overlaps. Whole chunks that lie back to back in
  a shard file and go straight into page-aligned box buffers are read in runs of up to RUN_BYTES:
  one preadv with an iovec per box, or through staging buffers (below) one per staging buffer.
- gs:// (and `use_tensorstore=True`): tensorstore reads a box that is exactly one chunk straight into
  its buffer (`ts.array(buf).write(store[box])`) and any other chunk once into its own array, which
  is then sliced into every box it overlaps.
On disks (not tmpfs; `direct_io`, as for writes in chunk_writer.py) a chunk file of at least
`DIRECT_MIN_BYTES` is read with `O_DIRECT`, with no page cache in between, so a restore needs fresh
memory for the state only, not a second time for the cache, and does not evict the host's cached
data. The disk fills a staging buffer on a huge page (staging.py: requests of the disk's maximum
size instead of ~1 MiB into 4 KiB pages) and the reading thread copies it into the box (or scratch)
buffer while the disk fills the next ones; without transparent huge pages it fills the box buffer
itself. Restoring 1 GiB on /tmp, staged against straight into the box buffers (4 alternating
rounds): cold 0.74-0.84 s against 0.98-1.23 s, a process's first restore 0.78-0.92 s against
0.97-1.28 s. Box buffers of that size are page-aligned for it; an unaligned head or tail of a
part, and a filesystem refusing `O_DIRECT`, get buffered reads.
The first restore of a fresh process, 1 GiB on /tmp, 5 alternating rounds: 0.90-2.06 s buffered
(median 1.20 s), 0.85-1.20 s direct (median 1.11 s): a fresh process first-touches memory the VM's
host had taken back, and the page cache doubled that. Box buffers take no transparent huge pages
(`_no_huge_pages`): the kernel's compaction for them stalled a fresh process's first touch.
The reads run on a thread pool of `io_concurrency` threads. A read straight into box buffers is
queued at once (its memory is the restored state's own); a read that needs memory of its own (a
scratch buffer, or tensorstore's buffers) counts against the in-flight byte limit. A missing chunk
file is an error naming it (never zeros), as is a file of the wrong size. Every chunk of a checksummed
array (checksums.py) is verified: its crc32c is computed on the bytes where they landed (box or
scratch buffer; a chunk a box needs only part of is read whole into a scratch buffer for that) and
compared with the one stored behind it; each shard file's index is verified once.
Once a leaf's reads are done it is cast (once) if the target asks for another dtype and becomes a
jax.Array with one batched `device_put` and `make_array_from_single_device_arrays`.
"""

from __future__ import annotations

import concurrent.futures
import errno
import mmap
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from resilax_ckpt import checksums, chunk_writer, planning, staging
from resilax_ckpt import tensorstore_io as tsio
from resilax_ckpt.errors import CorruptCheckpointError, MissingChunkError, StorageError

ALIGNMENT = 64
"""Bytes: XLA:CPU aliases a host buffer aligned to this instead of copying it."""
DIRECT_MIN_BYTES = chunk_writer.DIRECT_MIN_BYTES
"""Chunk files (and buffers) of at least this size are read (and aligned) for O_DIRECT."""
DIRECT_ALIGN = chunk_writer.DIRECT_ALIGN
RUN_BYTES = 16 << 20
"""Chunks back to back in a shard file are read as one run (one thread's reads) of up to this
many bytes..."""
RUN_CHUNKS = 1024
"""...and of up to this many chunks (Linux's limit of iovecs per preadv)."""


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
    stall while the kernel compacts memory for huge pages (and on our VM, whose host takes back
    freed huge-page-sized blocks, fault 1 GiB in at 2-6 s against 0.5 s in 4 KiB pages), and a
    restored buffer is written once by a copy from a staging buffer, which huge pages do not speed
    up (staging.py). A fresh process's first restore of 1 GiB on /tmp took 0.82-1.12 s (median 0.96 s) without them against 1.02-2.05 s (median 1.58 s) with them
    (6 alternating rounds; docs/benchmarks.md). Later restores in the same process reuse memory
    the allocator kept, already touched, either way (cold restores: median 0.95 s against 0.97 s)."""
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


class _ScratchPool:
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


def _view(array: np.ndarray, index: tuple[slice, ...]) -> np.ndarray:
    """`array[index]` as a view, also for 0-d arrays (where `array[()]` is a scalar copy)."""
    full: tuple[Any, ...] = (*index, Ellipsis)
    return array[full]


def _contiguous(extent: Sequence[int], full: Sequence[int]) -> bool:
    """Whether a sub-block of `extent` is contiguous inside a C-order block of shape `full`: leading
    extents of 1, then at most one partial dimension, then only full dimensions."""
    dim = 0
    while dim < len(extent) and extent[dim] == 1:
        dim += 1
    return all(extent[d] == full[d] for d in range(dim + 1, len(extent)))


def _c_offset(start: Sequence[int], full: Sequence[int]) -> int:
    """Element offset of `start` in a C-order block of shape `full`."""
    offset = 0
    for s, n in zip(start, full, strict=True):
        offset = offset * n + s
    return offset


class _ChunkTask:
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
            dst = _view(self.read.buffers[box], planning.offset_index(inter, box))
            np.copyto(dst, _view(data, planning.offset_index(inter, self.region)))


def _plan_chunk_tasks(read: LeafRead) -> list[_ChunkTask]:
    """The chunks a leaf's boxes overlap, each once, with the part every box needs."""
    shape = tuple(read.leaf.shape)
    chunks = tuple(read.leaf.chunks)
    tasks: dict[tuple[int, ...], _ChunkTask] = {}
    for box in read.devices:
        for chunk in planning.chunks_of_box(box, chunks):
            task = tasks.get(chunk)
            if task is None:
                region = tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(chunk, chunks, shape, strict=True))
                task = tasks[chunk] = _ChunkTask(read, chunk, region)
            inter = tuple((max(a, r0), min(b, r1)) for (a, b), (r0, r1) in zip(box, task.region, strict=True))
            task.pairs.append((box, inter))
    return list(tasks.values())


class _FileChunkReader:
    """Fills boxes from local chunk and shard files (see the module docstring)."""

    def __init__(self, leaf_paths: list[str], files: list[chunk_writer.ArrayFiles], pool: _ScratchPool,
                 o_direct: bool) -> None:
        self._leaf_paths = leaf_paths
        self._files = files
        self._pool = pool
        self._o_direct = o_direct
        """Read files of at least DIRECT_MIN_BYTES with O_DIRECT (cleared if the filesystem refuses)."""
        self._indexes_checked: set[str] = set()
        self._lock = threading.Lock()

    def location(self, index: int, task: _ChunkTask) -> tuple[str, int]:
        """The file holding the task's chunk and the chunk's offset in it."""
        key, offset = self._files[index].locate(task.chunk)
        return os.path.join(self._leaf_paths[index], *key), offset

    def jobs(self, index: int, tasks: list[_ChunkTask]) -> list[list[_ChunkTask]]:
        """The reads of a leaf: runs of whole chunks that lie back to back in one shard file and go
        straight into page-aligned box buffers (up to RUN_BYTES and RUN_CHUNKS: `_read_run`),
        each other chunk alone."""
        files = self._files[index]
        if not files.shard or files.chunk_bytes % DIRECT_ALIGN:
            return [[task] for task in tasks]
        most = RUN_CHUNKS // 2 if files.checksum else RUN_CHUNKS  # a checksum's block is an iovec too
        jobs: list[list[_ChunkTask]] = []
        run: list[_ChunkTask] = []
        end: tuple[str, int] | None = None
        located = sorted(((*self.location(index, t), t) for t in tasks), key=lambda x: (x[0], x[1]))
        for path, offset, task in located:
            box = task.single_box()
            whole = box is not None and box.nbytes == files.chunk_bytes and box.ctypes.data % DIRECT_ALIGN == 0
            if not whole:
                jobs.append([task])
                continue
            if run and (end != (path, offset) or (len(run) + 1) * files.stride > RUN_BYTES
                        or len(run) == most):
                jobs.append(run)
                run = []
            run.append(task)
            end = (path, offset + files.stride)
        if run:
            jobs.append(run)
        return jobs

    def buffered_bytes(self, job: list[_ChunkTask]) -> int:
        """Bytes of memory besides the box buffers that reading `job` takes: none when it is read
        straight into them, else its chunk's size (a scratch buffer)."""
        if len(job) > 1:
            return 0
        leaf = job[0].read.leaf
        files = chunk_writer.ArrayFiles.of(leaf)
        if self._in_place_parts(job[0], tuple(leaf.chunks), files.itemsize, files.checksum) is not None:
            return 0
        return files.chunk_bytes

    def run(self, index: int, job: list[_ChunkTask]) -> None:
        files = self._files[index]
        leaf = job[0].read.leaf
        itemsize = np.dtype(leaf.dtype).itemsize
        chunks = tuple(leaf.chunks)
        path, base = self.location(index, job[0])
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise MissingChunkError(f"chunk file {path} is missing") from e
        except OSError as e:
            raise StorageError(f"chunk file {path}: {e}") from e
        dfd = -1
        try:
            size = os.fstat(fd).st_size
            expected = files.file_size()
            if size != expected:
                what = f"a shard {list(files.shard)} of chunks {list(chunks)}" if files.shard else f"a chunk {list(chunks)}"
                raise CorruptCheckpointError(
                    f"chunk file {path} has {size} bytes, expected {expected} ({what} of "
                    f"{leaf.dtype}): truncated or not written by resilax_ckpt")
            dfd = self._open_direct(path, size)
            if files.shard and files.checksum:
                self._check_index(path, fd, dfd, files, files.locate(job[0].chunk)[0])
            if len(job) > 1:
                self._read_whole_chunks(path, fd, dfd, base, files, [task.read.buffers[task.region] for task in job])
                return
            what = f"chunk file {path}" + (f", the chunk at byte {base}" if files.shard else "")
            task = job[0]
            in_place = self._in_place_parts(task, chunks, itemsize, files.checksum)
            if in_place is not None:
                self._read_parts(path, fd, dfd, [(base + offset, buf) for offset, buf in in_place])
                if files.checksum:
                    in_order = [buf for _, buf in sorted(in_place, key=lambda part: part[0])]
                    stored = self._read_small(path, fd, dfd, base + files.chunk_bytes, files.crc_bytes)
                    checksums.verify(checksums.crc32c_of(in_order), stored, what)
                return
            scratch = self._pool.take(files.chunk_bytes)
            try:
                self._read_parts(path, fd, dfd, [(base, scratch)])
                if files.checksum:
                    stored = self._read_small(path, fd, dfd, base + files.chunk_bytes, files.crc_bytes)
                    checksums.verify(checksums.crc32c(scratch), stored, what)
                data = scratch.view(np.dtype(leaf.dtype)).reshape(chunks)
                task.scatter(_view(data, tuple(slice(0, b - a) for a, b in task.region)))
            finally:
                self._pool.give(scratch)
        finally:
            os.close(fd)
            if dfd >= 0:
                os.close(dfd)

    def _read_whole_chunks(self, path: str, fd: int, dfd: int, base: int, files: chunk_writer.ArrayFiles,
                           boxes: list[np.ndarray]) -> None:
        """Fill `boxes` (page-aligned, page-multiple sizes) with the chunks that lie back to back in a
        shard file from `base`: one run; with checksums, each chunk's checksum and padding up to the
        next chunk (one block) is read into a block of its own and verified."""
        if not files.checksum:
            self._read_run(path, fd, dfd, base, boxes)
            return
        tails = aligned_empty((len(boxes), files.stride - files.chunk_bytes), np.uint8, DIRECT_ALIGN)
        self._read_run(path, fd, dfd, base, [b for pair in zip(boxes, tails, strict=True) for b in pair])
        for n, (box, tail) in enumerate(zip(boxes, tails, strict=True)):
            checksums.verify(checksums.crc32c(box.reshape(-1).view(np.uint8)), tail[:files.crc_bytes],
                             f"chunk file {path}, the chunk at byte {base + n * files.stride}")

    def _check_index(self, path: str, fd: int, dfd: int, files: chunk_writer.ArrayFiles, key: Sequence[str]) -> None:
        """Verify the shard index of the open shard file `path`, once per file: its crc32c, and that it
        is the index of our layout (ArrayFiles), by which this reader finds the chunks without it."""
        with self._lock:  # held while reading: each file's index is read once
            if path in self._indexes_checked:
                return
            stored = self._read_small(path, fd, dfd, files.index_offset, files.index_bytes)
            what = f"chunk file {path}, its shard index"
            checksums.verify(checksums.crc32c(stored[:-files.crc_bytes]), stored[-files.crc_bytes:], what)
            if stored.tobytes() != files.shard_index(key):
                raise CorruptCheckpointError(f"{what}: not the index of a {list(files.shard)} shard of "
                                             f"{list(files.chunks)} chunks as resilax_ckpt writes it")
            self._indexes_checked.add(path)

    def _read_small(self, path: str, fd: int, dfd: int, offset: int, nbytes: int) -> np.ndarray:
        """`nbytes` bytes at `offset` (a checksum, a shard index): with O_DIRECT (`dfd` >= 0) as the
        few whole blocks around them, so that they fill no page cache either; else buffered."""
        out = np.empty(nbytes, np.uint8)
        if dfd >= 0:
            start = offset // DIRECT_ALIGN * DIRECT_ALIGN
            block = aligned_empty((-(-(offset + nbytes - start) // DIRECT_ALIGN) * DIRECT_ALIGN,), np.uint8,
                                  DIRECT_ALIGN)
            try:
                got = os.preadv(dfd, [block.data], start)
            except OSError as e:  # e.g. a logical block larger than DIRECT_ALIGN
                if e.errno != errno.EINVAL:
                    raise
                got = 0
            if got >= offset + nbytes - start:
                out[:] = block[offset - start:offset - start + nbytes]
                return out
        _pread_exact(fd, out, offset, path)
        return out

    def _open_direct(self, path: str, size: int) -> int:
        """`path` opened with O_DIRECT when enabled and the file is large enough, else -1."""
        if self._o_direct and size >= DIRECT_MIN_BYTES:
            try:
                return os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise StorageError(f"chunk file {path}: {e}") from e
                self._o_direct = False  # the filesystem refuses O_DIRECT
        return -1

    @staticmethod
    def _read_run(path: str, fd: int, dfd: int, offset: int, buffers: list[np.ndarray]) -> None:
        """Fill `buffers` (page-aligned, page-multiple sizes) from consecutive bytes of the file at
        `offset`: with O_DIRECT when `dfd` >= 0 (through staging buffers: `_read_direct`), else one
        preadv."""
        try:
            if dfd < 0:
                _preadv_exact(fd, buffers, offset, path)
            else:
                _read_direct(dfd, buffers, offset, path)
        except OSError as e:  # e.g. a logical block larger than DIRECT_ALIGN
            if dfd < 0 or e.errno != errno.EINVAL:
                raise
            _preadv_exact(fd, buffers, offset, path)

    @staticmethod
    def _read_parts(path: str, fd: int, dfd: int, parts: list[tuple[int, np.ndarray]]) -> None:
        """Fill each (file offset, buffer) part from the open file `fd`: the page-aligned middle of a
        part with O_DIRECT when `dfd` >= 0, the rest (and everything otherwise) with buffered reads."""
        for offset, view in parts:
            buf = view.reshape(-1).view(np.uint8)
            head = (-offset) % DIRECT_ALIGN
            body = (buf.nbytes - head) // DIRECT_ALIGN * DIRECT_ALIGN if buf.nbytes > head else 0
            if dfd < 0 or body == 0 or (buf.ctypes.data + head) % DIRECT_ALIGN:
                head, body = buf.nbytes, 0
            if head:
                _pread_exact(fd, buf[:head], offset, path)
            if body:
                try:
                    _read_direct(dfd, [buf[head:head + body]], offset + head, path)
                except OSError as e:  # e.g. a logical block larger than DIRECT_ALIGN
                    if e.errno != errno.EINVAL:
                        raise
                    _pread_exact(fd, buf[head:head + body], offset + head, path)
            if head + body < buf.nbytes:
                _pread_exact(fd, buf[head + body:], offset + head + body, path)

    @staticmethod
    def _in_place_parts(task: _ChunkTask, chunks: tuple[int, ...], itemsize: int,
                        whole: bool = False) -> list[tuple[int, np.ndarray]] | None:
        """(offset in the chunk, destination byte view) per pair when every pair's part is
        contiguous in the chunk and in its box buffer (and with `whole`, as a checksum needs, when
        the parts hold every byte of the chunk); None when the chunk must be read into a scratch
        buffer and sliced from there."""
        parts = []
        origin = tuple(a for a, _ in task.region)
        for box, inter in task.pairs:
            extent = planning.box_shape(inter)
            if not _contiguous(extent, chunks):
                return None
            dst = _view(task.read.buffers[box], planning.offset_index(inter, box))
            if not dst.flags.c_contiguous:
                return None
            start = tuple(a - o for (a, _), o in zip(inter, origin, strict=True))
            parts.append((_c_offset(start, chunks) * itemsize, dst.reshape(-1).view(np.uint8)))
        if whole and sum(buf.nbytes for _, buf in parts) != planning.box_size(tuple((0, c) for c in chunks)) * itemsize:
            return None
        return parts


def _read_direct(fd: int, views: list[np.ndarray], offset: int, path: str) -> None:
    """Fill `views` (page-aligned, page-multiple sizes), in order, from the bytes at `offset` of a
    file opened with O_DIRECT: through a staging buffer (staging.py: bigger requests than the views'
    4 KiB pages make), piece by piece, where huge pages exist; else straight into the views."""
    if not staging.huge_pages():
        _preadv_exact(fd, views, offset, path)
        return
    targets = [v.reshape(-1).view(np.uint8) for v in views]
    with staging.borrowed() as stage:
        index, pos = 0, 0  # the view being filled and the bytes of it done
        left = sum(t.nbytes for t in targets)
        while left:
            want = min(stage.nbytes, left)
            _preadv_exact(fd, [stage[:want]], offset, path)
            offset += want
            left -= want
            got = 0
            while got < want:
                target = targets[index]
                n = min(target.nbytes - pos, want - got)
                target[pos:pos + n] = stage[got:got + n]
                got += n
                pos += n
                if pos == target.nbytes:
                    index, pos = index + 1, 0


def _pread_exact(fd: int, view: np.ndarray, offset: int, path: str) -> None:
    _preadv_exact(fd, [view], offset, path)


def _preadv_exact(fd: int, views: list[np.ndarray], offset: int, path: str) -> None:
    """Fill `views`, in order, from the file's bytes at `offset` (preadv, repeated on short reads)."""
    bufs = [v.reshape(-1).view(np.uint8).data for v in views]
    want = offset + sum(len(b) for b in bufs)
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n <= 0:
            raise CorruptCheckpointError(f"chunk file {path}: ended after {offset} bytes, expected at least {want}")
        offset += n
        while bufs and n >= len(bufs[0]):
            n -= len(bufs.pop(0))
        if bufs and n:
            bufs[0] = bufs[0][n:]


class _TensorstoreChunkReader:
    """Fills boxes through tensorstore (gs://, or local when asked): each chunk read once, its
    checksum verified by tensorstore (the `crc32c` codec)."""

    def __init__(self, stores: list[Any], leaf_paths: list[str], files: list[chunk_writer.ArrayFiles],
                 storage: Any) -> None:
        self._stores = stores
        self._leaf_paths = leaf_paths
        self._files = files
        self._storage = storage

    @staticmethod
    def jobs(index: int, tasks: list[_ChunkTask]) -> list[list[_ChunkTask]]:
        """Each chunk is a read of its own (tensorstore batches them itself)."""
        return [[task] for task in tasks]

    @staticmethod
    def buffered_bytes(job: list[_ChunkTask]) -> int:
        """Bytes of tensorstore's own buffers while reading `job`'s chunk: its region's (counted always)."""
        (task,) = job
        return planning.box_size(task.region) * np.dtype(task.read.leaf.dtype).itemsize

    def run(self, index: int, job: list[_ChunkTask]) -> None:
        (task,) = job
        store = self._stores[index][planning.box_to_index(task.region)]
        target = task.single_box()
        try:
            if target is not None:
                ts.array(target).write(store).result()
                return
            data = store.read().result()
        except Exception as e:
            key, _ = self._files[index].locate(task.chunk)
            raise tsio.read_error(e, self._storage.join(self._leaf_paths[index], *key)) from e
        task.scatter(data)


def read_leaves(reads: list[LeafRead], step_path: str, storage: Any, context: Any, max_inflight_bytes: int,
                io_concurrency: int = 32, use_tensorstore: bool | None = None, direct_io: bool = True) -> None:
    """Read, per leaf, the boxes this process's target shards need (each saved chunk once) and fill
    each `LeafRead.result`. `use_tensorstore` (default: unless the storage is local) picks the
    tensorstore reader over direct file reads. `direct_io`: O_DIRECT file reads where
    `chunk_writer.use_direct_io` allows (module docstring). Errors name the leaf, the chunk and the file:
    MissingChunkError (a chunk file is missing), ChecksumMismatchError (a crc32c does not match),
    CorruptCheckpointError (a file is truncated or damaged), StorageError (reading failed)."""
    if use_tensorstore is None:
        use_tensorstore = not storage.is_local
    leaf_paths = [storage.join(step_path, r.item, r.leaf.dir) for r in reads]
    total = sum(planning.box_size(tuple((0, d) for d in r.leaf.shape)) * np.dtype(r.leaf.dtype).itemsize
                for r in reads)
    limit = tsio.scaled_inflight_limit(max_inflight_bytes, total)
    scratch = _ScratchPool(limit)
    runner: _FileChunkReader | _TensorstoreChunkReader
    if use_tensorstore:
        specs = [tsio.build_array_spec(storage.kvstore_spec(path), r.leaf.shape, r.leaf.dtype, r.leaf.chunks,
                                       r.leaf.shard, r.leaf.checksum)
                 for path, r in zip(leaf_paths, reads, strict=True)]
        runner = _TensorstoreChunkReader(tsio.open_arrays(specs, context, create=False), leaf_paths,
                                         [chunk_writer.ArrayFiles.of(r.leaf) for r in reads], storage)
    else:
        runner = _FileChunkReader(leaf_paths, [chunk_writer.ArrayFiles.of(r.leaf) for r in reads], scratch,
                                  chunk_writer.use_direct_io(step_path, direct_io))
    limiter = tsio.InflightLimiter(limit)
    executor = concurrent.futures.ThreadPoolExecutor(max(1, io_concurrency), thread_name_prefix="resilax-read")
    try:
        for index, read in enumerate(reads):
            read.plan_boxes()
            stored = np.dtype(read.leaf.dtype)
            read.buffers = {box: aligned_empty(planning.box_shape(box), stored) for box in read.devices}
            jobs = runner.jobs(index, _plan_chunk_tasks(read))
            read.remaining = len(jobs)
            if not jobs:  # empty array
                read.finish()
                continue
            for job in jobs:
                nbytes = runner.buffered_bytes(job)
                limiter.admit(nbytes)
                future = executor.submit(runner.run, index, job)
                chunks = f"chunk {list(job[0].chunk)}" + (f" and {len(job) - 1} more" if len(job) > 1 else "")
                limiter.add(future, nbytes, f"reading {read.name} {chunks} from {step_path}",
                            on_done=lambda _, r=read: _one_done(r))
        limiter.drain()
    finally:
        limiter.cancel()
        executor.shutdown(wait=True, cancel_futures=True)
        scratch.clear()


def _one_done(read: LeafRead) -> None:
    read.remaining -= 1
    if read.remaining == 0:
        read.finish()
