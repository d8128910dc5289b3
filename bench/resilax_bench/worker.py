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


def run_restore(lib: Any, directory: str, leaves: list[Any], result: dict[str, Any]) -> None:
    from resilax_bench.cache import evict_from_page_cache
    from resilax_bench.libraries import NotApplicable
    from resilax_bench.memory import PeakRSS, rss_bytes
    from resilax_bench.profiling import profiled

    with open(os.path.join(directory, "expected.json")) as f:
        expected = json.load(f)
    t0 = time.perf_counter()
    lib.open_restore(directory, leaves)
    result["open_s"] = time.perf_counter() - t0
    gc.collect()
    result["rss_before_restores"] = rss_bytes()
    restores = []
    for label, kind in RESTORES:
        gc.collect()
        entry: dict[str, Any] = {
            "label": label,
            "kind": kind,
            "evicted_files": evict_from_page_cache(directory),
        }
        try:
            with profiled(lib.name, f"restore-{label}"), PeakRSS() as mem:
                t0 = time.perf_counter()
                out = lib.restore(REPORTED_STEP, kind)
                entry["seconds"] = time.perf_counter() - t0
        except NotApplicable as e:
            entry["not_applicable"] = str(e)
            restores.append(entry)
            continue
        entry.update(peak_rss=mem.peak, rss_at_start=mem.start, rss_method=mem.method)
        problems = _compare(expected, _checksums(out), kind)
        if problems:
            raise RuntimeError(
                f"{lib.name} {label} restore of step {REPORTED_STEP} is wrong: " + "; ".join(problems[:5])
            )
        del out
        restores.append(entry)
    result["restores"] = restores
    lib.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--lib", required=True)
    p.add_argument("--phase", choices=("save", "restore"), required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--size-gib", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

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

        if jax.device_count() < 8:
            raise RuntimeError(
                f"need 8 devices, found {jax.device_count()}; set XLA_FLAGS=--xla_force_host_platform_device_count=8"
            )
        __import__(libraries.IMPORTS[args.lib])
        result["import_s"] = time.perf_counter() - t0
        lib = libraries.LIBRARIES[args.lib]()
        result["version"] = lib.version()
        leaves = st.build_leaf_specs(args.size_gib)
        result["state_bytes"] = sum(s.nbytes for s in leaves)
        result["leaves"] = len(leaves)
        if args.phase == "save":
            run_save(lib, args.dir, leaves, args.seed, result)
        else:
            run_restore(lib, args.dir, leaves, result)
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
