"""Any pytree as a checkpoint: a state that is not a mapping of named items, and typed PRNG keys.

`save(step, state)` takes either a mapping of named items (`{"params": ..., "opt_state": ...}`) or
any other pytree (a flax `TrainState`, an optax state, a tuple): the latter is saved as the one item
named `STATE_ITEM` ("state"), and `restore(target=state_like)` returns it unwrapped.

A typed PRNG key array (`jax.random.key`) is stored as its key data (uint32, one trailing axis
more) with the name of its implementation in the leaf's metadata (`LeafMetadata.prng_impl`), and
rebuilt with `jax.random.wrap_key_data` on restore. Legacy raw keys (`jax.random.PRNGKey`) are plain
uint32 arrays and need nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

STATE_ITEM = "state"
"""The item name of a pytree saved without names (`save(step, train_state)`)."""


def as_items(state: Any) -> tuple[Mapping[str, Any], bool]:
    """The named items of a save, and whether `state` was wrapped as the one item `STATE_ITEM`.
    A mapping is taken as named items (a plain dict pytree saves the same either way)."""
    if isinstance(state, Mapping):
        return state, False
    return {STATE_ITEM: state}, True


def as_target(target: Any) -> tuple[Mapping[str, Any] | None, bool]:
    """A restore target as named items, and whether the result is to be unwrapped."""
    if target is None or isinstance(target, Mapping):
        return target, False
    return {STATE_ITEM: target}, True


def is_prng_key(dtype: Any) -> bool:
    """Whether `dtype` is a typed PRNG key dtype (`key<fry>` and the like)."""
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def key_data(leaf: jax.Array) -> tuple[jax.Array, str]:
    """A typed key array's data (uint32, shape + the impl's key shape) and its implementation's name."""
    return jax.random.key_data(leaf), str(jax.random.key_impl(leaf))


def data_sharding(sharding: Any, ndim: int) -> Any:
    """The sharding of the key data of a key array sharded by `sharding` (`ndim`: the key array's
    rank): a NamedSharding gains replicated trailing axes; other shardings stay as they are."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(tuple(sharding.spec)))
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec, None))
    return sharding


def wrap(data: Any, impl: str) -> jax.Array:
    """The typed key array stored as `data` with implementation `impl`."""
    return jax.random.wrap_key_data(data, impl=impl)
