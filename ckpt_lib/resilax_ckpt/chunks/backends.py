"""The chunk backends: how a step's array chunks are written and read, behind one interface.

Two implementations of `ChunkBackend`:
- `FileChunkBackend` (local folders): our own chunk and shard files (chunk_writer.py writes them:
  O_DIRECT through staging buffers, files rewritten in place in recycled folders, one durability
  flush per save; file_reader.py reads them: straight into the restored arrays' buffers, runs of a
  shard file's chunks, O_DIRECT through staging buffers). A step whose arrays include a dtype whose
  chunks are not their raw bytes (chunk_format.supports: complex, sub-byte ints) is written by
  tensorstore instead (its arrays then have one file per chunk: items.snapshot_items).
- `TensorstoreChunkBackend` (gs://, and any storage when asked): tensorstore's zarr3 driver
  (tensorstore_io.py).
Both write the same format (chunk_format.py: zarr3 arrays, crc32c after every chunk) and verify every
chunk they read. The manager, items and commit use only this interface and `for_storage`, which
picks the implementation; they never know which one runs.
"""

from __future__ import annotations

import ctypes
import functools
import gc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from resilax_ckpt import tensorstore_io as tsio
from resilax_ckpt.chunks import chunk_format, chunk_writer, file_reader
from resilax_ckpt.chunks.reader import ChunkBackendReads, ChunkReader, LeafRead

if TYPE_CHECKING:
    from resilax_ckpt.items import SnapshotPlan
    from resilax_ckpt.options import ManagerOptions
    from resilax_ckpt.storage import Storage


class ChunkBackend(ChunkBackendReads, Protocol):
    """Writes a process's chunks of a save and reads the chunks of a restore, on one storage. Its read
    half, `open_reader`, is declared once, in reader.py (`ChunkBackendReads`: the chunk modules may
    import that one, not this module).

    Call order: 1. `write` (every writing process, in a save's background thread); 2. `open_reader`
    (every process, in a restore), which reader.read_leaves drives."""

    def write(self, plan: SnapshotPlan, step_path: str, create_metadata: bool,
              on_progress: Callable[[int], None] | None = None) -> None:
        """Write this process's boxes of `plan` under `step_path` (and, when `create_metadata`, every
        array's zarr.json); return once they are written (durable when the options ask for fsync).
        `on_progress(i)` is called before the i-th write (test hook). Called on: every writing process."""
        ...


class TensorstoreChunkBackend:
    """Chunks through tensorstore's zarr3 driver (gs://; local folders when asked)."""

    def __init__(self, storage: Storage, context: Any, max_inflight_bytes: int) -> None:
        self._storage = storage
        self._context = context
        self._max_inflight_bytes = max_inflight_bytes

    def write(self, plan: SnapshotPlan, step_path: str, create_metadata: bool,
              on_progress: Callable[[int], None] | None = None) -> None:
        tsio.write_snapshot(plan, step_path, self._storage, self._context, create_metadata,
                            self._max_inflight_bytes, on_progress)

    def open_reader(self, reads: list[LeafRead], step_path: str, memory_limit: int) -> ChunkReader:
        paths = [self._storage.join(step_path, r.item, str(r.leaf.dir)) for r in reads]
        specs = [tsio.build_array_spec(self._storage.kvstore_spec(path), r.leaf.shape, r.leaf.dtype, r.leaf.chunks,
                                       r.leaf.shard, r.leaf.checksum, r.leaf.transpose)
                 for path, r in zip(paths, reads, strict=True)]
        return tsio.TensorstoreChunkReader(tsio.open_arrays(specs, self._context, create=False), paths,
                                           [chunk_format.ArrayFiles.of(r.leaf) for r in reads], self._storage)


class FileChunkBackend:
    """Chunk and shard files of a local folder, written and read by our own code."""

    def __init__(self, storage: Storage, context: Any, max_inflight_bytes: int, *, write_threads: int = 8,
                 fsync: bool = True, direct_io: bool = True) -> None:
        self._storage = storage
        self._max_inflight_bytes = max_inflight_bytes
        self._write_threads = write_threads
        self._fsync = fsync
        self._direct_io = direct_io
        self._tensorstore = TensorstoreChunkBackend(storage, context, max_inflight_bytes)
        """Writes the steps with a dtype our files do not hold (chunk_format.supports)."""

    def write(self, plan: SnapshotPlan, step_path: str, create_metadata: bool,
              on_progress: Callable[[int], None] | None = None) -> None:
        if not all(chunk_format.supports(leaf.dtype) for _, leaf in plan.arrays):
            self._tensorstore.write(plan, step_path, create_metadata, on_progress)
            return
        chunk_writer.write_snapshot(plan, step_path, create_metadata, self._fsync, self._write_threads,
                                    self._max_inflight_bytes, on_progress, self._direct_io)

    def open_reader(self, reads: list[LeafRead], step_path: str, memory_limit: int) -> ChunkReader:
        return file_reader.FileReads(self._storage, self._direct_io).open_reader(reads, step_path, memory_limit)


def for_storage(storage: Storage, options: ManagerOptions, *, use_tensorstore: bool = False) -> ChunkBackend:
    """The chunk backend of `storage` with the I/O settings of `options`: our own files on local
    folders, tensorstore elsewhere (or when `use_tensorstore`)."""
    context = tsio.build_context(options.io_concurrency, options.fsync, options.gcs_retries)
    if storage.is_local and not use_tensorstore:
        return FileChunkBackend(storage, context, options.max_inflight_bytes, write_threads=options.write_threads,
                                fsync=options.fsync, direct_io=options.direct_io)
    return TensorstoreChunkBackend(storage, context, options.max_inflight_bytes)


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_memory() -> None:
    """Give the memory of a written snapshot back to the OS (glibc keeps freed small blocks in its
    arenas: without this the next save's copy starts on top of the last one's high-water mark). A
    young-generation collection first: jaxlib releases the host copies behind `np.asarray` of device
    arrays only in its garbage-collection callback (saving/drain.RECLAIM_BYTES)."""
    gc.collect(0)
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
