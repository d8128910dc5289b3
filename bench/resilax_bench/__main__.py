"""Checkpoint benchmark driver: ``python -m resilax_bench [--size-gib 1] [--repeats 3] [--target /tmp]
[--libs resilax,orbax,dcp,numpy] [--quick]`` (``bench/run`` sets up the venv and calls this).

Rounds are interleaved (every library once, then dd, then the next round) so the machine's drift hits
all alike. In a round each library runs in two fresh processes: one saves (steps 1 and 2), the next
restores step 2, so its first restore is a fresh process's. A library that cannot be imported or
fails is reported as such, with its error; nothing is made up.

``--accel``: the same rounds on the devices present (whatever JAX_PLATFORMS selects; on one TPU chip a
(1, 1) mesh), with a state that a donating jitted step changes before every save, and each round also
measures the device's own transfer times in a process of its own (``worker.py``, ``accel.py``). Only
one process at a time opens the devices: this driver never does. With RESILAX_BENCH_PROFILE set, one
extra save and one extra restore per library are profiled, apart from the measured ones.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from resilax_bench import report
from resilax_bench.disk import measure_dd
from resilax_bench.libraries import IMPORTS, LIBRARIES, parse_options

DEFAULT_LIBS = ("resilax", "orbax", "dcp", "numpy")
ACCEL_LIBS = ("resilax", "orbax", "numpy")
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


def _env(accel: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    if not accel:
        flags = env.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            env["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
        env["JAX_PLATFORMS"] = "cpu"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


def run_worker(
    lib: str,
    phase: str,
    directory: str,
    size_gib: float,
    scratch: str,
    extra: list[str] | None = None,
    accel: bool = False,
    timeout_s: float = WORKER_TIMEOUT_S,
) -> dict[str, Any]:
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
        *(extra or []),
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=_env(accel), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:g} s"}
    wall = time.perf_counter() - t0
    try:
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
    except (OSError, ValueError):
        tail = (proc.stderr or "").strip().splitlines()[-5:]
        return {"error": f"worker exited {proc.returncode} without a result: " + " | ".join(tail)}
    result["wall_s"] = wall
    return result


def commit_facts() -> dict[str, Any]:
    """The commit measured: RESILAX_COMMIT when set, else ``git`` in the checkout, else the first line
    of the file RESILAX_COMMIT_FILE names (default ``<checkout>/.resilax-commit``), else "unknown".
    The variable comes first: the accelerator host's copy of the checkout carried a stale ``.git``
    (2026-12-07: HEAD said b477a40, the files were 2f8191d's, `dirty` true)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if os.environ.get("RESILAX_COMMIT"):
        return {"commit": os.environ["RESILAX_COMMIT"], "commit_source": "RESILAX_COMMIT"}
    try:
        head = subprocess.run(
            ["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
        )
        if head.returncode == 0 and head.stdout.strip():
            dirty = subprocess.run(
                ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            return {"commit": head.stdout.strip(), "commit_source": "git", "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        pass
    path = os.environ.get("RESILAX_COMMIT_FILE") or os.path.join(root, ".resilax-commit")
    try:
        with open(path) as f:
            line = f.readline().strip()
        if line:
            return {"commit": line, "commit_source": path}
    except OSError:
        pass
    return {"commit": "unknown", "commit_source": "none (no git, no RESILAX_COMMIT, no commit file)"}


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
            for d in (
                "jax",
                "jaxlib",
                "libtpu",
                "libtpu-nightly",
                "tensorstore",
                "numpy",
                "orbax-checkpoint",
                "torch",
                "resilax",
            )
        },
        **commit_facts(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/run", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target", default="/tmp", help="folder on the storage to measure (default /tmp)")
    p.add_argument("--libs", help=f"default {','.join(DEFAULT_LIBS)}; with --accel {','.join(ACCEL_LIBS)}")
    p.add_argument(
        "--accel",
        action="store_true",
        help="the devices present (JAX_PLATFORMS as set), a state changed by a donating step, device transfer floors",
    )
    p.add_argument("--steady-saves", type=int, help="saves after the first (default 3)")
    p.add_argument("--restores", help="restores to time, of first,cold,reshard,params (default all four)")
    p.add_argument("--floor-repeats", type=int, default=3, help="--accel: repeats of each transfer floor")
    p.add_argument(
        "--resilax-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra resilax_ckpt ManagerOptions field (repeatable), e.g. a forced save path",
    )
    p.add_argument(
        "--profile-libs",
        default="resilax",
        help="--accel with RESILAX_BENCH_PROFILE set: the libraries that get a profiled extra save and restore",
    )
    p.add_argument("--worker-timeout", type=float, default=WORKER_TIMEOUT_S, help="seconds per worker process")
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
        saved.setdefault("errors", {})
        print(render_run(saved))
        return 0
    if args.quick:
        args.size_gib = QUICK_GIB
        if "--repeats" not in (argv if argv is not None else sys.argv):
            args.repeats = 1
    if args.libs is None:
        args.libs = ",".join(ACCEL_LIBS if args.accel else DEFAULT_LIBS)
    wanted = [lib.strip() for lib in args.libs.split(",") if lib.strip()]
    unknown = [lib for lib in wanted if lib not in LIBRARIES]
    if unknown:
        p.error(f"--libs: unknown {', '.join(unknown)}; known: {', '.join(LIBRARIES)}")
    if args.accel and "dcp" in wanted:
        p.error("--libs: dcp saves torch CPU tensors, not device arrays; not run with --accel")
    known_restores = ("first", "cold", "reshard", "params")
    restores = [r.strip() for r in (args.restores or ",".join(known_restores)).split(",") if r.strip()]
    if not restores or any(r not in known_restores for r in restores):
        p.error(f"--restores: {args.restores!r}; allowed: a comma list of {', '.join(known_restores)}")
    if args.steady_saves is not None and args.steady_saves < 1:
        p.error(f"--steady-saves: {args.steady_saves}; need at least 1 (the steady state is the saves after the first)")
    if not args.accel and (args.steady_saves not in (None, 3) or args.restores):
        p.error("--steady-saves and --restores shorten an --accel run; the CPU run keeps its fixed steps")
    try:
        parse_options(args.resilax_option)
    except ValueError as e:
        p.error(str(e))
    extra = [f"--resilax-option={o}" for o in args.resilax_option]
    if args.accel:
        extra += ["--accel", "--steady-saves", str(args.steady_saves or 3), "--restores", ",".join(restores)]
    profile_libs = {lib.strip() for lib in args.profile_libs.split(",") if lib.strip()}

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
    interrupted = None

    def stop(signum: int, frame: Any) -> None:
        # A step timeout (bench/tpu/run-all) sends SIGTERM: the worker in flight is killed by
        # subprocess.run on the way out, and what was measured so far is still written.
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        for i in range(args.repeats):
            rnd: dict[str, Any] = {"round": i, "load_before": os.getloadavg(), "libs": {}}
            rounds.append(rnd)
            for lib in libs:
                if lib in errors:
                    continue
                directory = os.path.join(root, lib)
                os.makedirs(directory)
                # --accel: one extra save and restore, profiled apart from the measured ones.
                profile = args.accel and bool(os.environ.get("RESILAX_BENCH_PROFILE")) and lib in profile_libs
                lib_extra = extra + (["--profile-extra"] if profile else [])
                rec = {"save": run_worker(lib, "save", directory, args.size_gib, scratch, lib_extra, args.accel, args.worker_timeout)}
                if "error" not in rec["save"]:
                    rec["restore"] = run_worker(
                        lib, "restore", directory, args.size_gib, scratch, lib_extra, args.accel, args.worker_timeout
                    )
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
            if args.accel and args.floor_repeats > 0:
                fl = run_worker(
                    "numpy",
                    "floors",
                    root,
                    args.size_gib,
                    scratch,
                    ["--accel", "--floor-repeats", str(args.floor_repeats)],
                    True,
                    args.worker_timeout,
                )
                if "error" in fl:
                    errors[f"floors (round {i})"] = fl["error"]
                    print(fl.get("traceback", ""), file=sys.stderr)
                else:
                    rnd["floors"] = fl["floors"]
                    f = fl["floors"]
                    print(
                        f"  round {i} device floors: d2h batched {f['d2h_batched_s']:.3f} s, leaf by leaf "
                        f"{f['d2h_leafwise_s']:.3f} s, one array {f['d2h_one_s']:.3f} s; h2d batched "
                        f"{f['h2d_batched_s']:.3f} s, leaf by leaf {f['h2d_leafwise_s']:.3f} s, one array {f['h2d_one_s']:.3f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                rnd["devices"] = fl.get("devices")
            if args.accel and not rnd.get("devices"):
                rnd["devices"] = next(
                    (rec[ph]["devices"] for rec in rnd["libs"].values() for ph in ("save", "restore") if "devices" in rec.get(ph, {})),
                    None,
                )
            nbytes = state_bytes or int(args.size_gib * (1 << 30))
            try:
                rnd["dd"] = measure_dd(root, nbytes)
            except (OSError, subprocess.SubprocessError) as e:
                errors[f"dd (round {i})"] = f"{type(e).__name__}: {e}"
            rnd["load_after"] = os.getloadavg()
            if "dd" in rnd:
                print(
                    f"  round {i} dd: write {rnd['dd']['write_gbps']:.2f} GB/s, cold read {rnd['dd']['read_gbps']:.2f} GB/s",
                    file=sys.stderr,
                    flush=True,
                )
    except SystemExit as e:
        interrupted = f"stopped by a signal (exit {e.code}) in round {len(rounds) - 1}: the figures below are partial"
        print(f"resilax bench: {interrupted}", file=sys.stderr, flush=True)
        errors["run"] = interrupted
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)

    measured = [lib for lib in libs if lib not in errors]
    facts["devices"] = next((r["devices"] for r in rounds if r.get("devices")), None)
    data = {"args": vars(args), "facts": facts, "errors": errors, "libs": measured, "rounds": rounds}
    text = render_run(data)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**data, "summary": report.summarize(rounds, measured)}, f, indent=1)
    return 1 if interrupted else 0


def render_run(data: dict[str, Any]) -> str:
    """The markdown of one run (``--json`` output): header with the machine's state, then the tables."""
    rounds, facts, measured = data["rounds"], data["facts"], data["libs"]
    summary = report.summarize(rounds, measured)
    first = next((rec["save"] for r in rounds for rec in r["libs"].values()), {})
    state_bytes, leaves = first.get("state_bytes", 0), first.get("leaves", 0)
    loads = [r["load_before"][0] for r in rounds] + [r["load_after"][0] for r in rounds if "load_after" in r]
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
        f"dd: new-file write {_med([r['dd']['write_gbps'] for r in rounds if 'dd' in r])} GB/s, "
        f"rewrite {_med([r['dd']['rewrite_gbps'] for r in rounds if 'dd' in r])} GB/s, "
        f"cold read {_med([r['dd']['read_gbps'] for r in rounds if 'dd' in r])} GB/s (medians)."
    )
    notes = []
    devices = facts.get("devices") or next((r["devices"] for r in rounds if r.get("devices")), None)
    if devices or data.get("args", {}).get("accel"):
        d = devices or {}
        header += (
            f"\n\nDevices: {d.get('device_count', '?')} x {d.get('device_kind', '?')} (platform "
            f"{d.get('platform', '?')}); a donating jitted step changes the state before every save and "
            "runs right after save() returns."
        )
    if "commit" in facts:
        v = facts.get("versions", {})
        header += (
            f"\n\nCommit {facts['commit'][:12]} ({facts.get('commit_source', '?')}"
            f"{', uncommitted changes' if facts.get('dirty') else ''}); "
            + ", ".join(f"{k} {v[k]}" for k in ("jax", "jaxlib", "libtpu", "tensorstore", "orbax-checkpoint", "numpy") if v.get(k, "not installed") != "not installed")
            + "."
        )
    paths = [
        report.save_path_line(s)
        for r in rounds
        for s in r["libs"].get("resilax", {}).get("save", {}).get("saves", [])
        if s.get("save_info")
    ]
    opts = next((r["libs"]["resilax"]["save"].get("resilax_options") for r in rounds if "resilax" in r["libs"]), None)
    if opts:
        notes.append("resilax options: " + ", ".join(f"{k}={v}" for k, v in opts.items()))
    if "resilax" in measured and data.get("args", {}).get("accel"):
        notes.append(
            "resilax save report: " + ("; ".join(paths) if paths else "none (this resilax_ckpt reports no save path)")
        )
    accel = bool(data.get("args", {}).get("accel"))
    return report.render(summary, measured, data["errors"], header, state_bytes, notes, accel)


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "—"


if __name__ == "__main__":
    sys.exit(main())
