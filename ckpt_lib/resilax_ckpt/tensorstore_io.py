"""Array I/O through tensorstore: one zarr3 array per leaf, chunks = the shard grid, no compression.

The restore side's reading lives in reader.py (it uses the specs, context and limiter from here).
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

import collections
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from resilax_ckpt import checksums
from resilax_ckpt.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    MissingChunkError,
    ResilaxCkptError,
    StorageError,
)


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


def short_error(error: Exception) -> str:
    """tensorstore's message without the JSON spec it appends."""
    return str(error).split(" [tensorstore_spec=", 1)[0]


def dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def build_array_spec(kvstore: dict[str, Any], shape: Sequence[int], dtype: str,
                     chunks: Sequence[int], shard: Sequence[int] = (), checksum: str = "") -> dict[str, Any]:
    """The zarr3 spec of a leaf's array; with `shard`, an array of shards of that shape holding
    `chunks`-shaped chunks (chunk_writer.ArrayFiles); `checksum` ("crc32c" or "") as the leaf's."""
    crc: list[dict[str, Any]] = [{"name": checksums.CRC32C}] if checksum == checksums.CRC32C else []
    codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}, *crc]
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
            "fill_value": 0 if dtype != "bool" else False,
        },
    }


class InflightLimiter:
    """Keeps at most `limit` bytes of I/O in flight (always admits one operation). Each operation
    may carry a callback run on its result and objects kept alive until it finished."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._inflight = 0
        self._pending: collections.deque[tuple[Any, int, str, Any, Any]] = collections.deque()

    def admit(self, nbytes: int) -> None:
        while self._pending and self._inflight + nbytes > self._limit:
            self._finish_oldest()

    def add(self, future: Any, nbytes: int, what: str, on_done: Any = None, keep: Any = None) -> None:
        self._pending.append((future, nbytes, what, on_done, keep))
        self._inflight += nbytes

    def _finish_oldest(self) -> None:
        future, nbytes, what, on_done, _ = self._pending.popleft()
        self._inflight -= nbytes
        try:
            result = future.result()
        except ResilaxCkptError as e:  # e.g. the step's data is bad, not the storage: keep the kind
            self.cancel()
            raise type(e)(f"{what}: {e}") from e
        except Exception as e:
            self.cancel()
            raise StorageError(f"{what}: {short_error(e)}") from e
        if on_done is not None:
            on_done(result)

    def drain(self) -> None:
        while self._pending:
            self._finish_oldest()

    def cancel(self) -> None:
        for entry in self._pending:
            entry[0].cancel()
        self._pending.clear()
        self._inflight = 0


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
                         leaf.dtype, leaf.chunks, leaf.shard, leaf.checksum)
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
    from resilax_ckpt.items import resolve_source

    limiter = InflightLimiter(scaled_inflight_limit(max_inflight_bytes, sum(w.nbytes for w in plan.writes)))
    shard_cache: dict[int, dict[Any, Any]] = {}
    try:
        for n, write in enumerate(plan.writes):
            if on_progress is not None:
                on_progress(n)
            limiter.admit(write.nbytes)
            data = resolve_source(write.source, shard_cache)
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
        shard_cache.clear()


def scaled_inflight_limit(limit: int, total_bytes: int) -> int:
    """The in-flight bound for an operation on `total_bytes`: `limit`, but at most an eighth of the
    total (at least 8 MiB): tensorstore's own buffers roughly double it, and the peak memory of a
    restore (1x the state) or a save (2x: the state and its snapshot) must stay near those."""
    return max(8 << 20, min(limit, total_bytes // 16))
