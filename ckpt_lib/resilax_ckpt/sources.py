"""What a save's write reads its data from: a private copy taken at `save()` (items.snapshot_items),
resolved to NumPy on the writing thread by either chunk backend."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np


class Landing:
    """A shard's bytes on the host, set once they landed (by the thread that takes them off the
    device: the training thread for a host transfer, a drain thread for an on-device copy) and read
    by the writing thread, which waits for them: a shard is written as soon as it lands. The
    landings of one save share one condition (`landed`): cheap to make by the thousand."""

    __slots__ = ("_done", "_error", "_landed", "_value", "pull")

    def __init__(self, landed: threading.Condition) -> None:
        self._landed = landed
        self.pull: Callable[[Landing], None] | None = None
        """Lands this shard (and the ones before it) on the calling thread: a lazy transfer's."""
        self._done = False
        self._value: np.ndarray | None = None
        self._error: BaseException | None = None

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
