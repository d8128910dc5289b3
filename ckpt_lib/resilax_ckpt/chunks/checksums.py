"""Chunk checksums: the crc32c of zarr3's `crc32c` codec (4 bytes, little endian, after the bytes they cover).

A checksummed array (`LeafMetadata.checksum == "crc32c"`) has the codec after `bytes` in its
`zarr.json`: every chunk file ends with the crc32c of the chunk's bytes, and with shard files every
inner chunk does, and the shard index too (`index_codecs`). tensorstore verifies them itself; our own
reader verifies them where the bytes already are in memory (file_reader.py). Arrays saved before checksums
(format version 2 and earlier) have none, and restore reads them unverified.

The crc32c comes from the `crc32c` package (SSE4.2 / ARMv8 instructions; it releases the GIL for
large buffers, so the writer and reader threads compute in parallel and without copies).

`RESILAX_CKPT_CHECKSUMS=none` saves without checksums: for measuring their cost (docs/benchmarks.md)
only; anything else (default) saves with them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import crc32c as _crc32c

from resilax_ckpt.errors import ChecksumMismatchError

CRC32C = "crc32c"
"""The value of `LeafMetadata.checksum` (and the zarr3 codec's name)."""
CRC_BYTES = 4
ENV = "RESILAX_CKPT_CHECKSUMS"


def kind_for_saves() -> str:
    """The checksum new saves write: "crc32c", or "" when `RESILAX_CKPT_CHECKSUMS=none` (benchmarks)."""
    return "" if os.environ.get(ENV, "").strip().lower() == "none" else CRC32C


def crc32c(data: Any, value: int = 0) -> int:
    """The crc32c of a bytes-like object or a contiguous NumPy array's bytes, extending `value`."""
    return int(_crc32c.crc32c(data, value=value))


def crc32c_of(parts: Iterable[Any]) -> int:
    """The crc32c of the concatenation of `parts`."""
    value = 0
    for part in parts:
        value = crc32c(part, value)
    return value


def encode(value: int) -> bytes:
    return value.to_bytes(CRC_BYTES, "little")


def verify(value: int, stored: Any, what: str) -> None:
    """Raise ChecksumMismatchError naming `what` unless `stored` (4 bytes) is the crc32c `value`."""
    want = int.from_bytes(bytes(stored), "little")
    if want != value:
        raise ChecksumMismatchError(f"{what}: crc32c mismatch (stored 0x{want:08x}, computed 0x{value:08x}): "
                                    "the file was changed or damaged after it was written")
