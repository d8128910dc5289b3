"""The disk's own limits on the benchmark's target: ``dd`` fresh-file writes and cold reads."""

from __future__ import annotations

import os
import subprocess
import time

BLOCK = 16 << 20


def _dd(*args: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(["dd", *args, "status=none"], check=True)
    return time.perf_counter() - t0


def measure_dd(directory: str, nbytes: int) -> dict[str, float | bool]:
    """Seconds to write ``nbytes`` into a NEW file (``conv=fdatasync``), to rewrite the same file in
    place, and to read it back cold (its pages evicted first)."""
    from resilax_bench.cache import evict_from_page_cache

    count = max(1, round(nbytes / BLOCK))
    path = os.path.join(directory, "dd.bin")
    if os.path.exists(path):
        os.unlink(path)
    os.sync()
    write_s = _dd("if=/dev/zero", f"of={path}", f"bs={BLOCK}", f"count={count}", "conv=fdatasync")
    rewrite_s = _dd("if=/dev/zero", f"of={path}", f"bs={BLOCK}", f"count={count}", "conv=fdatasync,notrunc")
    evict_from_page_cache(path)
    read_s = _dd(f"if={path}", "of=/dev/null", f"bs={BLOCK}")
    os.unlink(path)
    written = count * BLOCK
    # Scale to the state's bytes so the anchor compares like with like.
    scale = nbytes / written
    return {
        "write_s": write_s * scale,
        "rewrite_s": rewrite_s * scale,
        "read_s": read_s * scale,
        "write_gbps": written / write_s / 1e9,
        "rewrite_gbps": written / rewrite_s / 1e9,
        "read_gbps": written / read_s / 1e9,
    }
