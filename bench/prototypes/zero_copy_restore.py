"""Prototype, not library code: restore paths for resilax_ckpt's plain restore, one per fresh process.

Evidence for docs/benchmarks.md "Known gaps" 1: on XLA:CPU, ``jax.device_put`` aliases a NumPy array
whose data is 64-byte aligned, so a restore can read each box straight into the memory the device
array will use. Three paths, each checked against the saved bytes:

- ``rc``: ``resilax_ckpt.CheckpointManager.restore`` as it is;
- ``ts``: aligned buffers filled by ``ts.array(buf).write(store[box])`` (512 MiB in flight);
- ``raw``: aligned buffers filled by ``readinto`` of the chunk file (plain restore only: the target
  box is one saved chunk, the ``bytes`` codec stores its raw little-endian bytes).

Usage (the bench venv, 8 fake devices, ``PYTHONPATH=bench``):
  python bench/prototypes/zero_copy_restore.py make DIR        # save a 1 GiB state as step 2
  python bench/prototypes/zero_copy_restore.py rc|ts|raw DIR   # first restore, then a second
"""

from __future__ import annotations

import collections
import gc
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
import resilax_ckpt as rc
import tensorstore as ts
from resilax_bench import state as st
from resilax_bench.cache import evict_from_page_cache
from resilax_bench.memory import PeakRSS

STEP = 2
LIMIT = 512 << 20


def aligned(shape: tuple[int, ...], dtype: Any, align: int = 64) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(n + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off : off + n].view(dtype).reshape(shape)


def boxes_of(t: Any) -> dict[tuple[tuple[int, int], ...], list[Any]]:
    boxes: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for dev, index in t.sharding.addressable_devices_indices_map(t.shape).items():
        key = tuple(
            (s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(index, t.shape, strict=True)
        )
        boxes.setdefault(key, []).append(dev)
    return boxes


def assemble(t: Any, bufs: list[tuple[np.ndarray, list[Any], Any]]) -> jax.Array:
    arrays, devices = [], []
    for buf, devs, future in bufs:
        future.result()
        arrays += [buf] * len(devs)
        devices += devs
    placed = jax.device_put(arrays, devices)  # aliases the aligned buffers on CPU
    by_dev = {next(iter(a.devices())): a for a in placed}
    return jax.make_array_from_single_device_arrays(
        t.shape, t.sharding, [by_dev[d] for d in t.sharding.addressable_devices]
    )


def leaf_folder(root: str, path: tuple[str, ...]) -> str:
    return f"{root}/{STEP}/{path[0]}/" + ".".join(path[1:])


def restore_ts(root: str, target: dict[tuple[str, ...], Any], ctx: ts.Context) -> dict[Any, Any]:
    opens = {
        p: ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "file", "path": leaf_folder(root, p) + "/"}},
            context=ctx,
            open=True,
        )
        for p in target
    }
    out: dict[Any, Any] = {}
    pending: collections.deque[Any] = collections.deque()
    inflight = 0
    for path, t in target.items():
        store = opens[path].result()
        boxes = boxes_of(t)
        nbytes = sum(int(np.prod([b - a for a, b in k])) * np.dtype(t.dtype).itemsize for k in boxes)
        while pending and inflight + nbytes > LIMIT:
            p, tt, bufs, n = pending.popleft()
            out[p] = assemble(tt, bufs)
            inflight -= n
        bufs = []
        for key, devs in boxes.items():
            buf = aligned(tuple(b - a for a, b in key), t.dtype)
            bufs.append((buf, devs, ts.array(buf).write(store[tuple(slice(a, b) for a, b in key)])))
        pending.append((path, t, bufs, nbytes))
        inflight += nbytes
    for p, tt, bufs, _ in pending:
        out[p] = assemble(tt, bufs)
    return out


def _readinto(fname: str, buf: np.ndarray) -> None:
    view = memoryview(buf.reshape(-1).view(np.uint8))
    with open(fname, "rb", buffering=0) as f:
        got = 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise EOFError(f"{fname}: {got} of {len(view)} bytes")
            got += n


def restore_raw(root: str, target: dict[tuple[str, ...], Any], pool: ThreadPoolExecutor) -> dict[Any, Any]:
    work = []
    for path, t in target.items():
        folder = leaf_folder(root, path)
        with open(folder + "/zarr.json") as f:
            chunks = json.load(f)["chunk_grid"]["configuration"]["chunk_shape"]
        bufs = []
        for key, devs in boxes_of(t).items():
            shape = tuple(b - a for a, b in key)
            if shape and list(shape) != [max(1, c) for c in chunks]:
                raise ValueError(f"{path}: box {key} is not one saved chunk {chunks}")
            cidx = [a // c for (a, _), c in zip(key, chunks, strict=True)]
            fname = folder + "/c" + "".join(f"/{i}" for i in cidx)
            buf = aligned(shape, t.dtype)
            bufs.append((buf, devs, pool.submit(_readinto, fname, buf)))
        work.append((path, t, bufs))
    return {path: assemble(t, bufs) for path, t, bufs in work}


def main() -> None:
    how, root = sys.argv[1], sys.argv[2]
    leaves = st.build_leaf_specs(1)
    mesh = st.make_mesh(st.SAVE_MESH)
    if how == "make":
        shutil.rmtree(root, ignore_errors=True)
        state = st.build_jax_state(leaves, mesh)
        with rc.CheckpointManager(root, options=rc.ManagerOptions(async_save=True)) as mgr:
            mgr.save(STEP, {"params": state["params"], "opt_state": state["opt_state"]}, force=True)
            mgr.wait()
        return
    ctx = ts.Context(
        {
            "data_copy_concurrency": {"limit": 32},
            "file_io_concurrency": {"limit": 32},
            "cache_pool": {"total_bytes_limit": 0},
        }
    )
    pool = ThreadPoolExecutor(8)
    mgr = rc.CheckpointManager(root, options=rc.ManagerOptions(async_save=True))
    nbytes = sum(s.nbytes for s in leaves)
    results = []
    for _ in range(2):
        tree = st.build_abstract_state(leaves, mesh)
        target = st.flatten(tree)
        evict_from_page_cache(root)
        gc.collect()
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            if how == "rc":
                out = st.flatten(mgr.restore(STEP, target=tree))
            elif how == "ts":
                out = restore_ts(root, target, ctx)
            else:
                out = restore_raw(root, target, pool)
            jax.block_until_ready(out)
            seconds = time.perf_counter() - t0
        total = sum(st.checksum(v) for v in out.values()) % (1 << 64)
        results.append(f"{seconds:.2f} s, peak +{(mem.peak - mem.start) / nbytes:.2f}x")
        del out
    print(f"{how}: first {results[0]}; second {results[1]}; load {os.getloadavg()[0]:.1f}; word sum {total}")
    mgr.close()


if __name__ == "__main__":
    main()
