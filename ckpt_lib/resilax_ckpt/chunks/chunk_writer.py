"""Chunk files written by ourselves on local paths (no tensorstore on the save path).

Each array is a zarr3 array with chunks = the shard grid, the `bytes` codec (little-endian) and no
compression, so a chunk file IS the chunk's C-order little-endian bytes (an edge chunk is padded to the
full chunk shape with the fill value 0, as zarr requires), followed by their crc32c (zarr3's `crc32c`
codec, checksums.py; computed on the staging buffer of a direct write). Chunk keys use the zarr3 default
encoding: `c/<i>/<j>...`, and `c` itself for a 0-d array. With shard files (`ArrayFiles`, zarr3's
`sharding_indexed` codec) each process's chunks of an array are ranges of one file instead.

Why not tensorstore's `file` kvstore: it writes a temporary file and renames it over the chunk, so every
save creates new files. `write_chunk_file` rewrites an existing file in place (`O_CREAT` without `O_TRUNC`,
`pwrite`, `ftruncate` to the exact size), which is what makes the recycled step folders of a retention
(retention.py, docs/checkpointing.md §8) fast: the disk rewrites existing blocks several times faster than
it allocates new ones.

Durability (`fsync=True`) is one flush per save, not one per file: each file's writeback is started as soon
as it is written (`sync_file_range(SYNC_FILE_RANGE_WRITE)`: the disk works while the next files are written,
nothing waits), and once every file is written one `syncfs` of the step folder's filesystem makes them all
durable with their folders: one journal commit instead of one per new file. syncfs also flushes what other
processes left dirty on that filesystem. Where syncfs does not report write-back errors (Linux before 5.8)
or does not exist, every file is fdatasync'ed at the end instead (`durability_mode`).

Direct I/O (`direct_io=True`, on disks; not on tmpfs, where the page cache IS the storage): a chunk
file of at least `DIRECT_MIN_BYTES` is written with `O_DIRECT` through a staging buffer (staging.py:
reused, on a huge page; the snapshot's buffers are only 64-byte aligned), the last block padded and
the file then truncated to its exact size. A buffered write of a new file must first get fresh page
cache for every byte (1 GiB of it per save, which on our VM first-touches memory the host had taken
back, and on a training host evicts the dataset's cache); a direct write copies into the same few
warm MiB and the disk reads from there. A filesystem that refuses `O_DIRECT` (EINVAL) gets buffered writes.

The figures behind these choices: docs/benchmarks.md, "Measurements behind the fast path".

`zarr_json` produces byte for byte the `zarr.json` tensorstore writes for the same array, so any zarr3
reader (tensorstore without `assume_metadata`, zarr-python) reads what we wrote.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import errno
import functools
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from resilax_ckpt import planning
from resilax_ckpt.chunks import checksums, staging
from resilax_ckpt.chunks.chunk_format import (
    DIRECT_ALIGN,
    DIRECT_MIN_BYTES,
    ZARR_JSON,
    ArrayFiles,
    chunk_data,
    stored_view,
    zarr_json,
)
from resilax_ckpt.chunks.sources import Landing, resolve_source
from resilax_ckpt.errors import StorageError


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _kernel_at_least(release: str, want: tuple[int, int]) -> bool:
    parts = []
    for part in release.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit()) if part else ""
        parts.append(int(digits) if digits else 0)
    return tuple(parts) >= want


@functools.cache
def durability_mode() -> str:
    """How written chunk files are made durable: "syncfs" (Linux >= 5.8, where syncfs reports
    write-back errors: writeback started per file, one syncfs at the end) or "fdatasync" (every
    file fdatasync'ed once all are written)."""
    libc = _libc()
    if (sys.platform.startswith("linux") and libc is not None and hasattr(libc, "syncfs")
            and hasattr(libc, "sync_file_range") and _kernel_at_least(os.uname().release, (5, 8))):
        libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        libc.syncfs.argtypes = [ctypes.c_int]
        return "syncfs"
    return "fdatasync"


_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing `fd`'s dirty pages now, without waiting (syncfs mode)."""
    if durability_mode() == "syncfs" and _libc().sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sync_file_range: {os.strerror(err)}")


def make_durable(folder: str, files: Sequence[str]) -> None:
    """Make `files` (all under `folder`, one filesystem) and their folders durable: one syncfs, or
    (fdatasync mode) an fdatasync of every file and an fsync of every folder up to `folder`."""
    if durability_mode() == "syncfs":
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise OSError(e.errno, f"syncfs of the filesystem of {folder}: {e.strerror}") from e
        try:
            if _libc().syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syncfs of the filesystem of {folder}: {os.strerror(err)}")
        finally:
            os.close(fd)
        return
    folders = {folder}
    for path in files:
        parent = os.path.dirname(path)
        while parent not in folders and parent.startswith(folder):
            folders.add(parent)
            parent = os.path.dirname(parent)
    for path, sync in [*((f, os.fdatasync) for f in files), *((d, os.fsync) for d in sorted(folders))]:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            sync(fd)
        finally:
            os.close(fd)




@functools.cache
def _mount_types() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, longest mount point first."""
    mounts = []
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 3:
                    mounts.append((fields[1].replace("\\040", " "), fields[2]))
    except OSError:
        return []
    return sorted(mounts, key=lambda m: len(m[0]), reverse=True)


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem `path` is on ("ext4", "tmpfs", ...), None when unknown."""
    real = os.path.realpath(path)
    for point, kind in _mount_types():
        if real == point or real.startswith(point.rstrip("/") + "/"):
            return kind
    return None


def use_direct_io(folder: str, wanted: bool) -> bool:
    """Whether to write chunk files under `folder` with O_DIRECT: when `wanted`, on Linux, and not on
    a memory filesystem (tmpfs, ramfs), whose page cache is the storage itself."""
    return wanted and hasattr(os, "O_DIRECT") and filesystem_type(folder) not in ("tmpfs", "ramfs", None)


def _open_for_write(path: str, flags: int) -> int:
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, 0o644)


def preallocate(path: str, size: int) -> None:
    """Create `path` (or keep it) and allocate `size` bytes for it at once (fallocate), so the chunks
    that threads write into it concurrently land in one contiguous run of the disk instead of
    extents in the order the writes happened (a shard file read back sequentially then reads the
    disk sequentially), and aligned O_DIRECT writes into it are overwrites, which ext4 runs in
    parallel. Nothing happens where fallocate is not supported."""
    fd = _open_for_write(path, 0)
    try:
        libc = _libc()
        if libc is not None and hasattr(libc, "fallocate"):
            libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            if libc.fallocate(fd, 0, 0, size) != 0 and ctypes.get_errno() not in (errno.EOPNOTSUPP, errno.ENOSYS):
                err = ctypes.get_errno()
                raise OSError(err, f"fallocate {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _write_direct(path: str, raw: np.ndarray, offset: int, size: int | None, checksum: bool = False) -> bool:
    """Write `raw` (uint8) at `offset` (a multiple of DIRECT_ALIGN) of `path` with O_DIRECT through a
    staging buffer, the last block padded with zeros, then truncate the file to `size` (when given);
    with `checksum`, the data's crc32c right after it (computed on the staging buffer, while it is
    in the cache). False (nothing written) when the filesystem refuses O_DIRECT."""
    try:
        fd = _open_for_write(path, os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    try:
        with staging.borrowed() as bounce:
            return _write_through(fd, bounce, raw, offset, size, checksum)
    finally:
        os.close(fd)


def _write_through(fd: int, bounce: np.ndarray, raw: np.ndarray, offset: int, size: int | None,
                   checksum: bool = False) -> bool:
    """`_write_direct`'s writes into the open file `fd`, each piece copied into `bounce` first (with
    `checksum`, pieces leave a block free, so the last one has room for the crc32c behind it)."""
    done = 0
    crc = 0
    most = bounce.nbytes - (DIRECT_ALIGN if checksum else 0)
    while done < raw.nbytes:
        piece = min(most, raw.nbytes - done)
        bounce[:piece] = raw[done:done + piece]
        end = piece
        if checksum:
            crc = checksums.crc32c(bounce[:piece], crc)
            if done + piece == raw.nbytes:
                bounce[piece:piece + checksums.CRC_BYTES] = np.frombuffer(checksums.encode(crc), np.uint8)
                end += checksums.CRC_BYTES
        padded = -(-end // DIRECT_ALIGN) * DIRECT_ALIGN
        bounce[end:padded] = 0
        try:
            _pwrite_all(fd, bounce[:padded].data, offset + done)
        except OSError as e:
            if e.errno == errno.EINVAL and done == 0:
                return False  # e.g. a logical block larger than DIRECT_ALIGN
            raise
        done += piece
    if size is not None:
        os.ftruncate(fd, size)
    return True


def write_chunk_file(path: str, data: np.ndarray, fsync: bool = True, direct: bool = False,
                     offset: int = 0, size: int | None = -1, checksum: bool = False) -> None:
    """Write `data`'s C-order bytes at `offset` of `path`, in place when it exists: open without
    truncating, pwrite, then ftruncate to `size` (by default the end of what was written: the whole
    file; None leaves the size alone: a chunk inside a shard file); when `fsync`, start its writeback
    (durable only after `make_durable`). `checksum`: the data's crc32c (4 bytes) follows it.
    `direct`: with O_DIRECT (module docstring) when the data has at least DIRECT_MIN_BYTES and
    `offset` is aligned. Data that is not C-contiguous is written (buffered) without a copy where it
    is made of contiguous blocks of at least MIN_BLOCK_BYTES (a slice along a non-leading axis:
    `pwritev` of the blocks), else piece by piece through a staging buffer (counted:
    `bounced_writes`), never copied whole."""
    contiguous = data.flags.c_contiguous
    raw = data.reshape(-1).view(np.uint8) if contiguous else None
    if size == -1:
        size = offset + data.nbytes + (checksums.CRC_BYTES if checksum else 0)
    if (raw is not None and direct and raw.nbytes >= DIRECT_MIN_BYTES and offset % DIRECT_ALIGN == 0
            and _write_direct(path, raw, offset, size, checksum)):
        return
    fd = _open_for_write(path, 0)
    try:
        if raw is not None:
            _pwrite_all(fd, raw.data, offset)
            crc = checksums.crc32c(raw) if checksum else 0
        elif (blocks := _contiguous_blocks(data)) is not None:
            crc = _write_blocks(fd, blocks, offset, checksum)
        else:
            _count_bounce(data)
            crc = _write_pieces(fd, data, offset, checksum)
        if checksum:
            _pwrite_all(fd, memoryview(checksums.encode(crc)), offset + data.nbytes)
        if size is not None:
            os.ftruncate(fd, size)
        if fsync:
            start_writeback(fd)
    finally:
        os.close(fd)


MIN_BLOCK_BYTES = 4096
"""The smallest contiguous block `write_chunk_file` writes as one piece of a `pwritev`; data made of
smaller blocks goes through the staging buffer."""
_IOV_MAX = 1024
_bounces = {"writes": 0, "bytes": 0}
_bounce_layout: list[str] = []
_bounce_lock = threading.Lock()


def bounced_writes() -> dict[str, Any]:
    """Writes this process made through the staging buffer (a copy of their data piece by piece):
    {"writes", "bytes", "layout" (shape, dtype and strides of the first, "" if none)}. On a TPU v5e
    the bench's profile showed 0.7 s of a 2 GiB save in such copies: the bench reports this count."""
    with _bounce_lock:
        return {**_bounces, "layout": _bounce_layout[0] if _bounce_layout else ""}


def _count_bounce(data: np.ndarray) -> None:
    with _bounce_lock:
        _bounces["writes"] += 1
        _bounces["bytes"] += data.nbytes
        if not _bounce_layout:
            _bounce_layout.append(f"shape {data.shape} {data.dtype} strides {data.strides}")


def _contiguous_blocks(data: np.ndarray) -> list[np.ndarray] | None:
    """`data` (not C-contiguous) as its C-contiguous blocks in C order, each a uint8 view of at
    least MIN_BLOCK_BYTES (the trailing axes that are laid out contiguously), or None."""
    if data.ndim == 0 or data.size == 0:
        return None
    expected = data.itemsize
    split = data.ndim
    for axis in range(data.ndim - 1, -1, -1):
        if data.shape[axis] != 1 and data.strides[axis] != expected:
            break
        expected *= data.shape[axis]
        split = axis
    if split == data.ndim or expected < MIN_BLOCK_BYTES:
        return None
    return [data[index].reshape(-1).view(np.uint8) for index in np.ndindex(*data.shape[:split])]


def _write_blocks(fd: int, blocks: list[np.ndarray], offset: int, checksum: bool) -> int:
    """Write `blocks` one after the other at `offset` of `fd` with `pwritev` (no copy); their crc32c
    (0 without `checksum`)."""
    crc = 0
    done = 0
    for start in range(0, len(blocks), _IOV_MAX):
        group = blocks[start:start + _IOV_MAX]
        size = sum(b.nbytes for b in group)
        written = os.pwritev(fd, [b.data for b in group], offset + done)
        if written < size:  # short write: the rest block by block
            skip = written
            for b in group:
                if skip >= b.nbytes:
                    skip -= b.nbytes
                    continue
                _pwrite_all(fd, b[skip:].data, offset + done + written)
                written += b.nbytes - skip
                skip = 0
        if checksum:
            for b in group:
                crc = checksums.crc32c(b, crc)
        done += size
    return crc


def _write_pieces(fd: int, data: np.ndarray, offset: int, checksum: bool) -> int:
    """Write non-contiguous `data` at `offset` of `fd` in C order, a block of its leading axis at a
    time copied into a staging buffer; the crc32c of its bytes (0 without `checksum`)."""
    crc = 0
    if data.ndim == 0 or data.size == 0:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        _pwrite_all(fd, raw.data, offset)
        return checksums.crc32c(raw) if checksum else 0
    row = data[0].nbytes
    rows = max(1, staging.BUFFER_BYTES // max(1, row))
    done = 0
    with staging.borrowed() as bounce:
        for start in range(0, data.shape[0], rows):
            block = data[start:start + rows]
            if block.nbytes <= bounce.nbytes:
                piece = bounce[:block.nbytes].view(data.dtype).reshape(block.shape)
                np.copyto(piece, block)
                raw = bounce[:block.nbytes]
            else:  # one row larger than the buffer
                raw = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
            _pwrite_all(fd, raw.data, offset + done)
            if checksum:
                crc = checksums.crc32c(raw, crc)
            done += raw.nbytes
    return crc


def _write_then(done: Callable[[], None] | None, *args: Any) -> None:
    """write_chunk_file(*args), then `done()` (before the future completes: whoever waits for the
    write sees its data given back)."""
    try:
        write_chunk_file(*args)
    finally:
        if done is not None:
            done()


class ChunkWriter:
    """Writes chunk files on a thread pool, keeping at most `limit` bytes in flight (always admits
    one). A write's data stays referenced only until its file is written."""

    def __init__(self, threads: int, limit: int, fsync: bool, direct: bool = False) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="resilax-chunk")
        self._limit = limit
        self._fsync = fsync
        self._direct = direct
        self._inflight = 0
        self._pending: list[tuple[concurrent.futures.Future[None], int, str, Callable[[], None] | None]] = []
        self.written: list[str] = []
        """The paths of every file submitted (each written once `drain` returned), each once."""
        self._seen: set[str] = set()

    def submit(self, path: str, data: np.ndarray, what: str, offset: int = 0, size: int | None = -1,
               checksum: bool = False, done: Callable[[], None] | None = None) -> None:
        """Write `data` (and with `checksum` its crc32c) at `offset` of `path`, then truncate it to
        `size` (write_chunk_file). `done()` is called once the write is over with `data` (written,
        failed or cancelled)."""
        nbytes = data.nbytes
        if path not in self._seen:
            self._seen.add(path)
            self.written.append(path)
        while self._pending and self._inflight + nbytes > self._limit:
            self._finish_oldest()
        future = self._pool.submit(_write_then, done, path, data, self._fsync, self._direct, offset, size,
                                   checksum)
        self._pending.append((future, nbytes, what, done))
        self._inflight += nbytes

    def _finish_oldest(self) -> None:
        future, nbytes, what, _ = self._pending.pop(0)
        self._inflight -= nbytes
        try:
            future.result()
        except OSError as e:
            raise StorageError(f"{what}: {type(e).__name__}: {e}") from e

    def drain(self) -> None:
        while self._pending:
            self._finish_oldest()

    def close(self) -> None:
        """Stop: cancel what has not started, wait for what has (no thread writes after this)."""
        for future, _, _, done in self._pending:
            if future.cancel() and done is not None:  # never runs: its data is given back here
                done()
        self._pending.clear()
        self._inflight = 0
        self._pool.shutdown(wait=True)


def write_snapshot(plan: Any, step_path: str, create_metadata: bool, fsync: bool, threads: int,
                   max_inflight_bytes: int, on_progress: Callable[[int], None] | None = None,
                   direct_io: bool = True) -> None:
    """Write this process's boxes of `plan` (items.SnapshotPlan) as chunk files, or into its shard
    files (ArrayFiles: each preallocated, then its chunks and index written), under the local folder
    `step_path` (and, when `create_metadata`, every array's zarr.json); returns once all are written
    (and durable when `fsync`: `make_durable`). `direct_io`: O_DIRECT where `use_direct_io` allows.
    `on_progress(i)` is called before the i-th write (test hook)."""
    limit = planning.scaled_inflight_limit(max_inflight_bytes, sum(w.nbytes for w in plan.writes))
    writer = ChunkWriter(threads, limit, fsync, use_direct_io(step_path, direct_io))
    shard_files: set[str] = set()
    try:
        if create_metadata:
            for item, leaf in plan.arrays:
                path = os.path.join(step_path, item, leaf.dir, ZARR_JSON)
                meta = np.frombuffer(zarr_json(leaf.shape, leaf.dtype, leaf.chunks, leaf.shard,
                                               leaf.checksum == checksums.CRC32C, leaf.transpose), np.uint8)
                writer.submit(path, meta, f"writing {path}")
        for n, write in enumerate(plan.writes):
            if on_progress is not None:
                on_progress(n)
            source, write.source = write.source, None
            data = resolve_source(source)  # waits for a device shard to land
            # gives the shard's bytes back to the drain's budget once written (Landing.release)
            done = source.release if isinstance(source, Landing) else None
            del source
            if planning.box_size(write.box) == 0:
                if done is not None:
                    done()
                continue
            item, leaf = plan.arrays[write.array_index]
            index, data = chunk_data(write.box, data, leaf.shape, leaf.chunks, leaf.transpose)
            data = stored_view(data, leaf.transpose)  # in the order it landed: no bounce (metadata.py)
            files = ArrayFiles.of(leaf)
            file_key, offset = files.locate(index)
            path = os.path.join(step_path, item, leaf.dir, *file_key)
            what = f"writing {item}/{leaf.keystr} box {write.box} to {path}"
            if not files.shard:
                writer.submit(path, data, what, checksum=files.checksum, done=done)
            else:
                if path not in shard_files:  # this process writes the whole shard: its index too
                    shard_files.add(path)
                    try:
                        preallocate(path, files.file_size())
                    except OSError as e:
                        raise StorageError(f"creating {path}: {e}") from e
                    index_bytes = np.frombuffer(files.shard_index(file_key), np.uint8)
                    writer.submit(path, index_bytes, f"writing the shard index of {path}", files.index_offset,
                                  files.file_size())
                writer.submit(path, data, what, offset, None, files.checksum, done)
            del data, done
        writer.drain()
        if fsync and writer.written:
            try:
                make_durable(step_path, writer.written)
            except OSError as e:
                raise StorageError(f"making the chunk files under {step_path} durable: {e}") from e
    finally:
        writer.close()
