"""The file backend's reads (backends.FileChunkBackend): chunks and shard files of local folders read
with our own code, no tensorstore.

A chunk (zarr3 `bytes` codec, little endian, no compression: the chunk's C-order bytes, edge chunks
padded to the full chunk shape; with a `transpose` codec, those of the chunk transposed: box buffers
are then laid out in that order, and "contiguous" below means in it; then its crc32c), a whole chunk
file or a range of a shard file
(chunk_format.ArrayFiles), is read with `os.preadv` straight into the box buffer when the part a box
needs is contiguous in both the chunk and the buffer (always so when the box is exactly one chunk: a
restore onto the save's sharding) and covers the whole chunk; otherwise (resharding, edge chunks) the
chunk is read once into a pooled scratch buffer and sliced into every box it overlaps. Whole chunks
that lie back to back in a shard file and go straight into page-aligned box buffers are read in runs
of up to RUN_BYTES: one preadv with an iovec per box (and one per chunk's checksum block), or through
staging buffers one request per staging buffer.
Every chunk of a checksummed array is verified where its bytes landed (checksums.py), each shard
file's index once; a missing file is a MissingChunkError, a file of the wrong size a
CorruptCheckpointError, a checksum mismatch a ChecksumMismatchError, each naming the file.
On disks (not tmpfs; `direct_io`, as for writes in chunk_writer.py) a chunk file of at least
`DIRECT_MIN_BYTES` is read with `O_DIRECT`, with no page cache in between, so a restore needs fresh
memory for the state only, not a second time for the cache, and does not evict the host's cached
data. The disk fills a staging buffer on a huge page (staging.py: requests of the disk's maximum
size instead of ~1 MiB into 4 KiB pages) and the reading thread copies it into the box (or scratch)
buffer while the disk fills the next ones; without transparent huge pages it fills the box buffer
itself. An unaligned head or tail of a part, a checksum or a shard index of a file not read with
`O_DIRECT`, and a filesystem refusing `O_DIRECT`, get buffered reads. The figures behind these
choices: docs/benchmarks.md, "Measurements behind the fast path".
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Sequence

import numpy as np

from resilax_ckpt import planning
from resilax_ckpt.chunks import checksums, chunk_format, chunk_writer, staging
from resilax_ckpt.chunks.reader import (
    ChunkTask,
    LeafRead,
    ScratchPool,
    aligned_empty,
    c_offset,
    is_contiguous,
    subview,
)
from resilax_ckpt.errors import CorruptCheckpointError, MissingChunkError, StorageError
from resilax_ckpt.storage import Storage

DIRECT_MIN_BYTES = chunk_format.DIRECT_MIN_BYTES
"""Chunk files of at least this size are read with O_DIRECT."""
DIRECT_ALIGN = chunk_format.DIRECT_ALIGN
RUN_BYTES = 16 << 20
"""Chunks back to back in a shard file are read as one run (one thread's reads) of up to this
many bytes..."""
RUN_CHUNKS = 1024
"""...and of up to this many iovecs (Linux's limit per preadv; with checksums two per chunk)."""


class FileReads:
    """The read half of the file chunk backend (reader.ChunkBackendReads): backends.FileChunkBackend
    reads through it, and the restore prefetch uses it alone (prefetch.py: backends.py imports
    tensorstore, which a trainer's first line should not wait for)."""

    def __init__(self, storage: Storage, direct_io: bool = True) -> None:
        self._storage = storage
        self._direct_io = direct_io

    def open_reader(self, reads: list[LeafRead], step_path: str, memory_limit: int) -> FileChunkReader:
        paths = [self._storage.join(step_path, r.item, str(r.leaf.dir)) for r in reads]
        return FileChunkReader(paths, [chunk_format.ArrayFiles.of(r.leaf) for r in reads], ScratchPool(memory_limit),
                               chunk_writer.use_direct_io(step_path, self._direct_io))


class FileChunkReader:
    """Fills boxes from local chunk and shard files (see the module docstring)."""

    def __init__(self, leaf_paths: list[str], files: list[chunk_format.ArrayFiles], pool: ScratchPool,
                 o_direct: bool) -> None:
        self._leaf_paths = leaf_paths
        self._files = files
        self._pool = pool
        self._o_direct = o_direct
        """Read files of at least DIRECT_MIN_BYTES with O_DIRECT (cleared if the filesystem refuses)."""
        self._indexes_checked: set[str] = set()
        self._index_locks: dict[str, threading.Lock] = {}
        """One lock per shard file: a thread reading one file's index holds up only the threads
        reading that file (one lock for all of them serialized every file's first read behind any
        index read queued at the disk: a third of a reader thread's time in a cold restore)."""
        self._lock = threading.Lock()

    def close(self) -> None:
        """Drop the scratch buffers kept for reuse."""
        self._pool.clear()

    def location(self, index: int, task: ChunkTask) -> tuple[str, int]:
        """The file holding the task's chunk and the chunk's offset in it."""
        key, offset = self._files[index].locate(task.chunk)
        return os.path.join(self._leaf_paths[index], *key), offset

    def jobs(self, index: int, tasks: list[ChunkTask]) -> list[list[ChunkTask]]:
        """The reads of a leaf: runs of whole chunks that lie back to back in one shard file and go
        straight into page-aligned box buffers (up to RUN_BYTES and RUN_CHUNKS: `_read_run`),
        each other chunk alone."""
        files = self._files[index]
        if not files.shard or files.chunk_bytes % DIRECT_ALIGN:
            return [[task] for task in tasks]
        most = RUN_CHUNKS // 2 if files.checksum else RUN_CHUNKS  # a checksum's block is an iovec too
        jobs: list[list[ChunkTask]] = []
        run: list[ChunkTask] = []
        end: tuple[str, int] | None = None
        located = sorted(((*self.location(index, t), t) for t in tasks), key=lambda x: (x[0], x[1]))
        order = tasks[0].read.leaf.transpose if tasks else ()
        for path, offset, task in located:
            box = task.single_box()
            if box is not None:
                box = chunk_format.stored_view(box, order)
            whole = (box is not None and box.flags.c_contiguous and box.nbytes == files.chunk_bytes
                     and box.ctypes.data % DIRECT_ALIGN == 0)
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

    def buffered_bytes(self, job: list[ChunkTask]) -> int:
        """Bytes of memory besides the box buffers that reading `job` takes: none when it is read
        straight into them, else its chunk's size (a scratch buffer)."""
        if len(job) > 1:
            return 0
        leaf = job[0].read.leaf
        files = chunk_format.ArrayFiles.of(leaf)
        if self._in_place_parts(job[0], files.itemsize, files.checksum) is not None:
            return 0
        return files.chunk_bytes

    def run(self, index: int, job: list[ChunkTask]) -> None:
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
            order = leaf.transpose
            if len(job) > 1:
                self._read_whole_chunks(path, fd, dfd, base, files, [
                    chunk_format.stored_view(task.read.buffers[task.region], order) for task in job])
                return
            what = f"chunk file {path}" + (f", the chunk at byte {base}" if files.shard else "")
            task = job[0]
            in_place = self._in_place_parts(task, itemsize, files.checksum)
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
                data = chunk_format.empty_in_order(chunks, np.dtype(leaf.dtype), order,
                                                   lambda shape, dtype: scratch.view(dtype).reshape(shape))
                task.scatter(subview(data, tuple(slice(0, b - a) for a, b in task.region)))
            finally:
                self._pool.give(scratch)
        finally:
            os.close(fd)
            if dfd >= 0:
                os.close(dfd)

    def _read_whole_chunks(self, path: str, fd: int, dfd: int, base: int, files: chunk_format.ArrayFiles,
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

    def _check_index(self, path: str, fd: int, dfd: int, files: chunk_format.ArrayFiles, key: Sequence[str]) -> None:
        """Verify the shard index of the open shard file `path`, once per file: its crc32c, and that it
        is the index of our layout (ArrayFiles), by which this reader finds the chunks without it."""
        with self._lock:
            if path in self._indexes_checked:
                return
            lock = self._index_locks.setdefault(path, threading.Lock())
        with lock:  # held while reading: each file's index is read once
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
    def _in_place_parts(task: ChunkTask, itemsize: int, whole: bool = False) -> list[tuple[int, np.ndarray]] | None:
        """(offset in the chunk, destination byte view) per pair when every pair's part is
        contiguous in the chunk and in its box buffer, both in the order the chunk is stored
        (LeafMetadata.transpose), and with `whole`, as a checksum needs, when the parts hold every
        byte of the chunk; None when the chunk must be read into a scratch buffer and sliced from
        there."""
        order = tuple(task.read.leaf.transpose) or tuple(range(len(task.region)))
        chunks = tuple(task.read.leaf.chunks[d] for d in order)
        parts = []
        origin = tuple(a for a, _ in task.region)
        for box, inter in task.pairs:
            extent = planning.box_shape(inter)
            if not is_contiguous(tuple(extent[d] for d in order), chunks):
                return None
            dst = chunk_format.stored_view(subview(task.read.buffers[box], planning.offset_index(inter, box)),
                                           task.read.leaf.transpose)
            if not dst.flags.c_contiguous:
                return None
            start = tuple(inter[d][0] - origin[d] for d in order)
            parts.append((c_offset(start, chunks) * itemsize, dst.reshape(-1).view(np.uint8)))
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
