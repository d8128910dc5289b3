"""Probe (issue 38): does JAX's persistent compilation cache still hit after `jax.extend.backend.clear_backends()`
in the same process (the kept trainer's path)? On the TPU v5e the kept incarnation of examples/transformer.py
counted 3 cache requests and 0 hits (its compile took 12.3 s, a cold compile's time) while a fresh process
hit every time; on CPU the kept incarnation hits 6 of 6. This compiles one program three ways, each in its own
round: (1) fresh cache, (2) the same process after clear_backends, (3) the same again after clear_backends and
`compilation_cache.reset_cache()`. It logs the cache key's parts (JAX's own DEBUG lines of jax._src.cache_key)
to $OUT/kept_cache.log, so the part that changes across the reopen is named. Not part of any test. ~30 s.

  OUT=/some/folder python3 bench/tpu/probes/kept_cache.py    (CPU: JAX_PLATFORMS=cpu)

One `PROBE {json}` line per round, and $OUT/kept_cache.json.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import compilation_cache
from jax.extend.backend import clear_backends

EVENTS: dict[str, int] = {}


def count(event: str, **_: Any) -> None:
    EVENTS[event] = EVENTS.get(event, 0) + 1


def program(x: jax.Array, w: jax.Array) -> jax.Array:
    for _ in range(8):
        x = jnp.tanh(x @ w)
    return x.sum()


def round_(name: str) -> dict[str, Any]:
    before = dict(EVENTS)
    t0 = time.perf_counter()
    devices = jax.devices()
    t1 = time.perf_counter()
    x = jnp.ones((512, 512), jnp.float32)
    w = jnp.ones((512, 512), jnp.float32) * 0.001
    compiled = jax.jit(program).lower(x, w).compile()
    t2 = time.perf_counter()
    compiled(x, w).block_until_ready()
    delta = {k: v - before.get(k, 0) for k, v in EVENTS.items() if v != before.get(k, 0)}
    out = {"round": name, "device_kind": devices[0].device_kind, "platform_version": devices[0].client.platform_version,
           "open_s": round(t1 - t0, 3), "lower_compile_s": round(t2 - t1, 3), "events": delta}
    print("PROBE " + json.dumps(out), flush=True)
    return out


def main() -> int:
    out_dir = os.environ.get("OUT", "/tmp/kept-cache-probe")
    os.makedirs(out_dir, exist_ok=True)
    cache = "/dev/shm/kept-cache-probe" if os.path.isdir("/dev/shm") else "/tmp/kept-cache-probe-cache"
    shutil.rmtree(cache, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    handler = logging.FileHandler(os.path.join(out_dir, "kept_cache.log"), mode="w")
    handler.setFormatter(logging.Formatter("%(relativeCreated)d %(name)s %(message)s"))
    for name in ("jax._src.cache_key", "jax._src.compiler", "jax._src.compilation_cache"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
    jax.monitoring.register_event_listener(count)
    rounds = [round_("fresh")]
    clear_backends()
    rounds.append(round_("after clear_backends"))
    clear_backends()
    compilation_cache.reset_cache()
    rounds.append(round_("after clear_backends + reset_cache"))
    with open(os.path.join(out_dir, "kept_cache.json"), "w") as f:
        json.dump({"rounds": rounds, "jax": jax.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
