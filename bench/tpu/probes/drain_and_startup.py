# ruff: noqa: B023  (the closures run at once, inside the loop or block that binds their names)
"""Second probe of the accelerator host (issue 37/38), after bench/tpu/probes/host_memory_and_copy.py: how a background
drain of on-device copies can leave a donating loop alone, what a first save's copy costs with a warm
persistent compile cache, and whether faulting pages in user space first keeps a read-ahead thread
from slowing start-up. Not part of any test.

  OUT=/some/folder python3 bench/tpu/probes/drain_and_startup.py all
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

SHM = "/dev/shm/resilax-probe2"
GIB = 1 << 30
OUT = os.environ.get("OUT", "/tmp/probe2-out")
ROWS = int(os.environ.get("PROBE_ROWS", "1792"))
FILES = int(os.environ.get("PROBE_FILES", "6"))
FILE_BYTES = int(float(os.environ.get("PROBE_GIB", "1")) * GIB) // (64 << 20) * (64 << 20)
RESULTS: dict[str, object] = {}


def emit(name: str, value: object) -> None:
    RESULTS[name] = value
    print("PROBE", json.dumps({name: value}), flush=True)


def make_files() -> list[str]:
    os.makedirs(SHM, exist_ok=True)
    block = os.urandom(1 << 20) * 64
    paths = []
    for i in range(FILES):
        path = f"{SHM}/f{i}"
        with open(path, "wb") as f:
            for _ in range(FILE_BYTES // len(block)):
                f.write(block)
        paths.append(path)
    return paths


def _touch(buf, start: int, stop: int) -> None:
    buf[start:stop:4096] = 1


def touch_then_read(paths: list[str], out: dict, threads: int) -> None:
    import numpy as np

    t = time.perf_counter()
    keep = []
    for path in paths:
        size = os.path.getsize(path)
        buf = np.empty(size, np.uint8)
        step = -(-size // threads) // 4096 * 4096
        ts = [threading.Thread(target=_touch, args=(buf, i * step, min(size, (i + 1) * step)))
              for i in range(threads)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        fd = os.open(path, os.O_RDONLY)
        done = 0
        mv = memoryview(buf)
        while done < size:
            n = os.preadv(fd, [mv[done:done + (64 << 20)]], done)
            if n <= 0:
                break
            done += n
        os.close(fd)
        keep.append(buf)
    out["read_s"] = time.perf_counter() - t


def startup_variant(variant: str) -> None:
    t0 = time.perf_counter()
    paths = sorted(f"{SHM}/{n}" for n in os.listdir(SHM) if n.startswith("f"))
    out: dict = {"variant": variant}
    thread = None
    if variant.startswith("touch-read-"):
        thread = threading.Thread(target=touch_then_read, args=(paths, out, int(variant.rsplit("-", 1)[1])))
        thread.start()
    t = time.perf_counter()
    import jax
    out["import_jax_s"] = time.perf_counter() - t
    t = time.perf_counter()
    jax.devices()
    out["open_devices_s"] = time.perf_counter() - t
    if thread is not None:
        t = time.perf_counter()
        thread.join()
        out["join_after_open_s"] = time.perf_counter() - t
    out["total_s"] = time.perf_counter() - t0
    print("RESULT", json.dumps(out), flush=True)


def cache_variant(variant: str) -> None:
    """A jitted copy of the probe state, first call, with the persistent compile cache in SHM/cc."""
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_compilation_cache_dir", f"{SHM}/cc")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    state = _state()
    jcopy = jax.jit(lambda xs: [jnp.copy(x) for x in xs])
    t = time.perf_counter()
    jcopy.lower(state).compile()
    aot = time.perf_counter() - t
    t = time.perf_counter()
    copies = jcopy(state)
    first = time.perf_counter() - t
    jax.block_until_ready(copies)
    print("RESULT", json.dumps({"variant": variant, "aot_compile_s": aot, "first_call_after_aot_s": first}),
          flush=True)


def _state():
    import jax
    import jax.numpy as jnp

    shapes = [((ROWS, 2048), jnp.float32)] * 100 + [((ROWS, 2048), jnp.bfloat16)] * 54
    make = jax.jit(lambda: [jnp.full(s, i % 7 + 1, d) for i, (s, d) in enumerate(shapes)])
    state = make()
    jax.block_until_ready(state)
    return state


def device_section() -> None:
    import jax
    import numpy as np

    state = _state()
    step = jax.jit(lambda s: [a * 2 for a in s], donate_argnums=0)
    jcopy = jax.jit(lambda xs: [x + 0 for x in xs])
    for _ in range(3):
        state = step(state)
    jax.block_until_ready(jcopy(state))
    dev = jax.devices()[0]
    res: dict = {"state_bytes": sum(a.nbytes for a in state)}

    def steps(n=8):
        nonlocal state
        times = []
        for _ in range(n):
            t = time.perf_counter()
            state = step(state)
            jax.block_until_ready(state)
            times.append(round(time.perf_counter() - t, 4))
        return times

    res["alone"] = steps()
    # cost of copy_to_host_async on the calling thread
    copies = jcopy(state)
    jax.block_until_ready(copies)
    t = time.perf_counter()
    for c in copies:
        c.copy_to_host_async()
    res["async_calls_s"] = time.perf_counter() - t
    t = time.perf_counter()
    host = [np.asarray(c) for c in copies]
    res["asarray_after_async_s"] = time.perf_counter() - t
    del host, copies

    pinned = None
    try:
        pinned = [a.sharding.with_memory_kind("pinned_host") for a in state]
    except Exception as e:
        res["pinned_error"] = repr(e)

    def drain_current(cs, box):
        for c in cs:
            c.copy_to_host_async()
        box.extend(np.asarray(c) for c in cs)

    def drain_sequential(cs, box):
        for c in cs:
            box.append(np.asarray(c))

    def drain_device_get(cs, box):
        box.extend(jax.device_get(cs))

    def drain_pinned(cs, box):
        ps = jax.device_put(cs, pinned)
        jax.block_until_ready(ps)
        box.append(time.perf_counter())
        box.extend(np.asarray(p) for p in ps)

    def drain_pinned_blocked(cs, box):  # only the device-to-pinned transfer, no numpy
        ps = jax.device_put(cs, pinned)
        jax.block_until_ready(ps)
        box.append(ps)

    variants = {"current": drain_current, "sequential": drain_sequential, "device_get": drain_device_get}
    if pinned is not None:
        variants["pinned"] = drain_pinned
        variants["pinned_only"] = drain_pinned_blocked
    for name, fn in variants.items():
        try:
            copies = jcopy(state)
            box: list = []
            t0 = time.perf_counter()
            timing = {}

            def run(cs=copies, fn=fn, box=box, timing=timing):
                fn(cs, box)
                timing["s"] = time.perf_counter() - t0

            th = threading.Thread(target=run)
            th.start()
            del copies
            times = steps()
            th.join()
            entry = {"steps": times, "drain_s": timing.get("s")}
            if name == "pinned" and box:
                entry["pinned_ready_s"] = box[0] - t0
                h = box[1]
                entry["host_flags"] = {"owndata": bool(h.flags.owndata), "base": type(h.base).__name__,
                                       "writeable": bool(h.flags.writeable)}
            res[name] = entry
            del box
        except Exception as e:
            res[name] = {"error": repr(e)[:400]}
    # the drain after the next step is dispatched (the loop dispatches first, then the thread drains)
    try:
        copies = jcopy(state)
        state = step(state)
        box = []
        t0 = time.perf_counter()
        th = threading.Thread(target=drain_device_get, args=(copies, box))
        th.start()
        del copies
        jax.block_until_ready(state)
        first = time.perf_counter() - t0
        res["dispatch_step_first_then_drain"] = {"first_step_wait": first, "steps": steps()}
        th.join()
    except Exception as e:
        res["dispatch_step_first_then_drain"] = {"error": repr(e)[:400]}
    # device_put copy vs jitted copy dispatch, once more, with the step right after
    for label, make in {"jit": lambda: jcopy(state),
                        "device_put": lambda: jax.device_put(state, [a.sharding for a in state], may_alias=False)}.items():
        t = time.perf_counter()
        copies = make()
        d = time.perf_counter() - t
        state = step(state)
        jax.block_until_ready(state)
        res[f"copy_{label}"] = {"dispatch_s": d, "dispatch_plus_step_s": time.perf_counter() - t}
        del copies
    del dev
    emit("drain", res)


def main() -> None:
    mode = sys.argv[1]
    if mode == "startup":
        startup_variant(sys.argv[2])
        return
    if mode == "cache":
        cache_variant(sys.argv[2])
        return
    if mode == "device":
        device_section()
        with open(os.path.join(OUT, "probe2-device.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
        return
    os.makedirs(OUT, exist_ok=True)
    if mode == "startups":
        make_files()
        for variant in ["none", "touch-read-1", "touch-read-4", "none"]:
            r = subprocess.run([sys.executable, __file__, "startup", variant], capture_output=True, text=True,
                               timeout=120)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            emit(f"startup-{variant}", json.loads(line[-1][7:]) if line else {"rc": r.returncode,
                                                                              "err": r.stderr[-600:]})
        subprocess.run(["rm", "-rf", SHM])
        return
    r = subprocess.run([sys.executable, __file__, "device"], text=True, timeout=240)
    emit("device_rc", r.returncode)
    for variant in ["cold", "warm"]:
        r = subprocess.run([sys.executable, __file__, "cache", variant], capture_output=True, text=True, timeout=120)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        emit(f"cache-{variant}", json.loads(line[-1][7:]) if line else {"rc": r.returncode, "err": r.stderr[-600:]})
    make_files()
    for variant in ["none", "touch-read-1", "touch-read-4"]:
        r = subprocess.run([sys.executable, __file__, "startup", variant], capture_output=True, text=True, timeout=120)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        emit(f"startup-{variant}", json.loads(line[-1][7:]) if line else {"rc": r.returncode, "err": r.stderr[-600:]})
    with open(os.path.join(OUT, "probe2.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    subprocess.run(["rm", "-rf", SHM])


if __name__ == "__main__":
    main()
