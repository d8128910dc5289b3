"""How long a job's FIRST save blocks the training loop: ``python -m resilax_bench.first_save``.

The first save of a process dispatches a device-side copy (8 fake CPU devices) that jit has not
compiled yet. resilax_ckpt compiles it ahead, in the background, when it first sees the state: at a
``save()`` call the policy does not save, or at ``restore()``. Each round runs, in fresh processes
(the bench's 1 GiB state, mesh (4, 2), under ``--target``):

  ``cold``      the manager's first call is the saving one (the benchmark's save phase does this)
  ``skipped``   a training loop: ``save(1)`` is not due (``save_every_steps=2``), a 1 s step, ``save(2)``
  ``restored``  a recovering job: ``restore()`` of the previous round's step, a 1 s step, ``save()``
  ``started``   a job started as Resilax's trainer starts (examples/transformer.py):
                ``restore_step_from_env(target=...)`` finds nothing, 1 s of making the state, ``save()``

and prints the median seconds the saving call blocked and the median durable time of that save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

MODES = ("cold", "skipped", "restored", "started")


def child(mode: str, directory: str, size_gib: float) -> dict[str, float]:
    import jax
    import resilax_ckpt as rc

    from resilax_bench import state as st
    from resilax_bench.profiling import profiled

    leaves = st.build_leaf_specs(size_gib)
    mesh = st.make_mesh(st.SAVE_MESH)
    state = st.build_jax_state(leaves, mesh, 0)
    items = {"params": state["params"], "opt_state": state["opt_state"]}
    step = 2
    with rc.CheckpointManager(directory, rc.ManagerOptions(save_every_steps=2, keep_last=1)) as mgr:
        if mode == "skipped":
            assert not mgr.save(1, items)
            time.sleep(1.0)
        elif mode == "started":
            target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), items)
            assert mgr.restore_step_from_env({}, target=target) is None
            time.sleep(1.0)
        elif mode == "restored":
            target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), items)
            restored = mgr.restore(target=target)
            saved = {k: st.checksum(v) for k, v in st.flatten(items).items()}
            got = {k: st.checksum(v) for k, v in st.flatten(restored).items()}
            if got != saved:
                raise RuntimeError(f"restored state differs from the saved one in {sorted(k for k in saved if got.get(k) != saved[k])[:5]}")
            items = restored
            step = mgr.latest_step() + 2
            time.sleep(1.0)
        with profiled("resilax", f"first-save-{mode}"):
            t0 = time.perf_counter()
            assert mgr.save(step, items)
            t1 = time.perf_counter()
            mgr.wait()
            t2 = time.perf_counter()
    return {"blocked_s": t1 - t0, "durable_s": t2 - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="/tmp")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.dir, args.size_gib)))
        return 0

    directory = os.path.join(args.target, f"resilax-first-save-{os.getpid()}")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    try:
        for r in range(args.rounds):
            for mode in MODES:
                if mode != "restored":
                    shutil.rmtree(directory, ignore_errors=True)
                out = subprocess.run(
                    [sys.executable, "-m", "resilax_bench.first_save", "--child", mode, "--dir", directory,
                     "--size-gib", str(args.size_gib)],
                    env=env, check=True, capture_output=True, text=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                results[mode].append(got)
                print(f"round {r + 1} {mode:9s} blocked {got['blocked_s']:.3f} s, durable {got['durable_s']:.3f} s",
                      flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\nmedians over {args.rounds} rounds ({args.size_gib} GiB under {args.target}):")
    for mode, runs in results.items():
        blocked = statistics.median(x["blocked_s"] for x in runs)
        durable = statistics.median(x["durable_s"] for x in runs)
        print(f"  {mode:9s} first save blocked {blocked:.3f} s, durable {durable:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
