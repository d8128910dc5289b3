"""The uploader's copy of one save into its attempt prefix (steps 3 and 4 of the pass described in
resilax_sidecar.uploader): each file copied with bounded concurrency, skipped when the same bytes are
already there, verified, then this process's `_UPLOADED.<process_id>` marker written.

Memory: each upload holds at most one piece of its file (resilax_sidecar.store), and the copies in
flight together hold at most `UPLOAD_BUFFER_BYTES` of pieces (`ByteBudget`): many small files still
go `upload_concurrency` at a time, big ones a few at a time, whatever the files' sizes."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from resilax_ckpt import layout

from resilax_sidecar.config import SidecarConfig
from resilax_sidecar.errors import StoreError, VerifyError
from resilax_sidecar.metrics import SidecarMetrics
from resilax_sidecar.store import BlobInfo, BlobStore, md5_file
from resilax_sidecar.upload_scan import LocalStep, UploadMemory

log = logging.getLogger(__name__)


UPLOAD_BUFFER_BYTES = 64 << 20
"""The most bytes of file pieces the copies in flight hold together (four 16 MiB pieces)."""


class ByteBudget:
    """At most `limit` bytes reserved at once across threads; a reservation above the limit is
    capped to it (it then runs alone)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.reserved = 0
        self.peak = 0
        """The most bytes ever reserved at once (for tests and the benchmark)."""
        self._changed = threading.Condition()

    @contextmanager
    def reserve(self, nbytes: int) -> Iterator[None]:
        n = min(max(nbytes, 0), self.limit)
        with self._changed:
            self._changed.wait_for(lambda: self.reserved + n <= self.limit)
            self.reserved += n
            self.peak = max(self.peak, self.reserved)
        try:
            yield
        finally:
            with self._changed:
                self.reserved -= n
                self._changed.notify_all()


class Superseded(Exception):
    """A newer local step appeared during an upload; not a failure."""

    def __init__(self, newer: int) -> None:
        super().__init__(f"superseded by step {newer}")
        self.newer = newer


class StepCopier:
    """Copies one process's files of a save into the save's attempt and writes its marker."""

    def __init__(
        self,
        config: SidecarConfig,
        store: BlobStore,
        metrics: SidecarMetrics,
        memory: UploadMemory,
        clock: Callable[[], float],
        urgent: threading.Event,
        newer_step: Callable[[int], int | None],
        on_uploaded: Callable[[dict[str, int | float]], None],
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.memory = memory
        self._clock = clock
        self._urgent = urgent
        """Set when a final save is coming: only then does a newer local step supersede the upload."""
        self._newer_step = newer_step
        """The newest local step to be persisted if it is newer than the one given, else None."""
        self._on_uploaded = on_uploaded
        """Told of each finished copy: step, seconds, bytes, files (what `/v1/state` shows)."""
        self.budget = ByteBudget(UPLOAD_BUFFER_BYTES)

    def copy_and_mark(self, local: LocalStep) -> bool:
        """Copy and verify every file of this process's save, then write its `_UPLOADED` marker; done
        once per save (a restarted sidecar finds its marker and copies nothing). True when this call
        copied (or found) and verified every file and wrote the marker: the committer then knows this
        process's part without listing it."""
        step = local.step
        base = f"{step}/{local.attempt}"
        marker_key = f"{base}/{layout.uploaded_name(local.process)}"
        done = f"{local.attempt}:{local.digest}"
        fresh = False
        if self.memory.marker_done.get(step) != done and not self._marker_current(marker_key, local):
            self.check_step_folder(step)
            # What is in the attempt already: only a folder the last root listing had (a resumed
            # upload, another host's copies) or one written before in this life can hold any of it;
            # the other hosts of a multi-process save may be copying the same shared files now.
            listed = self.memory.listed
            empty = (listed is not None and step not in listed and step not in self.memory.written
                     and local.process_count == 1)
            started = self._clock()
            # Before the first file: the attempt is provably Resilax's (layout.owns_step_folder).
            self.store.write_bytes(f"{base}/{layout.writer_name(local.process)}", b"")
            self.memory.written.add(step)
            self.memory.folders.add(step)
            self.memory.settled.discard(step)
            copied_bytes = self._copy_files(local, empty)
            sizes = {key: path.stat().st_size for key, path in local.files.items()}
            marker = {
                "process_id": local.process,
                "generation": local.generation,
                "era": local.era,
                "digest": local.digest,
                "attempt": local.attempt,
                "sidecar_generation": self.config.generation,
                "files": sizes,
                "time": time.time(),
            }
            self.store.write_bytes(marker_key, json.dumps(marker).encode())
            fresh = True
            seconds = self._clock() - started
            self.metrics.uploads.inc()
            self.metrics.upload_seconds.observe(seconds)
            self._on_uploaded({"step": step, "seconds": round(seconds, 3), "bytes": copied_bytes,
                               "files": len(sizes)})
            log.info(
                "step %d: uploaded %d files (%d bytes copied) to %s/%s in %.2f s",
                step,
                len(sizes),
                copied_bytes,
                self.store.url,
                base,
                seconds,
            )
        self.memory.marker_done[step] = done
        return fresh

    def check_step_folder(self, step: int) -> None:
        """Refuse to upload into a step folder that holds only what someone else wrote. Listed only
        when the last root listing had the folder and this uploader has not written there: a folder
        that was not there is new (this job's hosts), so a save costs no listing here."""
        listed = self.memory.listed
        if (listed is not None and step not in listed) or step in self.memory.written:
            return
        names = self.store.list_dir(str(step))
        if names and not layout.owns_step_folder(names):
            shown = ", ".join(sorted(names)[:3])
            raise StoreError(
                f"{self.store.url}/{step}: step {step} cannot be uploaded here: the folder holds data Resilax "
                f"did not write ({shown}), which Resilax never deletes or overwrites; move it away, or give "
                "the checkpoint root a folder of its own")

    def _marker_current(self, marker_key: str, local: LocalStep) -> bool:
        """Whether our marker for this very save is already there (a restarted sidecar)."""
        try:
            raw = json.loads(self.store.read_bytes(marker_key))
        except FileNotFoundError:
            return False
        except ValueError:
            return False
        return isinstance(raw, dict) and raw.get("digest") == local.digest

    def _copy_files(self, local: LocalStep, empty: bool) -> int:
        """Copy every missing or different file into the save's attempt with `upload_concurrency`
        workers; the bytes copied. `empty`: the attempt is known to hold nothing yet (not listed)."""
        step = local.step
        base = f"{step}/{local.attempt}"
        remote = {} if empty else self.store.list_files(base)
        work: queue.SimpleQueue[tuple[str, Path]] = queue.SimpleQueue()
        for key, path in local.files.items():
            work.put((key, path))
        errors: list[BaseException] = []
        copied = [0]
        lock = threading.Lock()
        last_check = [self._clock()]

        def worker() -> None:
            while not errors:
                newer = self._newer_local_step(step, last_check, lock)
                if newer is not None:
                    with lock:
                        errors.append(Superseded(newer))
                    return
                try:
                    key, path = work.get_nowait()
                except queue.Empty:
                    return
                try:
                    n = self._copy_one(base, key, path, remote.get(key))
                except BaseException as e:
                    with lock:
                        errors.append(e)
                    return
                with lock:
                    copied[0] += n

        # Daemon threads: a sidecar told to exit never waits on a hung storage call.
        threads = [
            threading.Thread(target=worker, name=f"upload-{step}-{i}", daemon=True)
            for i in range(min(self.config.upload_concurrency, max(1, len(local.files))))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return copied[0]

    def _newer_local_step(self, step: int, last_check: list[float], lock: threading.Lock) -> int | None:
        """When `urgent`: a local step newer than `step` (looked for at most every half second); a
        final save must not wait behind an older upload, and every host moves to the newest step."""
        if not self._urgent.is_set():
            return None
        with lock:
            now = self._clock()
            if now - last_check[0] < 0.5:
                return None
            last_check[0] = now
        return self._newer_step(step)

    def _copy_one(self, base: str, key: str, path: Path, remote: BlobInfo | None) -> int:
        full_key = f"{base}/{key}"
        size = path.stat().st_size
        if remote is not None and remote.size == size:
            # Already in this save's attempt: ours from before a restart, or another host's copy.
            # Same bytes only if the MD5s agree (an interrupted copy can have the right size).
            remote_md5 = remote.md5 or self.store.md5(full_key)
            if remote_md5 == md5_file(path):
                return 0
        with self.budget.reserve(self.store.upload_buffer_bytes(size)):
            self.store.upload_file(path, full_key)
        self.metrics.upload_bytes.inc(size)
        info = self.store.stat(full_key)
        if info is None or info.size != size:
            raise VerifyError(
                f"{self.store.url}: {full_key!r} has {None if info is None else info.size} bytes after "
                f"upload, the local file {path} has {size}"
            )
        if self.config.verify == "md5":
            want = md5_file(path)
            got = info.md5 or self.store.md5(full_key)
            if got != want:
                raise VerifyError(f"{self.store.url}: {full_key!r} has MD5 {got} after upload, local {want}")
        return size
