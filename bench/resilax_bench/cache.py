"""Make the next read of a checkpoint cold: evict its files, and only its files, from the page cache.

``posix_fadvise(DONTNEED)`` on every file after a ``sync`` (dirty pages are not dropped). Unlike
``echo 3 > /proc/sys/vm/drop_caches`` it leaves the process's own code pages (jaxlib's shared objects
are hundreds of MB) and other users' files cached, so a "cold restore" measures reading the
checkpoint, not re-faulting the libraries; and it needs no root. On tmpfs there is no backing store
and the call changes nothing: there the data is always in memory, which is the point of that tier.
"""

from __future__ import annotations

import os


def evict_from_page_cache(path: str) -> int:
    """Evict every file under ``path`` (a file or a folder); returns how many files were evicted."""
    os.sync()
    files = (
        [path]
        if os.path.isfile(path)
        else [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
    )
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return len(files)
