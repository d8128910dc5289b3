"""A bound on the bytes of I/O in flight: operations (futures) are admitted while their bytes fit
(one is always admitted), and awaited oldest first. Used by both chunk backends' writes and by the
reads of restore; `planning.scaled_inflight_limit` gives the bound."""

from __future__ import annotations

import collections
from typing import Any

from resilax_ckpt.errors import ResilaxCkptError, StorageError


def short_error(error: Exception) -> str:
    """tensorstore's message without the JSON spec it appends."""
    return str(error).split(" [tensorstore_spec=", 1)[0]


class InflightLimiter:
    """Keeps at most `limit` bytes of I/O in flight (always admits one operation). Each operation
    may carry a callback run on its result and objects kept alive until it finished."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._inflight = 0
        self._pending: collections.deque[tuple[Any, int, str, Any, Any]] = collections.deque()

    def admit(self, nbytes: int) -> None:
        while self._pending and self._inflight + nbytes > self._limit:
            self._finish_oldest()

    def add(self, future: Any, nbytes: int, what: str, on_done: Any = None, keep: Any = None) -> None:
        self._pending.append((future, nbytes, what, on_done, keep))
        self._inflight += nbytes

    def _finish_oldest(self) -> None:
        future, nbytes, what, on_done, _ = self._pending.popleft()
        self._inflight -= nbytes
        try:
            result = future.result()
        except ResilaxCkptError as e:  # e.g. the step's data is bad, not the storage: keep the kind
            self.cancel()
            raise type(e)(f"{what}: {e}") from e
        except Exception as e:
            self.cancel()
            raise StorageError(f"{what}: {short_error(e)}") from e
        if on_done is not None:
            on_done(result)

    def finish_oldest(self) -> bool:
        """Await the oldest operation and run its callback; False when none is pending."""
        if not self._pending:
            return False
        self._finish_oldest()
        return True

    def finish_done(self) -> None:
        """Run the callbacks of the oldest operations that have already finished (no waiting)."""
        while self._pending and self._pending[0][0].done():
            self._finish_oldest()

    def drain(self) -> None:
        while self._pending:
            self._finish_oldest()

    def cancel(self) -> None:
        for entry in self._pending:
            entry[0].cancel()
        self._pending.clear()
        self._inflight = 0
