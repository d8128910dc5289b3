"""Reading the control folder's small JSON files (restore.json, stopped.json, trainer.json,
assignment.json, the save requests and results): written by the trainer or the sidecar of the same pod,
read by the other. A read never waits (`O_NONBLOCK`: a FIFO there answers at once), never follows a
link (`O_NOFOLLOW`), takes only a regular file (fstat) and reads at most `CONTROL_FILE_CAP` bytes, so
a file in the wrong shape costs a missing report, never a blocked or swollen reader (issue 40)."""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any

CONTROL_FILE_CAP = 1 << 20
"""The most bytes of a control file read; a longer one counts as unreadable."""


def load_control_json(path: str) -> Any | None:
    """The parsed JSON of the control file at `path`, or None when it is missing, not a regular file,
    a link, over CONTROL_FILE_CAP bytes, or not (yet) valid JSON. Other OS errors are raised."""
    data = read_regular_file(path, CONTROL_FILE_CAP)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def read_regular_file(path: str, cap: int) -> bytes | None:
    """The bytes of the regular file at `path`, read without waiting or following a link; None when it
    is missing, a link, not a regular file (a FIFO, a socket, a device, a folder) or over `cap` bytes
    (also one that grows past it while read). Other OS errors are raised. Also for the sidecar's reads of
    the trainer's step markers and metadata (resilax_sidecar.upload_scan)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):  # a link; a FIFO or socket nobody writes
            return None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > cap:
            return None
        chunks: list[bytes] = []
        size = 0
        while size <= cap:  # the file may grow meanwhile: still never past the cap
            chunk = os.read(fd, min(cap + 1 - size, max(info.st_size - size, 0) + 4096))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return None if size > cap else b"".join(chunks)
