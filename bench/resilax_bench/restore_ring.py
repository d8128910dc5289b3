"""Restore through the host ring against fresh buffers, side by side in one process (issue 37).

Saves two steps of a state of `--size-gib` in `--leaves` float32 leaves (on the devices present, a
(n, 1) mesh) into `--workdir` (tmpfs by default), then restores alternately with the ring
(`restore_host_buffer_bytes`, default 512 MiB) and without it (0: fresh buffers, the old path), a new
manager per restore. Beside them, the floors: every chunk file read once into a reused buffer by
`--threads` threads, and one batched `device_put` of the same leaves from host memory. It checks
that a restored result held by the caller is unchanged, bit for bit, after later restores reused
the ring (on the devices), and that every restore is bit-exact.

    PYTHONPATH=ckpt_lib:bench python -m resilax_bench.restore_ring --json out.json
    JAX_PLATFORMS=cpu PYTHONPATH=ckpt_lib:bench python -m resilax_bench.restore_ring --size-gib 0.05 --force-ring

With RESILAX_BENCH_PROFILE=<folder>, each restore writes its stacks (profiling.py).
On CPU devices the ring is used only with --force-ring (a device-side copy stands for the transfer).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from resilax_bench import profiling


def _state(step: int, shapes: list[tuple[int, int]], sharding: Any) -> list[Any]:
    keys = jax.random.split(jax.random.key(step), len(shapes))
    make = jax.jit(lambda k, shape: jax.random.normal(k, shape, jnp.float32), static_argnums=1,
                   out_shardings=sharding)
    return [make(k, s) for k, s in zip(keys, shapes, strict=True)]


def _same(a: list[Any], b: list[Any]) -> bool:
    return all(bool(jnp.array_equal(x, y)) for x, y in zip(a, b, strict=True))


def _read_floor(folder: str, threads: int) -> float:
    files = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
    biggest = max(os.path.getsize(f) for f in files)
    bufs = [np.empty(biggest, np.uint8) for _ in range(threads)]
    for b in bufs:
        b[::4096] = 0  # touched: the floor is the read, not page faults

    def read(i: int) -> int:
        buf, n = bufs[i % threads], 0
        with open(files[i], "rb", buffering=0) as f:
            while True:
                got = f.readinto(memoryview(buf)[: biggest])
                if not got:
                    return n
                n += got

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, range(len(files))))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    import resilax_ckpt as rc
    from resilax_ckpt.chunks import host_ring

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=2.03)
    p.add_argument("--leaves", type=int, default=154)
    p.add_argument("--workdir", default="/dev/shm/resilax-restore-ring")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ring-bytes", type=int, default=512 << 20)
    p.add_argument("--threads", type=int, default=32)
    p.add_argument("--force-ring", action="store_true", help="use the ring on CPU devices too")
    p.add_argument("--json")
    args = p.parse_args(argv)

    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices).reshape(len(devices), 1), ("a", "b"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", None))
    cols = 1024
    rows = max(len(devices), int(args.size_gib * (1 << 30) / 4 / cols / args.leaves) // len(devices) * len(devices))
    shapes = [(rows, cols)] * args.leaves
    nbytes = rows * cols * 4 * args.leaves
    print(f"restore_ring: {nbytes / (1 << 30):.2f} GiB in {args.leaves} leaves on {len(devices)} "
          f"{devices[0].platform} device(s) ({devices[0].device_kind}), {args.workdir}", flush=True)
    shutil.rmtree(args.workdir, ignore_errors=True)
    expected = {step: _state(step, shapes, sharding) for step in (1, 2)}
    with rc.CheckpointManager(args.workdir, rc.ManagerOptions(async_save=False)) as mgr:
        for step in (1, 2):
            mgr.save(step, {"s": expected[step]}, force=True)
        mgr.wait()
    target = {"s": [jax.ShapeDtypeStruct(s, jnp.float32, sharding=sharding) for s in shapes]}
    reuse = True if args.force_ring else None

    def restore(label: str, ring: int, step: int) -> tuple[float, list[Any]]:
        opts = rc.ManagerOptions(restore_host_buffer_bytes=ring, restore_reuse_host_buffers=reuse)
        with rc.CheckpointManager(args.workdir, opts) as m:
            allocs = host_ring.host_buffer_counts()["allocations"]
            with profiling.profiled("resilax", label):
                start = time.perf_counter()
                out = m.restore(step, target)["s"]
                jax.block_until_ready(out)
                took = time.perf_counter() - start
        allocs = host_ring.host_buffer_counts()["allocations"] - allocs
        print(f"  {label}: {took:.3f} s, {allocs} host buffer allocations", flush=True)
        return took, out

    results: dict[str, Any] = {"platform": devices[0].platform, "device_kind": devices[0].device_kind,
                               "bytes": nbytes, "leaves": args.leaves, "workdir": args.workdir,
                               "ring_bytes": args.ring_bytes, "jax": jax.__version__}
    first, held = restore("restore-ring-first", args.ring_bytes, 1)  # this process's first restore
    results["first_restore_ring_s"] = first
    ok = _same(held, expected[1])
    times: dict[str, list[float]] = {"ring": [], "fresh": []}
    for r in range(args.rounds):
        for mode, ring in (("fresh", 0), ("ring", args.ring_bytes)):
            took, out = restore(f"restore-{mode}-{r}", ring, 2 - r % 2)
            ok = ok and _same(out, expected[2 - r % 2])
            times[mode].append(took)
            del out
    ok_held = _same(held, expected[1])  # later restores reused the ring: the held result is untouched
    results["restore_ring_s"] = times["ring"]
    results["restore_fresh_s"] = times["fresh"]
    results["read_floor_s"] = statistics.median(_read_floor(args.workdir, args.threads) for _ in range(3))
    host = [np.asarray(x) for x in expected[1]]
    h2d = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(jax.device_put(host, [sharding] * len(host)))
        h2d.append(time.perf_counter() - start)
    results["host_to_device_floor_s"] = statistics.median(h2d)
    results["bit_exact"] = ok
    results["held_result_unchanged"] = ok_held
    floor = results["read_floor_s"] + results["host_to_device_floor_s"]
    ring_med = statistics.median(times["ring"])
    print(f"restore_ring: ring {ring_med:.3f} s (median), fresh {statistics.median(times['fresh']):.3f} s, "
          f"first {first:.3f} s; floor read {results['read_floor_s']:.3f} + host-to-device "
          f"{results['host_to_device_floor_s']:.3f} = {floor:.3f} s; ring / floor {ring_med / floor:.2f}x; "
          f"bit-exact {ok}, held result unchanged {ok_held}; platform {devices[0].platform}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    shutil.rmtree(args.workdir, ignore_errors=True)
    return 0 if ok and ok_held else 1


if __name__ == "__main__":
    sys.exit(main())
