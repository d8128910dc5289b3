"""What a save's write reads its data from: a private copy taken at `save()` (items.snapshot_items),
resolved to NumPy on the writing thread by either chunk backend."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import jax


@dataclasses.dataclass(frozen=True)
class ShardOf:
    """The shard on `device` of a (private, possibly still being computed) global array copy."""

    array: jax.Array
    device: Any


def resolve_source(source: Any, cache: dict[int, dict[Any, Any]]) -> np.ndarray:
    """A write's data as NumPy (zero-copy for CPU arrays). Called on: the writing thread."""
    if isinstance(source, ShardOf):
        shards = cache.get(id(source.array))
        if shards is None:
            shards = {s.device: s.data for s in source.array.addressable_shards}
            cache[id(source.array)] = shards
        return np.asarray(shards[source.device])
    return np.asarray(source)
