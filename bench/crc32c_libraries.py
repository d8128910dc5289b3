"""crc32c (LGPL-2.1-or-later) against google-crc32c (Apache-2.0) on a 64 MiB NumPy buffer, as
resilax_ckpt.chunks.checksums uses them: throughput in one thread, and whether two threads compute at once
(they do only if the call releases the GIL), and, the figure that does not depend on a quiet machine,
the longest stretch during one call in which the main Python thread could not run: about the whole
call when the call holds the GIL, a scheduler tick when it releases it. Both packages come with the test extra (google-crc32c
through gcsfs's google-cloud-storage).

    python bench/crc32c_libraries.py [--mib 64] [--repeat 7]

google-crc32c accepts only read-only buffers without a release hook (`bytes`), not a NumPy array or
its memoryview: checksumming a chunk where it lies costs it a copy, measured here both with the copy
(what the library would pay) and without (its raw speed on bytes already made).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import crc32c
import google_crc32c
import numpy as np


def best_seconds(run: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def in_two_threads(fn: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        threads = [threading.Thread(target=fn) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return run


def longest_main_thread_stall(fn: Callable[[], Any]) -> tuple[float, float]:
    """(longest gap between two iterations of a Python loop in this thread, duration of `fn`) while
    another thread runs `fn` once."""
    done = threading.Event()
    span: list[float] = []

    def worker() -> None:
        started = time.perf_counter()
        fn()
        span.append(time.perf_counter() - started)
        done.set()

    thread = threading.Thread(target=worker)
    last = time.perf_counter()
    longest = 0.0
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
    thread.join()
    return longest, span[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    buf = np.random.default_rng(0).integers(0, 255, args.mib << 20, dtype=np.uint8)
    view = memoryview(buf)
    as_bytes = buf.tobytes()
    cases: dict[str, Callable[[], int]] = {
        "crc32c (NumPy buffer, in place)": lambda: int(crc32c.crc32c(view)),
        "google-crc32c (bytes(buffer): the copy it needs)": lambda: int(google_crc32c.extend(0, bytes(view))),
        "google-crc32c (bytes made beforehand)": lambda: int(google_crc32c.extend(0, as_bytes)),
    }
    values = {fn() for fn in cases.values()}
    assert len(values) == 1, f"the libraries disagree: {values}"
    gib = (args.mib << 20) / (1 << 30)
    results = []
    for name, fn in cases.items():
        one = best_seconds(fn, args.repeat)
        two = best_seconds(in_two_threads(fn), args.repeat)
        stall, call = min((longest_main_thread_stall(fn) for _ in range(args.repeat)), key=lambda sc: sc[0] / sc[1])
        results.append({"library": name, "one_thread_gib_per_s": round(gib / one, 2),
                        "two_threads_gib_per_s": round(2 * gib / two, 2),
                        "two_thread_speedup": round(2 * one / two, 2),
                        "main_thread_stall_fraction_of_call": round(stall / call, 2)})
        print(f"{name:<50} 1 thread {gib / one:6.2f} GiB/s   2 threads {2 * gib / two:6.2f} GiB/s "
              f"(x{2 * one / two:.2f})   main thread stalled {stall * 1e3:.1f} ms of a {call * 1e3:.1f} ms call")
    print(json.dumps({"mib": args.mib, "repeat": args.repeat, "results": results}))


if __name__ == "__main__":
    main()
