"""The multi-tier uploader: moves locally committed steps to the persistent tier, then commits them.

Write-once, like the library's saves (resilax_ckpt.layout): every upload of a save goes into an
attempt prefix of its own, `<root>/<step>/a-e<era>-g<gen>-<nonce>/`, whose name every host's sidecar
derives alike from the save's local commit marker (`layout.upload_attempt_name`); the one
`<root>/<step>/_COMMIT`, created once, names the attempt that won. Files under a committed step are
never written again: a stale uploader (an older generation woken after a newer one committed the same
step numbers) writes only into its own attempt, which no marker names and cleanup removes later.

One pass (`run_once`), repeated every `poll_seconds` by `run_forever` on a background thread:
1. list this host's locally committed steps (`<local>/<step>/_COMMIT`, or `_COMMIT.<process_id>`; not
   those a restore marked bad in `<local>/_bad/`) and the persistent tier's visible committed steps
   (`<root>/<step>/_COMMIT` that no newer generation's fence and no `_bad/` record hides);
2. take the newest local step that is newer than the newest persisted one (older ones would only add
   lag; every host picks the same newest step, so their uploads meet in one persistent step);
3. copy each of its files to `<root>/<step>/<attempt>/` with bounded concurrency, skipping files
   already there with the same size and MD5 (a resumed upload, or another host's identical copy), and
   verify each copy (size, or MD5 with `RESILAX_SIDECAR_VERIFY=md5`);
4. write `<attempt>/_UPLOADED.<process_id>` listing the files and sizes this process needs;
5. if every process's marker is in the attempt, all from the same save (generation), every listed
   file exists with its size, and no newer generation's fence hides the step, create `_COMMIT` naming
   the attempt (create-only; the losers of a race see it exists and are done). A `_COMMIT` that
   fences or a bad record hide (a fenced-out older generation's, a step a restore marked bad) is
   re-pointed to our attempt, as the library's commit does; a visible one is never touched;
6. retention on both tiers, and (process 0) deleting attempts that a visible step's marker does not
   name (`layout.is_attempt_name` entries only: never anything Resilax did not write).
Any error aborts the pass; `run_forever` records it, counts it and retries with exponential back-off.
A restart simply runs the passes again: files that are there are skipped, nothing is committed before
step 5's checks pass, so a killed upload resumes and a partial step never looks committed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilax_ckpt import fencing, layout
from resilax_ckpt.requests import read_stop_record

from resilax_sidecar.config import SidecarConfig
from resilax_sidecar.errors import StoreError, VerifyError
from resilax_sidecar.metrics import SidecarMetrics
from resilax_sidecar.store import BlobInfo, BlobStore, md5_file

log = logging.getLogger(__name__)


HIDING_REFRESH_SECONDS = 30.0
"""How long `scan_persisted` trusts the fences and bad records it read while no step folder appears
or goes."""


@dataclass
class UploadState:
    """What `/v1/state` reports; written by the uploader thread, read by the HTTP handlers."""

    newest_local: int | None = None
    newest_persisted: int | None = None
    in_flight: int | None = None
    last_error: str | None = None
    last_error_time: float | None = None
    consecutive_failures: int = 0
    last_upload: dict[str, Any] | None = None
    passes: int = 0
    committed_steps: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "newest_local_step": self.newest_local,
            "newest_persisted_step": self.newest_persisted,
            "upload_in_flight": self.in_flight,
            "last_error": self.last_error,
            "last_error_time": self.last_error_time,
            "consecutive_failures": self.consecutive_failures,
            "last_upload": self.last_upload,
        }


@dataclass(frozen=True)
class LocalStep:
    """One locally committed step of this process, as it will be uploaded."""

    step: int
    folder: Path
    files: dict[str, Path]
    """Persistent key relative to the step folder -> local file."""
    generation: int
    digest: str
    """Identifies this save: SHA-256 of the local metadata (or of the file list if there is none)."""
    commit_body: bytes
    era: int = 0
    """The era of the job that saved it (resilax_ckpt.fencing): with `generation`, its epoch."""
    attempt: str = ""
    """The persistent attempt prefix this save is uploaded into (layout.upload_attempt_name)."""

    @property
    def epoch(self) -> fencing.Epoch:
        return self.era, self.generation


def local_commit_marker(folder: Path, process_id: int) -> Path | None:
    """The marker that makes a local step folder committed for this process, or None."""
    for name in (layout.commit_name(None), layout.commit_name(process_id)):
        if (folder / name).is_file():
            return folder / name
    return None


def list_local_steps(local_dir: Path, process_id: int) -> list[int]:
    """The steps committed in a host's local tier for this process, ascending (bad ones included:
    retention counts them like any other)."""
    try:
        names = os.listdir(local_dir)
    except FileNotFoundError:
        return []
    steps = [s for s in map(layout.parse_step, names) if s is not None]
    return sorted(s for s in steps if local_commit_marker(local_dir / str(s), process_id) is not None)


def list_bad_steps(names: list[str]) -> set[int]:
    """The steps of the `_bad/<step>.json` records among `names` (pure)."""
    return {s for n in names if n.endswith(".json") and (s := layout.parse_step(n[:-5])) is not None}


def commit_body_naming(local_body: bytes, step: int, epoch: fencing.Epoch, attempt: str) -> bytes:
    """The persistent `_COMMIT` of an upload: the library's local marker (step, generation, era, time,
    save) plus the attempt that holds the files (pure)."""
    try:
        body = json.loads(local_body)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {}
    body.update({"step": step, "era": epoch[0], "generation": epoch[1], "attempt": attempt})
    body.setdefault("time", time.time())
    return json.dumps(body).encode()


def named_attempt(body: bytes) -> str | None:
    """The attempt a commit marker names, or None (a step committed in place) (pure)."""
    try:
        attempt = json.loads(body).get("attempt")
    except (ValueError, AttributeError):
        return None
    return attempt if isinstance(attempt, str) and layout.is_attempt_name(attempt) else None


class _Superseded(Exception):
    """A newer local step appeared during an upload; not a failure."""

    def __init__(self, newer: int) -> None:
        super().__init__(f"superseded by step {newer}")
        self.newer = newer


def plan_retention(
    steps: list[int], keep_last: int | None, keep_every_steps: int | None, protect: set[int]
) -> list[int]:
    """Which of the committed `steps` retention deletes (pure). The newest is always kept, and so is
    every step in `protect` (an upload in flight)."""
    if keep_last is None or not steps:
        return []
    ordered = sorted(steps)
    keep = set(ordered[-keep_last:]) | {ordered[-1]} | protect
    if keep_every_steps:
        keep |= {s for s in ordered if s % keep_every_steps == 0}
    return [s for s in ordered if s not in keep]


class Uploader:
    """Copies this host's local steps to the persistent tier. Thread-safe to read `state`."""

    def __init__(
        self,
        config: SidecarConfig,
        store: BlobStore,
        metrics: SidecarMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.local_dir is None:
            raise ValueError("the uploader needs RESILAX_LOCAL_DIR")
        self.config = config
        self.local_dir = config.local_dir
        self.store = store
        self.metrics = metrics
        self.state = UploadState()
        self._clock = clock
        self._wake = threading.Event()
        self.urgent = threading.Event()
        """Set when a final save is coming (SIGTERM, a stop request): a newer local step then
        supersedes the upload in flight. Not otherwise: with saves more frequent than uploads take,
        superseding would starve the persistent tier."""
        self.requested_steps: set[int] = set()
        """Steps that answered a save request of this sidecar's (a final save, the operator's): they
        go to the persistent tier whatever `persist_every_steps` says."""
        self._known_committed: dict[int, fencing.Epoch] = {}
        """Steps with a `_COMMIT` in the persistent tier, visible or not, and its epoch."""
        self._fences: dict[str, tuple[str, tuple[fencing.Epoch, int | None]]] = {}
        """gs://: fence records read so far, by name: (their MD5, what they say)."""
        self._cleaned: dict[int, str] = {}
        """Process 0: the committed steps whose unnamed attempts were deleted, and the attempt kept."""
        self._marker_done: dict[int, str] = {}
        self._changed = threading.Condition()

    # ---- the loop -------------------------------------------------------------------------------

    def wake(self) -> None:
        """Start the next pass now (a save was just committed locally)."""
        self._wake.set()

    def run_forever(self, stop: threading.Event) -> None:
        """Passes until `stop` is set; errors back off exponentially and never escape."""
        delay = self.config.retry_initial_seconds
        while not stop.is_set():
            try:
                self.run_once()
            except Exception as e:  # every failure is recorded and retried; nothing may kill the loop
                self._record_failure(e)
                wait = delay
                delay = min(delay * 2, self.config.retry_max_seconds)
            else:
                delay = self.config.retry_initial_seconds
                wait = self.config.poll_seconds
            self._wake.wait(wait)
            self._wake.clear()

    def _record_failure(self, e: BaseException) -> None:
        message = f"{type(e).__name__}: {e}" if not isinstance(e, StoreError) else str(e)
        self.state.last_error = message
        self.state.last_error_time = time.time()
        self.state.consecutive_failures += 1
        self.metrics.upload_failures.inc()
        log.warning(
            "upload pass failed (%d in a row), retrying with back-off: %s",
            self.state.consecutive_failures,
            message,
        )
        with self._changed:
            self._changed.notify_all()

    def wait_persisted(self, step: int, timeout: float) -> bool:
        """Block until `step` (or a newer one) is committed in the persistent tier, or `timeout`."""
        deadline = self._clock() + timeout
        with self._changed:
            while True:
                newest = self.state.newest_persisted
                if newest is not None and newest >= step:
                    return True
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.5))

    # ---- one pass ---------------------------------------------------------------------------------

    def persists(self, step: int) -> bool:
        """Whether `step` goes to the persistent tier: every step, or with `persist_every_steps` its
        multiples, the steps that answered a save request, and the final save the trainer stopped
        after on its own SIGTERM (`stopped.json`, read as soon as it appears: the upload then runs
        while the trainer shuts down, not after); the other local steps stay local."""
        every = self.config.persist_every_steps
        if every is None or step % every == 0 or step in self.requested_steps:
            return True
        final = read_stop_record(str(self.config.control_dir))
        if final is not None and final == step:
            self.requested_steps.add(step)
            self.urgent.set()
            return True
        return False

    def run_once(self) -> None:
        """One pass: see both tiers, upload and commit the newest new step, apply retention."""
        local_steps = self.scan_local()
        persisted = self.scan_persisted()
        self._publish(local_steps, persisted)
        newest_persisted = max(persisted, default=None)
        candidates = [s for s in local_steps if (newest_persisted is None or s > newest_persisted)
                      and self.persists(s)]
        if candidates:
            step = max(candidates)
            self.state.in_flight = step
            try:
                if self.upload_step(self.read_local_step(step)):
                    persisted = sorted({*persisted, step})
            except _Superseded as e:
                log.info("step %d: a newer local step %d appeared; uploading that one instead", step, e.newer)
                self._wake.set()
            except FileNotFoundError:
                if (self.local_dir / str(step)).exists():
                    raise
                # The trainer's own local retention removed it under us; the next pass takes the newest.
                log.info("step %d: deleted from the local tier before its upload finished", step)
                self._wake.set()
            finally:
                self.state.in_flight = None
            self._publish(self.scan_local(), persisted)
        if self.apply_retention(persisted):
            self._publish(self.scan_local(), self.scan_persisted())
        self.state.consecutive_failures = 0
        self.state.passes += 1

    def _publish(self, local_steps: list[int], persisted: list[int]) -> None:
        newest_local = max(local_steps, default=None)
        newest_persisted = max(persisted, default=None)
        self.state.newest_local = newest_local
        self.state.newest_persisted = newest_persisted
        self.state.committed_steps = sorted(persisted)
        self.metrics.newest_step.labels(tier="local").set(-1 if newest_local is None else newest_local)
        self.metrics.newest_step.labels(tier="persistent").set(
            -1 if newest_persisted is None else newest_persisted
        )
        lag = 0
        if newest_local is not None:
            lag = max(0, newest_local - (newest_persisted if newest_persisted is not None else 0))
        self.metrics.lag_steps.set(lag)
        with self._changed:
            self._changed.notify_all()

    # ---- the local tier -------------------------------------------------------------------------

    def _local_commit(self, folder: Path) -> Path | None:
        return local_commit_marker(folder, self.config.process_id)

    def scan_local(self) -> list[int]:
        """This process's locally committed steps that a restore did not mark bad (what is uploaded)."""
        try:
            bad = list_bad_steps(os.listdir(self.local_dir / layout.BAD_DIR))
        except FileNotFoundError:
            bad = set()
        return [s for s in list_local_steps(self.local_dir, self.config.process_id) if s not in bad]

    def read_local_step(self, step: int) -> LocalStep:
        """The files of a local step this process uploads, and what identifies the save."""
        folder = self.local_dir / str(step)
        pid = self.config.process_id
        own_metadata = layout.metadata_name(pid)
        files: dict[str, Path] = {}
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel_dir = Path(dirpath).relative_to(folder)
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                if rel_dir == Path(".") and self._is_local_only(name, own_metadata):
                    continue
                files[(rel_dir / name).as_posix()] = Path(dirpath) / name
        # Several processes sharing one host folder (tests) each write _METADATA.<id>.json; the
        # persistent step has one _METADATA.json.
        if layout.METADATA_FILE not in files and (folder / own_metadata).is_file():
            files[layout.METADATA_FILE] = folder / own_metadata
        commit_path = self._local_commit(folder)
        commit_body = commit_path.read_bytes() if commit_path is not None else b""
        era, generation = self._epoch_of(commit_body, files.get(layout.METADATA_FILE))
        if layout.METADATA_FILE in files:
            digest = hashlib.sha256(files[layout.METADATA_FILE].read_bytes()).hexdigest()
        else:
            listing = "\n".join(f"{k}\t{p.stat().st_size}" for k, p in sorted(files.items()))
            digest = hashlib.sha256(listing.encode()).hexdigest()
        save = ""
        with contextlib.suppress(ValueError, AttributeError):
            save = str(json.loads(commit_body).get("save") or "")
        attempt = layout.upload_attempt_name(era, generation, step, save)
        return LocalStep(step, folder, files, generation, digest,
                         commit_body_naming(commit_body, step, (era, generation), attempt), era, attempt)

    def _is_local_only(self, name: str, own_metadata: str) -> bool:
        if name == layout.COMMIT_FILE or name.startswith(layout.COMMIT_FILE + "."):
            return True
        if layout.parse_uploaded(name) is not None or name.startswith(layout.WRITER_PREFIX):
            return True
        # Another process's metadata in a shared host folder; ours is mapped to _METADATA.json.
        return name.startswith("_METADATA.") and name != layout.METADATA_FILE

    def _epoch_of(self, commit_body: bytes, metadata: Path | None) -> fencing.Epoch:
        """The epoch (era, generation) of the trainer that committed the local step (its marker)."""
        epoch = fencing.parse_marker_epoch(commit_body)
        if epoch != (-1, -1):
            return epoch
        for raw in (metadata.read_bytes() if metadata is not None else b"",):
            with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
                return 0, int(json.loads(raw)["generation"])
        return 0, self.config.generation

    # ---- the persistent tier ----------------------------------------------------------------------

    def scan_persisted(self) -> list[int]:
        """The persistent tier's visible committed steps: a `_COMMIT` that no newer generation's fence
        and no `_bad/` record hides (what the library's readers see, resilax_ckpt.commit.list_visible)."""
        steps = [s for s in map(layout.parse_step, self.store.list_dir("")) if s is not None]
        present = set(steps)
        for gone in set(self._known_committed) - present:
            del self._known_committed[gone]
        fences, bad = self._hiding(present)
        for step in steps:
            known = self._known_committed.get(step)
            if known is not None and fencing.decide_visible(step, known, fences):
                continue
            # New, or hidden so far (its marker may since have been re-pointed by a newer save).
            body = self._read_commit(step)
            if body is None:
                self._known_committed.pop(step, None)
            else:
                self._known_committed[step] = fencing.parse_marker_epoch(body)
        return sorted(s for s, epoch in self._known_committed.items()
                      if s not in bad and fencing.decide_visible(s, epoch, fences))

    def _hiding(self, present: set[int]) -> tuple[dict[fencing.Epoch, int | None], set[int]]:
        """The fences and the bad records, as `scan_persisted` uses them: read again when the set of
        step folders changed or `HIDING_REFRESH_SECONDS` passed, not on every pass (two listings
        less per pass; both change only when a generation starts or a restore marks a step bad).
        The checks before an upload and a commit always read them fresh (`_visible`, `try_commit`)."""
        now = self._clock()
        cached = self._hiding_cache
        if cached is None or cached[0] != present or now - cached[1] >= HIDING_REFRESH_SECONDS:
            fences, bad = self.read_fences(), list_bad_steps(self.store.list_dir(layout.BAD_DIR))
            self._hiding_cache = (present, now, fences, bad)
            return fences, bad
        return cached[2], cached[3]

    _hiding_cache: tuple[set[int], float, dict[fencing.Epoch, int | None], set[int]] | None = None

    def _read_commit(self, step: int) -> bytes | None:
        try:
            return self.store.read_bytes(f"{step}/{layout.COMMIT_FILE}")
        except FileNotFoundError:
            return None

    def _visible(self, step: int, epoch: fencing.Epoch) -> bool:
        """Whether a step committed at `epoch` is visible now (fences, bad records)."""
        if step in list_bad_steps(self.store.list_dir(layout.BAD_DIR)):
            return False
        return fencing.decide_visible(step, epoch, self.read_fences())

    def read_fences(self) -> dict[fencing.Epoch, int | None]:
        """Every fence record (resilax_ckpt.fencing). On gs:// a record whose MD5 (free in the
        listing) did not change is not read again."""
        listing = self.store.list_files(layout.FENCES_DIR)
        fences: dict[fencing.Epoch, int | None] = {}
        for name, info in listing.items():
            if "/" in name or not name.endswith(".json") or name.startswith("era-"):
                continue
            cached = self._fences.get(name)
            if cached is not None and info.md5 is not None and cached[0] == info.md5:
                parsed = cached[1]
            else:
                try:
                    fresh = fencing.parse_fence(name, self.store.read_bytes(f"{layout.FENCES_DIR}/{name}"))
                except FileNotFoundError:
                    continue
                if fresh is None:
                    continue  # half-written by a crashed primary: read again next time
                parsed = fresh
                if info.md5 is not None:
                    self._fences[name] = (info.md5, parsed)
            fences[parsed[0]] = parsed[1]
        return fences

    def upload_step(self, local: LocalStep) -> bool:
        """Copy, verify, mark and (when every process is done) commit one step; True if the step is
        committed (by this save or, visibly, by another one)."""
        step = local.step
        if self._committed_elsewhere(local):
            return True
        self._check_step_folder(step)
        base = f"{step}/{local.attempt}"
        marker_key = f"{base}/{layout.uploaded_name(self.config.process_id)}"
        done = f"{local.attempt}:{local.digest}"
        if self._marker_done.get(step) != done and not self._marker_current(marker_key, local):
            started = self._clock()
            # Before the first file: the attempt is provably Resilax's (layout.owns_step_folder).
            self.store.write_bytes(f"{base}/{layout.writer_name(self.config.process_id)}", b"")
            copied_bytes = self._copy_files(local)
            sizes = {key: path.stat().st_size for key, path in local.files.items()}
            marker = {
                "process_id": self.config.process_id,
                "generation": local.generation,
                "era": local.era,
                "digest": local.digest,
                "attempt": local.attempt,
                "sidecar_generation": self.config.generation,
                "files": sizes,
                "time": time.time(),
            }
            self.store.write_bytes(marker_key, json.dumps(marker).encode())
            seconds = self._clock() - started
            self.metrics.uploads.inc()
            self.metrics.upload_seconds.observe(seconds)
            self.state.last_upload = {
                "step": step,
                "seconds": round(seconds, 3),
                "bytes": copied_bytes,
                "files": len(sizes),
            }
            log.info(
                "step %d: uploaded %d files (%d bytes copied) to %s/%s in %.2f s",
                step,
                len(sizes),
                copied_bytes,
                self.store.url,
                base,
                seconds,
            )
        self._marker_done[step] = done
        return self.try_commit(local)

    def _committed_elsewhere(self, local: LocalStep) -> bool:
        """Whether `_COMMIT` of the step names another attempt and is visible: the step is committed
        and this upload has nothing to add (it could never be read)."""
        body = self._read_commit(local.step)
        if body is None or named_attempt(body) == local.attempt:
            return False
        epoch = fencing.parse_marker_epoch(body)
        if not self._visible(local.step, epoch):
            return False
        log.info("step %d: already committed by another save (%s, era %d generation %d); not uploading ours",
                 local.step, named_attempt(body) or "in place", *epoch)
        self._known_committed[local.step] = epoch
        return True

    def _check_step_folder(self, step: int) -> None:
        """Refuse to upload into a step folder that holds only what someone else wrote."""
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

    def _copy_files(self, local: LocalStep) -> int:
        """Copy every missing or different file into the save's attempt with `upload_concurrency`
        workers; the bytes copied."""
        step = local.step
        base = f"{step}/{local.attempt}"
        remote = self.store.list_files(base)
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
                        errors.append(_Superseded(newer))
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
        if not self.urgent.is_set():
            return None
        with lock:
            now = self._clock()
            if now - last_check[0] < 0.5:
                return None
            last_check[0] = now
        newest = max((s for s in self.scan_local() if self.persists(s)), default=None)
        return newest if newest is not None and newest > step else None

    def _copy_one(self, base: str, key: str, path: Path, remote: BlobInfo | None) -> int:
        full_key = f"{base}/{key}"
        size = path.stat().st_size
        if remote is not None and remote.size == size:
            # Already in this save's attempt: ours from before a restart, or another host's copy.
            # Same bytes only if the MD5s agree (an interrupted copy can have the right size).
            remote_md5 = remote.md5 or self.store.md5(full_key)
            if remote_md5 == md5_file(path):
                return 0
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

    def try_commit(self, local: LocalStep) -> bool:
        """Create `<step>/_COMMIT` naming the save's attempt if every process's upload of this save is
        complete; True when the step is committed (by this save, or visibly by another one)."""
        step = local.step
        existing = self._read_commit(step)
        if existing is not None:
            if named_attempt(existing) == local.attempt:
                self._known_committed[step] = local.epoch
                return True
            if self._committed_elsewhere(local):
                return True
            # Hidden (a fenced-out older generation's commit, or a step marked bad): a complete
            # upload of ours re-points it below; the attempt it named is left as it is.
        base = f"{step}/{local.attempt}"
        listing = self.store.list_files(base)
        markers: dict[int, dict[str, Any]] = {}
        for name in listing:
            pid = layout.parse_uploaded(name)
            if pid is None:
                continue
            try:
                raw = json.loads(self.store.read_bytes(f"{base}/{name}"))
            except (FileNotFoundError, ValueError):
                continue
            if isinstance(raw, dict):
                markers[pid] = raw
        missing = sorted(set(range(self.config.num_processes)) - set(markers))
        if missing:
            log.info("step %d: waiting for the uploads of processes %s", step, missing)
            return False
        stale = sorted(p for p, m in markers.items()
                       if (m.get("era", 0), m.get("generation")) != (local.era, local.generation))
        if stale:
            log.info(
                "step %d: the markers of processes %s are from another save (not generation %d); waiting",
                step,
                stale,
                local.generation,
            )
            return False
        for pid, marker in markers.items():
            files = marker.get("files")
            if not isinstance(files, dict):
                return False
            for key, size in files.items():
                info = listing.get(key)
                # Each host's metadata is valid for the step but carries its own save time, so the
                # copy in place may be another host's, of another size: only its presence counts.
                if info is not None and key == layout.METADATA_FILE:
                    continue
                if info is None or info.size != size:
                    log.warning(
                        "step %d: process %d's file %r is %s in %s/%s; not committing",
                        step,
                        pid,
                        key,
                        "missing" if info is None else f"{info.size} bytes, not {size}",
                        self.store.url,
                        base,
                    )
                    if key in local.files:
                        # Deleted under us (e.g. a cleanup that took the attempt for a leftover):
                        # withdraw our marker so the next pass copies it again.
                        self.store.delete(f"{base}/{layout.uploaded_name(self.config.process_id)}")
                        self._marker_done.pop(step, None)
                    return False
        fences = self.read_fences()
        if not fencing.decide_visible(step, local.epoch, fences):
            raise StoreError(
                f"step {step} of era {local.era} generation {local.generation} is fenced out by a newer "
                f"generation or job (fences {sorted(fences)}); not committing it"
            )
        commit_key = f"{step}/{layout.COMMIT_FILE}"
        if existing is None:
            if self.store.create_bytes(commit_key, local.commit_body):
                self.metrics.commits.inc()
                log.info("step %d: committed in %s (all %d processes uploaded into %s)",
                         step, self.store.url, len(markers), local.attempt)
                self._known_committed[step] = local.epoch
                return True
            existing = self._read_commit(step)
            if existing is not None and named_attempt(existing) == local.attempt:
                log.info("step %d: already committed by another sidecar", step)
                self._known_committed[step] = local.epoch
                return True
            return self._committed_elsewhere(local)
        # Re-point a hidden commit, as resilax_ckpt.commit.commit_object does: only an older epoch's
        # that the fences hide, or a step marked bad, never a visible one.
        old_epoch = fencing.parse_marker_epoch(existing)
        bad = step in list_bad_steps(self.store.list_dir(layout.BAD_DIR))
        if not bad and old_epoch >= local.epoch:
            log.warning("step %d: committed by era %d generation %d, which is hidden; not replacing it with "
                        "era %d generation %d's", step, *old_epoch, *local.epoch)
            return False
        self.store.write_bytes(commit_key, local.commit_body)
        if bad:
            self.store.delete(f"{layout.BAD_DIR}/{layout.bad_name(step)}")
        self.metrics.commits.inc()
        log.info("step %d: committed in %s (all %d processes uploaded into %s), replacing %s's hidden commit",
                 step, self.store.url, len(markers), local.attempt, named_attempt(existing) or "an in-place")
        self._known_committed[step] = local.epoch
        return True

    # ---- cleanup and retention ----

    def clean_stale_attempts(self, persisted: list[int]) -> list[str]:
        """Delete the attempts under visible committed steps that their `_COMMIT` does not name (a
        stale or losing upload's, never readable), once per step in this sidecar's life; only entries of
        the attempt form, only in steps whose marker names an attempt. Called on: process 0's
        sidecar, each pass (the library's primary does the same at each generation's start)."""
        deleted: list[str] = []
        for step in persisted:
            if step in self._cleaned:
                continue  # a visible commit is never re-pointed: its named attempt stays the same
            body = self._read_commit(step)
            won = named_attempt(body) if body is not None else None
            if won is None:
                self._cleaned[step] = ""
                continue
            for name in self.store.list_dir(str(step)):
                if layout.is_attempt_name(name) and name != won:
                    self.store.delete_prefix(f"{step}/{name}")
                    deleted.append(f"{step}/{name}")
            self._cleaned[step] = won
        if deleted:
            log.info("deleted attempts no commit marker names in %s: %s", self.store.url, ", ".join(deleted))
        return deleted

    # ---- retention --------------------------------------------------------------------------------

    def apply_retention(self, persisted: list[int]) -> bool:
        """Keep the newest `keep_last` steps on both tiers (`local_keep_last` on the local tier when
        set). The persistent tier is trimmed by process 0 only (one deleter); each host trims its own
        local tier. True when something was deleted."""
        cfg = self.config
        if cfg.process_id == 0:
            self.clean_stale_attempts(persisted)
        local_keep = cfg.local_keep_last if cfg.local_keep_last is not None else cfg.keep_last
        if cfg.keep_last is None and local_keep is None:
            return False
        deleted = False
        protect = {self.state.in_flight} if self.state.in_flight is not None else set()
        if cfg.keep_last is not None and cfg.process_id == 0 and persisted:
            for step in plan_retention(persisted, cfg.keep_last, cfg.keep_every_steps, protect):
                # _COMMIT first: a half-deleted step must never look committed.
                self.store.delete(f"{step}/{layout.COMMIT_FILE}")
                self._known_committed.pop(step, None)
                self._cleaned.pop(step, None)
                self.store.delete_prefix(str(step))
                self.metrics.retention_deletes.labels(tier="persistent").inc()
                deleted = True
                log.info("retention: deleted step %d from %s", step, self.store.url)
            # Partial uploads older than every kept (visible) step (a save abandoned for a newer one, a
            # host that died mid-upload) will never be committed, and a commit there that the fences
            # hide (a stale generation's) will never be read: clear them out too. Not a step marked
            # bad (kept), never a folder of someone else's.
            kept = sorted(s for s in persisted if s in self._known_committed)
            if kept:
                all_steps = (layout.parse_step(n) for n in self.store.list_dir(""))
                hiding: tuple[dict[fencing.Epoch, int | None], set[int]] | None = None
                for step in sorted(s for s in all_steps if s is not None and s < kept[0]):
                    body = self._read_commit(step)
                    if body is None:
                        if layout.owns_step_folder(self.store.list_dir(str(step))):
                            self.store.delete_prefix(str(step))
                            log.info("retention: deleted the abandoned partial upload of step %d", step)
                        continue
                    if hiding is None:
                        hiding = self.read_fences(), list_bad_steps(self.store.list_dir(layout.BAD_DIR))
                    fences, bad = hiding
                    if step not in bad and not fencing.decide_visible(step, fencing.parse_marker_epoch(body), fences):
                        self.store.delete(f"{step}/{layout.COMMIT_FILE}")
                        self._known_committed.pop(step, None)
                        self.store.delete_prefix(str(step))
                        log.info("retention: deleted step %d, committed by a fenced-out generation (never visible)",
                                 step)
        if local_keep is None:
            return deleted
        # Steps a restore marked bad count like the others (kept until they age out, never uploaded).
        local_steps = list_local_steps(self.local_dir, cfg.process_id)
        newest_persisted = max(persisted, default=None)
        local_protect = set(protect)
        # A local step newer than everything persisted is still to be uploaded: keep the newest one.
        waiting = [s for s in self.scan_local()
                   if (newest_persisted is None or s > newest_persisted) and self.persists(s)]
        if waiting:
            local_protect.add(waiting[-1])
        for step in plan_retention(local_steps, local_keep, None, local_protect):
            folder = self.local_dir / str(step)
            trash = self.local_dir / f"{layout.TRASH_PREFIX}{step}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(folder, trash)
            except FileNotFoundError:
                continue  # the trainer's own retention got there first
            shutil.rmtree(trash, ignore_errors=True)
            self._marker_done.pop(step, None)
            self.metrics.retention_deletes.labels(tier="local").inc()
            deleted = True
            log.info("retention: deleted local step %d", step)
        return deleted
