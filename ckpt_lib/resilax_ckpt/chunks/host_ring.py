"""The host memory a restore reads into (reader.py fills it): aligned box buffers, and on accelerators
the process's host ring, reused by every restore.

- `aligned_empty`: an uninitialized C-order array aligned for XLA:CPU's aliasing (64 bytes) and, from
  DIRECT_MIN_BYTES, for O_DIRECT (4 KiB), without transparent huge pages from 4 MiB on
  (`_no_huge_pages`; why, with figures: docs/benchmarks.md, "Measurements behind the fast path").
  `box_buffer` is the same, counted (`host_buffer_counts`, for tests that check reuse by count).
- The *host ring* (`HostRing`, one region of `ManagerOptions.restore_host_buffer_bytes`, 512 MiB by
  default, kept for the life of the process): a restore onto accelerators (`reuses_host_buffers`)
  holds it through a `HostLease`; each leaf takes one piece, its `device_put` copies it to the
  devices, and the piece is given back once that transfer is done. So a restore touches no fresh
  memory beyond the ring (on a TPU v5e, faulting 2 GiB of fresh buffers in was 86% of a cold
  restore's main thread), and a state bigger than the ring streams through it. The ring is faulted
  in ahead of any read into it (`populate_pages`: one `madvise(MADV_POPULATE_WRITE)`, else a write
  per page in user space), ahead of the first restore when the
  manager is created on accelerators (`warm_host_ring`). A piece goes back only after
  `block_until_ready` on every array built from it, and only when none aliases it: on CPU devices
  (whose `device_put` aliases 64-byte-aligned buffers) one that did would retire the ring, which its
  arrays then keep alive; `restore_reuse_host_buffers=True` forces the ring onto CPU devices, for
  tests, with a device-side copy standing for the transfer (reader._build_array).
JAX is imported lazily (the restore prefetch, read_ahead.py, runs before JAX is loaded).
"""

from __future__ import annotations

import collections
import mmap
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from resilax_ckpt import planning
from resilax_ckpt.chunks import chunk_format, staging

if TYPE_CHECKING:
    from resilax_ckpt.chunks.reader import LeafRead

ALIGNMENT = 64
"""Bytes: XLA:CPU aliases a host buffer aligned to this instead of copying it."""
DIRECT_MIN_BYTES = chunk_format.DIRECT_MIN_BYTES
"""Buffers of at least this size are aligned for O_DIRECT reads into them."""
DIRECT_ALIGN = chunk_format.DIRECT_ALIGN


def aligned_empty(shape: Sequence[int], dtype: Any, align: int | None = None) -> np.ndarray:
    """An uninitialized C-order array whose data starts at a multiple of `align` bytes: by default
    ALIGNMENT, and DIRECT_ALIGN when it has at least DIRECT_MIN_BYTES (so O_DIRECT can read into
    it), without transparent huge pages (`_no_huge_pages`)."""
    dtype = np.dtype(dtype)
    nbytes = planning.box_size(tuple((0, int(d)) for d in shape)) * dtype.itemsize
    if align is None:
        align = DIRECT_ALIGN if nbytes >= DIRECT_MIN_BYTES else ALIGNMENT
    raw = np.empty(nbytes + align, np.uint8)
    offset = (-raw.ctypes.data) % align
    out = raw[offset:offset + nbytes]
    if nbytes >= NUMPY_HUGE_PAGE_BYTES:
        _no_huge_pages(out)
    return out.view(dtype).reshape(tuple(shape))


NUMPY_HUGE_PAGE_BYTES = 4 << 20
"""NumPy asks the kernel for transparent huge pages for allocations of this size and more."""


def _no_huge_pages(buf: np.ndarray) -> None:
    """Undo NumPy's `madvise(MADV_HUGEPAGE)` on the whole pages of a not yet touched buffer: on a
    host whose THP `defrag` is `madvise` (the kernel's default) the first touch of such memory may
    stall while the kernel compacts memory for huge pages (and where the host takes back freed
    huge-page-sized blocks, as on our VM, faulting huge pages in is several times slower), and a
    restored buffer is written once by a copy from a staging buffer, which huge pages do not speed
    up (staging.py). Figures: docs/benchmarks.md, "Measurements behind the fast path"."""
    madvise = staging.libc_madvise()
    if madvise is None or not hasattr(mmap, "MADV_NOHUGEPAGE"):  # not Linux
        return
    page = mmap.PAGESIZE
    start = -(-buf.ctypes.data // page) * page
    end = (buf.ctypes.data + buf.nbytes) // page * page
    if end > start:
        madvise(start, end - start, mmap.MADV_NOHUGEPAGE)  # best effort: an error leaves huge pages on


_counts_lock = threading.Lock()
_counts = {"allocations": 0, "bytes": 0, "populated_bytes": 0, "touched_bytes": 0}


def box_buffer(shape: Sequence[int], dtype: Any, align: int | None = None, *, populate: bool = False) -> np.ndarray:
    """A fresh `aligned_empty` for restored data, counted (`host_buffer_counts`); with `populate`,
    faulted in before it is returned (`populate_pages`: in user space, never inside a read)."""
    out = aligned_empty(shape, dtype, align)
    if not out.nbytes:
        return out
    with _counts_lock:
        _counts["allocations"] += 1
        _counts["bytes"] += out.nbytes
    if populate:
        populate_pages(out)
    return out


def host_buffer_counts() -> dict[str, int]:
    """The host buffers this process's restores allocated so far for restored data (box buffers,
    cast buffers, the ring): {"allocations", "bytes"}, and the bytes faulted in ahead of the reads
    into them (`populate_pages`): "populated_bytes" (all), "touched_bytes" (page by page in user
    space, where `madvise(MADV_POPULATE_WRITE)` is refused). Tests check reuse by these counts."""
    with _counts_lock:
        return dict(_counts)


DEFAULT_HOST_RING_BYTES = 512 << 20
"""ManagerOptions.restore_host_buffer_bytes's default."""


def plan_ring_bytes(pieces: Sequence[int], host_buffer_bytes: int, slots: int = 1) -> int:
    """The host ring for a restore of leaves with these ring pieces (bytes): `host_buffer_bytes`, or
    room for its `slots` largest pieces at once when that is bigger; never more than all pieces
    together (pure).
    - `slots=2` where the ring is faulted in ahead, off the restore's path (the restore prefetch's
      ring-only mode, during the trainer's start-up): a large leaf is then read while the one before
      it is transferred (with room for one, big leaves alternated between reading and transferring:
      1.80 s of a 6.25 GiB restore on a TPU v5e host, docs/benchmarks.md).
    - `slots=1` where the restore itself would fault it (reader.read_leaves; a ring already there
      of any bigger size is used as it is): on the TPU v5e host, faulting fresh memory costs ~1 s/GiB,
      more than the overlap saves: a fresh process's first restore of 2.03 GiB took 1.52 s with a
      ring of two leaves against 0.92 s with one, and a 6.25 GiB restore 3.68 s against 3.06 s
      (2026-12-07 and 2026-12-06, docs/benchmarks.md)."""
    if not pieces:
        return 0
    return min(max(host_buffer_bytes, sum(sorted(pieces)[-slots:])), sum(pieces))


class HostRing:
    """One page-aligned region of host memory, lent out in pieces in allocation order and taken back
    in any order (a piece's space is free again once every older piece is back too)."""

    def __init__(self, nbytes: int) -> None:
        self.buf = box_buffer((nbytes,), np.uint8, DIRECT_ALIGN, populate=True)
        self.nbytes = nbytes
        self._live: collections.deque[list[int]] = collections.deque()  # [start, end, returned]

    def take(self, nbytes: int) -> int | None:
        """The offset of `nbytes` (a multiple of DIRECT_ALIGN) of free space, or None when there is none."""
        tail, head = (self._live[0][0], self._live[-1][1]) if self._live else (0, 0)
        if not self._live:
            if nbytes > self.nbytes:
                return None
            start = 0
        elif self._live[-1][0] >= tail:  # not wrapped: free at [head, end) and [0, tail)
            if self.nbytes - head >= nbytes:
                start = head
            elif tail >= nbytes:
                start = 0
            else:
                return None
        elif tail - head >= nbytes:  # wrapped: free at [head, tail)
            start = head
        else:
            return None
        self._live.append([start, start + nbytes, 0])
        return start

    def give(self, start: int) -> None:
        for piece in self._live:
            if piece[0] == start and not piece[2]:
                piece[2] = 1
                break
        while self._live and self._live[0][2]:
            self._live.popleft()

    def idle(self) -> bool:
        return not self._live


MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault a range's pages in, writable, in one call."""


def populate_pages(buf: np.ndarray) -> None:
    """Fault a not yet touched buffer's pages in before anything reads into it: one
    `madvise(MADV_POPULATE_WRITE)` (the kernel fills them in bulk, the GIL released: 512 MiB on our
    CPU VM under load 1.28 s against 2.0-2.4 s page by page), else, where the kernel refuses it
    (older kernels; gVisor, as on our TPU test host, returns -1), one byte written per page
    (`touch_pages`). Never left to the first `read()` into the buffer: on the gVisor test host a
    page faulted inside `read()` costs as much as one touched (~1 s per GiB of fresh memory) but
    stalls the other threads' address-space work, so a prefetch reading into fresh buffers slowed
    the trainer's `import jax` from 0.96 s to 7.05 s, and pages touched first did not (TPU host probes,
    docs/checkpointing.md)."""
    if not buf.nbytes:
        return
    madvise = staging.libc_madvise()
    page = mmap.PAGESIZE
    start = -(-buf.ctypes.data // page) * page
    end = (buf.ctypes.data + buf.nbytes) // page * page
    done = False
    if madvise is not None and hasattr(mmap, "MADV_HUGEPAGE") and end > start:  # Linux
        done = madvise(start, end - start, MADV_POPULATE_WRITE) == 0
    if not done:
        touch_pages(buf)
    with _counts_lock:
        _counts["populated_bytes"] += buf.nbytes
        if not done:
            _counts["touched_bytes"] += buf.nbytes


def touch_pages(buf: np.ndarray) -> None:
    """Write a zero into every page of `buf` (contents undefined afterwards: for buffers about to
    be filled): the page faults happen here, in user space, NumPy's strided fill with the GIL released."""
    flat = buf.reshape(-1).view(np.uint8)
    page = mmap.PAGESIZE
    first = (-flat.ctypes.data) % page  # the first byte on a page boundary
    flat[:min(first + 1, flat.nbytes)] = 0  # the partial page at the start (or everything)
    flat[first::page] = 0
    flat[-1:] = 0  # the partial page at the end


_ring: HostRing | None = None
_ring_busy = False
_ring_warming = False
_ring_lock = threading.Lock()
_ring_warmed = threading.Condition(_ring_lock)


def ring_expected(reuse: bool | None) -> bool:
    """Whether this process's restores will read into the host ring without being forced to: auto
    (`reuse` None) and JAX's backend already started, on accelerators. Starts no backend."""
    if reuse is not None:
        return False
    try:
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            return False
    except (ImportError, AttributeError):  # another JAX: no warming rather than starting a backend
        return False
    import jax

    return jax.default_backend() != "cpu"


def warm_host_ring(nbytes: int) -> threading.Thread | None:
    """Allocate the process's host ring of `nbytes` and fault it in on a background thread (the
    Restorer does, at the manager's creation, when `ring_expected`), so that the first restore finds
    it ready; a restore that starts meanwhile waits for it. None when there is nothing to do."""
    global _ring_busy, _ring_warming
    nbytes = -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN
    with _ring_lock:
        if nbytes <= 0 or _ring_busy or (_ring is not None and _ring.nbytes >= nbytes):
            return None
        _ring_busy = _ring_warming = True

    def build() -> None:
        global _ring, _ring_busy, _ring_warming
        try:
            with _ring_lock:
                _ring = None  # the old one's memory goes first
            ring = HostRing(nbytes)
            with _ring_lock:
                _ring = ring
        finally:
            with _ring_lock:
                _ring_busy = _ring_warming = False
                _ring_warmed.notify_all()

    thread = threading.Thread(target=build, name="resilax-host-ring-warm", daemon=True)
    thread.start()
    return thread


def release_host_buffers() -> None:
    """Drop the process's host ring (when no restore uses it); the next restore onto accelerators
    allocates a new one."""
    global _ring
    with _ring_lock:
        if not _ring_busy:
            _ring = None


def reuses_host_buffers(sharding: Any, reuse: bool | None) -> bool:
    """Whether a leaf restored onto `sharding` reads into the host ring: `reuse` True or False
    decides; None (auto): when `device_put` copies to the devices (not CPU devices, whose
    `device_put` aliases the buffer; not host memory kinds)."""
    if sharding is None or reuse is False:
        return False
    if reuse:
        return True
    kind = getattr(sharding, "memory_kind", None)
    return (kind in (None, "device")
            and all(d.platform != "cpu" for d in sharding.addressable_devices))


class HostLease:
    """One restore's use of the process's host ring (read_leaves): each leaf's boxes in one piece,
    the piece given back once the leaf's transfers are done and no array it built aliases it."""

    def __init__(self, want: int, limit: int) -> None:
        global _ring, _ring_busy
        self.ring: HostRing | None = None
        self._holds = False
        """Whether this lease holds the process's ring (and frees it in `close`)."""
        self._placed: collections.deque[tuple[int, list[Any]]] = collections.deque()
        size = min(limit, -(-want // DIRECT_ALIGN) * DIRECT_ALIGN)
        if size <= 0:
            return
        with _ring_lock:
            while _ring_warming:  # warm_host_ring is faulting it in: faster than faulting anew
                _ring_warmed.wait()
            if _ring_busy:  # another restore of this process holds it: fresh buffers
                return
            if _ring is None or _ring.nbytes < size:
                _ring = None  # the old one's memory goes before the new one's is touched
                _ring = HostRing(size)
            _ring_busy = self._holds = True
            self.ring = _ring

    def take(self, read: LeafRead, stored: np.dtype) -> bool:
        """Put `read`'s boxes in the ring; False when it has no room now."""
        if self.ring is None:
            return False
        sizes = [planning.box_size(box) * stored.itemsize for box in read.devices]
        rounded = [-(-n // DIRECT_ALIGN) * DIRECT_ALIGN for n in sizes]
        start = self.ring.take(sum(rounded))
        if start is None:
            return False
        pos = start
        ring = self.ring.buf
        for (box, n), r in zip(zip(read.devices, sizes, strict=True), rounded, strict=True):
            read.buffers[box] = chunk_format.empty_in_order(  # laid out as the chunks are stored
                planning.box_shape(box), stored, read.leaf.transpose,
                lambda shape, dtype, at=pos, n=n: ring[at:at + n].view(dtype).reshape(shape))
            pos += r
        read.lease, read.region = self, start
        return True

    def placed(self, start: int, arrays: list[Any]) -> None:
        """The leaf in the piece at `start` was put on its devices as `arrays` (transfers maybe in flight)."""
        self._placed.append((start, arrays))

    def give_oldest(self) -> bool:
        """Wait for the oldest placed leaf's transfers and give its piece back; False when none is placed."""
        if not self._placed:
            return False
        start, arrays = self._placed.popleft()
        self._give(start, arrays)
        return True

    def fits(self, read: LeafRead, stored: np.dtype) -> bool:
        """Whether `read`'s boxes fit the ring at all (False: no ring, empty boxes, or too big even for
        an empty ring)."""
        need = sum(-(-planning.box_size(b) * stored.itemsize // DIRECT_ALIGN) * DIRECT_ALIGN for b in read.devices)
        return self.ring is not None and 0 < need <= self.ring.nbytes

    def _give(self, start: int, arrays: list[Any]) -> None:
        global _ring
        import jax

        jax.block_until_ready(arrays)
        ring = self.ring
        if ring is None:
            return
        lo, hi = ring.buf.ctypes.data, ring.buf.ctypes.data + ring.nbytes
        for array in arrays:  # an array on CPU devices that aliases the ring must keep its memory
            if any(d.platform == "cpu" for d in array.devices()) and lo <= array.unsafe_buffer_pointer() < hi:
                with _ring_lock:
                    if _ring is ring:
                        _ring = None  # never lent again: the arrays keep it alive
                self.ring = None
                return
        ring.give(start)

    def close(self, pieces: list[int]) -> None:
        """Give every piece back once its leaf's transfers are done: those placed, and `pieces` of
        leaves never placed (a failed restore, whose reads have all ended); then free the ring for
        the process's next restore."""
        global _ring, _ring_busy
        try:
            while self._placed:
                start, arrays = self._placed.popleft()
                try:
                    self._give(start, arrays)
                except Exception:  # a failed transfer: the piece is ours again either way
                    if self.ring is not None:
                        self.ring.give(start)
            for start in pieces:
                if self.ring is not None:
                    self.ring.give(start)
        finally:
            if self.ring is not None and not self.ring.idle():  # should not happen: start over
                with _ring_lock:
                    if _ring is self.ring:
                        _ring = None
            if self._holds:
                with _ring_lock:
                    _ring_busy = self._holds = False


def _forget_ring() -> None:
    """In a forked child: the parent's restore that held the ring (or warmed it) is not there."""
    global _ring, _ring_busy, _ring_warming, _ring_lock, _ring_warmed
    _ring, _ring_busy, _ring_warming, _ring_lock = None, False, False, threading.Lock()
    _ring_warmed = threading.Condition(_ring_lock)


os.register_at_fork(after_in_child=_forget_ring)
