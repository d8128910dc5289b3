"""Probe (issue 37): when does the host memory behind `np.asarray` of a TPU array go back?

154 float32 leaves of (1024, 3328) (13 MiB each, 1.96 GiB), copied on the device by one jitted step,
then each taken to the host with `np.asarray` and dropped at once (the copy too), as a save's drain
and writer do. For each mode, the peak RSS over the loop above its start. Modes (MODES env, comma
separated; default all):
  none          nothing else
  gcN           gc.collect() (all generations) every N leaves
  gen0_everyN   gc.collect(0) every N leaves
  sleepN        time.sleep(0.05) every N leaves
  trimN         malloc_trim(0) every N leaves
  gc_trimN      both
  delete        Array.delete() right after np.asarray
  async_delete  copy_to_host_async(), np.asarray, then delete()
Run on the TPU host: `OUT=<folder> python3 bench/tpu/probes/host_copy_release.py` (~25 s, the chip
opened once). Results of 2026-12-07 (TPU v5e, JAX 0.10.2; four device calls with subsets of these
modes, raw in bench/results/2026-12-07-tpu-v5e-probes/host-copy-release-*.json): none 1.955-1.956
GiB; gc16 0.191; gc_trim16 0.190; sleep16 1.955; trim16 1.954; delete 1.956; async_delete 1.956;
gen0_every8 0.115; gen0_every32 0.394; a numpy-only loop of fresh 13 MiB arrays 0.013. So the copies
are released by jaxlib's gc callback (`_xla_gc_callback` -> `_jax.collect_garbage()`), which a young
collection runs: resilax_ckpt's drain runs one every RECLAIM_BYTES (saving/drain.py).
"""

import ctypes
import gc
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

ALL = "none,gc16,sleep16,trim16,gc_trim16,delete,async_delete,gen0_every8,gen0_every32"


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) * 1024
    return 0


def every(mode: str, prefix: str) -> int:
    """N of a mode `<prefix>N`, else 0."""
    return int(mode[len(prefix):]) if mode.startswith(prefix) and mode[len(prefix):].isdigit() else 0


def main() -> None:
    libc = ctypes.CDLL("libc.so.6")
    keys = jax.random.split(jax.random.PRNGKey(0), 154)
    state = [jax.random.normal(k, (1024, 3328), jnp.float32) for k in keys]
    jax.block_until_ready(state)
    sums = [float(jnp.sum(a)) for a in state[:8]]
    copy = jax.jit(lambda s: [a + 0 for a in s])
    out = {}
    for mode in os.environ.get("MODES", ALL).split(","):
        c = copy(state)
        jax.block_until_ready(c)
        gc.collect()
        libc.malloc_trim(0)
        base = rss()
        peak, ok = base, True
        t = time.perf_counter()
        for i in range(len(c)):
            if mode == "async_delete":
                c[i].copy_to_host_async()
            h = np.asarray(c[i])
            if mode in ("delete", "async_delete"):
                c[i].delete()
            c[i] = None
            k = i + 1
            if (n := every(mode, "gc")) and k % n == 0:
                gc.collect()
            if (n := every(mode, "gc_trim")) and k % n == 0:
                gc.collect()
                libc.malloc_trim(0)
            if (n := every(mode, "gen0_every")) and i % n == 0:
                gc.collect(0)
            if (n := every(mode, "sleep")) and k % n == 0:
                time.sleep(0.05)
            if (n := every(mode, "trim")) and k % n == 0:
                libc.malloc_trim(0)
            if i < 8:  # the host copy stays valid whatever was done to its device array
                ok = ok and abs(float(h.astype(np.float64).sum()) - sums[i]) < 1e-2 * max(1.0, abs(sums[i]))
            del h
            peak = max(peak, rss())
        out[mode] = {"peak_gib": round((peak - base) / 2**30, 3), "s": round(time.perf_counter() - t, 3),
                     "values_ok_after": ok}
        print(mode, out[mode], flush=True)
        del c
    with open(os.path.join(os.environ.get("OUT", "."), "host-copy-release.json"), "w") as f:
        json.dump({"platform": jax.devices()[0].platform, "device_kind": jax.devices()[0].device_kind,
                   "jax": jax.__version__, "modes": out}, f, indent=1)


if __name__ == "__main__":
    main()
