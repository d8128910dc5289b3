"""Checkpoint benchmark driver: ``python -m resilax_bench [--size-gib 1] [--repeats 3] [--target /tmp]
[--libs resilax,orbax,dcp,numpy] [--quick]`` (``bench/run`` sets up the venv and calls this).

Rounds are interleaved (every library once, then dd, then the next round) so the machine's drift hits
all alike. In a round each library runs in two fresh processes: one saves (steps 1 and 2), the next
restores step 2, so its first restore is a fresh process's. A library that cannot be imported or
fails is reported as such, with its error; nothing is made up.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from resilax_bench import report
from resilax_bench.disk import measure_dd
from resilax_bench.libraries import IMPORTS, LIBRARIES

DEFAULT_LIBS = ("resilax", "orbax", "dcp", "numpy")
QUICK_GIB = 1 / 16
WORKER_TIMEOUT_S = 900


def _available(lib: str) -> str | None:
    """None when ``lib`` can be imported here, else why not (without importing it)."""
    mod = IMPORTS[lib]
    try:
        if importlib.util.find_spec(mod.split(".")[0]) is None:
            return f"{mod} is not installed"
    except (ImportError, ValueError) as e:
        return f"{mod}: {e}"
    return None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    flags = env.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
    env["JAX_PLATFORMS"] = "cpu"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


def run_worker(lib: str, phase: str, directory: str, size_gib: float, scratch: str) -> dict[str, Any]:
    out = os.path.join(scratch, f"{lib}-{phase}.json")
    cmd = [
        sys.executable,
        "-m",
        "resilax_bench.worker",
        "--lib",
        lib,
        "--phase",
        phase,
        "--dir",
        directory,
        "--size-gib",
        str(size_gib),
        "--out",
        out,
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {WORKER_TIMEOUT_S} s"}
    wall = time.perf_counter() - t0
    try:
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        tail = (proc.stderr or "").strip().splitlines()[-5:]
        return {"error": f"worker exited {proc.returncode} without a result: " + " | ".join(tail)}
    result["wall_s"] = wall
    return result


def machine_facts(target: str) -> dict[str, Any]:
    from importlib import metadata

    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    mem_kib = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    fs = subprocess.run(["df", "-hT", target], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": os.cpu_count(),
        "mem_gib": round(mem_kib / (1 << 20), 1),
        "target": target,
        "filesystem": " ".join(fs.split()),
        "python": platform.python_version(),
        "versions": {
            d: version(d)
            for d in ("jax", "jaxlib", "tensorstore", "numpy", "orbax-checkpoint", "torch", "resilax")
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/run", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target", default="/tmp", help="folder on the storage to measure (default /tmp)")
    p.add_argument("--libs", default=",".join(DEFAULT_LIBS))
    p.add_argument(
        "--quick", action="store_true", help=f"{QUICK_GIB * 1024:.0f} MiB state, 1 round (smoke test)"
    )
    p.add_argument("--json", help="also write every raw figure to this file")
    p.add_argument("--markdown", help="also write the table to this file")
    p.add_argument(
        "--render", metavar="JSON", help="print the tables of an earlier run's --json file and exit"
    )
    args = p.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        saved.setdefault(
            "libs", [lib for lib in DEFAULT_LIBS if any(lib in r["libs"] for r in saved["rounds"])]
        )
        print(render_run(saved))
        return 0
    if args.quick:
        args.size_gib = QUICK_GIB
        if "--repeats" not in (argv if argv is not None else sys.argv):
            args.repeats = 1
    wanted = [lib.strip() for lib in args.libs.split(",") if lib.strip()]
    unknown = [lib for lib in wanted if lib not in LIBRARIES]
    if unknown:
        p.error(f"--libs: unknown {', '.join(unknown)}; known: {', '.join(LIBRARIES)}")

    errors: dict[str, str] = {}
    libs = []
    for lib in wanted:
        why = _available(lib)
        if why:
            errors[lib] = f"unavailable: {why}"
        else:
            libs.append(lib)

    facts = machine_facts(args.target)
    root = tempfile.mkdtemp(prefix="resilax-bench-", dir=args.target)
    scratch = tempfile.mkdtemp(prefix="resilax-bench-results-")
    print(
        f"resilax bench: {args.size_gib:g} GiB, {args.repeats} round(s), target {args.target} ({facts['filesystem']}), "
        f"libs {', '.join(libs) or 'none'}; load {os.getloadavg()}",
        file=sys.stderr,
        flush=True,
    )
    rounds: list[dict[str, Any]] = []
    state_bytes = 0
    try:
        for i in range(args.repeats):
            rnd: dict[str, Any] = {"round": i, "load_before": os.getloadavg(), "libs": {}}
            for lib in libs:
                if lib in errors:
                    continue
                directory = os.path.join(root, lib)
                os.makedirs(directory)
                rec = {"save": run_worker(lib, "save", directory, args.size_gib, scratch)}
                if "error" not in rec["save"]:
                    rec["restore"] = run_worker(lib, "restore", directory, args.size_gib, scratch)
                shutil.rmtree(directory, ignore_errors=True)
                failed = next((rec[ph] for ph in ("save", "restore") if "error" in rec.get(ph, {})), None)
                if failed:
                    errors[lib] = f"failed in round {i}: {failed['error']}"
                    print(failed.get("traceback", ""), file=sys.stderr)
                    continue
                rnd["libs"][lib] = rec
                state_bytes = rec["save"]["state_bytes"]
                m = report.lib_metrics(rec)
                print(
                    f"  round {i} {lib}: save {m.get('save_s', 0):.2f} s (blocked {m.get('blocked_s', 0):.3f}), "
                    f"first restore {m.get('first_restore_s', 0):.2f} s, cold {m.get('cold_restore_s', 0):.2f} s, "
                    f"load {os.getloadavg()[0]:.1f}",
                    file=sys.stderr,
                    flush=True,
                )
            nbytes = state_bytes or int(args.size_gib * (1 << 30))
            rnd["dd"] = measure_dd(root, nbytes)
            rnd["load_after"] = os.getloadavg()
            print(
                f"  round {i} dd: write {rnd['dd']['write_gbps']:.2f} GB/s, cold read {rnd['dd']['read_gbps']:.2f} GB/s",
                file=sys.stderr,
                flush=True,
            )
            rounds.append(rnd)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)

    measured = [lib for lib in libs if lib not in errors]
    data = {"args": vars(args), "facts": facts, "errors": errors, "libs": measured, "rounds": rounds}
    text = render_run(data)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**data, "summary": report.summarize(rounds, measured)}, f, indent=1)
    return 0


def render_run(data: dict[str, Any]) -> str:
    """The markdown of one run (``--json`` output): header with the machine's state, then the tables."""
    rounds, facts, measured = data["rounds"], data["facts"], data["libs"]
    summary = report.summarize(rounds, measured)
    first = next((rec["save"] for r in rounds for rec in r["libs"].values()), {})
    state_bytes, leaves = first.get("state_bytes", 0), first.get("leaves", 0)
    loads = [r["load_before"][0] for r in rounds] + [r["load_after"][0] for r in rounds]
    loads += [
        rec[ph][k][0]
        for r in rounds
        for rec in r["libs"].values()
        for ph in ("save", "restore")
        for k in ("load_before", "load_after")
        if k in rec.get(ph, {})
    ]
    fs = facts["filesystem"].split()
    header = (
        f"### {facts['target']} ({fs[1] if len(fs) > 1 else '?'}), {state_bytes / (1 << 30):.2f} GiB in {leaves} leaves, "
        f"{len(rounds)} round(s), {facts['date']}\n\n"
        f"Load average (1 min) at the start and end of every process: {min(loads, default=0):.1f}-"
        f"{max(loads, default=0):.1f} on {facts['nproc']} CPUs. Cold reads: the checkpoint's files evicted from the "
        "page cache first (no effect on tmpfs). "
        f"dd: new-file write {_med([r['dd']['write_gbps'] for r in rounds])} GB/s, "
        f"rewrite {_med([r['dd']['rewrite_gbps'] for r in rounds])} GB/s, "
        f"cold read {_med([r['dd']['read_gbps'] for r in rounds])} GB/s (medians)."
    )
    return report.render(summary, measured, data["errors"], header)


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "—"


if __name__ == "__main__":
    sys.exit(main())
