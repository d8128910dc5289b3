"""Third probe of the accelerator host (issue 37/38): is MAP_POPULATE a cheap way to get host memory
that is already faulted in, for a read and for a transfer to the device? One fresh 1 GiB tmpfs file.
Not part of any test.

  python3 bench/tpu/probes/populate.py      (prints one `PROBE3 {json}` line)
"""

from __future__ import annotations

import json
import mmap
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

GIB = 1 << 30
PATH = "/dev/shm/resilax-probe3"


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    result = fn()
    return result, round(time.perf_counter() - start, 4)


def read_into(buf: Any) -> None:
    fd = os.open(PATH, os.O_RDONLY)
    done = 0
    view = memoryview(buf).cast("B")
    while done < GIB:
        n = os.preadv(fd, [view[done:done + (64 << 20)]], done)
        if n <= 0:
            raise OSError(f"{PATH}: short read at {done}")
        done += n
    os.close(fd)


def main() -> None:
    out: dict[str, Any] = {}
    with open(PATH, "wb") as f:
        block = os.urandom(1 << 20) * 64
        for _ in range(GIB // len(block)):
            f.write(block)
    anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    populated, out["anon_populate_s"] = timed(lambda: mmap.mmap(-1, GIB, flags=anon | mmap.MAP_POPULATE))
    _, out["read_into_populated_s"] = timed(lambda: read_into(populated))
    _, out["read_again_s"] = timed(lambda: read_into(populated))
    populated.close()
    lazy, out["anon_nopopulate_s"] = timed(lambda: mmap.mmap(-1, GIB, flags=anon))
    _, out["read_into_unpopulated_s"] = timed(lambda: read_into(lazy))
    lazy.close()
    fd = os.open(PATH, os.O_RDONLY)
    mapped, out["file_populate_s"] = timed(
        lambda: mmap.mmap(fd, GIB, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ))
    from_file = np.frombuffer(mapped, np.float32)
    _, out["sum_file_populated_s"] = timed(lambda: float(from_file[::1024].sum()))

    import jax

    device = jax.devices()[0]
    _, out["h2d_file_populated_s"] = timed(lambda: jax.block_until_ready(jax.device_put(from_file, device)))
    _, out["h2d_file_populated_again_s"] = timed(lambda: jax.block_until_ready(jax.device_put(from_file, device)))
    warm = mmap.mmap(-1, GIB, flags=anon | mmap.MAP_POPULATE)
    read_into(warm)
    from_anon = np.frombuffer(warm, np.float32)
    _, out["h2d_anon_populated_s"] = timed(lambda: jax.block_until_ready(jax.device_put(from_anon, device)))
    on_device = jax.block_until_ready(jax.device_put(from_anon, device))
    _, out["d2h_fresh_numpy_s"] = timed(lambda: np.asarray(on_device))
    changed = on_device + 1
    _, out["d2h_again_new_array_s"] = timed(lambda: np.asarray(changed))
    print("PROBE3", json.dumps(out), flush=True)
    os.close(fd)
    os.unlink(PATH)


if __name__ == "__main__":
    main()
