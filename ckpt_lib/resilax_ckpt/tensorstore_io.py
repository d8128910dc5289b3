"""Array I/O through tensorstore: one zarr3 array per leaf, chunks = the shard grid, no compression.

The tensorstore chunk backend (backends.TensorstoreChunkBackend): writes here, reads through
`TensorstoreChunkReader` (driven by reader.read_leaves).
Writes and reads are issued as futures and awaited together, bounded by a byte limit so the host
memory of in-flight I/O stays below `ManagerOptions.max_inflight_bytes`. Arrays are opened with
`assume_metadata` (no metadata I/O per leaf): the shape, dtype and chunks come from our own
`_METADATA.json`; the primary writes each array's `zarr.json` so the data stays readable by any zarr3
reader. Reads refuse missing chunks (`fill_missing_data_reads: false`) instead of returning zeros.
A checksummed array has zarr3's `crc32c` codec (checksums.py): tensorstore writes the crc32c after
every chunk and shard index and verifies it on every read; `read_error` turns tensorstore's errors
about the data (missing, digest mismatch, truncated) into the typed errors naming the file.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorstore as ts

from resilax_ckpt import planning
from resilax_ckpt.chunks import checksums
from resilax_ckpt.chunks.chunk_format import ArrayFiles
from resilax_ckpt.chunks.inflight import InflightLimiter, short_error
from resilax_ckpt.chunks.sources import Landing, resolve_source
from resilax_ckpt.errors import ChecksumMismatchError, CorruptCheckpointError, MissingChunkError, StorageError

if TYPE_CHECKING:
    from resilax_ckpt.chunks.reader import ChunkTask


def build_context(io_concurrency: int, fsync: bool, gcs_retries: int | None = None) -> ts.Context:
    spec: dict[str, Any] = {
        "data_copy_concurrency": {"limit": io_concurrency},
        "file_io_concurrency": {"limit": io_concurrency},
        "gcs_request_concurrency": {"limit": io_concurrency},
        "file_io_sync": fsync,
        "cache_pool": {"total_bytes_limit": 0},
    }
    if gcs_retries is not None:
        spec["gcs_request_retries"] = {"max_retries": gcs_retries, "initial_delay": "50ms", "max_delay": "1s"}
    return ts.Context(spec)


def kvstore_url(kvstore: dict[str, Any]) -> str:
    if kvstore.get("driver") == "gcs":
        return f"gs://{kvstore['bucket']}/{kvstore.get('path', '')}"
    return str(kvstore.get("path", kvstore))




def dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def build_array_spec(kvstore: dict[str, Any], shape: Sequence[int], dtype: str,
                     chunks: Sequence[int], shard: Sequence[int] = (), checksum: str = "",
                     transpose: Sequence[int] = ()) -> dict[str, Any]:
    """The zarr3 spec of a leaf's array; with `shard`, an array of shards of that shape holding
    `chunks`-shaped chunks (chunk_format.ArrayFiles); `checksum` ("crc32c" or "") and `transpose`
    (zarr3's `transpose` codec, LeafMetadata.transpose) as the leaf's."""
    crc: list[dict[str, Any]] = [{"name": checksums.CRC32C}] if checksum == checksums.CRC32C else []
    order: list[dict[str, Any]] = (
        [{"name": "transpose", "configuration": {"order": list(transpose)}}] if transpose else [])
    codecs: list[dict[str, Any]] = [*order, {"name": "bytes", "configuration": {"endian": "little"}}, *crc]
    grid = list(chunks)
    if shard:
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(chunks), "codecs": codecs, "index_location": "end",
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, *crc]}}]
        grid = list(shard)
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "fill_missing_data_reads": False,
        # Store every chunk, also one equal to the fill value (an all-zero shard): reads refuse
        # missing chunks, and a skipped chunk would leave a recycled folder's old file in place.
        "store_data_equal_to_fill_value": True,
        "metadata": {
            "shape": list(shape),
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
            "chunk_key_encoding": {"name": "default"},
            "codecs": codecs,
            "fill_value": False if dtype == "bool" else [0.0, 0.0] if dtype.startswith("complex") else 0,
        },
    }



def read_error(error: Exception, file: str) -> Exception:
    """The error to raise for tensorstore's `error` reading a chunk of the file `file`: a missing
    chunk (NOT_FOUND) is a MissingChunkError, a digest mismatch a ChecksumMismatchError, other bad
    data (DATA_LOSS; FAILED_PRECONDITION while decoding, e.g. a truncated chunk) a
    CorruptCheckpointError, each naming the file; anything else (a transient storage error) a
    StorageError."""
    message = short_error(error)
    if message.startswith("NOT_FOUND"):
        return MissingChunkError(f"chunk file {file} is missing ({message})")
    if "Digest mismatch" in message:
        return ChecksumMismatchError(f"chunk file {file}: crc32c mismatch ({message})")
    if message.startswith("DATA_LOSS") or (message.startswith("FAILED_PRECONDITION") and "Error reading" in message):
        return CorruptCheckpointError(f"chunk file {file} is damaged or truncated ({message})")
    return StorageError(f"chunk file {file}: {message}")


def open_arrays(specs: Sequence[dict[str, Any]], context: ts.Context, create: bool) -> list[ts.TensorStore]:
    """Open arrays; `create=True` writes their zarr.json (primary only), else assume metadata."""
    if create:
        futures = [ts.open(spec, create=True, open=True, context=context) for spec in specs]
    else:
        futures = [ts.open(spec, open=True, assume_metadata=True, context=context) for spec in specs]
    out = []
    for spec, future in zip(specs, futures, strict=True):
        try:
            out.append(future.result())
        except Exception as e:
            raise StorageError(f"opening array {kvstore_url(spec['kvstore'])}: {short_error(e)}") from e
    return out


def write_snapshot(plan: Any, step_path: str, storage: Any, context: ts.Context, create_metadata: bool,
                   max_inflight_bytes: int, on_progress: Any = None) -> None:
    """Write this process's boxes (and, when `create_metadata`, every array's zarr.json) under
    `step_path`. Issues the writes as futures, at most `max_inflight_bytes` at once, and returns
    once all are durable. `on_progress(i)` is called before the i-th write (test hook)."""
    specs = [
        build_array_spec(storage.kvstore_spec(storage.join(step_path, item, leaf.dir)), leaf.shape,
                         leaf.dtype, leaf.chunks, leaf.shard, leaf.checksum, leaf.transpose)
        for item, leaf in plan.arrays
    ]
    needed = sorted({w.array_index for w in plan.writes})
    if create_metadata:
        stores = open_arrays(specs, context, create=True)
    else:
        opened = open_arrays([specs[i] for i in needed], context, create=False)
        stores = [None] * len(specs)  # type: ignore[list-item]
        for i, store in zip(needed, opened, strict=True):
            stores[i] = store
    limiter = InflightLimiter(planning.scaled_inflight_limit(max_inflight_bytes, sum(w.nbytes for w in plan.writes)))
    try:
        for n, write in enumerate(plan.writes):
            if on_progress is not None:
                on_progress(n)
            limiter.admit(write.nbytes)
            data = resolve_source(write.source)
            if isinstance(write.source, Landing):  # the limiter bounds what this holds from here on
                write.source.release()
            store = stores[write.array_index]
            item, leaf = plan.arrays[write.array_index]
            future = store[tuple(slice(a, b) for a, b in write.box)].write(
                data, can_reference_source_data_indefinitely=True)
            limiter.add(future, write.nbytes, f"writing {item}/{leaf.keystr} box {write.box} to {step_path}",
                        keep=data)
            write.source = None  # the limiter holds the data until it is written
        limiter.drain()
    finally:
        limiter.cancel()


class TensorstoreChunkReader:
    """Fills boxes through tensorstore (gs://, or local when asked): each chunk read once, its
    checksum verified by tensorstore (the `crc32c` codec)."""

    def __init__(self, stores: list[Any], leaf_paths: list[str], files: list[ArrayFiles],
                 storage: Any) -> None:
        self._stores = stores
        self._leaf_paths = leaf_paths
        self._files = files
        self._storage = storage

    @staticmethod
    def jobs(index: int, tasks: list[ChunkTask]) -> list[list[ChunkTask]]:
        """Each chunk is a read of its own (tensorstore batches them itself)."""
        return [[task] for task in tasks]

    @staticmethod
    def buffered_bytes(job: list[ChunkTask]) -> int:
        """Bytes of tensorstore's own buffers while reading `job`'s chunk: its region's (counted always)."""
        (task,) = job
        return planning.box_size(task.region) * np.dtype(task.read.leaf.dtype).itemsize

    def run(self, index: int, job: list[ChunkTask]) -> None:
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
            raise read_error(e, self._storage.join(self._leaf_paths[index], *key)) from e
        task.scatter(data)

    def close(self) -> None:
        """Nothing to release (tensorstore's buffers are its own)."""
