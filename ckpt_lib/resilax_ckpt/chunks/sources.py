"""What a save's write reads its data from: a private copy taken at `save()` (items.snapshot_items),
resolved to NumPy on the writing thread by either chunk backend."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np


class HostBudget:
    """Bounds the host bytes a save's drain has taken off the devices and its writer has not yet
    written (drain.DRAIN_HOST_BYTES): the drain `take`s a shard's bytes before its
    transfer starts, the writer gives them back (`Landing.release`) once the write finished with
    the data. Without it the drain lands shards far ahead of slow writes, and the host keeps every
    landed copy until written (peak host RSS). `take` always admits a shard when nothing is held (a
    shard larger than the bound still moves), so at most max(limit, one shard) is held. `close`
    stops every wait for good (the save failed or ended: nobody will give bytes back)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        """The most bytes held at once (tests)."""
        self._closed = False
        self._cond = threading.Condition()

    def _fits(self, nbytes: int) -> bool:
        return self._closed or self.held == 0 or self.held + nbytes <= self.limit

    def try_take(self, nbytes: int) -> bool:
        """Take `nbytes` if they fit now; never waits."""
        with self._cond:
            if not self._fits(nbytes):
                return False
            self._take(nbytes)
            return True

    def take(self, nbytes: int) -> None:
        """Take `nbytes`, waiting until they fit. Only call it when what is held will be given back
        without the caller's help (the drain: when every shard it started has landed, so the held
        bytes are the writer's, which it writes and releases on its own)."""
        with self._cond:
            self._cond.wait_for(lambda: self._fits(nbytes))
            self._take(nbytes)

    def _take(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def give(self, nbytes: int) -> None:
        with self._cond:
            self.held -= nbytes
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Landing:
    """A shard's bytes on the host, set once they landed (by the thread that takes them off the
    device: the training thread for a host transfer, a drain thread for an on-device copy) and read
    by the writing thread, which waits for them: a shard is written as soon as it lands. The
    landings of one save share one condition (`landed`): cheap to make by the thousand."""

    __slots__ = ("_budget", "_done", "_error", "_held", "_landed", "_value", "pull")

    def __init__(self, landed: threading.Condition) -> None:
        self._landed = landed
        self.pull: Callable[[Landing], None] | None = None
        """Lands this shard (and the ones before it) on the calling thread: a lazy transfer's."""
        self._done = False
        self._value: np.ndarray | None = None
        self._error: BaseException | None = None
        self._budget: HostBudget | None = None
        self._held = 0

    def hold(self, budget: HostBudget, nbytes: int) -> None:
        """This shard's `nbytes` were taken from `budget` (by the drain): `release` gives them back."""
        self._budget, self._held = budget, nbytes

    def release(self) -> None:
        """The writer is done with this shard's data (written, failed or cancelled): its bytes go
        back to the drain's budget, once (a no-op for a shard that took none)."""
        budget, self._budget = self._budget, None
        if budget is not None:
            budget.give(self._held)

    def set(self, value: np.ndarray) -> None:
        with self._landed:
            self._value, self._done = value, True
            self._landed.notify_all()

    def fail(self, error: BaseException) -> None:
        """The transfer failed: the writer raises `error` instead of waiting for ever."""
        with self._landed:
            if not self._done:
                self._error, self._done = error, True
                self._landed.notify_all()

    @property
    def landed(self) -> bool:
        return self._done

    def get(self) -> np.ndarray:
        if not self._done and self.pull is not None:
            self.pull(self)
        if not self._done:
            with self._landed:
                self._landed.wait_for(lambda: self._done)
        if self._error is not None:
            raise RuntimeError(f"taking a shard off its device failed: {self._error}") from self._error
        value, self._value = self._value, None  # the writer holds it now; freed once written
        assert value is not None
        return value


def resolve_source(source: Any) -> np.ndarray:
    """A write's data as NumPy (a Landing: once it landed). Called on: the writing thread."""
    if isinstance(source, Landing):
        return source.get()
    return np.asarray(source)
