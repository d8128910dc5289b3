"""SIGTERM to the final commit: what a spot VM's 30 s (15 s for non-system pods on GKE) has to hold.

N real JAX processes (`jax.distributed` on 127.0.0.1, gloo, 8 fake CPU devices in all) train with a
local tier (one folder per process, as one host each, in /dev/shm: `checkpoint.local.medium: Memory`,
or on disk with `--tier disk`) and a routine save every `--every` steps. Once every process is past
step `--warm`, one process (not process 0) gets SIGTERM at a random moment within a step, as the
kubelet's graceful node shutdown sends it. Every process then agrees on one step, saves it to its
local tier and stops (resilax_ckpt, issue 18 item 2). Measured from the SIGTERM:
- `agreed`: until the agreed step's `save()` started (the wait for the step boundary and the agreement);
- `committed`: until the last process's local commit of that step (`save()` + `wait()` returned);
- `exited`: until the last process exited 75 (`jax.distributed` shut down);
- `persisted`: until the sidecars' uploaders (the real `Uploader.run_once`, one per process, in
  parallel) copied that step from the local tiers to a persistent folder on disk and committed it
  there. They start as soon as every process has recorded its final save (`stopped.json`), while the
  trainers shut down, as the real uploader does at its next poll (within `RESILAX_SIDECAR_POLL_SECONDS`,
  1 s by default; here 0.05 s); `uploaded` is the upload alone.

    python bench/sigterm_final_save.py                       # the demo's state and 1 GiB, 3 rounds each
    python bench/sigterm_final_save.py --state 1gib --rounds 5 --step-seconds 1.0 --tier disk

States: `demo` is examples/train.py's (an MLP with Adam, 25 KiB); `1gib` is the benchmark's 0.98 GiB
transformer-like state (bench/resilax_bench/state.py) on mesh (4, 2). The training step is a sleep of
`--step-seconds` (the signal's wait for the step boundary is part of what is measured).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from resilax_local.processes import free_port

ROOT = Path(__file__).resolve().parents[1]


# ---- one training process ---------------------------------------------------------------------


def build_state(kind: str) -> Any:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if kind == "demo":
        sys.path.insert(0, str(ROOT / "examples"))
        import optax
        import train

        mesh = train.make_mesh()
        params = train.init_params(mesh)
        opt_state = jax.tree.map(lambda a: a if isinstance(a.sharding, NamedSharding)
                                 else jax.device_put(a, NamedSharding(mesh, P())), optax.adam(0.05).init(params))
        return {"params": params, "opt_state": opt_state, "meta": {"step": 0}}
    sys.path.insert(0, str(ROOT / "bench"))
    from resilax_bench import state as bench_state

    mesh = Mesh(np.array(jax.devices()).reshape(bench_state.SAVE_MESH), bench_state.MESH_AXES)
    flat = {}
    for i, spec in enumerate(bench_state.build_leaf_specs(1.0)):
        sharding = NamedSharding(mesh, P(*spec.spec))
        value = bench_state.fill_leaf(spec, i)
        flat[spec.path] = jax.make_array_from_callback(spec.shape, sharding, lambda idx, v=value: v[idx])
    return bench_state.nest(flat)


def worker(args: dict[str, Any]) -> int:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // args['processes']}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args["coordinator"], args["processes"], args["pid"], initialization_timeout=120)
    import resilax_ckpt as rc

    pid = jax.process_index()
    state = build_state(args["state"])
    options = rc.ManagerOptions(local_tier=True, keep_last=None, save_every_steps=args["every"],
                                control_dir=os.path.join(args["control"], str(pid)))
    with rc.CheckpointManager(os.path.join(args["local"], str(pid)), options) as mgr:
        for step in range(1, 100_000):
            time.sleep(args["step_seconds"])  # the training step
            if step == args["warm"]:
                Path(args["ready"], str(pid)).touch()
            started = time.time()
            mgr.save(step, state)
            if mgr.should_stop:
                committed = time.time()
                print("RESULT " + json.dumps({"step": step, "save_started": started, "committed": committed}),
                      flush=True)
                return int(rc.EXIT_CODE_STOPPED)
    return 1


# ---- the harness ------------------------------------------------------------------------------


def upload(local: Path, persistent: Path, step: int, processes: int, control: Path) -> float:
    """The sidecars' part: each process's uploader copies its local step; the last one commits."""
    from resilax_sidecar.config import SidecarConfig
    from resilax_sidecar.metrics import SidecarMetrics
    from resilax_sidecar.store import LocalFolderStore
    from resilax_sidecar.uploader import Uploader

    store = LocalFolderStore(persistent)
    uploaders = [Uploader(SidecarConfig(control_dir=control / f"sidecar-{p}", checkpoint_dir=str(persistent),
                                        local_dir=local / str(p), process_id=p, num_processes=processes),
                          store, SidecarMetrics()) for p in range(processes)]
    started = time.perf_counter()
    threads = [threading.Thread(target=u.run_once) for u in uploaders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for u in uploaders:  # the ones that finished before the last marker see the commit on a second pass
        if u.state.newest_persisted != step:
            u.run_once()
    seconds = time.perf_counter() - started
    if not (persistent / str(step) / "_COMMIT").exists():
        raise RuntimeError(f"step {step} was not committed in {persistent}")
    return seconds


def one_round(state: str, processes: int, step_seconds: float, every: int, warm: int, tier: str) -> dict[str, float]:
    base = Path(tempfile.mkdtemp(prefix="resilax-sigterm-", dir="/dev/shm" if tier == "shm" else None))
    disk = Path(tempfile.mkdtemp(prefix="resilax-sigterm-persistent-"))
    local, control, ready = base / "local", base / "control", base / "ready"
    ready.mkdir(parents=True)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "ckpt_lib"), os.environ.get("PYTHONPATH", "")]))
    procs = []
    try:
        for pid in range(processes):
            a = {"state": state, "processes": processes, "pid": pid, "coordinator": f"127.0.0.1:{port}",
                 "local": str(local), "control": str(control), "ready": str(ready), "every": every, "warm": warm,
                 "step_seconds": step_seconds}
            procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(a)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 600
        while len(list(ready.iterdir())) < processes:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError("the workers did not get going: "
                                   + "".join(p.communicate()[0].decode(errors="replace")[-2000:] for p in procs))
            time.sleep(0.05)
        time.sleep(random.uniform(0, step_seconds))
        victim = procs[processes - 1]
        signalled = time.time()
        victim.send_signal(signal.SIGTERM)
        upload_result: dict[str, float] = {}

        def uploads() -> None:
            from resilax_ckpt.control.requests import read_stop_record

            while True:
                steps = {read_stop_record(str(control / str(p))) for p in range(processes)}
                if None not in steps or time.time() - signalled > 600:
                    break
                time.sleep(0.05)
            if len(steps) == 1 and None not in steps:
                upload_result["uploaded"] = upload(local, disk / "persistent", steps.pop(), processes, control)
                upload_result["persisted"] = time.time() - signalled

        uploader = threading.Thread(target=uploads)
        uploader.start()
        results, exited = [], 0.0
        for p in procs:
            out, _ = p.communicate(timeout=600)
            exited = max(exited, time.time())
            text = out.decode(errors="replace")
            lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 75 or not lines:
                raise RuntimeError(f"worker exited {p.returncode}:\n{text[-3000:]}")
            results.append(json.loads(lines[-1][len("RESULT "):]))
        steps = {r["step"] for r in results}
        if len(steps) != 1:
            raise RuntimeError(f"the processes stopped at different steps: {sorted(steps)}")
        step = steps.pop()
        uploader.join()
        if "persisted" not in upload_result:
            raise RuntimeError(f"step {step} was not uploaded")
        return {"agreed": max(r["save_started"] for r in results) - signalled,
                "committed": max(r["committed"] for r in results) - signalled,
                "exited": exited - signalled, **upload_result,
                "bytes": sum(f.stat().st_size for f in (local / "0" / str(step)).rglob("*") if f.is_file())}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--state", choices=["demo", "1gib", "both"], default="both")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-seconds", type=float, default=0.5, help="the training step (a sleep)")
    parser.add_argument("--every", type=int, default=5, help="routine save every this many steps")
    parser.add_argument("--warm", type=int, default=6, help="SIGTERM once every process is past this step")
    parser.add_argument("--tier", choices=["shm", "disk"], default="shm")
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    states = ["demo", "1gib"] if args.state == "both" else [args.state]
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in states}
    for _ in range(args.rounds):
        for s in states:  # interleaved: the machine's speed drifts
            runs[s].append(one_round(s, args.processes, args.step_seconds, args.every, args.warm, args.tier))
            print(f"{s}: " + ", ".join(f"{k} {v:.2f}" for k, v in runs[s][-1].items() if k != "bytes"), flush=True)
    print(f"\n{args.processes} processes, local tier in {'/dev/shm' if args.tier == 'shm' else 'a disk folder'}, "
          f"step {args.step_seconds} s, {args.rounds} rounds; seconds from the SIGTERM, median (min-max)")
    print("| state | agreed step's save starts | committed (local tier) | trainers exited (75) | "
          "persisted (uploaded + committed, a disk folder) | the upload alone |")
    print("|---|---:|---:|---:|---:|---:|")
    for s, rs in runs.items():
        def cell(key: str, rs: list[dict[str, float]] = rs) -> str:
            values = [r[key] for r in rs]
            return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"
        size = rs[0]["bytes"] * args.processes
        print(f"| {s} ({size / 2**20:.2f} MiB in the local tiers) | {cell('agreed')} | {cell('committed')} | "
              f"{cell('exited')} | {cell('persisted')} | {cell('uploaded')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
