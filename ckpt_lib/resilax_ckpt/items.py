"""Named items: pytrees of arrays and scalars, JSON items and per-process items.

`snapshot_items` turns the items of a save into metadata plus a list of writes whose sources are
private copies (so the training loop may donate or overwrite its buffers as soon as save() returns).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.extend.backend import register_backend_cache

from resilax_ckpt import layout, planning, pytrees
from resilax_ckpt.chunks import checksums, chunk_format, staging
from resilax_ckpt.errors import ResilaxCkptError, TreeMismatchError
from resilax_ckpt.metadata import ItemMetadata, LeafMetadata, StepMetadata
from resilax_ckpt.saving import device_snapshot, host_layout
from resilax_ckpt.saving.copy_choice import CopyReport
from resilax_ckpt.saving.device_snapshot import Transfer

log = logging.getLogger(__name__)


class UnsupportedLeafError(ResilaxCkptError, TypeError):
    """A leaf of a saved item is neither an array nor a scalar."""


@dataclasses.dataclass(frozen=True)
class PerProcess:
    """An item whose value differs per process (e.g. a data iterator's state), saved by each
    process as JSON and restored by the process with the same index."""

    value: Any


_SCALARS = (bool, int, float, str)


def encode_path(path: tuple[Any, ...]) -> list[list[Any]]:
    out: list[list[Any]] = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            k = key.key
            out.append(["d", k if isinstance(k, (str, int)) else str(k)])
        elif isinstance(key, jax.tree_util.SequenceKey):
            out.append(["s", key.idx])
        elif isinstance(key, jax.tree_util.GetAttrKey):
            out.append(["a", key.name])
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            out.append(["f", key.key])
        else:
            out.append(["d", str(key)])
    return out


def rebuild_tree(paths: list[list[list[Any]]], values: list[Any]) -> Any:
    """A nested structure of dicts (dict keys, attributes) and lists (sequence indices) from paths."""
    if len(paths) == 1 and not paths[0]:
        return values[0]
    root: dict[Any, Any] = {}
    for path, value in zip(paths, values, strict=True):
        node = root
        for depth, (_, key) in enumerate(path):
            if depth == len(path) - 1:
                node[key] = value
            else:
                node = node.setdefault(key, {})
    return _lists_from_dicts(root)


def _lists_from_dicts(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {k: _lists_from_dicts(v) for k, v in node.items()}
    if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def is_json_item(value: Any) -> bool:
    """A dict whose leaves are all Python scalars/None (no arrays) is saved as one JSON file."""
    if not isinstance(value, dict):
        return False

    def plain(v: Any) -> bool:
        if v is None or isinstance(v, _SCALARS):
            return True
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(x) for k, x in v.items())
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        return False

    return plain(value)


@dataclasses.dataclass
class ArrayWrite:
    """One box of one leaf that this process writes."""

    array_index: int
    box: planning.Box
    source: Any
    """After snapshot_items, a private copy: a NumPy array, or a `Landing` its device shard lands in."""
    nbytes: int


@dataclasses.dataclass
class SnapshotPlan:
    metadata: StepMetadata
    arrays: list[tuple[str, LeafMetadata]]
    """(item, leaf) of every array leaf, in a fixed order shared by all processes."""
    writes: list[ArrayWrite]
    files: list[tuple[tuple[str, ...], bytes]]
    """Small files this process writes (relative path parts, content)."""
    transfer: Transfer | None = None
    """What takes the device shards to the host (None: no device arrays); start it once the writes
    are handed off (`Transfer.start`)."""

    @property
    def report(self) -> CopyReport:
        return self.transfer.report if self.transfer is not None else CopyReport()


def snapshot_items(items: Mapping[str, Any], *, step: int, generation: int, process_index: int,
                   process_count: int, local_tier: bool, time_now: float, shard_files: bool = False,
                   device_copy: str = "auto", arena: staging.HostArena | None = None) -> SnapshotPlan:
    """Flatten the items and set up private copies of what this process writes.

    Shared folder: each process writes replica 0 of its addressable shards; process 0 writes host
    (NumPy) arrays and JSON items; each process writes its per-process items. Local tier: each
    process writes everything it holds. `shard_files` (local shared folders, written by chunk_writer):
    arrays whose processes' shards form a regular grid are stored as one file per process
    (`LeafMetadata.shard`). NumPy leaves are copied here; device shards land on the host through
    `plan.transfer` (`device_copy`: "auto", "on_device" or "host_transfer", `choose_device_copy`;
    `arena`: the host memory a host transfer on CPU devices copies into, reused across saves).
    The caller must start `plan.transfer` before it waits for the writes.
    """
    plan, device_sources = _plan_snapshot(items, step=step, generation=generation,
                                          process_index=process_index, process_count=process_count,
                                          local_tier=local_tier, time_now=time_now,
                                          shard_files=shard_files and not local_tier)
    for write in plan.writes:
        if isinstance(write.source, np.ndarray):
            write.source = np.array(write.source, copy=True)
    plan.transfer = device_snapshot.snapshot_devices(plan.writes, device_sources, device_copy, arena)
    return plan


def copy_signature(items: Mapping[str, Any], *, process_index: int, process_count: int,
                   local_tier: bool) -> list[list[jax.ShapeDtypeStruct]]:
    """The abstract inputs of the on-device copies a save of `items` dispatches: what
    `compile_copies` needs, without holding the arrays. `items` may be abstract (a restore target:
    `jax.ShapeDtypeStruct` leaves with shardings, before the state exists): `_abstract_signature`."""
    abstract = [leaf for value in items.values() if not isinstance(value, PerProcess)
                for leaf in jax.tree_util.tree_leaves(value) if isinstance(leaf, jax.ShapeDtypeStruct)]
    if abstract:
        return _abstract_signature(items, one_writer=process_count == 1 or local_tier)
    _, device_sources = _plan_snapshot(items, step=0, generation=0, process_index=process_index,
                                       process_count=process_count, local_tier=local_tier, time_now=0.0)
    return [[jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding, weak_type=a.weak_type)
             for a in group] for group in device_snapshot.copy_groups(device_sources)]


def _abstract_signature(items: Mapping[str, Any], one_writer: bool) -> list[list[jax.ShapeDtypeStruct]]:
    """`copy_signature` of a target whose array leaves are `jax.ShapeDtypeStruct`s with shardings (or
    arrays): a save of arrays of those shapes, dtypes and shardings dispatches this, grouped by device
    set in the save's order, when this process writes a shard of every one (`one_writer`: one
    process, or the local tier); else, and for a leaf without a sharding or a PRNG key, none (the
    first save then takes the runtime copy, as without it)."""
    if not one_writer:
        return []
    groups: dict[frozenset[Any], list[jax.ShapeDtypeStruct]] = {}
    for value in items.values():
        if isinstance(value, PerProcess) or is_json_item(value):
            continue
        for leaf in jax.tree_util.tree_leaves(value):
            if isinstance(leaf, (np.ndarray, np.generic, *_SCALARS)):
                continue
            sharding = getattr(leaf, "sharding", None)
            if sharding is None or pytrees.is_prng_key(leaf.dtype):
                return []
            groups.setdefault(frozenset(sharding.device_set), []).append(
                jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding, weak_type=leaf.weak_type))
    return list(groups.values())


def _plan_snapshot(items: Mapping[str, Any], *, step: int, generation: int, process_index: int,
                   process_count: int, local_tier: bool, time_now: float,
                   shard_files: bool = False) -> tuple[SnapshotPlan, list[tuple[int, jax.Array, Any]]]:
    """The metadata and writes of a save, with the writes' sources not yet copied: NumPy leaves as
    they are, device shards listed apart as (index into writes, global array, shard)."""
    writes_host = local_tier or process_index == 0
    item_meta: dict[str, ItemMetadata] = {}
    arrays: list[tuple[str, LeafMetadata]] = []
    writes: list[ArrayWrite] = []
    files: list[tuple[tuple[str, ...], bytes]] = []
    device_sources: list[tuple[int, jax.Array, Any]] = []
    checksum = checksums.kind_for_saves()

    for name, value in items.items():
        layout.validate_item_name(name)
        if isinstance(value, PerProcess):
            item_meta[name] = ItemMetadata(kind="per_process")
            files.append(((name, layout.process_json_name(process_index)), _json_bytes(name, value.value)))
            continue
        if is_json_item(value):
            item_meta[name] = ItemMetadata(kind="json")
            if writes_host:
                files.append(((layout.item_json_name(name),), _json_bytes(name, value)))
            continue
        flat, _ = jax.tree_util.tree_flatten_with_path(value)
        keystrs = [jax.tree_util.keystr(path) for path, _ in flat]
        dirs = layout.leaf_dir_names(keystrs)
        leaves: list[LeafMetadata] = []
        for (path, leaf), keystr, leaf_dir in zip(flat, keystrs, dirs, strict=True):
            enc = encode_path(path)
            prng_impl = ""
            if isinstance(leaf, jax.Array) and pytrees.is_prng_key(leaf.dtype):
                leaf, prng_impl = pytrees.key_data(leaf)
            if isinstance(leaf, jax.Array):
                shape = tuple(leaf.shape)
                chunks = _chunk_shape(leaf.sharding, shape)
                shard_shape = _shard_shape(leaf.sharding, shape, chunks) if shard_files else ()
                meta = LeafMetadata(keystr=keystr, path=enc, kind="array", dir=leaf_dir, shape=shape,
                                    dtype=np.dtype(leaf.dtype).name, chunks=chunks, shard=shard_shape,
                                    checksum=checksum, transpose=host_layout.landing_order(leaf),
                                    prng_impl=prng_impl)
                array_index = len(arrays)
                arrays.append((name, meta))
                shards = leaf.addressable_shards
                for position, box in planning.plan_write_boxes(((sh.index, sh.replica_id) for sh in shards), shape,
                                                               all_replicas=local_tier):
                    shard = shards[position]
                    nbytes = planning.box_size(box) * leaf.dtype.itemsize
                    device_sources.append((len(writes), leaf, shard))
                    writes.append(ArrayWrite(array_index, box, None, nbytes))
            elif isinstance(leaf, np.ndarray):
                shape = tuple(leaf.shape)
                meta = LeafMetadata(keystr=keystr, path=enc, kind="array", dir=leaf_dir, shape=shape,
                                    dtype=leaf.dtype.name, chunks=tuple(max(1, d) for d in shape),
                                    checksum=checksum)
                array_index = len(arrays)
                arrays.append((name, meta))
                if writes_host:
                    box = tuple((0, d) for d in shape)
                    writes.append(ArrayWrite(array_index, box, leaf, leaf.nbytes))
            elif isinstance(leaf, np.generic):
                meta = LeafMetadata(keystr=keystr, path=enc, kind="scalar", value=leaf.item(),
                                    pytype=leaf.dtype.name)
            elif isinstance(leaf, _SCALARS):
                meta = LeafMetadata(keystr=keystr, path=enc, kind="scalar", value=leaf,
                                    pytype=type(leaf).__name__)
            else:
                raise UnsupportedLeafError(
                    f"item {name!r}, leaf {keystr or '<root>'}: {type(leaf).__name__} is not supported; "
                    "leaves must be jax.Array, numpy arrays or scalars"
                )
            leaves.append(meta)
        item_meta[name] = ItemMetadata(kind="pytree", leaves=tuple(leaves))

    if shard_files and not all(chunk_format.supports(leaf.dtype) for _, leaf in arrays):
        # Shard files hold raw chunks only (chunk_format.supports): one file per chunk instead.
        arrays = [(name, dataclasses.replace(leaf, shard=())) for name, leaf in arrays]
        item_meta = {name: dataclasses.replace(item, leaves=tuple(
            dataclasses.replace(leaf, shard=()) if leaf.kind == "array" else leaf for leaf in item.leaves))
            for name, item in item_meta.items()}
    metadata = StepMetadata(step=step, generation=generation, process_count=process_count,
                            items=item_meta, time=time_now, local_tier=local_tier)
    return SnapshotPlan(metadata=metadata, arrays=arrays, writes=writes, files=files), device_sources


@functools.lru_cache(maxsize=4096)
def _chunk_shape(sharding: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The chunk shape of an array saved with `sharding` (planning.plan_chunk_shape of its boxes on
    every device, so all processes agree)."""
    boxes = {planning.box_of_index(index, shape) for index in sharding.devices_indices_map(shape).values()}
    return planning.plan_chunk_shape(shape, boxes)


@functools.lru_cache(maxsize=4096)
def _shard_shape(sharding: Any, shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[int, ...]:
    """The shard shape of an array stored one file per process (planning.plan_shard_shape), from
    which process holds which box of the global sharding."""
    by_process: dict[int, set[planning.Box]] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        by_process.setdefault(device.process_index, set()).add(planning.box_of_index(index, shape))
    return planning.plan_shard_shape(chunks, by_process.values())


def _json_bytes(name: str, value: Any) -> bytes:
    try:
        return json.dumps(value, sort_keys=True).encode()
    except (TypeError, ValueError) as e:
        raise UnsupportedLeafError(f"item {name!r}: not JSON-serializable ({e})") from e


def match_target(step: int, item: str, meta: ItemMetadata, target: Any) -> tuple[list[LeafMetadata], Any]:
    """The saved leaves, in the order of the target's leaves, and the target's treedef. Reports every
    missing leaf at once."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    by_key = {leaf.keystr: leaf for leaf in meta.leaves}
    matched: list[LeafMetadata] = []
    missing = []
    for path, _ in flat:
        key = jax.tree_util.keystr(path)
        if key in by_key:
            matched.append(by_key[key])
        else:
            missing.append(key or "<root>")
    if missing:
        have = ", ".join(sorted(by_key)[:10]) + (" ..." if len(by_key) > 10 else "")
        raise TreeMismatchError(
            f"step {step}: item {item!r}: the target has leaves the checkpoint lacks: "
            f"{', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}; the checkpoint has: {have}"
        )
    return matched, treedef


# Its keys hold shardings, so devices: emptied with the backends (jax.extend.backend.clear_backends).
register_backend_cache(_chunk_shape, "resilax_ckpt chunk shapes")
