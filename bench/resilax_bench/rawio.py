"""The floor under a checkpoint's I/O: the same files written and read with nothing but syscalls.

``python -m resilax_bench.rawio --like STEP_DIR [--target /tmp] [--rounds 5]`` takes the chunk files of
a saved step (their number and sizes, e.g. ``<bench dir>/resilax/4``) and, interleaved over rounds:

write (new files under ``--target``, from memory already touched, 8 threads):
  ``fdatasync-each``   pwrite, then fdatasync every file as it is written (resilax_ckpt before 2026-12-03)
  ``writeback-syncfs`` pwrite, start its writeback (sync_file_range), one syncfs at the end
  ``direct-syncfs``    O_DIRECT through a reused aligned bounce buffer per thread, one syncfs at the
                       end (resilax_ckpt on disks since 2026-12-03)
  ``dd-one-file``      the same bytes as ONE new file, one fdatasync (dd's ``conv=fdatasync``)
read (the step's own files, evicted from the page cache first, into fresh 4 KiB-aligned buffers):
  ``files@8``, ``files@32``  every file preadv'ed whole on 8 / 32 threads
  ``files-direct@32``        the same with O_DIRECT (the last partial block buffered), as
                             resilax_ckpt reads on disks since 2026-12-03 afternoon
  ``one-file``               the dd-one-file file read back sequentially in 16 MiB blocks
  ``one-file-direct``        the same with O_DIRECT (the last partial block buffered)
  ``one-file@32``            the dd-one-file file read in the step's file-sized pieces on 32 threads:
                             what a one-file-per-process layout could read at

It prints the median seconds per variant. It answers "how close to the disk is the library": a
restore cannot beat ``files@N`` by much, nor a first save ``writeback-syncfs``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import statistics
import time

import numpy as np

from resilax_bench.cache import evict_from_page_cache

BLOCK = 16 << 20


def chunk_files(step_dir: str) -> list[str]:
    """Every chunk file (under a ``c/`` folder) of a saved step, sorted."""
    out = []
    for top, _, names in os.walk(step_dir):
        for name in names:
            path = os.path.join(top, name)
            if f"{os.sep}c{os.sep}" in path or path.endswith(f"{os.sep}c"):
                out.append(path)
    return sorted(out)


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + 4096, np.uint8)
    offset = (-raw.ctypes.data) % 4096
    return raw[offset:offset + nbytes]


def write_files(root: str, rels: list[str], payloads: list[np.ndarray], mode: str) -> float:
    from resilax_ckpt.chunks import chunk_writer

    shutil.rmtree(root, ignore_errors=True)
    os.sync()
    t0 = time.perf_counter()
    if mode == "dd-one-file":
        os.makedirs(root)
        fd = os.open(os.path.join(root, "one"), os.O_WRONLY | os.O_CREAT, 0o644)
        offset = 0
        for data in payloads:
            chunk_writer._pwrite_all(fd, memoryview(data), offset)
            offset += data.nbytes
        os.fdatasync(fd)
        os.close(fd)
        return time.perf_counter() - t0
    paths = [os.path.join(root, rel) for rel in rels]
    for folder in sorted({os.path.dirname(p) for p in paths}):
        os.makedirs(folder, exist_ok=True)

    def buffered(path: str, data: np.ndarray) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            chunk_writer._pwrite_all(fd, memoryview(data), 0)
            if mode == "fdatasync-each":
                os.fdatasync(fd)
            else:
                chunk_writer.start_writeback(fd)
        finally:
            os.close(fd)

    def direct(path: str, data: np.ndarray) -> None:
        if not chunk_writer._write_direct(path, data, 0, data.nbytes):
            raise SystemExit(f"{root}: the filesystem refuses O_DIRECT")

    one = direct if mode == "direct-syncfs" else buffered
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(one, paths, payloads))
    if mode != "fdatasync-each":
        chunk_writer.make_durable(root, paths)
    else:
        for folder in sorted({os.path.dirname(p) for p in paths}, reverse=True):
            fd = os.open(folder, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    return time.perf_counter() - t0


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n


def read_files(paths: list[str], threads: int, direct: bool = False) -> float:
    evict_from_page_cache(os.path.commonpath(paths) if len(paths) > 1 else paths[0])
    t0 = time.perf_counter()

    def one(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            view = memoryview(_aligned(size))
            body = size // 4096 * 4096 if direct else 0
            if body:
                dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                try:
                    _pread_into(dfd, view[:body], 0)
                finally:
                    os.close(dfd)
            _pread_into(fd, view[body:], body)
        finally:
            os.close(fd)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, paths))
    return time.perf_counter() - t0


def read_pieces(path: str, sizes: list[int], threads: int) -> float:
    """`path` read in consecutive pieces of `sizes` bytes on `threads` threads, cold."""
    evict_from_page_cache(path)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda o, n: _pread_into(fd, memoryview(_aligned(n)), o), offsets, sizes))
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def read_one_file(path: str, direct: bool = False) -> float:
    evict_from_page_cache(path)
    buf = memoryview(_aligned(BLOCK))
    t0 = time.perf_counter()
    size = os.path.getsize(path)
    body = size // 4096 * 4096 if direct else 0
    if body:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            for offset in range(0, body, BLOCK):
                _pread_into(fd, buf[:min(BLOCK, body - offset)], offset)
        finally:
            os.close(fd)
    with open(path, "rb", buffering=0) as f:
        f.seek(body)
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", required=True, help="a saved step folder whose chunk files to imitate and read")
    p.add_argument("--target", default="/tmp", help="where the write variants create their files")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    paths = chunk_files(args.like)
    if not paths:
        raise SystemExit(f"--like {args.like}: no chunk files (c/...) under it")
    rels = [os.path.relpath(p, args.like) for p in paths]
    sizes = [os.path.getsize(p) for p in paths]
    total = sum(sizes)
    pool = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    payloads = [pool[(i * 4096) % (32 << 20):][:size] for i, size in enumerate(sizes)]
    scratch = os.path.join(args.target, f"resilax-rawio-{os.getpid()}")
    one_file = os.path.join(scratch + "-one", "one")
    print(f"{len(paths)} files, {total / 2**30:.2f} GiB, like {args.like}; writes under {args.target}")
    seconds: dict[str, list[float]] = {}
    try:
        for r in range(args.rounds):
            runs = {
                "write fdatasync-each": lambda: write_files(scratch, rels, payloads, "fdatasync-each"),
                "write writeback-syncfs": lambda: write_files(scratch, rels, payloads, "writeback-syncfs"),
                "write direct-syncfs": lambda: write_files(scratch, rels, payloads, "direct-syncfs"),
                "write dd-one-file": lambda: write_files(scratch + "-one", rels, payloads, "dd-one-file"),
                "read files@8": lambda: read_files(paths, 8),
                "read files@32": lambda: read_files(paths, 32),
                "read files-direct@32": lambda: read_files(paths, 32, direct=True),
                "read one-file": lambda: read_one_file(one_file),
                "read one-file-direct": lambda: read_one_file(one_file, direct=True),
                "read one-file@32": lambda: read_pieces(one_file, sizes, 32),
            }
            for name, run in runs.items():
                seconds.setdefault(name, []).append(run())
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in seconds.items()), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(scratch + "-one", ignore_errors=True)
    print(f"\nmedian of {args.rounds} rounds (seconds, GB/s):")
    for name, values in seconds.items():
        median = statistics.median(values)
        print(f"  {name:<24} {median:6.2f} s  {total / median / 1e9:5.2f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
