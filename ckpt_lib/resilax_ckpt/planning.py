"""Pure planning: which boxes of each array a process writes and reads.

A box is a tuple of `(start, stop)` pairs, one per dimension. Nothing here touches JAX devices or
storage, so resharding plans are tested as plain tables.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

Box = tuple[tuple[int, int], ...]
Index = tuple[slice, ...]


def box_of_index(index: Index, shape: Sequence[int]) -> Box:
    """The box an index (a tuple of slices, as JAX's `devices_indices_map` gives) selects."""
    box = []
    for dim, size in enumerate(shape):
        s = index[dim] if dim < len(index) else slice(None)
        start, stop, step = s.indices(size)
        if step != 1:
            raise ValueError(f"strided shard index {index} is not supported")
        box.append((start, stop))
    return tuple(box)


def box_to_index(box: Box) -> Index:
    return tuple(slice(a, b) for a, b in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_size(box: Box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def plan_chunk_shape(shape: Sequence[int], boxes: Iterable[Box]) -> tuple[int, ...]:
    """The zarr chunk shape for an array sharded into `boxes`: the largest shard extent per
    dimension (at least 1). Shards of a JAX sharding start at multiples of it, so each process
    writes whole, disjoint chunks."""
    chunk = [1] * len(shape)
    for box in boxes:
        for dim, (a, b) in enumerate(box):
            chunk[dim] = max(chunk[dim], b - a)
    return tuple(chunk)


def plan_shard_shape(chunks: Sequence[int], boxes_per_process: Iterable[Iterable[Box]]) -> tuple[int, ...]:
    """The zarr3 shard shape (in elements) that gives every process one file per array, from the
    boxes each process holds (one iterable per process): each process's boxes must cover one block
    of whole chunks, all blocks of the same chunk counts, starting at multiples of them, and no box
    may be held by two processes (then one process writes each shard, whole). `()` when they do
    not, or when a shard would hold a single chunk (one file per chunk is then the same thing)."""
    counts: tuple[int, ...] | None = None
    seen: set[tuple[int, ...]] = set()
    for boxes in boxes_per_process:
        cells = {c for box in boxes for c in chunks_of_box(box, chunks)}
        if not cells:
            continue
        if cells & seen:
            return ()
        seen |= cells
        low = [min(c[d] for c in cells) for d in range(len(chunks))]
        high = [max(c[d] for c in cells) + 1 for d in range(len(chunks))]
        block = tuple(h - lo for lo, h in zip(low, high, strict=True))
        if len(cells) != box_size(tuple((0, n) for n in block)) or (counts is not None and block != counts):
            return ()
        if any(lo % n for lo, n in zip(low, block, strict=True)):
            return ()
        counts = block
    if counts is None or box_size(tuple((0, n) for n in counts)) <= 1:
        return ()
    return tuple(n * c for n, c in zip(counts, chunks, strict=True))


def plan_write_boxes(shards: Iterable[tuple[Index, int]], shape: Sequence[int],
                     all_replicas: bool = False) -> list[tuple[int, Box]]:
    """The distinct boxes a process writes, from its addressable shards' `(index, replica_id)`, each
    with the position of the shard that writes it.

    Only replica 0 of each shard is written to a shared folder (so each byte is written once
    overall); `all_replicas=True` (the per-host local tier) writes every box the process holds.
    """
    seen: dict[Box, int] = {}
    for position, (index, replica_id) in enumerate(shards):
        if all_replicas or replica_id == 0:
            seen.setdefault(box_of_index(index, shape), position)
    return [(position, box) for box, position in seen.items()]


def plan_read_boxes(device_indices: Iterable[tuple[Hashable, Index]],
                    shape: Sequence[int]) -> dict[Box, list[Hashable]]:
    """The distinct boxes a process reads for its target shards, each with the devices needing it."""
    plan: dict[Box, list[Hashable]] = {}
    for device, index in device_indices:
        plan.setdefault(box_of_index(index, shape), []).append(device)
    return plan


def chunks_of_box(box: Box, chunks: Sequence[int]) -> list[tuple[int, ...]]:
    """The grid positions of the chunks a box overlaps."""
    ranges = []
    for (a, b), c in zip(box, chunks, strict=True):
        if b <= a:
            return []
        ranges.append(range(a // c, (b - 1) // c + 1))
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [(*prefix, i) for prefix in out for i in r]
    return out


def offset_index(box: Box, region: Box) -> Index:
    """The slices of `box` inside an array holding `region`."""
    return tuple(slice(a - r0, b - r0) for (a, b), (r0, _) in zip(box, region, strict=True))


def scaled_inflight_limit(limit: int, total_bytes: int) -> int:
    """The in-flight bound for an operation on `total_bytes`: `limit`, but at most an eighth of the
    total (at least 8 MiB): tensorstore's own buffers roughly double it, and the peak memory of a
    restore (1x the state) or a save (2x: the state and its snapshot) must stay near those."""
    return max(8 << 20, min(limit, total_bytes // 16))
