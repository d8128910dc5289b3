"""The channel between `resilax run` and its child for a kept trainer process (kept.py): a Unix socket
pair, one JSON object a line, the child's end inherited as file descriptor `$RESILAX_KEPT_FD`.

| from | message | when |
|---|---|---|
| child | `{"parked": {"pid", "exit_code", "processes", "marks"}}` | its entry returned after a stop's final save and its JAX backends are dropped |
| child | `{"leaving": {"key", "message"}}` | it exits instead of parking (kept.decide_park's refusal), or a kept restart failed |
| child | `{"resumed": {"incarnation", "marks"}}` | it runs the next incarnation: new environment taken, devices open again |
| supervisor | `{"resume": {"incarnation", "generation", "env"}}` | run the next incarnation with this whole environment |
| supervisor | `{"exit": {"reason"}}` | exit (the next incarnation is a fresh process, or the supervisor ends) |

The supervisor never blocks on it (non-blocking reads in its loop); the parked child blocks on it, and
takes its end of file (the supervisor gone) as an exit. JAX-free.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping
from typing import Any

from resilax_ckpt.trainer import kept

#: The longest line either end accepts (a resume carries a whole environment: kilobytes). A peer that
#: sends more without a newline has broken the channel: it is closed, so the supervisor's memory stays
#: bounded whatever the child writes (the next incarnation is then a fresh process).
MAX_LINE_BYTES = 4 << 20


class Channel:
    """One end of the pair."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""
        self.closed = False

    @classmethod
    def open_pair(cls) -> tuple[Channel, int]:
        """The supervisor's end (non-blocking) and the child's descriptor, inheritable, to pass at spawn
        (the caller closes it once the child started)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        mine.setblocking(False)
        fd = theirs.detach()
        os.set_inheritable(fd, True)
        return cls(mine), fd

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Channel | None:
        """The child's end named by RESILAX_KEPT_FD, made non-inheritable (the trainer's own children
        do not get it); None where it is unset or not an open socket."""
        raw = env.get(kept.FD_ENV, "").strip()
        if not raw.isdigit():
            return None
        try:
            sock = socket.socket(fileno=int(raw))
        except OSError:
            return None
        if sock.family != socket.AF_UNIX:
            sock.detach()
            return None
        sock.set_inheritable(False)
        sock.setblocking(True)
        return cls(sock)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, kind: str, body: Mapping[str, Any]) -> bool:
        """Send one message; False when the other end is gone."""
        if self.closed:
            return False
        try:
            was = self.sock.getblocking()
            self.sock.setblocking(True)
            self.sock.sendall(kept.encode(kind, body))
            self.sock.setblocking(was)
            return True
        except OSError:
            return False

    def poll(self) -> list[tuple[str, dict[str, Any]]]:
        """The messages that arrived (non-blocking); `closed` once the other end is gone."""
        out = []
        while not self.closed:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            self._buffer += data
            if self._overlong():
                break
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = kept.parse_message(line)
            if message is not None:
                out.append(message)
        return out

    def receive(self) -> tuple[str, dict[str, Any]] | None:
        """Block for the next message; None once the other end is gone."""
        while True:
            if b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                message = kept.parse_message(line)
                if message is not None:
                    return message
                continue
            if self._overlong():
                return None
            try:
                data = self.sock.recv(65536)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                self.closed = True
                return None
            self._buffer += data

    def _overlong(self) -> bool:
        """Whether the unfinished line is past MAX_LINE_BYTES: then the channel closes (see there)."""
        if len(self._buffer) - (self._buffer.rfind(b"\n") + 1) <= MAX_LINE_BYTES:
            return False
        self._buffer = self._buffer[: self._buffer.rfind(b"\n") + 1]
        self.close()
        return True

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
