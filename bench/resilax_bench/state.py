"""The benchmark's training state: a transformer-like pytree of params plus Adam moments.

Every library sees the same bytes. A leaf's values are float32 draws from a normal distribution: a
16 MiB pool of true normal draws, each 4 MiB block of a leaf scaled by its own factor, so no two
blocks share bytes (a compressor finds what it would find in real weights: a little in the exponent
bytes, nothing in the mantissas) and building 1 GiB takes about a second instead of twenty.

Layout, with ``d`` the model width, ``L = 4`` layers and a vocabulary of ``36 d``:
params = {embed (V, d), layer_i/{attn_q, attn_k, attn_v, attn_o, mlp_in, mlp_in_bias, mlp_out,
mlp_out_bias, ln1_scale, ln1_bias, ln2_scale, ln2_bias}, final_ln_scale, final_ln_bias};
opt_state = {mu: like params, nu: like params, count: int32 scalar}: 3 x 51 + 1 = 154 leaves.
Partition specs are what an FSDP-over-``data`` plus tensor-parallel-over-``model`` run would use.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

MESH_AXES = ("data", "model")
SAVE_MESH = (4, 2)
RESHARD_MESH = (2, 4)
LAYERS = 4
VOCAB_PER_WIDTH = 36
_POOL_ELEMS = 4 << 20
_BLOCK_ELEMS = 1 << 20

Spec = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """One array of the state: its path, shape, dtype and partition spec on the save mesh."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    spec: Spec

    @property
    def name(self) -> str:
        return "/".join(self.path)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def width_for(size_gib: float) -> int:
    """The model width whose state is closest to ``size_gib`` GiB (a multiple of 64, at least 64)."""
    # Per width^2: L * 12 (attention 4 d^2, MLP 8 d^2) + vocabulary 36 -> 84 d^2 params, x3 for
    # Adam's mu and nu, x4 bytes.
    per_d2 = (LAYERS * 12 + VOCAB_PER_WIDTH) * 3 * 4
    d = math.sqrt(size_gib * (1 << 30) / per_d2)
    return max(64, round(d / 64) * 64)


def _param_leaves(d: int) -> list[LeafSpec]:
    f = "float32"
    leaves = [LeafSpec(("embed",), (VOCAB_PER_WIDTH * d, d), f, ("model", "data"))]
    for i in range(LAYERS):
        p = f"layer_{i}"
        leaves += [
            LeafSpec((p, "attn_q"), (d, d), f, ("data", "model")),
            LeafSpec((p, "attn_k"), (d, d), f, ("data", "model")),
            LeafSpec((p, "attn_v"), (d, d), f, ("data", "model")),
            LeafSpec((p, "attn_o"), (d, d), f, ("model", "data")),
            LeafSpec((p, "mlp_in"), (d, 4 * d), f, ("data", "model")),
            LeafSpec((p, "mlp_in_bias"), (4 * d,), f, ("model",)),
            LeafSpec((p, "mlp_out"), (4 * d, d), f, ("model", "data")),
            LeafSpec((p, "mlp_out_bias"), (d,), f, (None,)),
            LeafSpec((p, "ln1_scale"), (d,), f, (None,)),
            LeafSpec((p, "ln1_bias"), (d,), f, (None,)),
            LeafSpec((p, "ln2_scale"), (d,), f, (None,)),
            LeafSpec((p, "ln2_bias"), (d,), f, (None,)),
        ]
    leaves += [
        LeafSpec(("final_ln_scale",), (d,), f, (None,)),
        LeafSpec(("final_ln_bias",), (d,), f, (None,)),
    ]
    return leaves


def build_leaf_specs(size_gib: float) -> list[LeafSpec]:
    """All leaves, paths rooted at the item name (``params`` or ``opt_state``)."""
    d = width_for(size_gib)
    params = _param_leaves(d)
    leaves = [dataclasses.replace(s, path=("params", *s.path)) for s in params]
    for moment in ("mu", "nu"):
        leaves += [dataclasses.replace(s, path=("opt_state", moment, *s.path)) for s in params]
    leaves.append(LeafSpec(("opt_state", "count"), (), "int32", ()))
    return leaves


def transposed(spec: Spec) -> Spec:
    """The spec with the mesh axes swapped: what a (2, 4) restore of a (4, 2) save asks for."""
    swap = {"data": "model", "model": "data"}
    return tuple(swap.get(a, a) if a is not None else None for a in spec)


def fill_leaf(spec: LeafSpec, index: int, seed: int = 0) -> np.ndarray:
    """The host values of one leaf (deterministic in ``seed`` and the leaf's index)."""
    if spec.dtype == "int32":
        return np.full(spec.shape, 1000 + index, dtype=np.int32)
    pool = _pool(seed)
    n = math.prod(spec.shape)
    out = np.empty(n, dtype=np.float32)
    rng = np.random.default_rng((seed, index))
    for start in range(0, n, _BLOCK_ELEMS):
        stop = min(n, start + _BLOCK_ELEMS)
        offset = int(rng.integers(0, _POOL_ELEMS - (stop - start) + 1))
        scale = np.float32(0.02 * (1.0 + rng.random()))
        np.multiply(pool[offset : offset + stop - start], scale, out=out[start:stop])
    return out.reshape(spec.shape)


_POOLS: dict[int, np.ndarray] = {}


def _pool(seed: int) -> np.ndarray:
    if seed not in _POOLS:
        _POOLS[seed] = np.random.default_rng(seed).standard_normal(_POOL_ELEMS, dtype=np.float32)
    return _POOLS[seed]


def iter_host_leaves(leaves: list[LeafSpec], seed: int = 0) -> Iterator[tuple[LeafSpec, np.ndarray]]:
    for i, spec in enumerate(leaves):
        yield spec, fill_leaf(spec, i, seed)


def nest(flat: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    """``{("params", "embed"): x}`` -> ``{"params": {"embed": x}}``."""
    root: dict[str, Any] = {}
    for path, value in flat.items():
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return root


def flatten(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out: dict[tuple[str, ...], Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def make_mesh(shape: tuple[int, int]) -> Any:
    import jax

    devices = np.asarray(jax.devices()[: shape[0] * shape[1]]).reshape(shape)
    return jax.sharding.Mesh(devices, MESH_AXES)


def sharding_for(mesh: Any, spec: Spec) -> Any:
    import jax

    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))


def build_jax_state(leaves: list[LeafSpec], mesh: Any, seed: int = 0) -> dict[str, Any]:
    """The state as ``jax.Array`` leaves sharded on ``mesh``; host copies are dropped leaf by leaf."""
    import jax

    flat: dict[tuple[str, ...], Any] = {}
    for spec, host in iter_host_leaves(leaves, seed):
        sharding = sharding_for(mesh, spec.spec)
        flat[spec.path] = jax.make_array_from_callback(spec.shape, sharding, _slicer(host))
        del host
    jax.block_until_ready(list(flat.values()))
    return nest(flat)


def _slicer(host: np.ndarray) -> Callable[[Any], np.ndarray]:
    # A copy per shard: the device buffer must not alias the host array we are about to drop.
    return lambda index: np.array(host[index], copy=True)


def build_abstract_state(
    leaves: list[LeafSpec], mesh: Any, transpose: bool = False, items: tuple[str, ...] | None = None
) -> dict[str, Any]:
    """``jax.ShapeDtypeStruct`` leaves with shardings on ``mesh`` (specs transposed when asked)."""
    import jax

    flat = {}
    for spec in leaves:
        if items is not None and spec.path[0] not in items:
            continue
        pspec = transposed(spec.spec) if transpose else spec.spec
        flat[spec.path] = jax.ShapeDtypeStruct(
            spec.shape, np.dtype(spec.dtype), sharding=sharding_for(mesh, pspec)
        )
    return nest(flat)


def checksum(value: Any) -> int:
    """The sum of an array's 32-bit words, modulo 2**64: exact and independent of the sharding.

    Summed shard by shard for a ``jax.Array`` (no gather), each distinct shard once.
    """
    shards = getattr(value, "addressable_shards", None)
    if shards is None:
        return _word_sum(np.asarray(value))
    total = 0
    seen: set[tuple[tuple[int, int, int], ...]] = set()
    for shard in shards:
        key = tuple((s.start or 0, s.stop or 0, s.step or 1) for s in shard.index)
        if key in seen:
            continue
        seen.add(key)
        total += _word_sum(np.asarray(shard.data))
    return total % (1 << 64)


def _word_sum(a: np.ndarray) -> int:
    words = np.ascontiguousarray(a).reshape(-1).view(np.uint32)
    return int(words.sum(dtype=np.uint64))
