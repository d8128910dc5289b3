"""The versioned JSON metadata of a step (`_METADATA.json`). Never pickle.

A leaf's tree position is stored as a list of `[kind, key]` pairs (`"d"` dict key, `"s"` sequence
index, `"a"` attribute, `"f"` flattened index) plus its `jax.tree_util.keystr`, which is what a
restore target is matched against.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from resilax_ckpt.errors import MetadataError

FORMAT_NAME = "resilax-ckpt"
FORMAT_VERSION = 4
"""Written by this library. Version 2 added a leaf's `shard` (one file per leaf and process), version 3
a leaf's `checksum` (a crc32c after every chunk and shard index: checksums.py), version 4 a leaf's
`transpose` (chunks stored in the order a device's layout lands them on the host). A step none of whose
leaves is transposed is written as version 3 (`StepMetadata.version`), so that it stays readable by
the libraries that read version 3."""
READABLE_VERSIONS = (1, 2, 3, 4)

CHECKSUMS = ("", "crc32c")
"""A leaf's `checksum` values this library reads ("" = none)."""

LeafKind = Literal["array", "scalar"]
ItemKind = Literal["pytree", "json", "per_process"]


@dataclasses.dataclass(frozen=True)
class LeafMetadata:
    """One leaf of a pytree item."""

    keystr: str
    path: list[list[Any]]
    kind: LeafKind
    dir: str | None = None
    """Folder of the zarr3 array under the item's folder (arrays only)."""
    shape: tuple[int, ...] = ()
    dtype: str = ""
    chunks: tuple[int, ...] = ()
    """The zarr3 chunk shape: the shard shape of the saved sharding (of a JAX sharding, not zarr's)."""
    shard: tuple[int, ...] = ()
    """When set, the array's files are zarr3 shards of this shape (the `sharding_indexed` codec), each
    holding the `chunks` one process wrote (chunk_format.ArrayFiles); else one file per chunk."""
    checksum: str = ""
    """"crc32c" when every chunk (and shard index) of the array carries one (zarr3's `crc32c` codec,
    checksums.py); "" for arrays saved without (before format version 3)."""
    transpose: tuple[int, ...] = ()
    """When set, a permutation of the dimensions: every chunk is stored as the C-order bytes of the
    chunk transposed by it (zarr3's `transpose` codec before `bytes`), i.e. in the order its host
    copy lands from a device whose layout is not row major (a column-major 2-D leaf: `(1, 0)`, its
    Fortran-order bytes), so the writer writes it without a copy (chunk_format.plan_transpose)."""
    prng_impl: str = ""
    """When set, the array is the key data of a typed PRNG key array of this implementation
    (`jax.random.key_impl`): restore wraps it back (resilax_ckpt.pytrees)."""
    value: Any = None
    """A scalar leaf's value (JSON)."""
    pytype: str = ""
    """A scalar leaf's Python type: int, float, bool, str, or a NumPy dtype name (np.generic)."""

    def to_json(self) -> dict[str, Any]:
        if self.kind == "scalar":
            return {"keystr": self.keystr, "path": self.path, "kind": "scalar",
                    "value": self.value, "pytype": self.pytype}
        out = {"keystr": self.keystr, "path": self.path, "kind": "array", "dir": self.dir,
               "shape": list(self.shape), "dtype": self.dtype, "chunks": list(self.chunks)}
        if self.shard:
            out["shard"] = list(self.shard)
        if self.checksum:
            out["checksum"] = self.checksum
        if self.transpose:
            out["transpose"] = list(self.transpose)
        if self.prng_impl:
            out["prng_impl"] = self.prng_impl
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LeafMetadata:
        if raw["kind"] == "scalar":
            return cls(keystr=raw["keystr"], path=raw["path"], kind="scalar", value=raw["value"],
                       pytype=raw["pytype"])
        if raw["kind"] != "array":
            raise KeyError(f"unknown leaf kind {raw['kind']!r}")
        if raw.get("checksum", "") not in CHECKSUMS:
            raise KeyError(f"unknown checksum {raw['checksum']!r} (known: {', '.join(map(repr, CHECKSUMS))})")
        shape = tuple(raw["shape"])
        transpose = tuple(int(d) for d in raw.get("transpose", ()))
        if transpose and sorted(transpose) != list(range(len(shape))):
            raise ValueError(f"leaf {raw['keystr']!r}: transpose {list(transpose)} is not a permutation of the "
                             f"{len(shape)} dimensions of shape {list(shape)}")
        return cls(keystr=raw["keystr"], path=raw["path"], kind="array", dir=raw["dir"],
                   shape=shape, dtype=raw["dtype"], chunks=tuple(raw["chunks"]),
                   shard=tuple(raw.get("shard", ())), checksum=str(raw.get("checksum", "")),
                   transpose=transpose, prng_impl=str(raw.get("prng_impl", "")))


@dataclasses.dataclass(frozen=True)
class ItemMetadata:
    kind: ItemKind
    leaves: tuple[LeafMetadata, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "pytree":
            out["leaves"] = [leaf.to_json() for leaf in self.leaves]
        return out

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> ItemMetadata:
        kind = raw["kind"]
        if kind not in ("pytree", "json", "per_process"):
            raise KeyError(f"unknown item kind {kind!r}")
        leaves = tuple(LeafMetadata.from_json(leaf) for leaf in raw.get("leaves", []))
        return cls(kind=kind, leaves=leaves)


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    step: int
    generation: int
    process_count: int
    items: dict[str, ItemMetadata]
    time: float = 0.0
    local_tier: bool = False
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """The user's metrics of this step (`save(..., metrics=)`; best-N retention ranks by them).
    Written only when given, so a step saved without them has the same bytes as before."""

    @property
    def version(self) -> int:
        """The format version these metadata are written as: FORMAT_VERSION when a leaf is
        transposed, else 3 (what every reader of version 3 reads)."""
        transposed = any(leaf.transpose for item in self.items.values() for leaf in item.leaves)
        return FORMAT_VERSION if transposed else 3

    def to_bytes(self) -> bytes:
        raw = {
            "format": FORMAT_NAME,
            "version": self.version,
            "step": self.step,
            "generation": self.generation,
            "process_count": self.process_count,
            "time": self.time,
            "local_tier": self.local_tier,
            "items": {name: item.to_json() for name, item in self.items.items()},
        }
        if self.metrics:
            raw["metrics"] = dict(self.metrics)
        return json.dumps(raw, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> StepMetadata:
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise MetadataError(f"{where}: not valid JSON ({e})") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise MetadataError(f"{where}: not a {FORMAT_NAME} metadata file")
        version = raw.get("version")
        if version not in READABLE_VERSIONS:
            raise MetadataError(
                f"{where}: format version {version!r} is not supported; this library reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        try:
            return cls(
                step=int(raw["step"]),
                generation=int(raw["generation"]),
                process_count=int(raw["process_count"]),
                time=float(raw.get("time", 0.0)),
                local_tier=bool(raw.get("local_tier", False)),
                items={name: ItemMetadata.from_json(item) for name, item in raw["items"].items()},
                metrics={str(k): float(v) for k, v in (raw.get("metrics") or {}).items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise MetadataError(f"{where}: malformed metadata ({type(e).__name__}: {e})") from e
