"""The restore's reader threads (reader.read_pool): one pool per size per process, kept between
restores, started ahead of the first restore, and never inherited by a forked child."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

from resilax_ckpt.chunks import reader


def _reader_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith("resilax-read_"))


def test_the_pool_is_kept_between_restores() -> None:
    assert reader.read_pool(3) is reader.read_pool(3)
    assert reader.read_pool(3) is not reader.read_pool(5)


def test_warming_starts_every_thread_before_any_read() -> None:
    before = _reader_threads()
    reader.warm_read_pool(7)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and reader.read_pool(7)._max_workers > len(reader.read_pool(7)._threads):
        time.sleep(0.01)
    assert len(reader.read_pool(7)._threads) == 7
    assert _reader_threads() >= before + 7
    # and they are idle again: 7 tasks that need 7 threads at once all run
    barrier = threading.Barrier(7)
    futures = [reader.read_pool(7).submit(barrier.wait, 10) for _ in range(7)]
    assert sorted(f.result(timeout=30) for f in futures) == list(range(7))


def test_a_forked_child_gets_its_own_pool() -> None:
    # In a fresh interpreter: once this test process has started JAX's backends, JAX warns at every
    # fork (its own at-fork hook), which says nothing about our pool.
    script = textwrap.dedent("""
        import os, sys
        from resilax_ckpt.chunks import reader
        parent = reader.read_pool(2)
        parent.submit(lambda: None).result()
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the parent's pool has no threads here; a new one must answer
            try:
                ok = reader.read_pool(2) is not parent and reader.read_pool(2).submit(lambda: 42).result(timeout=10) == 42
                os.write(write, b"1" if ok else b"0")
            finally:
                os._exit(0)
        os.close(write)
        answer = os.read(read, 1)
        os.waitpid(pid, 0)
        sys.exit(0 if answer == b"1" else 1)
    """)
    proc = subprocess.run([sys.executable, "-W", "error", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
