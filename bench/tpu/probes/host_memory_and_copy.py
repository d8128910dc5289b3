# ruff: noqa: B023, F821  (the closures run at once, inside the loop or block that binds their names)
"""A probe of the accelerator host's costs that decide how a save and a restore should move data
(issue 37 and 38): run once, read the JSON, then change the library. Not part of any test.

  OUT=/some/folder python3 bench/tpu/probes/host_memory_and_copy.py all

Sections (each prints one `PROBE {json}` line and lands in $OUT/probe.json):
  import-*   a fresh process timing `import jax` and opening the devices while a thread of the same
             process reads ~6 GiB from /dev/shm (fresh buffers, one reused buffer, only faulting
             pages, reading after `import jax`): what slows a start-up that reads ahead.
  copy       2 GiB in 154 leaves: a jitted copy vs `device_put(may_alias=False)` (compile, dispatch,
             the donating step after), the copies' transfers to the host (batched, async + asarray,
             in 512 MiB batches) and what the host arrays look like (contiguous? owned?).
  interfere  a donating step's time while a thread drains copies to the host, and while a thread
             spins in Python (the GIL), against no thread.
  bigread    a 1 GiB leaf from /dev/shm: read into a fresh buffer, a reused one, a pre-faulted one,
             then to the device; a mapped file straight to the device.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
import time

SHM = "/dev/shm/resilax-probe"
GIB = int(float(os.environ.get("PROBE_GIB", "1")) * (1 << 30)) // (1 << 20) * (1 << 20)
OUT = os.environ.get("OUT", "/tmp/probe-out")
RESULTS: dict[str, object] = {}


def emit(name: str, value: object) -> None:
    RESULTS[name] = value
    print("PROBE", json.dumps({name: value}), flush=True)


def make_files(count: int, size: int) -> list[str]:
    os.makedirs(SHM, exist_ok=True)
    block = os.urandom(1 << 20) * 64
    paths = []
    for i in range(count):
        path = f"{SHM}/f{i}"
        if not os.path.exists(path) or os.path.getsize(path) != size:
            with open(path, "wb") as f:
                for _ in range(size // len(block)):
                    f.write(block)
        paths.append(path)
    return paths


def read_fresh(paths: list[str], out: dict) -> None:
    import numpy as np

    t = time.perf_counter()
    keep = []
    for path in paths:
        size = os.path.getsize(path)
        buf = np.empty(size, np.uint8)
        fd = os.open(path, os.O_RDONLY)
        done = 0
        while done < size:
            n = os.preadv(fd, [memoryview(buf)[done:done + (64 << 20)]], done)
            if n <= 0:
                break
            done += n
        os.close(fd)
        keep.append(buf)
    out["read_s"] = time.perf_counter() - t
    out["bytes"] = sum(b.nbytes for b in keep)


def read_reuse(paths: list[str], out: dict) -> None:
    import numpy as np

    t = time.perf_counter()
    buf = np.empty(64 << 20, np.uint8)
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        while True:
            n = os.preadv(fd, [buf], total)
            if n <= 0:
                break
            total += n
        total = 0
        os.close(fd)
    out["read_s"] = time.perf_counter() - t


def fault_only(paths: list[str], out: dict) -> None:
    import numpy as np

    t = time.perf_counter()
    keep = []
    for path in paths:
        buf = np.empty(os.path.getsize(path), np.uint8)
        buf.fill(1)
        keep.append(buf)
    out["read_s"] = time.perf_counter() - t


def import_variant(variant: str) -> None:
    """One fresh process: time import jax + devices while `variant` runs on a thread."""
    t0 = time.perf_counter()
    paths = sorted(f"{SHM}/{n}" for n in os.listdir(SHM))
    out: dict = {"variant": variant}
    work = {"read-fresh": read_fresh, "read-reuse": read_reuse, "fault-only": fault_only,
            "read-fresh-after-import": read_fresh}.get(variant)
    thread = None
    if work is not None and variant != "read-fresh-after-import":
        thread = threading.Thread(target=work, args=(paths, out))
        thread.start()
    t = time.perf_counter()
    import jax
    out["import_jax_s"] = time.perf_counter() - t
    if variant == "read-fresh-after-import":
        thread = threading.Thread(target=work, args=(paths, out))
        thread.start()
    t = time.perf_counter()
    out["devices"] = str(jax.devices()[0].device_kind)
    out["open_devices_s"] = time.perf_counter() - t
    if thread is not None:
        t = time.perf_counter()
        thread.join()
        out["join_after_open_s"] = time.perf_counter() - t
    out["total_s"] = time.perf_counter() - t0
    print("RESULT", json.dumps(out), flush=True)


def timed(fn, *a):
    t = time.perf_counter()
    r = fn(*a)
    return r, time.perf_counter() - t


def device_section() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    devices = jax.devices()
    emit("platform", {"platform": devices[0].platform, "kind": devices[0].device_kind, "jax": jax.__version__})
    rows = int(os.environ.get("PROBE_ROWS", "1792"))
    shapes = [((rows, 2048), jnp.float32)] * 100 + [((rows, 2048), jnp.bfloat16)] * 54
    make = jax.jit(lambda: [jnp.full(s, i % 7 + 1, d) for i, (s, d) in enumerate(shapes)])
    state = make()
    jax.block_until_ready(state)
    nbytes = sum(a.nbytes for a in state)
    step = jax.jit(lambda s: [a * 2 for a in s], donate_argnums=0)
    for _ in range(3):
        state = step(state)
    jax.block_until_ready(state)
    t = time.perf_counter()
    state = step(state)
    jax.block_until_ready(state)
    step_s = time.perf_counter() - t

    copy = {"state_bytes": nbytes, "leaves": len(state), "step_s": step_s}

    # jitted copy: first call compiles
    jcopy = jax.jit(lambda xs: [jnp.copy(x) for x in xs])
    copies, copy["jit_first_call_s"] = timed(jcopy, state)
    jax.block_until_ready(copies)
    del copies
    state = step(state)
    jax.block_until_ready(state)
    copies, copy["jit_dispatch_s"] = timed(jcopy, state)
    state = step(state)
    _, copy["jit_step_after_s"] = timed(jax.block_until_ready, state)
    del copies
    # device_put copy: no compile
    shardings = [a.sharding for a in state]
    copies, copy["put_first_call_s"] = timed(lambda: jax.device_put(state, shardings, may_alias=False))
    _, copy["put_first_ready_s"] = timed(jax.block_until_ready, copies)
    del copies
    for r in range(2):
        copies, copy[f"put_dispatch_{r}_s"] = timed(lambda: jax.device_put(state, shardings, may_alias=False))
        state = step(state)
        _, copy[f"put_step_after_{r}_s"] = timed(jax.block_until_ready, state)
        ok = all(not c.is_deleted() for c in copies)
        copy["put_copies_alive_after_donation"] = ok
        # d2h variants on these copies
        if r == 0:
            host, copy["d2h_device_get_s"] = timed(jax.device_get, copies)
            copy["host_flags"] = {"c_contiguous": all(h.flags.c_contiguous for h in host),
                                  "owndata": sum(bool(h.flags.owndata) for h in host),
                                  "writeable": sum(bool(h.flags.writeable) for h in host),
                                  "base": type(host[0].base).__name__, "dtype0": str(host[0].dtype),
                                  "dtype_last": str(host[-1].dtype),
                                  "strides_last": list(host[-1].strides)}
            del host
        else:
            t = time.perf_counter()
            for c in copies:
                c.copy_to_host_async()
            host = [np.asarray(c) for c in copies]
            copy["d2h_async_asarray_s"] = time.perf_counter() - t
            del host
        del copies
    # 512 MiB batches, as the drain does
    copies = jax.device_put(state, shardings, may_alias=False)
    jax.block_until_ready(copies)
    t = time.perf_counter()
    batches, cur, size = [], [], 0
    for c in copies:
        if size >= 512 << 20:
            batches.append(cur)
            cur, size = [], 0
        cur.append(c)
        size += c.nbytes
    batches.append(cur)
    for c in batches[0]:
        c.copy_to_host_async()
    host = []
    for b, batch in enumerate(batches):
        if b + 1 < len(batches):
            for c in batches[b + 1]:
                c.copy_to_host_async()
        host += [np.asarray(c) for c in batch]
    copy["d2h_batches_512m_s"] = time.perf_counter() - t
    # write the host arrays to tmpfs on 8 threads (the writer's floor)
    from concurrent.futures import ThreadPoolExecutor

    os.makedirs(f"{SHM}/w", exist_ok=True)

    def write(i):
        fd = os.open(f"{SHM}/w/{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        h = host[i]
        os.write(fd, (h.reshape(-1).view(np.uint8) if h.flags.c_contiguous else np.ascontiguousarray(h).reshape(-1).view(np.uint8)).data)
        os.close(fd)

    with ThreadPoolExecutor(8) as pool:
        t = time.perf_counter()
        list(pool.map(write, range(len(host))))
        copy["write_tmpfs_8threads_s"] = time.perf_counter() - t
        t = time.perf_counter()
        list(pool.map(write, range(len(host))))
        copy["rewrite_tmpfs_8threads_s"] = time.perf_counter() - t
    del host, copies
    emit("copy", copy)

    # interference: steps while a thread drains copies, while a thread spins, alone
    inter = {}

    def steps(n=8):
        nonlocal state
        times = []
        for _ in range(n):
            t = time.perf_counter()
            state = step(state)
            jax.block_until_ready(state)
            times.append(round(time.perf_counter() - t, 4))
        return times

    inter["alone"] = steps()
    copies = jax.device_put(state, shardings, may_alias=False)
    done = {}

    def drain():
        t = time.perf_counter()
        for c in copies:
            c.copy_to_host_async()
        h = [np.asarray(c) for c in copies]
        done["s"] = time.perf_counter() - t
        done["n"] = len(h)

    th = threading.Thread(target=drain)
    th.start()
    inter["while_drain"] = steps()
    th.join()
    inter["drain_s"] = done.get("s")
    stop = []

    def spin():
        x = 0
        while not stop:
            x += 1

    th = threading.Thread(target=spin)
    th.start()
    inter["while_python_spin"] = steps()
    stop.append(1)
    th.join()
    emit("interfere", inter)
    del copies

    # big leaf reads
    big = {}
    path = make_files(1, GIB)[0]
    import ctypes

    def preadv_into(buf, fd):
        done = 0
        mv = memoryview(buf).cast("B")
        while done < len(mv):
            n = os.preadv(fd, [mv[done:done + (64 << 20)]], done)
            if n <= 0:
                raise OSError(f"short file: {done} of {len(mv)} bytes")
            done += n

    fd = os.open(path, os.O_RDONLY)
    buf, big["np_empty_s"] = timed(np.empty, GIB, np.uint8)
    _, big["read_fresh_s"] = timed(preadv_into, buf, fd)
    _, big["read_again_same_buffer_s"] = timed(preadv_into, buf, fd)
    dev = jax.devices()[0]
    _, big["h2d_from_buffer_s"] = timed(lambda: jax.block_until_ready(jax.device_put(buf.view(np.float32), dev)))
    _, big["h2d_again_s"] = timed(lambda: jax.block_until_ready(jax.device_put(buf.view(np.float32), dev)))
    del buf
    m = mmap.mmap(-1, GIB)
    t = time.perf_counter()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        addr = ctypes.c_void_p.from_buffer(m)
        rc = libc.madvise(addr, ctypes.c_size_t(GIB), 23)  # MADV_POPULATE_WRITE
        big["populate_rc"] = rc
        del addr
    except Exception as e:
        big["populate_error"] = repr(e)
    big["populate_s"] = time.perf_counter() - t
    arr = np.frombuffer(m, np.uint8)
    _, big["read_prefaulted_s"] = timed(preadv_into, arr, fd)
    del arr
    buf2 = np.empty(GIB, np.uint8)
    t = time.perf_counter()
    buf2[::4096] = 0
    big["touch_pages_s"] = time.perf_counter() - t
    _, big["read_after_touch_s"] = timed(preadv_into, buf2, fd)
    del buf2
    os.close(fd)
    t = time.perf_counter()
    mapped = np.memmap(path, np.float32, mode="r")
    x = jax.device_put(mapped, dev)
    jax.block_until_ready(x)
    big["h2d_from_mapped_file_s"] = time.perf_counter() - t
    del x
    t = time.perf_counter()
    x = jax.device_put(mapped, dev)
    jax.block_until_ready(x)
    big["h2d_from_mapped_file_again_s"] = time.perf_counter() - t
    del x, mapped
    emit("bigread", big)


def main() -> None:
    mode = sys.argv[1]
    if mode == "import":
        import_variant(sys.argv[2])
        return
    if mode == "device":
        device_section()
        with open(os.path.join(OUT, "probe-device.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)
        return
    os.makedirs(OUT, exist_ok=True)
    t = time.perf_counter()
    make_files(6, GIB)
    emit("make_files_s", time.perf_counter() - t)
    for variant in ["none", "read-fresh", "read-reuse", "fault-only", "read-fresh-after-import", "none"]:
        r = subprocess.run([sys.executable, __file__, "import", variant], capture_output=True, text=True,
                           timeout=120)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        emit(f"import-{variant}", json.loads(line[-1][7:]) if line else {"rc": r.returncode,
                                                                        "err": r.stderr[-800:]})
    r = subprocess.run([sys.executable, __file__, "device"], text=True, timeout=300)
    emit("device_rc", r.returncode)
    with open(os.path.join(OUT, "probe.json"), "w") as f:
        json.dump(RESULTS, f, indent=1)
    subprocess.run(["rm", "-rf", SHM])


if __name__ == "__main__":
    main()
