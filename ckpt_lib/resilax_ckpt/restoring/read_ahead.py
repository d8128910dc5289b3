"""The reading half of the restore prefetch (prefetch.py chooses what and starts it): the read-ahead
of one step folder's leaves on a background thread with the restore's own reader, and their hand-over
to the restore that reads the same folder (`RestorePrefetch.claim` and `fill`), with the pure plans
behind it (which boxes of a leaf, how many leaves fit in memory, a box from the boxes held).

JAX-free, like prefetch.py. Called on: each process by itself.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from resilax_ckpt import planning
from resilax_ckpt.chunks import chunk_format, host_ring, reader
from resilax_ckpt.errors import ResilaxCkptError
from resilax_ckpt.metadata import LeafMetadata
from resilax_ckpt.options import ManagerOptions
from resilax_ckpt.storage import Storage

log = logging.getLogger(__name__)

BATCH_BYTES = 256 << 20
"""The leaves are read in batches of about this many bytes (one reader.read_leaves each): a cancel
(the restore picked another step) waits for one batch at most."""

EventHook = Callable[[str, dict[str, Any]], None]
"""`on_event(name, info)`: "started" (the step is chosen and its metadata read; the chunk reads are
queued), "leaf" (a leaf's buffers are read: item, leaf, bytes), "done" (the reads ended: stats),
"taken" (the restore took a leaf), "released" (the rest dropped: reason). Called on the reading
thread or the restore's; it must be quick and must not raise."""

Box = planning.Box


# ---------------------------------------------------------------------------- pure choices


def plan_leaf_boxes(leaf: LeafMetadata, whole: bool,
                    file_present: Callable[[tuple[str, ...]], bool] | None) -> list[Box]:
    """The boxes of an array leaf to prefetch. Without `file_present` (a shared folder or the
    persistent tier): the whole array when `whole` (one process reads all), else none. With it (this
    host's local tier): the region of every chunk whose file is present (with an unchanged mesh, the
    boxes this process's restore reads), as the one whole array when `whole` and every file is."""
    shape = tuple(leaf.shape)
    if any(d == 0 for d in shape):
        return []
    everything = [tuple((0, d) for d in shape)]
    if file_present is None:
        return everything if whole else []
    files = chunk_format.ArrayFiles.of(leaf)
    grid = [range(-(-d // c)) for d, c in zip(shape, leaf.chunks, strict=True)]
    chunks: list[tuple[int, ...]] = [()]
    for r in grid:
        chunks = [(*prefix, i) for prefix in chunks for i in r]
    present: dict[tuple[str, ...], bool] = {}
    boxes = []
    for chunk in chunks:
        key = files.locate(chunk)[0]
        if key not in present:
            present[key] = file_present(key)
        if present[key]:
            boxes.append(tuple((i * c, min((i + 1) * c, n)) for i, c, n in zip(chunk, leaf.chunks, shape, strict=True)))
    return everything if whole and len(boxes) == len(chunks) else boxes


def plan_within_memory(sizes: Iterable[int], limit: int) -> int:
    """How many of the leaves (their byte sizes, in reading order) fit in `limit` bytes: the prefetch
    stops at the first that does not."""
    total = 0
    count = 0
    for size in sizes:
        total += size
        if total > limit:
            break
        count += 1
    return count


def find_box(held: Mapping[Box, np.ndarray], box: Box) -> np.ndarray | None:
    """`box`'s buffer from the held boxes: the held buffer itself when it is exactly `box`, a copy of
    its part of a held box that contains it, None when no held box does."""
    exact = held.get(box)
    if exact is not None:
        return exact
    for have, buf in held.items():
        if all(a0 <= a and b <= b0 for (a, b), (a0, b0) in zip(box, have, strict=True)):
            out = reader.aligned_empty(planning.box_shape(box), buf.dtype)
            np.copyto(out, reader.subview(buf, planning.offset_index(box, have)))
            return out
    return None


# ---------------------------------------------------------------------------- reading


class BoxesRead(reader.LeafRead):
    """A leaf read into host buffers of the given boxes (reader.read_leaves drives it); `result` is
    then {box: buffer}."""

    def __init__(self, item: str, leaf: LeafMetadata, boxes: list[Box]) -> None:
        super().__init__(item, leaf, np.dtype(leaf.dtype), None)
        self._boxes = boxes

    @property
    def nbytes(self) -> int:
        return sum(planning.box_size(b) for b in self._boxes) * np.dtype(self.leaf.dtype).itemsize

    def plan_boxes(self) -> None:
        self.devices = {box: [] for box in self._boxes}

    def finish(self) -> None:
        self.result = dict(self.buffers)
        self.buffers = {}


FileState = dict[str, tuple[int, int, int, int]]


def _file_state(folder: str) -> FileState:
    """Every file under a leaf's local folder: (device, inode, size, mtime_ns)."""
    out: FileState = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            out[os.path.relpath(path, folder)] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    return out


@dataclasses.dataclass
class _Held:
    leaf: LeafMetadata
    buffers: dict[Box, np.ndarray]
    files: FileState | None
    """The leaf's files when read (local storage; None on object stores, whose attempts are write-once)."""
    nbytes: int


def available_memory() -> int:
    """MemAvailable of /proc/meminfo (else the free physical pages)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


@dataclasses.dataclass(frozen=True)
class ReadPlan:
    """What a prefetch reads once its step is chosen (prefetch.plan_prefetch)."""

    storage: Storage
    backend: reader.ChunkBackendReads
    step: int
    tier: str
    """"local" (where saves go) or "persistent" (the tier behind a local tier)."""
    step_path: str
    """The step folder read (the restore uses the buffers only when it reads this folder)."""
    reads: list[BoxesRead]
    left: int
    """Leaves left to the restore (memory, or all of them with a ring)."""
    ring_bytes: int = 0
    """The host ring to fault in first, on the reading thread (host_ring.warm_host_ring): 0 for none."""


class RestorePrefetch:
    """One process's read-ahead of one step folder (see the module docstring). Built by `start_prefetch`.

    Call order: 1. `start` (the step is chosen, then read, on a background thread); 2. the manager's
    restore `claim`s the folder it reads (taking each leaf once it is read when it is this one, else
    dropping the prefetch; a prefetch still choosing its step is dropped, never waited for);
    3. `release` drops what the restore did not take. `wait`, `wait_chosen` and `stats` at any time."""

    def __init__(self, choose: Callable[[], ReadPlan | None], options: ManagerOptions,
                 on_event: EventHook | None) -> None:
        self.step: int | None = None
        """The step read ahead (None until chosen, and when there was none to read)."""
        self.tier: str | None = None
        """"local" (where saves go) or "persistent" (the tier behind a local tier); None until chosen."""
        self.step_path: str | None = None
        """The step folder read (the restore uses the buffers only when it reads this folder)."""
        self._choose = choose
        """Lists the tiers and plans the reads: on the reading thread, so that no listing (an object
        store's: network, retries) holds the caller."""
        self._plan: ReadPlan | None = None
        self._options = options
        self._on_event = on_event
        self._held: dict[tuple[str, str | None], _Held] = {}
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        """Notified as each leaf's read ends (held or not) and when the reads end."""
        self._pending: set[tuple[str, str | None]] = set()
        """The leaves whose reads have not ended yet."""
        self._chosen = threading.Event()
        """Set once the choice ended: a plan adopted, nothing to read, failed or dropped."""
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._released: str | None = None
        self._error: str | None = None
        self._stats: dict[str, Any] = {"step": None, "tier": None, "path": None, "leaves": 0, "left_to_restore": 0,
                                       "bytes": 0, "read_leaves": 0, "read_bytes": 0, "taken_leaves": 0,
                                       "taken_bytes": 0, "started": time.time(), "read_seconds": None,
                                       "ring_bytes": 0}
        self._thread = threading.Thread(target=self._run, name="resilax-prefetch", daemon=True)

    # ------------------------------------------------------------------ queries

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the reads ended (done, failed or cancelled); whether they did within `timeout`."""
        return self._done.wait(timeout)

    def wait_chosen(self, timeout: float | None = None) -> bool:
        """Block until the choice of step ended (chosen: `step` set; nothing to read; failed; dropped);
        whether it did within `timeout`."""
        return self._chosen.wait(timeout)

    def stats(self) -> dict[str, Any]:
        """What was read and taken: step, tier, path, leaves and bytes planned, read and taken by the
        restore, leaves left to the restore (memory, or all with a ring), ring_bytes (the host ring
        faulted in instead of reading: PrefetchSettings.ring_only), read_seconds, error, released (why)."""
        with self._lock:
            return {**self._stats, "error": self._error, "released": self._released}

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Choose the step and read it, on the background thread."""
        self._thread.start()

    def claim(self, storage: Storage, step_path: str, step: int) -> Callable[[reader.LeafRead], bool] | None:
        """The restore reads `step` from `step_path`: when that is the prefetched folder, the function
        that fills a restore's leaf from the prefetch (`fill`, which waits for that leaf's read: the
        restore puts the leaves read on their devices while the later ones are read); else drop the
        prefetch (the restore picked another step or tier, or came before the prefetch chose its
        step: the restore never waits for a listing of the prefetch's) and return None."""
        with self._lock:
            released, plan = self._released, self._plan
        if released is not None:
            return None
        if plan is None:
            why = "chose no step" if self._chosen.is_set() else "had chosen no step yet"
            self.release(f"the restore reads step {step} from {step_path}; the prefetch {why}")
            return None
        if step != plan.step or storage.is_local != plan.storage.is_local or not same_path(storage, step_path,
                                                                                             plan.step_path):
            self.release(f"the restore reads step {step} from {step_path}")
            return None
        return self.fill

    def fill(self, read: reader.LeafRead) -> bool:
        """Give a restore's leaf its buffers from the prefetch and finish it (its `result` is then set):
        True when the prefetch holds this leaf with the same metadata, unchanged files, and every box
        the leaf's target needs (a held box or one containing it); else False (the restore reads it)."""
        key = (read.item, read.leaf.dir)
        with self._settled:
            while key in self._pending and not self._done.is_set():
                self._settled.wait()
            held = self._held.pop(key, None)
        if held is None:
            return False
        if held.leaf != read.leaf:
            log.info("restore prefetch: %s has other metadata than the one prefetched: read again", read.name)
            return False
        if held.files is not None and _file_state(self._leaf_path(read.item, read.leaf)) != held.files:
            log.info("restore prefetch: the files of %s changed since they were prefetched: read again", read.name)
            return False
        read.plan_boxes()
        buffers: dict[Box, np.ndarray] = {}
        for box in read.devices:
            buf = find_box(held.buffers, box)
            if buf is None:
                return False
            buffers[box] = buf
        read.buffers = buffers
        read.remaining = 0
        read.finish()
        with self._lock:
            self._stats["taken_leaves"] += 1
            self._stats["taken_bytes"] += held.nbytes
        self._emit("taken", {"item": read.item, "leaf": read.leaf.keystr, "bytes": held.nbytes})
        return True

    def release(self, reason: str) -> None:
        """Stop reading (after the batch under way) and drop every buffer the restore did not take.
        A prefetch still choosing its step is not waited for: it holds nothing, and its thread ends
        without reading once its listing returns."""
        with self._lock:
            if self._released is not None:
                return
            self._released = reason
            reading = self._plan is not None
        self._cancel.set()
        if reading and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._done.wait()
        with self._lock:
            unused = len(self._held)
            self._held.clear()
        if unused:
            log.info("restore prefetch of step %s: %d leaves unused (%s)", self.step, unused, reason)
        self._emit("released", {"reason": reason, "unused_leaves": unused})

    # ------------------------------------------------------------------ the reading thread

    def _adopt(self) -> ReadPlan | None:
        """Choose the step (the listings and its metadata) and take the plan, unless the restore came
        first (released meanwhile) or there is nothing to read. Called on: the reading thread."""
        try:
            plan = self._choose()
        except Exception as e:  # a read-ahead never takes the trainer down: the restore reads as always
            with self._lock:
                self._error = f"{type(e).__name__}: {e}"
            log.warning("no restore prefetch (the restore reads as always): %s: %s", type(e).__name__, e,
                        exc_info=not isinstance(e, (ResilaxCkptError, OSError)))
            return None
        if plan is None:
            return None
        with self._lock:
            if self._released is not None:
                return None
            self._plan = plan
            self.step, self.tier, self.step_path = plan.step, plan.tier, plan.step_path
            self._pending = {(r.item, r.leaf.dir) for r in plan.reads}
            self._stats.update(step=plan.step, tier=plan.tier, path=plan.step_path, leaves=len(plan.reads),
                               left_to_restore=plan.left, bytes=sum(r.nbytes for r in plan.reads),
                               ring_bytes=plan.ring_bytes)
        self._emit("started", {"step": plan.step, "tier": plan.tier, "path": plan.step_path,
                               "leaves": len(plan.reads), "bytes": self._stats["bytes"]})
        log.info("restore prefetch: reading step %d (%s tier, %d leaves, %.1f MiB) from %s", plan.step, plan.tier,
                 len(plan.reads), self._stats["bytes"] / 2**20, plan.step_path)
        return plan

    def _run(self) -> None:
        began = time.perf_counter()
        try:
            plan = self._adopt()
            self._chosen.set()
            if plan is None:
                return
            if plan.ring_bytes:
                warming = host_ring.warm_host_ring(plan.ring_bytes)
                if warming is not None:
                    warming.join()
            batch: list[BoxesRead] = []
            size = 0
            for read in plan.reads:
                if self._cancel.is_set():
                    break
                batch.append(read)
                size += read.nbytes
                if size >= BATCH_BYTES:
                    self._read_batch(batch)
                    batch, size = [], 0
            if batch and not self._cancel.is_set():
                self._read_batch(batch)
        except (ResilaxCkptError, OSError) as e:  # the restore meets it again and decides (fallback)
            self._fail(e)
        except Exception as e:  # a read-ahead never takes the trainer down
            log.debug("restore prefetch failed", exc_info=True)
            self._fail(e)
        finally:
            self._chosen.set()
            with self._settled:
                self._stats["read_seconds"] = time.perf_counter() - began
                self._pending.clear()
                self._done.set()
                self._settled.notify_all()
            self._emit("done", self.stats())

    def _fail(self, e: BaseException) -> None:
        with self._lock:
            self._error = f"{type(e).__name__}: {e}"
        log.warning("restore prefetch of step %s stopped (the restore reads the rest itself): %s: %s",
                    self.step, type(e).__name__, e)

    def _leaf_path(self, item: str, leaf: LeafMetadata) -> str:
        assert self._plan is not None
        return self._plan.storage.join(self._plan.step_path, item, str(leaf.dir))

    def _read_batch(self, batch: list[BoxesRead]) -> None:
        plan = self._plan
        assert plan is not None
        local = plan.storage.is_local
        before = [_file_state(self._leaf_path(r.item, r.leaf)) if local else None for r in batch]
        # populate: this thread faults each leaf's buffers in (user space) before its reads are queued;
        # a page faulted inside read() stalls the trainer's start-up on some hosts (host_ring.populate_pages).
        reader.read_leaves(list(batch), plan.step_path, plan.backend, self._options.max_inflight_bytes,
                           self._options.io_concurrency, populate=True)
        for read, files in zip(batch, before, strict=True):
            after = _file_state(self._leaf_path(read.item, read.leaf)) if local else None
            key = (read.item, read.leaf.dir)
            if after == files:  # else changed while read: left to the restore
                # Told before the restore can take it: an event log has each "leaf" before its "taken".
                self._emit("leaf", {"item": read.item, "leaf": read.leaf.keystr, "bytes": read.nbytes})
            with self._settled:
                self._pending.discard(key)
                self._settled.notify_all()
                if self._released is not None:
                    return
                if after != files:
                    continue
                self._held[key] = _Held(read.leaf, read.result, files, read.nbytes)
                self._stats["read_leaves"] += 1
                self._stats["read_bytes"] += read.nbytes
            read.result = None

    def _emit(self, name: str, info: dict[str, Any]) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(name, info)
        except Exception:  # an observer's bug must not stop the reads nor the restore
            log.warning("restore prefetch: on_event(%r) raised; no more events", name, exc_info=True)
            self._on_event = None


def files_in(folder: str) -> Callable[[tuple[str, ...]], bool]:
    def present(key: tuple[str, ...]) -> bool:
        return os.path.exists(os.path.join(folder, *key))
    return present


def same_path(storage: Storage, a: str, b: str) -> bool:
    if storage.is_local:
        return os.path.realpath(a) == os.path.realpath(b)
    return a.rstrip("/") == b.rstrip("/")
