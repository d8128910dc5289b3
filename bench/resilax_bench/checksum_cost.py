"""What the chunk checksums cost: ``python -m resilax_bench.checksum_cost [--size-gib 1] [--rounds 3]``.

Each round runs two fresh processes, one saving with checksums (the default) and one without
(``RESILAX_CKPT_CHECKSUMS=none``, which exists for this measurement only), in alternating order. Each
saves the bench's state (mesh (4, 2), under ``--target``) as step 1 (new files) and step 2 (into the
recycled files of a ``keep_last=1`` retention), then restores step 2 onto the same sharding, its
files evicted from the page cache first. Per phase it records the wall seconds and the process's CPU
seconds (user + system, all threads: what the checksums add, and less sensitive than wall time to
other load on a shared machine). It also times the crc32c of a 1 GiB buffer on one thread. Prints the
medians and the median of the per-round ratios (with / without).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

PHASES = ("first_save", "steady_save", "cold_restore")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(directory: str, size_gib: float) -> dict[str, float]:
    import jax
    import resilax_ckpt as rc

    from resilax_bench import state as st
    from resilax_bench.cache import evict_from_page_cache

    leaves = st.build_leaf_specs(size_gib)
    mesh = st.make_mesh(st.SAVE_MESH)
    state = st.build_jax_state(leaves, mesh, 0)
    items = {"params": state["params"], "opt_state": state["opt_state"]}
    out: dict[str, float] = {}
    with rc.CheckpointManager(directory, rc.ManagerOptions(keep_last=1)) as mgr:
        for step, phase in ((1, "first_save"), (2, "steady_save")):
            wall, cpu = time.perf_counter(), _cpu()
            mgr.save(step, items, force=True)
            mgr.wait()
            out[phase] = time.perf_counter() - wall
            out[phase + "_cpu"] = _cpu() - cpu
        del items, state
        evict_from_page_cache(directory)
        target = st.build_abstract_state(leaves, mesh)
        wall, cpu = time.perf_counter(), _cpu()
        restored = mgr.restore(2, target=target)
        jax.block_until_ready(restored)
        out["cold_restore"] = time.perf_counter() - wall
        out["cold_restore_cpu"] = _cpu() - cpu
    with open(os.path.join(directory, "2", "_METADATA.json")) as f:
        meta = json.load(f)
    out["checksummed_leaves"] = sum(leaf.get("checksum") == "crc32c" for item in meta["items"].values()
                                    for leaf in item.get("leaves", []))
    return out


def crc_seconds_per_gib() -> float:
    import numpy as np
    from resilax_ckpt.chunks import checksums

    buf = np.ones(1 << 30, np.uint8)
    checksums.crc32c(buf[: 1 << 20])
    cpu = time.thread_time()
    checksums.crc32c(buf)
    return time.thread_time() - cpu


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m resilax_bench.checksum_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--target", default="/tmp")
    p.add_argument("--child", nargs=2, metavar=("DIR", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        with open(args.child[1], "w") as f:
            json.dump(child(args.child[0], args.size_gib), f)
        return 0
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (here, env.get("PYTHONPATH", "")) if x)
    results: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    for i in range(args.rounds):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            directory = tempfile.mkdtemp(prefix=f"resilax-crc-{mode}-", dir=args.target)
            out = os.path.join(directory + ".json")
            mode_env = {**env, "RESILAX_CKPT_CHECKSUMS": "none"} if mode == "off" else env
            try:
                subprocess.run([sys.executable, "-m", "resilax_bench.checksum_cost", "--size-gib", str(args.size_gib),
                                "--child", directory, out], env=mode_env, check=True)
                with open(out) as f:
                    rec = json.load(f)
            finally:
                shutil.rmtree(directory, ignore_errors=True)
                if os.path.exists(out):
                    os.remove(out)
            results[mode].append(rec)
            print(f"round {i} checksums {mode}: " + ", ".join(
                f"{ph} {rec[ph]:.2f} s (cpu {rec[ph + '_cpu']:.2f} s)" for ph in PHASES)
                + f"; {rec['checksummed_leaves']:.0f} checksummed leaves; load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"crc32c of 1 GiB on one thread: {crc_seconds_per_gib():.3f} CPU s")
    for ph in PHASES:
        for kind in ("", "_cpu"):
            on = [r[ph + kind] for r in results["on"]]
            off = [r[ph + kind] for r in results["off"]]
            ratios = [a / b for a, b in zip(on, off, strict=True)]
            print(f"{ph}{kind or '_wall'}: with {statistics.median(on):.3f} s, without {statistics.median(off):.3f} s, "
                  f"ratio median {statistics.median(ratios):.3f} (per round {', '.join(f'{r:.2f}' for r in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
