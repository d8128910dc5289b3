"""A multi-process generation start of examples/train.py, launch to restore and to first step (issue 39):
``python -m resilax_bench.genstart [--checkout DIR] [--trials 5] [--processes 4] [--late 0 2] [--json F]``.

What the goodput bench calls `jax_startup` (a generation's pods running to its restore beginning, and
its restore's end to its first step), without the cluster: per trial, `--processes` trainers of
`DIR/examples/train.py` (each with `--devices` CPU devices, gloo, the coordinator on 127.0.0.1) restore
the same committed step (a fresh copy of it each trial) and take one more step. Process 0, which runs
JAX's coordination service, is launched `late` seconds after the others (0: all at once): a new pod 0
whose survivors' trainers start sooner. Per trial: from the last launch to the last process's restore
beginning (`to_restore`), to the last restore ending, and to the first step (process 0's). `--checkout`
runs another copy of the repository (e.g. a worktree at an older commit) with its own resilax_ckpt,
for before/after on the same machine; the trials of several checkouts alternate
(``--checkout A --checkout B``). CPU only: a figure from it is never a TPU figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(checkout: Path, devices: int, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILAX_", "JAX_"))}
    env.update({"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
                "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join([str(checkout / "ckpt_lib"), env.get("PYTHONPATH", "")]),
                "RESILAX_SAVE_EVERY_STEPS": "1000", "RESILAX_EXIT_GRACE_SECONDS": "0", **extra})
    return env


def make_checkpoint(checkout: Path, folder: Path, devices: int) -> None:
    """One committed step (4) from one process, restorable on any mesh."""
    proc = subprocess.run([sys.executable, str(checkout / "examples" / "train.py"), "--steps", "4"],
                          env=_env(checkout, devices, {"RESILAX_CHECKPOINT_DIR": str(folder)}),
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"genstart: making the checkpoint failed ({proc.returncode}): {proc.stderr[-2000:]}")


def summarize(launches: list[float], outputs: list[str]) -> dict[str, float]:
    """One trial's figures from each process's launch time and stdout (pure)."""
    began, ended, first = [], [], []
    for out in outputs:
        for line in out.splitlines():
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if "restored" in record:
                began.append(float(record["began"]))
                ended.append(float(record["time"]))
            elif "step" in record and not first:
                first.append(float(record["time"]))
    if len(began) != len(outputs) or not first:
        raise ValueError(f"a trial without every process's restore line ({len(began)} of {len(outputs)}) or a step")
    last = max(launches)
    return {"to_restore": max(began) - last, "to_restore_end": max(ended) - last, "to_first_step": first[0] - last}


def trial(checkout: Path, seed_ckpt: Path, work: Path, processes: int, devices: int, late: float) -> dict[str, float]:
    ckpt = work / "ckpt"
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.copytree(seed_ckpt, ckpt)
    port = free_port()
    procs: list[subprocess.Popen[str]] = []
    launches: list[float] = [0.0] * processes
    for pid in [*range(1, processes), 0]:
        if pid == 0 and late:
            time.sleep(late)
        extra = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(processes),
                 "JAX_PROCESS_ID": str(pid), "RESILAX_CHECKPOINT_DIR": str(ckpt), "RESILAX_GENERATION": "2"}
        launches[pid] = time.time()
        procs.append(subprocess.Popen([sys.executable, str(checkout / "examples" / "train.py"), "--steps", "5"],
                                      env=_env(checkout, devices, extra), stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True))
    outputs = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"genstart: a trainer exited {p.returncode}")
        outputs.append(out)
    return summarize(launches, outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", action="append", type=Path, help="repository copies to run (default: this one)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
    parser.add_argument("--late", type=float, nargs="+", default=[0.0, 2.0],
                        help="seconds process 0 is launched after the others (each value a case)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    checkouts = [c.resolve() for c in (args.checkout or [ROOT])]
    results: dict[str, Any] = {"benchmark": "genstart", "platform": "cpu", "started": time.time(),
                               "command": " ".join(sys.argv), "processes": args.processes, "devices": args.devices,
                               "runs": []}
    with tempfile.TemporaryDirectory(prefix="resilax-genstart-") as tmp:
        work = Path(tmp)
        seed = work / "seed"
        make_checkpoint(checkouts[0], seed, args.processes * args.devices)
        for t in range(args.trials):
            for late in args.late:
                for checkout in checkouts:
                    r = trial(checkout, seed, work, args.processes, args.devices, late)
                    r.update(checkout=str(checkout), late=late, trial=t, load=os.getloadavg()[0])
                    results["runs"].append(r)
                    print(json.dumps(r), flush=True)
    print(f"\nmedians over {args.trials} trials (platform cpu, {args.processes} processes x {args.devices} devices):")
    for late in args.late:
        for checkout in checkouts:
            rs = [r for r in results["runs"] if r["late"] == late and r["checkout"] == str(checkout)]
            med = {k: round(statistics.median(r[k] for r in rs), 2) for k in ("to_restore", "to_restore_end",
                                                                             "to_first_step")}
            print(f"  late {late:g} s  {checkout}: {med}")
            results.setdefault("medians", []).append({"late": late, "checkout": str(checkout), **med})
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
