"""Peak resident memory of this process over a window, without a sampling thread where Linux allows.

Linux keeps the high-water mark of RSS in ``/proc/self/status`` (``VmHWM``) and resets it when "5" is
written to ``/proc/self/clear_refs``: exact, free, and blind to nothing a sampler would miss. Where the
reset is refused (gVisor, e.g. the TPU host), a thread samples the resident size every 20 ms instead
(and says so), from ``/proc/self/statm`` through one open descriptor: on the TPU v5e host a sampler
reading ``/proc/self/status`` every 2 ms spent ~0.8 s of a 2 GiB save's wall time on its thread, time
taken from the save it measured; one ``pread`` of statm every 20 ms costs a small fraction of that.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from types import TracebackType
from typing import Any

SAMPLE_SECONDS = 0.02
"""How often the sampler reads the resident size where the high-water mark cannot be reset."""
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2() -> Any:
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    return fn


def malloc_bytes() -> dict[str, int] | None:
    """glibc malloc's own count (mallinfo2): "in_use" (allocated blocks, mmapped ones included) and
    "free" (freed memory its arenas keep); None where it is not glibc. What of a peak RSS is malloc's
    (the snapshot's landed copies are NumPy, so malloc) and what is another allocator's (a runtime's
    own host buffers)."""
    fn = _mallinfo2()
    if fn is None:
        return None
    info = fn()
    return {"in_use": int(info.uordblks + info.hblkhd), "free": int(info.fordblks)}


MALLOC_STEP = 64 << 20
"""The sampler reads malloc's count again at a new peak this much above the one it read it at."""


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") <= _status_kib("VmRSS") + 64


class PeakRSS:
    """``with PeakRSS() as p: ...`` then ``p.peak`` (bytes) and ``p.start`` (RSS when entered)."""

    def __init__(self) -> None:
        self.start = 0
        self.peak = 0
        self.method = ""
        self.malloc_at_peak: dict[str, int] | None = None
        """Sampled mode: glibc malloc's count (`malloc_bytes`) near the peak (read again whenever the
        peak rose MALLOC_STEP above where it was last read)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        self.start = rss_bytes()
        if _reset_hwm():
            self.method = "VmHWM"
        else:
            self.method = "sampled"
            self.peak = self.start
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        read_at = self.peak
        try:
            while True:
                # statm: size resident shared ... (pages); one small read, no parsing of a long file.
                self.peak = max(self.peak, int(os.pread(fd, 128, 0).split()[1]) * _PAGE)
                if self.peak >= read_at + MALLOC_STEP:
                    self.malloc_at_peak, read_at = malloc_bytes(), self.peak
                if self._stop.wait(SAMPLE_SECONDS):
                    return
        finally:
            os.close(fd)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss_bytes())
        else:
            self.peak = _status_kib("VmHWM") * 1024
