"""What a save's write reads its data from: a private copy taken at `save()` (items.snapshot_items),
resolved to NumPy on the writing thread by either chunk backend."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np


class Landing:
    """A shard's bytes on the host, set once they landed (by the thread that takes them off the
    device: the training thread for a host transfer, a drain thread for an on-device copy) and read
    by the writing thread, which waits for them: a shard is written as soon as it lands."""

    __slots__ = ("_error", "_event", "_value")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._value: np.ndarray | None = None
        self._error: BaseException | None = None

    def set(self, value: np.ndarray) -> None:
        self._value = value
        self._event.set()

    def fail(self, error: BaseException) -> None:
        """The transfer failed: the writer raises `error` instead of waiting for ever."""
        if not self._event.is_set():
            self._error = error
            self._event.set()

    @property
    def landed(self) -> bool:
        return self._event.is_set()

    def get(self) -> np.ndarray:
        self._event.wait()
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
