"""One phase of one library in a fresh process: ``python -m resilax_bench.worker --lib L --phase P``.

save phase: build the state, then save steps 1-4 as a training job does, each library under its own
retention keeping the newest step (resilax ``keep_last=1``, Orbax ``max_to_keep=1``, DCP and numpy
delete the older folder): step 1 is the first save of a job (new files), steps 2-4 the steady state
(a library may reuse what retention retires). Each as ``save()`` (blocked time) then ``wait()``
(durable time), peak RSS over each.
restore phase (a new process): restore step 4 four times, the checkpoint's files evicted from the page cache before each:
``first`` (the first restore of this process), ``cold`` (plain, a warm process), ``reshard`` (mesh
(2, 4), specs transposed) and ``params`` (params only); each checked against the save's checksums.
Writes one JSON object to ``--out``; a failure is recorded there with its traceback, never hidden.

``--accel`` (the devices present, any platform; ``accel.py``): the meshes are (n, 1) and (1, n) on the
n devices there, the state changes before every save through a jitted step that donates the old state,
and each save is timed as a loop sees it: ``save()`` (blocked), the next donating step (whose time,
against a step without a save just before, shows any wait a save left behind), then ``wait()``
(durable, from the start of ``save()``). ``--steady-saves`` and ``--restores`` shorten the run;
``--profile-extra`` profiles one more save and one more cold restore, kept apart from the measured ones
(so a profile never slows a reported figure). A third phase, ``floors``, measures the device's own
transfer times (``accel.measure_floors``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from typing import Any

SAVE_STEPS = (1, 2, 3, 4)
REPORTED_STEP = SAVE_STEPS[-1]
RESTORES = (("first", "plain"), ("cold", "plain"), ("reshard", "reshard"), ("params", "params"))
STEP_FILE = "reported-step.json"


def _checksums(named: dict[str, Any]) -> dict[str, int]:
    from resilax_bench import state as st

    return {name: st.checksum(value) for name, value in named.items()}


def _compare(expected: dict[str, int], got: dict[str, int], kind: str) -> list[str]:
    names = [n for n in expected if kind != "params" or n.startswith("params/")]
    problems = [f"{n}: missing" for n in names if n not in got]
    problems += [f"{n}: unexpected" for n in got if n not in names]
    for n in names:
        if n in got and got[n] != expected[n]:
            problems.append(f"{n}: checksum {got[n]!r} != saved {expected[n]!r}")
    return problems


def run_save(lib: Any, directory: str, leaves: list[Any], seed: int, result: dict[str, Any]) -> None:
    from resilax_bench import state as st
    from resilax_bench.memory import PeakRSS, rss_bytes
    from resilax_bench.profiling import profiled

    result["rss_before_state"] = rss_bytes()
    t0 = time.perf_counter()
    lib.open_save(directory, leaves, seed)
    result["build_state_s"] = time.perf_counter() - t0
    result["rss_with_state"] = rss_bytes()
    state = lib.state
    expected = {"/".join(p): st.checksum(v) for p, v in st.flatten(state).items()}
    with open(os.path.join(directory, "expected.json"), "w") as f:
        json.dump(expected, f)
    saves = []
    for step in SAVE_STEPS:
        gc.collect()
        os.sync()
        with profiled(lib.name, f"save{step}"), PeakRSS() as mem:
            t0 = time.perf_counter()
            lib.save(step)
            t1 = time.perf_counter()
            lib.wait()
            t2 = time.perf_counter()
        saves.append(
            {
                "step": step,
                "blocked_s": t1 - t0,
                "durable_s": t2 - t0,
                "peak_rss": mem.peak,
                "rss_at_start": mem.start,
                "rss_method": mem.method,
            }
        )
    result["saves"] = saves
    lib.close()


def run_save_accel(
    lib: Any, directory: str, leaves: list[Any], seed: int, steady: int, profile_extra: bool, result: dict[str, Any]
) -> None:
    """The ``--accel`` save phase: a donating step before each save and right after it (module doc)."""
    import jax

    from resilax_bench import accel
    from resilax_bench import state as st
    from resilax_bench.memory import PeakRSS, rss_bytes
    from resilax_bench.profiling import profiled

    result["rss_before_state"] = rss_bytes()
    t0 = time.perf_counter()
    lib.open_save(directory, leaves, seed)
    # The first step compiles, and leaves arrays no host ever saw.
    lib.state = jax.block_until_ready(accel.train_step(lib.state))
    result["build_state_s"] = time.perf_counter() - t0
    result["rss_with_state"] = rss_bytes()
    result["hbm_with_state"] = accel.hbm_stats()
    steps = list(range(1, 2 + steady)) + ([2 + steady] if profile_extra else [])
    saves = []
    for step in steps:
        gc.collect()
        os.sync()
        t0 = time.perf_counter()
        lib.state = jax.block_until_ready(accel.train_step(lib.state))
        step_s = time.perf_counter() - t0
        if step == steps[-1]:
            expected = accel.device_checksums({"/".join(p): v for p, v in st.flatten(lib.state).items()})
            with open(os.path.join(directory, "expected.json"), "w") as f:
                json.dump(expected, f)
            with open(os.path.join(directory, STEP_FILE), "w") as f:
                json.dump({"step": step}, f)
        profile = profile_extra and step == steps[-1]
        with profiled(lib.name, "save") if profile else _nothing(), PeakRSS() as mem:
            t0 = time.perf_counter()
            lib.save(step)
            t1 = time.perf_counter()
            lib.state = jax.block_until_ready(accel.train_step(lib.state))
            t2 = time.perf_counter()
            lib.wait()
            t3 = time.perf_counter()
        entry = {
            "step": step,
            "blocked_s": t1 - t0,
            "step_after_save_s": t2 - t1,
            "step_s": step_s,
            "durable_s": t3 - t0,
            "peak_rss": mem.peak,
            "rss_at_start": mem.start,
            "rss_method": mem.method,
            "malloc_at_peak": mem.malloc_at_peak,
            "hbm": accel.hbm_stats(),
            "save_info": lib.save_info(),
        }
        if profile:
            result["profiled_save"] = entry
        else:
            saves.append(entry)
    result["saves"] = saves
    lib.close()


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()


def run_restore(
    lib: Any, directory: str, leaves: list[Any], result: dict[str, Any], restores: tuple[tuple[str, str], ...] = RESTORES,
    accel_mode: bool = False, profile_extra: bool = False,
) -> None:
    from resilax_bench.cache import evict_from_page_cache
    from resilax_bench.libraries import NotApplicable
    from resilax_bench.memory import PeakRSS, rss_bytes
    from resilax_bench.profiling import profiled

    with open(os.path.join(directory, "expected.json")) as f:
        expected = json.load(f)
    step = REPORTED_STEP
    if os.path.exists(os.path.join(directory, STEP_FILE)):
        with open(os.path.join(directory, STEP_FILE)) as f:
            step = int(json.load(f)["step"])
    if accel_mode:
        from resilax_bench import accel

        checksums = accel.device_checksums
    else:
        checksums = _checksums
    t0 = time.perf_counter()
    lib.open_restore(directory, leaves)
    result["open_s"] = time.perf_counter() - t0
    gc.collect()
    result["rss_before_restores"] = rss_bytes()
    done = []
    todo = list(restores) + ([("profiled", "plain")] if profile_extra else [])
    for label, kind in todo:
        gc.collect()
        entry: dict[str, Any] = {
            "label": label,
            "kind": kind,
            "evicted_files": evict_from_page_cache(directory),
        }
        # Outside --accel every restore is profiled when RESILAX_BENCH_PROFILE is set (as before);
        # with --accel only the extra one (--profile-extra) is.
        name = "restore" if label == "profiled" else f"restore-{label}"
        profile = label == "profiled" or not accel_mode
        try:
            with profiled(lib.name, name) if profile else _nothing(), PeakRSS() as mem:
                t0 = time.perf_counter()
                out = lib.restore(step, kind)
                entry["seconds"] = time.perf_counter() - t0
        except NotApplicable as e:
            entry["not_applicable"] = str(e)
            done.append(entry)
            continue
        entry.update(peak_rss=mem.peak, rss_at_start=mem.start, rss_method=mem.method)
        problems = _compare(expected, checksums(out), kind)
        if problems:
            raise RuntimeError(f"{lib.name} {label} restore of step {step} is wrong: " + "; ".join(problems[:5]))
        entry["checked_leaves"] = len(out)
        del out
        done.append(entry)
    result["restores"] = done
    lib.close()


def run_floors(leaves: list[Any], seed: int, repeats: int, result: dict[str, Any]) -> None:
    import jax

    from resilax_bench import accel
    from resilax_bench import state as st

    save_mesh, _ = accel.mesh_shapes(jax.device_count())
    result["floors"] = accel.measure_floors(leaves, st.make_mesh(save_mesh), repeats, seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lib", required=True)
    p.add_argument("--phase", choices=("save", "restore", "floors"), required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--size-gib", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    p.add_argument("--accel", action="store_true", help="the devices present, a donating step (module doc)")
    p.add_argument("--steady-saves", type=int, default=len(SAVE_STEPS) - 1)
    p.add_argument("--restores", default=",".join(label for label, _ in RESTORES))
    p.add_argument("--profile-extra", action="store_true")
    p.add_argument("--floor-repeats", type=int, default=3)
    p.add_argument("--resilax-option", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    kinds = dict(RESTORES)
    restores = tuple((label, kinds[label]) for label in args.restores.split(",") if label)

    result: dict[str, Any] = {
        "lib": args.lib,
        "phase": args.phase,
        "pid": os.getpid(),
        "load_before": os.getloadavg(),
    }
    code = 0
    try:
        t0 = time.perf_counter()
        import jax

        from resilax_bench import libraries
        from resilax_bench import state as st

        if not args.accel and jax.device_count() < 8:
            raise RuntimeError(
                f"need 8 devices, found {jax.device_count()}; set XLA_FLAGS=--xla_force_host_platform_device_count=8"
            )
        leaves = st.build_leaf_specs(args.size_gib)
        result["state_bytes"] = sum(s.nbytes for s in leaves)
        result["leaves"] = len(leaves)
        if args.accel:
            from resilax_bench import accel

            t1 = time.perf_counter()
            result["devices"] = accel.device_facts()
            result["open_devices_s"] = time.perf_counter() - t1
        if args.phase == "floors":
            result["import_s"] = time.perf_counter() - t0
            run_floors(leaves, args.seed, args.floor_repeats, result)
        else:
            __import__(libraries.IMPORTS[args.lib])
            result["import_s"] = time.perf_counter() - t0
            lib = libraries.LIBRARIES[args.lib]()
            result["version"] = lib.version()
            if args.lib == "resilax":
                lib.options = libraries.parse_options(args.resilax_option)
                result["resilax_options"] = {k: repr(v) for k, v in lib.options.items()}
            if args.accel:
                from resilax_bench import accel

                lib.save_mesh, lib.reshard_mesh = accel.mesh_shapes(jax.device_count())
            if args.phase == "save" and args.accel:
                run_save_accel(lib, args.dir, leaves, args.seed, args.steady_saves, args.profile_extra, result)
            elif args.phase == "save":
                run_save(lib, args.dir, leaves, args.seed, result)
            else:
                run_restore(lib, args.dir, leaves, result, restores, args.accel, args.profile_extra)
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
        code = 1
    result["load_after"] = os.getloadavg()
    with open(args.out, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    # Skip interpreter teardown (library thread pools), which is not what we measure.
    os._exit(code)


if __name__ == "__main__":
    main()
