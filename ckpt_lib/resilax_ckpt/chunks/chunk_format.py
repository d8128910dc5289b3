"""The on-disk format of an array's chunks: zarr3 arrays, chunk keys, shard files and their
index, checksums: where every chunk of a leaf is and how many bytes it takes, from its metadata
alone. Pure (NumPy only): both chunk backends (backends.py), commit's expected files and the local
tier's coverage check use it.

Each array is a zarr3 array with chunks = the shard grid, the `bytes` codec (little-endian) and no
compression, so a chunk is its C-order little-endian bytes (an edge chunk is padded to the full chunk
shape with the fill value 0, as zarr requires), followed by their crc32c (zarr3's `crc32c` codec,
checksums.py). Chunk keys use the zarr3 default encoding: `c/<i>/<j>...`, and `c` itself for a 0-d
array. With shard files (`ArrayFiles`, zarr3's `sharding_indexed` codec) each process's chunks of an
array are ranges of one file instead. A leaf laid out column major on its device (LeafMetadata.transpose)
has zarr3's `transpose` codec before `bytes`: its chunks are stored in the order their host copies land.

`zarr_json` produces byte for byte the `zarr.json` tensorstore writes for the same array, so any zarr3
reader (tensorstore without `assume_metadata`, zarr-python) reads what the file backend wrote.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from resilax_ckpt import planning
from resilax_ckpt.chunks import checksums
from resilax_ckpt.errors import StorageError

DIRECT_ALIGN = 4096
"""Bytes: O_DIRECT buffers, offsets and lengths are multiples of this (any disk's logical block);
shard files place their chunks at multiples of it."""
DIRECT_MIN_BYTES = 64 << 10
"""Smaller chunk files (and every zarr.json) are written and read buffered."""

ZARR_JSON = "zarr.json"
CHUNK_DIR = "c"

_ML_FLOATS = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
              "float8_e4m3b11fnuz", "float8_e3m4", "float8_e4m3", "float8_e8m0fnu")


def supports(dtype: str) -> bool:
    """Whether this module writes arrays of `dtype` (others go through tensorstore): numeric and bool
    types whose in-memory bytes are their zarr3 encoding (not sub-byte or complex types)."""
    if sys.byteorder != "little":
        return False
    if dtype in _ML_FLOATS:
        return True
    try:
        kind = np.dtype(dtype).kind
    except TypeError:
        return False
    return kind in "biuf" and dtype not in ("int4", "uint4", "int2", "uint2")


def _fill_value(dtype: str) -> Any:
    if dtype == "bool":
        return False
    if dtype in _ML_FLOATS or np.dtype(dtype).kind == "f":
        return 0.0
    return 0


def zarr_json(shape: Sequence[int], dtype: str, chunks: Sequence[int], shard: Sequence[int] = (),
              checksum: bool = False, transpose: Sequence[int] = ()) -> bytes:
    """The `zarr.json` of an array, exactly as tensorstore's zarr3 driver writes it; with `shard`,
    an array of shards of that shape holding `chunks`-shaped inner chunks (`sharding_indexed`, the
    index at the end of the file, zarr's default: see ArrayFiles); with `checksum`, the `crc32c`
    codec after every chunk's bytes and after the shard index (checksums.py); with `transpose`, the
    `transpose` codec of that order before the chunk's bytes (LeafMetadata.transpose). Cached: every
    save of a job writes the same ones."""
    return _zarr_json(tuple(shape), str(dtype), tuple(chunks), tuple(shard), bool(checksum), tuple(transpose))


def chunk_codecs(dtype: str, checksum: bool, transpose: Sequence[int] = ()) -> list[dict[str, Any]]:
    """The zarr3 codecs of a chunk (inside `sharding_indexed` with shard files), as tensorstore
    writes them in zarr.json: `transpose` when given, `bytes` (little endian), `crc32c` with
    `checksum`."""
    bytes_codec: dict[str, Any] = {"name": "bytes"}
    if dtype != "bool" and np.dtype(dtype).itemsize > 1:
        bytes_codec["configuration"] = {"endian": "little"}
    crc: list[dict[str, Any]] = [{"name": checksums.CRC32C}] if checksum else []
    order: list[dict[str, Any]] = (
        [{"configuration": {"order": list(transpose)}, "name": "transpose"}] if transpose else [])
    return [*order, bytes_codec, *crc]


@functools.lru_cache(maxsize=4096)
def _zarr_json(shape: tuple[int, ...], dtype: str, chunks: tuple[int, ...], shard: tuple[int, ...],
               checksum: bool, transpose: tuple[int, ...]) -> bytes:
    crc: list[dict[str, Any]] = [{"name": checksums.CRC32C}] if checksum else []
    codecs = chunk_codecs(dtype, checksum, transpose)
    grid = list(chunks)
    if shard:
        index_codecs = [{"configuration": {"endian": "little"}, "name": "bytes"}, *crc]
        codecs = [{"configuration": {"chunk_shape": list(chunks), "codecs": codecs, "index_codecs": index_codecs},
                   "name": "sharding_indexed"}]
        grid = list(shard)
    meta = {
        "chunk_grid": {"configuration": {"chunk_shape": grid}, "name": "regular"},
        "chunk_key_encoding": {"name": "default"},
        "codecs": codecs,
        "data_type": dtype,
        "fill_value": _fill_value(dtype),
        "node_type": "array",
        "shape": list(shape),
        "zarr_format": 3,
    }
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()


def chunk_key(index: Sequence[int]) -> tuple[str, ...]:
    """The path parts of a chunk under its array folder (zarr3 default encoding, '/' separator)."""
    return (CHUNK_DIR, *map(str, index))


def chunk_grid(shape: Sequence[int], chunks: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.ceil(s / c) for s, c in zip(shape, chunks, strict=True))


def all_chunk_keys(shape: Sequence[int], chunks: Sequence[int]) -> list[tuple[str, ...]]:
    """Every chunk key of an array (one for a 0-d array, none when a dimension is 0)."""
    grid = chunk_grid(shape, chunks)
    return [chunk_key(index) for index in np.ndindex(*grid)] if grid else [chunk_key(())]


_MISSING = 0xFFFFFFFFFFFFFFFF
"""A shard index entry (offset and size) of an inner chunk that is not stored."""


@dataclasses.dataclass(frozen=True)
class ArrayFiles:
    """Where an array's chunks are on disk, from its metadata alone (writer and reader agree).

    Unsharded: chunk `i` is the whole file `c/<i...>`. Sharded (`shard` set): the chunks of shard `s`
    (`shard // chunks` of them per dimension) are in the file `c/<s...>`, in C order, chunk `j` of
    the shard at byte `j * stride` (the chunk's stored size rounded up to DIRECT_ALIGN, so O_DIRECT
    writes and reads each chunk in place), followed by zarr's shard index: per chunk, its offset and
    stored size as little-endian uint64, both all-ones for a chunk outside the array. With `checksum`
    (zarr's `crc32c` codec) a chunk is stored as its bytes and their crc32c (4 bytes), and the index
    is followed by its own crc32c. A shard is written by one process (planning.plan_shard_shape), so
    the layout needs no coordination and a restore reads a run of a shard's chunks with one request.
    """

    shape: tuple[int, ...]
    itemsize: int
    chunks: tuple[int, ...]
    shard: tuple[int, ...] = ()
    checksum: bool = False

    @classmethod
    def of(cls, leaf: Any) -> ArrayFiles:
        """The files of a LeafMetadata."""
        itemsize = 1 if leaf.dtype == "bool" else np.dtype(leaf.dtype).itemsize
        return cls(tuple(leaf.shape), itemsize, tuple(leaf.chunks), tuple(leaf.shard),
                   leaf.checksum == checksums.CRC32C)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of a chunk's data (edge chunks padded to the full chunk shape)."""
        return math.prod(self.chunks) * self.itemsize

    @property
    def crc_bytes(self) -> int:
        """Bytes of the checksum after each chunk (and shard index): 4 with `checksum`, else 0."""
        return checksums.CRC_BYTES if self.checksum else 0

    @property
    def stored_chunk_bytes(self) -> int:
        """Bytes a chunk takes in its file: its data and its checksum."""
        return self.chunk_bytes + self.crc_bytes

    @property
    def stride(self) -> int:
        return -(-self.stored_chunk_bytes // DIRECT_ALIGN) * DIRECT_ALIGN

    @property
    def per_shard(self) -> tuple[int, ...]:
        return tuple(s // c for s, c in zip(self.shard, self.chunks, strict=True))

    def file_keys(self) -> list[tuple[str, ...]]:
        """Every file of the array's grid (chunk files, or shard files)."""
        return all_chunk_keys(self.shape, self.shard or self.chunks)

    @property
    def index_offset(self) -> int:
        """Where a shard file's index starts."""
        return math.prod(self.per_shard) * self.stride

    @property
    def index_bytes(self) -> int:
        """Bytes of a shard file's index (and its checksum)."""
        return 16 * math.prod(self.per_shard) + self.crc_bytes

    def file_size(self) -> int:
        if not self.shard:
            return self.stored_chunk_bytes
        return self.index_offset + self.index_bytes

    def locate(self, chunk: Sequence[int]) -> tuple[tuple[str, ...], int]:
        """The file (key parts) holding chunk `chunk` of the grid and the chunk's byte offset in it."""
        if not self.shard:
            return chunk_key(chunk), 0
        per = self.per_shard
        inner = 0
        for i, n in zip(chunk, per, strict=True):
            inner = inner * n + i % n
        return chunk_key([i // n for i, n in zip(chunk, per, strict=True)]), inner * self.stride

    def shard_index(self, key: Sequence[str]) -> bytes:
        """The zarr shard index of the shard file `key` (its last 16 bytes per chunk, then the
        index's crc32c with `checksum`)."""
        first = [int(k) * n for k, n in zip(key[1:], self.per_shard, strict=True)]
        grid = chunk_grid(self.shape, self.chunks)
        entries = np.full((math.prod(self.per_shard), 2), _MISSING, dtype="<u8")
        for j, inner in enumerate(np.ndindex(*self.per_shard)):
            if all(f + i < g for f, i, g in zip(first, inner, grid, strict=True)):
                entries[j] = (j * self.stride, self.stored_chunk_bytes)
        index = entries.tobytes()
        return index + checksums.encode(checksums.crc32c(index)) if self.checksum else index


def plan_transpose(ndim: int, major_to_minor: Sequence[int] | None) -> tuple[int, ...]:
    """A leaf's `transpose` (LeafMetadata.transpose): the order its shards land in on the host, as
    their device layout's `major_to_minor` says (a TPU lays a (52992, 1472) float32 leaf out column
    major, `(1, 0)`, and its host copy then has Fortran strides), when that is a permutation other
    than row major; else none (row major, unknown, or fewer than 2 dimensions). A pure function of
    the array's layout, which every process of a job sees the same (one program makes the array)."""
    if ndim < 2 or major_to_minor is None:
        return ()
    order = tuple(int(d) for d in major_to_minor)
    if sorted(order) != list(range(ndim)) or order == tuple(range(ndim)):
        return ()
    return order


def inverse_order(order: Sequence[int]) -> tuple[int, ...]:
    """The permutation that undoes `order` (`a.transpose(order).transpose(inverse_order(order))` is `a`)."""
    out = [0] * len(order)
    for i, d in enumerate(order):
        out[d] = i
    return tuple(out)


def stored_view(data: np.ndarray, transpose: Sequence[int]) -> np.ndarray:
    """`data` (a chunk, or a box of an array) in the order its bytes are stored: transposed by
    `transpose` when given (a view: C-contiguous when `data` is laid out in that order)."""
    return data.transpose(tuple(transpose)) if transpose else data


def empty_in_order(shape: Sequence[int], dtype: Any, transpose: Sequence[int], make: Any = np.empty) -> np.ndarray:
    """An array of `shape` laid out in the stored order `transpose` (`make` allocates the C-order
    buffer of the transposed shape: np.empty, np.zeros, an aligned allocator)."""
    if not transpose:
        out: np.ndarray = make(tuple(shape), dtype)
        return out
    buf = make(tuple(shape[d] for d in transpose), dtype)
    return np.asarray(buf).transpose(inverse_order(transpose))


def chunk_data(box: planning.Box, data: np.ndarray, shape: Sequence[int],
               chunks: Sequence[int], transpose: Sequence[int] = ()) -> tuple[tuple[int, ...], np.ndarray]:
    """The chunk index of a box that is exactly one chunk (clipped to the array) and the chunk's
    data, padded with zeros to the full chunk shape at the array's edge (laid out in the stored
    order `transpose`, so that `stored_view` of it is contiguous)."""
    index = []
    for dim, ((a, b), size, c) in enumerate(zip(box, shape, chunks, strict=True)):
        if a % c or b != min(a + c, size):
            raise StorageError(f"box {box} is not one chunk of the grid {tuple(chunks)} of an array of shape "
                               f"{tuple(shape)} (dimension {dim})")
        index.append(a // c)
    if tuple(data.shape) != tuple(chunks):
        padded = empty_in_order(chunks, data.dtype, transpose, np.zeros)
        padded[tuple(slice(0, n) for n in data.shape)] = data
        data = padded
    return tuple(index), data
