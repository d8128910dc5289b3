"""Reading one committed step folder: its metadata, the items a restore asks for (through a chunk
backend), and which of a step's chunk files a process's restore would read (`missing_chunk_file`).

No choice of step happens here: restorer.py picks the step and the tier, this module reads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

from resilax_ckpt import items as items_lib
from resilax_ckpt import layout, planning, pytrees
from resilax_ckpt.chunks import backends, chunk_format, host_ring, reader
from resilax_ckpt.errors import (
    CorruptCheckpointError,
    IncompleteStepError,
    MetadataError,
    ShapeMismatchError,
    TreeMismatchError,
)
from resilax_ckpt.metadata import StepMetadata
from resilax_ckpt.storage import Storage

#: What makes a committed step unreadable, as opposed to a transient storage error (which propagates):
#: a corrupt or truncated file, a missing one, metadata that cannot be read.
UNREADABLE_STEP_ERRORS = (CorruptCheckpointError, IncompleteStepError, MetadataError)


def read_metadata(storage: Storage, step_path: str, name: str = layout.METADATA_FILE) -> StepMetadata:
    where = storage.join(step_path, name)
    try:
        data = storage.read_bytes(where)
    except FileNotFoundError as e:
        raise MetadataError(f"{where}: missing") from e
    except OSError as e:
        raise MetadataError(f"{where}: unreadable ({e})") from e
    return StepMetadata.from_bytes(data, where)


def restore_step(storage: Storage, backend: backends.ChunkBackend, step_path: str, step: int,
                 target: Mapping[str, Any] | None, items: Iterable[str] | None, max_inflight_bytes: int,
                 process_index: int, metadata_name: str = layout.METADATA_FILE,
                 io_concurrency: int = 32,
                 prefilled: Callable[[reader.LeafRead], bool] | None = None, *,
                 reuse_host_buffers: bool | None = None,
                 host_buffer_bytes: int = host_ring.DEFAULT_HOST_RING_BYTES) -> dict[str, Any]:
    """Restore from one committed step folder (see CheckpointManager.restore), reading the chunks
    through `backend` (the storage's: backends.for_storage); `reuse_host_buffers` and
    `host_buffer_bytes`: reader.read_leaves. `prefilled(read)` finishes a leaf from buffers read
    ahead of this folder and says whether it did (prefetch.py); the others are read."""
    meta = read_metadata(storage, step_path, metadata_name)
    names = list(items) if items is not None else list(meta.items)
    unknown = [n for n in names if n not in meta.items]
    if unknown:
        raise TreeMismatchError(f"step {step}: no item(s) {', '.join(map(repr, unknown))} in the checkpoint; "
                                f"it has: {', '.join(map(repr, meta.items))}")
    target = target or {}
    out: dict[str, Any] = {}
    reads: list[reader.LeafRead] = []
    assemble: list[tuple[str, Any, list[Any]]] = []  # (item, treedef or paths, slots)
    problems: list[str] = []
    for name in names:
        item = meta.items[name]
        if item.kind == "json":
            out[name] = _read_json_item(storage, storage.join(step_path, layout.item_json_name(name)), step)
            continue
        if item.kind == "per_process":
            path = storage.join(step_path, name, layout.process_json_name(process_index))
            out[name] = _read_json_item(storage, path, step) if storage.exists(path) else None
            continue
        item_target = target.get(name)
        if item_target is not None:
            leaves, treedef = items_lib.match_target(step, name, item, item_target)
            targets = jax.tree_util.tree_leaves(item_target)
        else:
            leaves, treedef = list(item.leaves), None
            targets = [None] * len(leaves)
        slots: list[Any] = []
        for leaf, want in zip(leaves, targets, strict=True):
            if leaf.kind == "scalar":
                slots.append(_scalar_value(leaf.value, leaf.pytype, want))
                continue
            sharding = None
            dtype = np.dtype(leaf.dtype)
            if want is not None and hasattr(want, "shape"):
                want_shape, want_dtype = tuple(want.shape), want.dtype
                if leaf.prng_impl and pytrees.is_prng_key(want_dtype):
                    want_shape, want_dtype = want_shape + tuple(leaf.shape[len(want_shape):]), dtype
                if want_shape != tuple(leaf.shape):
                    problems.append(f"step {step}: array '{name}/{leaf.keystr}' has shape {tuple(leaf.shape)} "
                                    f"on disk, the target expects {tuple(want.shape)}")
                    continue
                dtype = np.dtype(want_dtype)
                sharding = getattr(want, "sharding", None)
                if leaf.prng_impl and sharding is not None:
                    sharding = pytrees.data_sharding(sharding, len(want.shape))
            read = reader.LeafRead(name, leaf, dtype, sharding)
            reads.append(read)
            slots.append(read)
        assemble.append((name, treedef if treedef is not None else [lf.path for lf in leaves], slots))
    if problems:
        raise ShapeMismatchError("; ".join(problems))
    if prefilled is not None:
        reads = [r for r in reads if not prefilled(r)]
    try:
        reader.read_leaves(reads, step_path, backend, max_inflight_bytes, io_concurrency,
                           reuse_host_buffers=reuse_host_buffers, host_buffer_bytes=host_buffer_bytes)
    except IncompleteStepError as e:  # a chunk file is missing (MissingChunkError)
        hint = " (a local-tier step holds only its host's shards: restore from the persistent tier)"
        raise type(e)(f"step {step}: {e}{hint if meta.local_tier else ''}") from e
    except CorruptCheckpointError as e:
        raise type(e)(f"step {step}: {e}") from e
    for name, structure, slots in assemble:
        values = [(pytrees.wrap(s.result, s.leaf.prng_impl) if s.leaf.prng_impl else s.result)
                  if isinstance(s, reader.LeafRead) else s for s in slots]
        if isinstance(structure, list):
            out[name] = items_lib.rebuild_tree(structure, values)
        else:
            out[name] = jax.tree_util.tree_unflatten(structure, values)
    return out


def _read_json_item(storage: Storage, path: str, step: int) -> Any:
    """A JSON item's value; a missing or damaged file is an error of the step that names the file (so a
    restore of the newest step falls back)."""
    try:
        return json.loads(storage.read_bytes(path))
    except FileNotFoundError as e:
        raise IncompleteStepError(f"step {step}: {path} is missing") from e
    except ValueError as e:
        raise CorruptCheckpointError(f"step {step}: {path} is not valid JSON ({e})") from e


def _scalar_value(value: Any, pytype: str, want: Any) -> Any:
    if pytype in ("int", "float", "bool", "str"):
        value = {"int": int, "float": float, "bool": bool, "str": str}[pytype](value)
    else:
        value = np.dtype(pytype).type(value)
    if want is not None and hasattr(want, "dtype") and not isinstance(want, (int, float, bool)):
        return np.asarray(value, dtype=want.dtype)[()]
    return value


def missing_chunk_file(storage: Storage, step_path: str, step: int, metadata_name: str,
                       target: Mapping[str, Any] | None, items: Iterable[str] | None) -> str | None:
    """Why the step folder `step_path` lacks a chunk file this process's restore of `items` onto
    `target` would read (naming the file), or None when it has every one. Raises MetadataError when
    the step's metadata `metadata_name` cannot be read."""
    meta = read_metadata(storage, step_path, metadata_name)
    try:
        needed = needed_chunk_files(meta, step, target, items)
    except TreeMismatchError as e:
        return str(e)
    for rel in needed:
        if not storage.exists(storage.join(step_path, *rel.split("/"))):
            return f"{storage.join(step_path, *rel.split('/'))} is missing on this host"
    return None


def needed_chunk_files(meta: StepMetadata, step: int, target: Mapping[str, Any] | None,
                       items: Iterable[str] | None) -> list[str]:
    """The chunk files (paths relative to the step folder) this process's restore of `items` onto
    `target` reads: those its target shards' boxes overlap, every chunk of an item without a target.
    Raises TreeMismatchError when an item is missing or does not match its target."""
    target = target or {}
    out: set[str] = set()
    for name in (list(items) if items is not None else list(meta.items)):
        item = meta.items.get(name)
        if item is None:
            raise TreeMismatchError(f"step {step}: no item {name!r}")
        if item.kind != "pytree":
            continue
        if target.get(name) is not None:
            leaves, _ = items_lib.match_target(step, name, item, target[name])
            wants = jax.tree_util.tree_leaves(target[name])
        else:
            leaves, wants = list(item.leaves), [None] * len(item.leaves)
        for leaf, want in zip(leaves, wants, strict=True):
            if leaf.kind != "array":
                continue
            sharding = getattr(want, "sharding", None)
            if sharding is None:
                boxes = [tuple((0, d) for d in leaf.shape)]
            else:
                boxes = list(planning.plan_read_boxes(
                    sharding.addressable_devices_indices_map(leaf.shape).items(), leaf.shape))
            files = chunk_format.ArrayFiles.of(leaf)
            for key in {files.locate(c)[0] for box in boxes for c in planning.chunks_of_box(box, leaf.chunks)}:
                out.add("/".join((name, str(leaf.dir), *key)))
    return sorted(out)


def all_chunk_files(meta: StepMetadata) -> list[str]:
    """Every chunk file of a step (paths relative to its folder)."""
    return sorted("/".join((name, str(leaf.dir), *key)) for name, item in meta.items.items()
                  if item.kind == "pytree" for leaf in item.leaves if leaf.kind == "array"
                  for key in chunk_format.ArrayFiles.of(leaf).file_keys())
