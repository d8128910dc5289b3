"""Probe (issue 37): why a save of the bench's 2.03 GiB state bounces 15 writes on a TPU v5e, all of
the (52992, 1472) float32 embedding leaves (params, mu, nu), landed with strides (4, 211968): column
major. Nothing in the bench transposes them (bench/resilax_bench/state.py: embed is (36 d, d), d =
1472, made by a jitted step): the device layout XLA gave them is the suspect (1472 is not a multiple
of 128, 52992 is). This prints, for that leaf and a 1792x2048 one (landed C-contiguous per the last
probe): the device format, the landed strides, the time to land it, the host bounce a C-order
file needs (np.ascontiguousarray), the host-to-device time of the landed host array against a C-order
copy of it (what a restore of a leaf stored in its landed order puts back), and whether a jitted copy or a device_put asking for a row-major
layout (jax.experimental.layout) lands C-contiguous, and its cost. Not part of any test. ~20 s.

  OUT=/some/folder python3 bench/tpu/probes/layout.py     (CPU: JAX_PLATFORMS=cpu, small shapes)

One `PROBE {json}` line per leaf, and $OUT/layout.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.layout import Format, Layout


def timed(fn: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def describe(host: np.ndarray) -> dict[str, Any]:
    return {"strides": list(host.strides), "c_contiguous": bool(host.flags.c_contiguous),
            "f_contiguous": bool(host.flags.f_contiguous)}


def probe(shape: tuple[int, int], column_major: bool = False) -> dict[str, Any]:
    """`column_major`: make the leaf with a (1, 0) device layout on purpose (what the chip is
    suspected to pick), so that a CPU run shows the fix working on such a leaf."""
    ones = jnp.ones(shape, jnp.float32) + 0
    made = Format(Layout(major_to_minor=(1, 0)), ones.sharding) if column_major else None
    step = jax.jit(lambda x: x * 2, donate_argnums=0, out_shardings=made)
    a = step(ones)  # made by a jitted step, as the bench's state
    a.block_until_ready()
    out: dict[str, Any] = {"shape": list(shape), "forced_column_major": column_major,
                           "device_format": str(a.format)}
    host, out["land_s"] = timed(lambda: np.asarray(a))
    out["landed"] = describe(host)
    c_order, out["bounce_s"] = timed(lambda: np.ascontiguousarray(host))
    # The restore side of storing such a leaf transposed (issue 37, the zarr3 transpose codec): the
    # restore reads it into a host buffer in the landed order and device_puts that; is the landed
    # order as fast to put back as a C-order copy? (median of 3, after a warm-up each)
    for name, h in (("h2d_landed_order", host), ("h2d_c_order", c_order)):
        try:
            jax.device_put(h, a.sharding).block_until_ready()
            times = []
            for _ in range(3):
                d, t = timed(lambda h=h: jax.device_put(h, a.sharding).block_until_ready())
                times.append(t)
            out[name + "_s"] = sorted(times)[1]
            out[name + "_format"] = str(d.format)
            out[name + "_equal"] = bool(np.array_equal(np.asarray(d), c_order))
        except Exception as e:
            out[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    row_major = Format(Layout(major_to_minor=tuple(range(a.ndim))), a.sharding)
    try:
        copy = jax.jit(lambda x: x + 0, out_shardings=row_major)
        b, out["jit_row_major_first_s"] = timed(lambda: copy(a).block_until_ready())
        b, out["jit_row_major_s"] = timed(lambda: copy(a).block_until_ready())
        out["jit_row_major_format"] = str(b.format)
        hb, out["jit_row_major_land_s"] = timed(lambda: np.asarray(b))
        out["jit_row_major_landed"] = describe(hb)
        out["jit_row_major_equal"] = bool(np.array_equal(hb, np.asarray(a)))
    except Exception as e:  # the point is to learn whether the chip takes it
        out["jit_row_major_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    try:
        c, out["device_put_row_major_s"] = timed(
            lambda: jax.device_put(a, row_major, may_alias=False).block_until_ready())
        out["device_put_row_major_format"] = str(c.format)
        hc, out["device_put_row_major_land_s"] = timed(lambda: np.asarray(c))
        out["device_put_row_major_landed"] = describe(hc)
    except Exception as e:
        out["device_put_row_major_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def main() -> int:
    cpu = jax.devices()[0].platform == "cpu"
    shapes = [(5299, 147), (179, 204)] if cpu else [(52992, 1472), (1792, 2048)]
    cases = [(shape, False) for shape in shapes] + [(shapes[0], True)]
    results = {"platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
               "jax": jax.__version__, "leaves": []}
    for shape, column_major in cases:
        r = probe(shape, column_major)
        results["leaves"].append(r)
        print("PROBE " + json.dumps(r), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "layout.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
