"""An on-device copy's drain (docs/checkpointing.md §4, issue 37): its shards to the host in write order,
a few transfers in flight, never more landed-and-unwritten host bytes than `DRAIN_HOST_BYTES`, and the
landed copies freed (and their host copies reclaimed) on a thread of its own. device_snapshot.Transfer
runs it on the save's drain thread.
"""

from __future__ import annotations

import gc
import os
import queue as queue_mod
import threading
from typing import Any

import numpy as np

from resilax_ckpt.chunks.sources import HostBudget, Landing
from resilax_ckpt.saving.host_layout import as_landed

DRAIN_WINDOW = 4
"""An on-device copy drains to the host shard by shard, in write order, with at most this many
transfers in flight (a shard's transfer is started when the one this many places before it is
consumed). Measured on a TPU v5e (1.74 GiB in 154 leaves, a donating step of 0.007 s running beside
the drain): starting every transfer at once (`copy_to_host_async` on all) holds the GIL 0.23 s on
the drain thread and slows the loop's steps to 0.05-0.10 s while it drains (0.49 s); one shard at a
time (`np.asarray`, nothing in flight ahead) leaves the steps at 0.007-0.009 s but drains in 0.85 s.
A small window spreads those calls (one per shard consumed) and keeps a few transfers overlapping.
`RESILAX_CKPT_DRAIN_WINDOW` overrides it (1: one shard at a time, nothing started ahead), so that a
bench run on a chip can compare."""

DRAIN_WINDOW_ENV = "RESILAX_CKPT_DRAIN_WINDOW"

DRAIN_HOST_BYTES = 512 << 20
"""Back-pressure on the drain (`sources.HostBudget`): the host bytes it may have taken off the
devices (in flight or landed) that the writer has not yet written. A shard's transfer starts only
when its bytes fit (the window's transfers too), or, with nothing started left to land, once the
writer has written enough; a shard larger than this still moves alone. Why: with the window of 4 the
drain landed shards far ahead of the writes on a TPU v5e (2.03 GiB in 154 leaves on tmpfs), and peak
host RSS during a save rose from 1.24x to 1.51x the state (issue 37 target: 1.3x). 512 MiB = 0.25x
of that state (4x the writer's own in-flight bound, ManagerOptions.max_inflight_bytes 128 MiB, which
the bytes it is writing count in): room for the bench's largest shards (52992x1472 float32, 312 MB)
to land beside the next ones, so the window keeps overlapping (256 MiB would move each alone, the
drain idle while it is written). A constant, not an option: a save's host memory for the snapshot
is bounded by it (or one shard), whatever the state's size."""


def drain_window() -> int:
    """DRAIN_WINDOW, or a positive integer from DRAIN_WINDOW_ENV."""
    raw = os.environ.get(DRAIN_WINDOW_ENV, "").strip()
    if not raw:
        return DRAIN_WINDOW
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{DRAIN_WINDOW_ENV}: {raw!r} is not a positive integer (the transfers a save's "
                         f"drain keeps in flight; default {DRAIN_WINDOW})")
    return value


def drain(pieces: list[tuple[Landing, Any]], shards: dict[tuple[int, Any], Any], budget: HostBudget) -> None:
    """On-device copy: the copies' shards to the host in write order, each landed with `np.asarray`,
    at most DRAIN_WINDOW transfers in flight (the next started as one is consumed), and never more
    bytes started-but-not-yet-written than `budget` allows (DRAIN_HOST_BYTES; each landing `hold`s
    its bytes until the writer `release`s them). A transfer ahead starts only if its bytes fit now;
    the drain waits for the writer only when nothing it started is left to land (so the bytes held
    are all the writer's, which it releases on its own: no deadlock)."""
    queue: list[tuple[Landing, Any] | None] = [(landing, shards[key]) for landing, key in pieces]
    shards.clear()
    pieces.clear()
    with _Freeing() as freeing:
        _drain_queue(queue, budget, freeing)


RECLAIM_BYTES = 256 << 20
"""Every this many bytes of landed shards, the freeing thread runs a young-generation collection
(`gc.collect(0)`). Why: on a TPU v5e (JAX 0.10.2) the host copy behind `np.asarray` of a device
array is not given back when the last Python reference to it goes; jaxlib defers that release to its
garbage-collection callback (`jax/_src/lib/__init__.py` appends `_xla_gc_callback`, which calls
`_jax.collect_garbage()`, to `gc.callbacks`), and a save allocates too few Python objects to start a
collection. Measured on the chip (2026-12-07, 154 leaves of 13 MiB, each taken off the device with
`np.asarray` and dropped at once): RSS grew by the whole 1.96 GiB and stayed there; with
`gc.collect(0)` every 8 leaves (104 MiB) the peak was 0.115 GiB, every 32 leaves 0.394 GiB, and
`malloc_trim` or a pause alone changed nothing. In the bench each save grew RSS by the state's size
while the drain held at most 0.4-0.5 GiB of landed, unwritten shards (issue 37: peak RSS 1.51x the
state, target 1.3x). A collection here frees the shards the writer has finished with by then: the
drain's own bound (DRAIN_HOST_BYTES) plus this much are held at most."""


class _Freeing:
    """Frees the landed shards' device buffers on a thread of its own, and every RECLAIM_BYTES of
    them runs the collection that gives the written shards' host copies back. Dropping a landed copy
    costs the drain thread ~1.8 ms a shard on a TPU v5e (0.27 s of a 0.85 s drain of 2.03 GiB in 154
    leaves, the bench's profile of 2026-12-07, JAX 0.10.2), in series with the transfers it waits
    for; here it overlaps them. `put` takes a one-item list, which the freeing thread empties, so
    the last reference to the shard is dropped there and not on the drain thread. Leaving the
    `with` waits until every buffer is freed: the next save's room check (`device_room`) then sees
    them free."""

    def __init__(self) -> None:
        self._queue: queue_mod.SimpleQueue[list[Any] | None] = queue_mod.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="resilax-free", daemon=True)

    def __enter__(self) -> _Freeing:
        self._thread.start()
        return self

    def put(self, box: list[Any]) -> None:
        self._queue.put(box)

    def _run(self) -> None:
        since = 0  # bytes freed since the last collection
        while (box := self._queue.get()) is not None:
            since += int(box[0].nbytes)
            box.clear()
            if since >= RECLAIM_BYTES:
                since = 0
                gc.collect(0)

    def __exit__(self, *exc: object) -> None:
        self._queue.put(None)
        self._thread.join()


def _drain_queue(queue: list[tuple[Landing, Any] | None], budget: HostBudget, freeing: _Freeing) -> None:
    """`_drain`'s loop over the shards in write order (`queue`, emptied as they land)."""
    window = max(1, drain_window())
    nxt = 0  # the next shard whose transfer is to start (those from n to nxt - 1 are in flight)

    def start(m: int) -> None:
        entry = queue[m]
        assert entry is not None
        entry[0].hold(budget, int(entry[1].nbytes))
        if window > 1:  # with a window of 1, np.asarray transfers the shard when it is consumed
            entry[1].copy_to_host_async()

    for n in range(len(queue)):
        entry = queue[n]
        assert entry is not None
        if nxt == n:  # nothing in flight: wait until this shard's bytes fit (the writer releases)
            budget.take(int(entry[1].nbytes))
            start(n)
            nxt += 1
        while nxt < min(len(queue), n + window):
            later = queue[nxt]
            assert later is not None
            if not budget.try_take(int(later[1].nbytes)):
                break
            start(nxt)
            nxt += 1
        queue[n] = None
        landing, box = entry[0], [entry[1]]
        del entry  # the box holds the shard's only reference here
        landing.set(as_landed(np.asarray(box[0])))
        freeing.put(box)  # the copy's device buffer is freed once landed, on the freeing thread
        del box
