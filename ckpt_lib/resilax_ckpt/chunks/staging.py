"""Staging buffers for direct I/O: a few reused, huge-page-backed buffers that every `O_DIRECT`
read and write of chunk files goes through.

Why: a direct request hands the disk the physical pages of its buffer, and the block layer puts at
most `max_segments` physically contiguous pieces into one request (254 on virtio-blk). A buffer of
scattered 4 KiB pages therefore makes requests of about 1 MiB, each with a descriptor per page; a
buffer on 2 MiB transparent huge pages makes requests of the disk's maximum (4 MiB here) with a few
descriptors, and reads and writes a file about twice as fast.

Why a copy instead of reading straight into the restored arrays on huge pages: the first touch of a
huge page is the expensive part where the host takes back the memory of freed huge-page-sized
blocks (virtio-balloon free page reporting, as on our VM). So the arrays stay on 4 KiB pages
(reader.aligned_empty) and a thread copies each staged piece into them while the disk fills the other
staging buffers. The figures: docs/benchmarks.md, "Measurements behind the fast path".

The pool holds at most `MAX_BUFFERS` buffers of `BUFFER_BYTES`, each one 2 MiB-aligned huge page,
allocated on first use and kept for the life of the process (32 MiB at most). A thread borrows one
buffer at a time (`borrowed()`), so borrowers never deadlock; more borrowers than buffers wait.
Where the kernel has no transparent huge pages (`huge_pages()` is False), the buffers are ordinary
pages: writes still need them (alignment), reads go straight into the arrays instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

HUGE_PAGE_BYTES = 2 << 20
BUFFER_BYTES = HUGE_PAGE_BYTES
"""Bytes of one staging buffer: one huge page, so the disk sees one physically contiguous piece."""
MAX_BUFFERS = 16
"""Buffers in the pool; 16 kept the disk busy while threads copied (8 were 10% slower)."""
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def huge_pages() -> bool:
    """Whether `madvise(MADV_HUGEPAGE)` memory gets transparent huge pages here (Linux, THP mode
    `always` or `madvise`)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(THP_ENABLED) as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


@functools.cache
def libc_madvise() -> Any:
    """libc's `madvise(addr, length, advice)` (returns 0 or -1, errno set), None where there is none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise
    except (OSError, AttributeError):
        return None


def _new_buffer() -> np.ndarray:
    """BUFFER_BYTES of a new anonymous mapping, HUGE_PAGE_BYTES-aligned and advised for huge pages."""
    region = mmap.mmap(-1, BUFFER_BYTES + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(region, np.uint8)
    start = (-whole.ctypes.data) % HUGE_PAGE_BYTES
    buf = whole[start:start + BUFFER_BYTES]
    madvise = libc_madvise()
    if madvise is not None and hasattr(mmap, "MADV_HUGEPAGE"):
        madvise(buf.ctypes.data, BUFFER_BYTES, mmap.MADV_HUGEPAGE)  # best effort
    return buf


class _Pool:
    def __init__(self) -> None:
        self._free: list[np.ndarray] = []  # each a view of its own mapping, which it keeps alive
        self._slots = threading.Semaphore(MAX_BUFFERS)
        self._lock = threading.Lock()
        self.allocations = 0
        """Buffers allocated so far (at most MAX_BUFFERS in a process's life: tests count reuse)."""

    @contextlib.contextmanager
    def borrowed(self) -> Iterator[np.ndarray]:
        """A staging buffer (uint8, BUFFER_BYTES, 2 MiB-aligned) for the duration of the block."""
        self._slots.acquire()
        try:
            with self._lock:
                buf = self._free.pop() if self._free else None
            if buf is None:
                buf = _new_buffer()
                with self._lock:
                    self.allocations += 1
            try:
                yield buf
            finally:
                with self._lock:
                    self._free.append(buf)
        finally:
            self._slots.release()


_pool = _Pool()
borrowed = _pool.borrowed


def pool_allocations() -> int:
    """How many staging buffers this process allocated (tests: consecutive saves allocate none)."""
    return _pool.allocations


ARENA_ALIGN = 64
"""Alignment of each piece carved from a HostArena (NumPy's own, and a cache line)."""


class HostArena:
    """The host memory a save lands device shards in when it must copy them itself (a host transfer
    on CPU devices, whose NumPy views alias the device buffers the training step may donate), kept
    for the next save: one per manager, reused by each of its saves (its saves never overlap: a save
    first waits for the previous one). Grown (a new buffer) only when a save needs more than it has.
    Ordinary 4 KiB pages: the buffer is faulted in once, by its first save."""

    total_allocations = 0
    """Buffers allocated by every arena of the process (tests count reuse)."""

    def __init__(self) -> None:
        self._buffer: np.ndarray | None = None
        self._used = 0
        self.allocations = 0
        """Buffers allocated so far (tests: consecutive saves of one state allocate one)."""

    def reset(self, nbytes: int) -> None:
        """Start a save that lands `nbytes` (plus alignment) here: the previous save's pieces are
        free again (the caller waited for its writes)."""
        if self._buffer is None or self._buffer.nbytes < nbytes:
            self._buffer = None  # the old one is freed before the new one is faulted in
            self._buffer = np.empty(max(nbytes, 1), np.uint8)
            self.allocations += 1
            HostArena.total_allocations += 1
        self._used = 0

    @staticmethod
    def size_of(shapes_and_dtypes: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> int:
        """Bytes `reset` needs for pieces of these shapes and dtypes, each aligned."""
        return sum(-(-int(np.prod(shape)) * dtype.itemsize // ARENA_ALIGN) * ARENA_ALIGN
                   for shape, dtype in shapes_and_dtypes)

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """A C-contiguous array of `shape` and `dtype` from the arena (after `reset`)."""
        assert self._buffer is not None, "HostArena.take before reset"
        nbytes = int(np.prod(shape)) * dtype.itemsize
        start = self._used
        self._used += -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN
        if self._used > self._buffer.nbytes:
            raise ValueError(f"HostArena: {self._used} bytes taken, {self._buffer.nbytes} reserved")
        return self._buffer[start:start + nbytes].view(dtype).reshape(shape)
