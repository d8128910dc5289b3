"""Wall-clock stack sampling of single benchmark operations, all Python threads, in-process.

Enabled by ``RESILAX_BENCH_PROFILE=<folder>``: each profiled operation writes
``<folder>/<lib>-<operation>.txt`` with folded stacks (``thread;frame;frame... seconds``), sampled every
5 ms and each sample weighted by the time since the previous one (a starved sampler stays honest).
A frame that calls into C (tensorstore, XLA, ``os.fsync``) stays on the stack for as long as the call
lasts, so native time is charged to the Python line that made the call. Threads that are only
waiting (an idle pool worker, a ``Event.wait``) are dropped. Summarize with
``python -m resilax_bench.profiling <file>...``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

INTERVAL_S = 0.005
_IDLE = (
    "wait (threading.py",
    "_worker (concurrent/futures/thread.py",
    "select (selectors.py",
    "_wait_for_tstate_lock",
    "get (queue.py",
    "sleep",
    "_sample (",
)


def _frame_name(frame: object) -> str:
    code = frame.f_code  # type: ignore[attr-defined]
    fname = code.co_filename
    for marker in ("site-packages/", "lib/python3.11/", "ckpt_lib/", "bench/"):
        if marker in fname:
            fname = fname.split(marker, 1)[1]
            break
    return f"{code.co_name} ({fname}:{frame.f_lineno})"  # type: ignore[attr-defined]


@contextlib.contextmanager
def profiled(lib: str, operation: str) -> Iterator[None]:
    folder = os.environ.get("RESILAX_BENCH_PROFILE")
    if not folder:
        yield
        return
    os.makedirs(folder, exist_ok=True)
    counts: collections.Counter[str] = collections.Counter()  # stack -> seconds
    stop = threading.Event()
    me = threading.get_ident()

    def sample() -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            dt, last = now - last, now
            for ident, frame in sys._current_frames().items():
                if ident == me_sampler[0]:
                    continue
                stack = []
                f = frame
                while f is not None:
                    stack.append(_frame_name(f))
                    f = f.f_back
                stack.reverse()
                leaf = stack[-1] if stack else ""
                if ident != me and any(m in leaf for m in _IDLE):
                    continue
                thread = "main" if ident == me else names.get(ident, str(ident))
                counts[";".join([thread, *stack])] += dt
            time.sleep(INTERVAL_S)
            names = {t.ident: t.name for t in threading.enumerate()}

    me_sampler = [0]
    t = threading.Thread(target=sample, daemon=True, name="bench-sampler")
    t.start()
    me_sampler[0] = t.ident or 0
    try:
        yield
    finally:
        stop.set()
        t.join()
        with open(os.path.join(folder, f"{lib}-{operation}.txt"), "w") as f:
            for stack, n in counts.most_common():
                f.write(f"{stack} {n:.4f}\n")


def summarize(path: str, top: int = 30) -> str:
    """Per thread: sample share of the leaf frames and of every frame (inclusive)."""
    per_thread: dict[str, tuple[collections.Counter[str], collections.Counter[str]]] = {}
    totals: collections.Counter[str] = collections.Counter()  # seconds
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            n = float(count)
            thread, *frames = stack.split(";")
            totals[thread] += n
            own, incl = per_thread.setdefault(thread, (collections.Counter(), collections.Counter()))
            if frames:
                own[frames[-1]] += n
            for name in set(frames):
                incl[name] += n
    lines = [f"{path} (wall seconds per frame, busy threads only)"]
    for thread, total in totals.most_common(8):
        own, incl = per_thread[thread]
        lines.append(f"thread {thread}: {total:.2f} s")
        lines += [
            f"   self {n:6.2f} s {100 * n / total:5.1f}%  {name}" for name, n in own.most_common(top // 2)
        ]
        lines += [f"   incl {n:6.2f} s {100 * n / total:5.1f}%  {name}" for name, n in incl.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(summarize(p))
