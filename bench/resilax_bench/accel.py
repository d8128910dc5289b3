"""The bench on the devices present (``--accel``): a training step that changes the state, and the
chip's own transfer limits.

On an accelerator a ``jax.Array`` keeps its host copy after the first ``np.asarray``, so saving the
same arrays again measures a cache. Here every save sees new arrays: between saves a jitted step
rewrites every leaf (floats doubled, integers incremented) and DONATES the old state
(``donate_argnums=0``), as a training loop does. A library that still reads a donated buffer after its
``save()`` returned fails loudly ("Array has been deleted").

Checksums are taken on the device (the 32-bit words summed modulo 2**32 in a jitted reduction), so
checking a save never pulls the state to the host and never warms a cache the next save would hit.

The floors (``measure_floors``), on the same leaves and shardings as the saved state:
  ``d2h_batched``  one ``jax.device_get`` of every leaf (all transfers in flight together)
  ``d2h_leafwise`` ``np.asarray`` leaf by leaf (one transfer at a time)
  ``d2h_one``      one array of the state's total size
  ``h2d_batched``  one ``jax.device_put`` of every leaf onto its sharding
  ``h2d_leafwise`` ``device_put`` + ``block_until_ready`` leaf by leaf
  ``h2d_one``      one array of the state's total size
each on arrays the step just made (no cached host copy), the median of ``repeats``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def mesh_shapes(device_count: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The save mesh and the reshard mesh on ``device_count`` devices: (n, 1) and (1, n).

    One chip gives (1, 1) for both (the reshard restore is then a plain one on transposed specs)."""
    if device_count < 1:
        raise ValueError(f"device_count: {device_count}; need at least 1 device")
    return (device_count, 1), (1, device_count)


def _advance(a: Any) -> Any:
    import jax.numpy as jnp

    if jnp.issubdtype(a.dtype, jnp.floating):
        return a * 2
    return a + 1


_STEP: Callable[[Any], Any] | None = None


def train_step(state: Any) -> Any:
    """A new state from ``state``, which is DONATED (its buffers are gone once this returns)."""
    global _STEP
    if _STEP is None:
        import jax

        _STEP = jax.jit(lambda s: jax.tree.map(_advance, s), donate_argnums=0)
    return _STEP(state)


def advance_host(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What ``train_step`` makes of host values (for tests)."""
    out = {}
    for name, a in values.items():
        out[name] = a * a.dtype.type(2) if np.issubdtype(a.dtype, np.floating) else a + a.dtype.type(1)
    return out


_SUM: Callable[[Any], Any] | None = None


def device_checksums(named: dict[str, Any]) -> dict[str, int]:
    """Each leaf's 32-bit words summed modulo 2**32, computed where the leaf lives."""
    global _SUM
    import jax

    if _SUM is None:
        import jax.numpy as jnp

        def words(a: Any) -> Any:
            if a.dtype.itemsize != 4:
                raise ValueError(f"device_checksums: dtype {a.dtype} is not 32-bit; only 32-bit leaves are summed")
            return jnp.sum(jax.lax.bitcast_convert_type(a, jnp.uint32), dtype=jnp.uint32)

        _SUM = jax.jit(lambda tree: {k: words(v) for k, v in tree.items()})
    sums = jax.device_get(_SUM(named))
    return {k: int(v) for k, v in sums.items()}


def host_checksum(a: np.ndarray) -> int:
    """``device_checksums`` of a host array (for tests)."""
    return int(np.ascontiguousarray(a).reshape(-1).view(np.uint32).sum(dtype=np.uint32))


def device_facts() -> dict[str, Any]:
    import jax

    d = jax.devices()[0]
    return {
        "platform": d.platform,
        "device_kind": d.device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
    }


def hbm_stats() -> dict[str, int] | None:
    """The first device's memory statistics (bytes in use, peak, limit), where the backend has them."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:  # backends without memory statistics raise various errors
        return None
    if not stats:
        return None
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {k: int(stats[k]) for k in keys if k in stats}


def measure_floors(leaves: list[Any], mesh: Any, repeats: int, seed: int = 0) -> dict[str, Any]:
    """Device-to-host and host-to-device seconds of the state's leaves and of one array as large.

    ``leaves``: the bench's ``LeafSpec``s; ``mesh``: the save mesh."""
    import jax
    import jax.numpy as jnp

    from resilax_bench import state as st

    state = train_step(st.build_jax_state(leaves, mesh, seed))
    paths = [s.path for s in leaves]
    nbytes = sum(s.nbytes for s in leaves)
    shardings = [st.sharding_for(mesh, s.spec) for s in leaves]
    one_sharding = st.sharding_for(mesh, (None,))
    one = train_step(jax.jit(lambda: jnp.ones((nbytes // 4,), jnp.float32), out_shardings=one_sharding)())
    jax.block_until_ready((state, one))
    times: dict[str, list[float]] = {
        k: [] for k in ("d2h_batched", "d2h_leafwise", "d2h_one", "h2d_batched", "h2d_leafwise", "h2d_one")
    }
    for _ in range(repeats):
        state = jax.block_until_ready(train_step(state))
        values = [st.flatten(state)[p] for p in paths]
        t0 = time.perf_counter()
        host = jax.device_get(values)
        times["d2h_batched"].append(time.perf_counter() - t0)
        state = jax.block_until_ready(train_step(state))
        values = [st.flatten(state)[p] for p in paths]
        t0 = time.perf_counter()
        for v in values:
            np.asarray(v)
        times["d2h_leafwise"].append(time.perf_counter() - t0)
        one = jax.block_until_ready(train_step(one))
        t0 = time.perf_counter()
        host_one = jax.device_get(one)
        times["d2h_one"].append(time.perf_counter() - t0)
        del values

        t0 = time.perf_counter()
        out = jax.block_until_ready(jax.device_put(host, shardings))
        times["h2d_batched"].append(time.perf_counter() - t0)
        del out
        t0 = time.perf_counter()
        for h, sharding in zip(host, shardings, strict=True):
            jax.block_until_ready(jax.device_put(h, sharding))
        times["h2d_leafwise"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = jax.block_until_ready(jax.device_put(host_one, one_sharding))
        times["h2d_one"].append(time.perf_counter() - t0)
        del out, host, host_one
    result: dict[str, Any] = {"state_bytes": nbytes, "leaves": len(leaves), "repeats": repeats, "raw": times}
    for k, v in times.items():
        result[f"{k}_s"] = statistics.median(v)
        result[f"{k}_gbps"] = nbytes / statistics.median(v) / 1e9
    return result
