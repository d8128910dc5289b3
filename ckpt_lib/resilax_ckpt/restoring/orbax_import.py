"""Read a checkpoint written by orbax-checkpoint, without Orbax (docs/migrating-from-orbax.md).

Layouts read (local folders and gs://):
- a pytree item folder (`StandardCheckpointer.save(path, tree)`, `PyTreeCheckpointHandler`): a
  `_METADATA` JSON whose `tree_metadata` lists every leaf by its key path, and the leaves as zarr
  arrays named by the key path joined with "." (`params.w`), either inside one OCDBT key-value store
  (`manifest.ocdbt` at the item folder, the default) or as one folder per leaf (`use_ocdbt=False`);
- a step folder of a `CheckpointManager` (`_CHECKPOINT_METADATA`, one subfolder per item: `default`
  for a single unnamed item, else the item names; JSON items as a `metadata` file);
- a `CheckpointManager` root (numbered step folders; the newest finished one, or `step`).

Leaves come back as NumPy (Python scalars for Orbax's scalars), or, for a target leaf that is a
`jax.ShapeDtypeStruct` with a sharding (or a jax.Array), as a jax.Array with that sharding and dtype:
each process reads only the boxes its devices hold, so the mesh may differ from the one that saved.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from resilax_ckpt import items as items_lib
from resilax_ckpt import pytrees
from resilax_ckpt import tensorstore_io as tsio
from resilax_ckpt.errors import (
    MetadataError,
    ShapeMismatchError,
    StepNotFoundError,
    StorageError,
    TreeMismatchError,
)
from resilax_ckpt.storage import Storage, open_storage

PYTREE_METADATA = "_METADATA"
STEP_METADATA = "_CHECKPOINT_METADATA"
_KEY_SEQUENCE = 1  # Orbax's KeyType.SEQUENCE; 2 is DICT


def restore_orbax(path: str, step: int | None = None, target: Any = None) -> Any:
    """Restore the Orbax checkpoint at `path` (an item folder, a step folder or a manager root).

    `step` picks a step of a manager root (default: the newest finished). `target`: a pytree of
    `jax.ShapeDtypeStruct`s (with shardings to get jax.Arrays) or arrays, shaped like the saved tree;
    None restores everything as NumPy into nested dicts and lists. A step with several items returns
    a dict by item name (and takes a target of that shape). Called on: all processes."""
    path = path.rstrip("/")
    storage = open_storage(path)
    if not storage.exists(path):
        raise StepNotFoundError(f"{path}: does not exist")
    if storage.exists(storage.join(path, PYTREE_METADATA)):
        return _restore_item(storage, path, target)
    if not storage.exists(storage.join(path, STEP_METADATA)):
        path = _step_folder(storage, path, step)
    elif step is not None:
        raise TreeMismatchError(f"restore_orbax: step={step} given, but {path} is one step's folder; "
                                "pass the manager's root folder to choose a step")
    names = sorted(n.rstrip("/") for n in storage.list_dir(path))
    items = [n for n in names if storage.exists(storage.join(path, n, PYTREE_METADATA))]
    json_items = [n for n in names if n not in items and storage.exists(storage.join(path, n, "metadata"))]
    if len(items) == 1 and not json_items:
        return _restore_item(storage, storage.join(path, items[0]), target)
    if not items and not json_items:
        raise MetadataError(f"{path}: an Orbax step folder without items (no */{PYTREE_METADATA})")
    if target is not None and not isinstance(target, Mapping):
        raise TreeMismatchError(f"{path}: the step has items {', '.join(items + json_items)}; "
                                "the target must be a dict by item name")
    want = dict(target or {})
    out: dict[str, Any] = {}
    for name in items:
        if target is None or name in want:
            out[name] = _restore_item(storage, storage.join(path, name), want.get(name))
    for name in json_items:
        if target is None or name in want:
            out[name] = json.loads(storage.read_bytes(storage.join(path, name, "metadata")))
    return out


def _step_folder(storage: Storage, root: str, step: int | None) -> str:
    """The step folder of a CheckpointManager root: `step`, or the newest finished one."""
    steps = sorted(int(n.rstrip("/")) for n in storage.list_dir(root)
                   if n.rstrip("/").isdigit() and storage.exists(storage.join(root, n.rstrip("/"), STEP_METADATA)))
    if not steps:
        raise StepNotFoundError(f"{root}: no Orbax checkpoint (no {PYTREE_METADATA}, no {STEP_METADATA}, "
                                "no finished numbered step folders)")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise StepNotFoundError(f"{root}: no finished Orbax step {step}; steps: {steps}")
    return storage.join(root, str(step))


def _restore_item(storage: Storage, item_path: str, target: Any) -> Any:
    where = storage.join(item_path, PYTREE_METADATA)
    try:
        tree = json.loads(storage.read_bytes(where))["tree_metadata"]
    except (ValueError, KeyError, TypeError) as e:
        raise MetadataError(f"{where}: not an Orbax pytree metadata file ({type(e).__name__}: {e})") from e
    leaves: dict[tuple[str, ...], dict[str, Any]] = {}
    for entry in tree.values():
        keys = tuple(str(k["key"]) for k in entry["key_metadata"])
        leaves[keys] = entry
    key_impls = _key_impls(storage, item_path)
    base = storage.kvstore_spec(item_path)
    ocdbt = storage.exists(storage.join(item_path, "manifest.ocdbt"))
    context = tsio.build_context(32, False)

    def open_leaf(keys: tuple[str, ...]) -> ts.TensorStore:
        name = ".".join(keys)
        if ocdbt:
            kvstore: dict[str, Any] = {"driver": "ocdbt", "base": base, "path": name + "/"}
        else:
            kvstore = dict(base, path=base["path"] + name + "/")
        errors = []
        for driver in ("zarr", "zarr3"):
            try:
                return ts.open({"driver": driver, "kvstore": kvstore}, context=context, open=True,
                               read=True).result()
            except Exception as e:  # the other zarr version is tried next
                errors.append(tsio.short_error(e))
        raise StorageError(f"{item_path}: cannot open leaf {name!r}: {'; '.join(errors)}")

    if target is None:
        paths, values = [], []
        for keys, entry in leaves.items():
            if entry["value_metadata"].get("skip_deserialize"):
                continue
            paths.append([["s", int(k)] if m["key_type"] == _KEY_SEQUENCE else ["d", k]
                          for k, m in zip(keys, entry["key_metadata"], strict=True)])
            value = _read_whole(open_leaf(keys), entry)
            impl = key_impls.get(".".join(keys))
            values.append(pytrees.wrap(value, impl) if impl else value)
        return items_lib.rebuild_tree(paths, values)

    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    wanted = [tuple(_key_name(k) for k in p) for p, _ in flat]
    missing = [".".join(k) or "<root>" for k in wanted if k not in leaves]
    if missing:
        have = sorted(".".join(k) for k in leaves)
        raise TreeMismatchError(f"{item_path}: the target has leaves the Orbax checkpoint lacks: "
                                f"{', '.join(missing[:10])}; it has: {', '.join(have[:10])}"
                                f"{' ...' if len(have) > 10 else ''}")
    values = []
    for keys, (_, want) in zip(wanted, flat, strict=True):
        array = open_leaf(keys)
        if not hasattr(want, "shape"):
            values.append(_read_whole(array, leaves[keys]))
            continue
        impl = key_impls.get(".".join(keys))
        if impl and pytrees.is_prng_key(want.dtype):
            # A typed key array: Orbax stored its key data (a trailing axis more) and the impl's name.
            data_shape = tuple(want.shape) + tuple(array.shape[len(want.shape):])
            sharding = getattr(want, "sharding", None)
            data_want = jax.ShapeDtypeStruct(
                data_shape, array.dtype.numpy_dtype,
                sharding=pytrees.data_sharding(sharding, len(want.shape)) if sharding is not None else None)
            if data_shape != tuple(array.shape):
                raise ShapeMismatchError(f"{item_path}: key leaf {'.'.join(keys)!r} has key data of shape "
                                         f"{tuple(array.shape)}, the target expects keys of shape {tuple(want.shape)}")
            values.append(pytrees.wrap(_read_to(array, data_want), impl))
            continue
        if tuple(want.shape) != tuple(array.shape):
            raise ShapeMismatchError(f"{item_path}: leaf {'.'.join(keys)!r} has shape {tuple(array.shape)} "
                                     f"in the Orbax checkpoint, the target expects {tuple(want.shape)}")
        values.append(_read_to(array, want))
    return jax.tree_util.tree_unflatten(treedef, values)


def _read_to(array: ts.TensorStore, want: Any) -> Any:
    """The array as NumPy of `want`'s dtype, or as a jax.Array with `want`'s sharding (each process
    reading only the boxes its devices hold)."""
    dtype = np.dtype(want.dtype)
    sharding = getattr(want, "sharding", None)
    if sharding is None:
        return np.asarray(array.read().result(), dtype=dtype)
    return jax.make_array_from_callback(tuple(want.shape), sharding, _box_reader(array, dtype))


def _key_impls(storage: Storage, item_path: str) -> dict[str, str]:
    """Orbax's leaf name -> PRNG implementation of its typed key arrays (`array_metadatas/process_*`,
    `ext_metadata.random_key_impl`); empty for checkpoints without them."""
    folder = storage.join(item_path, "array_metadatas")
    if not storage.exists(folder):
        return {}
    out: dict[str, str] = {}
    for name in storage.list_dir(folder):
        try:
            raw = json.loads(storage.read_bytes(storage.join(folder, name.rstrip("/"))))
            for entry in raw.get("array_metadatas", []):
                meta = entry.get("array_metadata", {})
                impl = (meta.get("ext_metadata") or {}).get("random_key_impl")
                if impl:
                    out[str(meta["param_name"])] = str(impl)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise MetadataError(f"{folder}/{name}: not Orbax array metadata ({type(e).__name__}: {e})") from e
    return out


def _box_reader(array: ts.TensorStore, dtype: np.dtype) -> Any:
    """Reads the box of one device (jax.make_array_from_callback's callback)."""
    def read(index: Any) -> np.ndarray:
        return np.asarray(array[index].read().result(), dtype=dtype)
    return read


def _read_whole(array: ts.TensorStore, entry: dict[str, Any]) -> Any:
    value = np.asarray(array.read().result())
    if entry["value_metadata"].get("value_type") == "scalar":
        return value.item()
    return value


def _key_name(key: Any) -> str:
    """Orbax's name of one key of a tree path."""
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return key.name
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)
