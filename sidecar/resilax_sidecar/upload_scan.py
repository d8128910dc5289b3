"""The uploader's view of both tiers: which steps each holds, what a save's local files are, what a
persistent `_COMMIT` names, and what the fences and bad records hide (step 1 of the pass described in
resilax_sidecar.uploader). Reads only; the writes are in upload_copy, upload_commit and upload_cleanup.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from resilax_ckpt import layout
from resilax_ckpt.control.control_files import CONTROL_FILE_CAP, read_regular_file
from resilax_ckpt.history import fencing, timelines

from resilax_sidecar.config import SidecarConfig
from resilax_sidecar.store import BlobStore

log = logging.getLogger(__name__)


MARKER_CAP = CONTROL_FILE_CAP
"""The most bytes of a local commit marker the uploader reads (a longer one is no marker)."""
METADATA_CAP = 256 << 20
"""The most bytes of a local step's metadata the uploader reads (a longer one fails the step's upload)."""


class NotRegularFileError(OSError):
    """A local step holds a file the uploader will not read: a link, a FIFO, a device (or one too long)."""


def regular_file(path: Path) -> bool:
    """`path` is a regular file itself, not a link to one (the trainer owns the local tier; the sidecar
    never follows its links nor waits on its FIFOs)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def read_step_file(path: Path, cap: int) -> bytes:
    """A local step's marker or metadata, read without waiting or following a link (FileNotFoundError:
    gone; NotRegularFileError: not a regular file, or over `cap`)."""
    data = read_regular_file(str(path), cap)
    if data is None:
        if not os.path.lexists(path):
            raise FileNotFoundError(path)
        raise NotRegularFileError(f"{path}: not a regular file, or over {cap} bytes: not read, its step not uploaded")
    return data


HIDING_REFRESH_SECONDS = 600.0
"""How long `scan_persisted` trusts the fences and bad records it read while no step folder appears
that the uploader did not write (a fence comes with a new generation's steps; each
commit's check reads the fences fresh anyway)."""


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
    """The era of the job that saved it (resilax_ckpt.history.fencing): with `generation`, its epoch."""
    attempt: str = ""
    """The persistent attempt prefix this save is uploaded into (layout.upload_attempt_name)."""
    process: int = 0
    """The process that saved it, of `process_count` (its local `_COMMIT`; after an in-place restart
    this sidecar's own settings may name another generation's)."""
    process_count: int = 1

    @property
    def epoch(self) -> fencing.Epoch:
        return self.era, self.generation


@dataclass
class UploadMemory:
    """What the uploader remembers between passes, shared by its parts (one uploader thread writes it)."""

    known_committed: dict[int, fencing.Epoch] = field(default_factory=dict)
    """Steps with a `_COMMIT` in the persistent tier, visible or not, and its epoch."""
    marker_done: dict[int, str] = field(default_factory=dict)
    """Steps whose `_UPLOADED.<process_id>` this sidecar wrote, and for which save (`attempt:digest`)."""
    cleaned: dict[int, str] = field(default_factory=dict)
    """Process 0: the committed steps whose unnamed attempts were deleted, and the attempt kept."""
    committed_own: bool = False
    """A save of this sidecar's trainer is committed in the persistent tier. Persistent retention
    waits for it: the trainer restores before it saves, so by then a rollback's branch record exists
    (resilax_ckpt.history.timelines) and the steps it supersedes are no longer counted (or deleted)."""
    listed: set[int] | None = None
    """The step folders of the persistent root at its last listing (None: not listed yet)."""
    folders: set[int] = field(default_factory=set)
    """The step folders believed present: `listed`, with this uploader's own writes and deletions
    since. A listing that finds others means someone else wrote steps."""
    written: set[int] = field(default_factory=set)
    """Steps this uploader wrote into (its attempt's `_WRITER`), in this life."""
    objects: dict[int, list[str]] = field(default_factory=dict)
    """Steps this uploader committed knowing every object of the named attempt (one process; or its
    listing at the commit): `_COMMIT` and those keys are the whole step, so retention deletes them
    without listing. Anything else there (another save's attempt) shows at the next root listing."""
    settled: set[int] = field(default_factory=set)
    """Folders without a commit that the leftover sweep leaves (kept attempts, data not Resilax's)."""


def local_commit_marker(folder: Path, process_id: int) -> Path | None:
    """The marker that makes a local step folder committed for this process, or None."""
    for name in (layout.commit_name(None), layout.commit_name(process_id)):
        if regular_file(folder / name):
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
    for local_only in ("process", "process_count"):  # one process's identity; the step is everyone's
        body.pop(local_only, None)
    body.setdefault("time", time.time())
    return json.dumps(body).encode()


def saving_process(local_body: bytes, process_id: int, num_processes: int) -> tuple[int, int]:
    """(process id, process count) of the trainer that committed a local step: its marker's `process`
    and `process_count`, else (a marker of an older library) this sidecar's settings (pure)."""
    with contextlib.suppress(ValueError, AttributeError):
        body = json.loads(local_body)
        process, count = body.get("process"), body.get("process_count")
        if isinstance(process, int) and isinstance(count, int) and 0 <= process < count:
            return process, count
    return process_id, num_processes


def named_attempt(body: bytes) -> str | None:
    """The attempt a commit marker names, or None (a step committed in place) (pure)."""
    try:
        attempt = json.loads(body).get("attempt")
    except (ValueError, AttributeError):
        return None
    return attempt if isinstance(attempt, str) and layout.is_attempt_name(attempt) else None


def _is_local_only(name: str, own_metadata: str) -> bool:
    if name == layout.COMMIT_FILE or name.startswith(layout.COMMIT_FILE + "."):
        return True
    if layout.parse_uploaded(name) is not None or name.startswith(layout.WRITER_PREFIX):
        return True
    # Another process's metadata in a shared host folder; ours is mapped to _METADATA.json.
    return name.startswith("_METADATA.") and name != layout.METADATA_FILE


class TierView:
    """Reads both tiers for one process's uploader; caches what is costly to list on gs://."""

    def __init__(
        self, config: SidecarConfig, store: BlobStore, memory: UploadMemory, clock: Callable[[], float]
    ) -> None:
        assert config.local_dir is not None
        self.config = config
        self.local_dir = config.local_dir
        self.store = store
        self.memory = memory
        self._clock = clock
        self._fences: dict[str, tuple[str, tuple[fencing.Epoch, int | None]]] = {}
        """gs://: fence records read so far, by name: (their MD5, what they say)."""
        self._fences_read: tuple[float, dict[fencing.Epoch, int | None]] | None = None
        """The last `read_fences` (each commit's check is one): when, and what it found."""
        self._bad_read: tuple[float, set[int]] | None = None
        self._records: dict[str, dict[str, object]] = {layout.BRANCHES_DIR: {}, layout.KEPT_DIR: {}}
        """Branch and kept records read so far, by folder and name (create-only: each is read once)."""

    # ---- the local tier -------------------------------------------------------------------------

    def scan_local(self) -> list[int]:
        """This process's locally committed steps that a restore did not mark bad and that are on the
        current branch (resilax_ckpt.history.timelines; e.g. a node that missed a rollback keeps the old
        timeline's steps in its local tier): what is uploaded."""
        try:
            bad = list_bad_steps(os.listdir(self.local_dir / layout.BAD_DIR))
        except FileNotFoundError:
            bad = set()
        steps = [s for s in list_local_steps(self.local_dir, self.config.process_id) if s not in bad]
        # Read after listing: a local step saved after a rollback was saved after its branch record.
        return timelines.current_steps(steps, self.local_epoch, self._branches or [])

    def local_epoch(self, step: int) -> fencing.Epoch:
        """The epoch in this process's local commit marker of `step` ((-1, -1) when unreadable)."""
        marker = local_commit_marker(self.local_dir / str(step), self.config.process_id)
        try:
            return fencing.parse_marker_epoch(read_step_file(marker, MARKER_CAP)) if marker is not None else (-1, -1)
        except (FileNotFoundError, NotRegularFileError):
            return (-1, -1)

    def local_attempt(self, step: int) -> str | None:
        """The persistent attempt this process's local save of `step` is uploaded into (its identity),
        or None when the local step is gone."""
        marker = local_commit_marker(self.local_dir / str(step), self.config.process_id)
        try:
            body = read_step_file(marker, MARKER_CAP) if marker is not None else None
        except (FileNotFoundError, NotRegularFileError):
            body = None
        if body is None:
            return None
        era, generation = self._epoch_of(body, None)
        save = ""
        with contextlib.suppress(ValueError, AttributeError):
            save = str(json.loads(body).get("save") or "")
        return layout.upload_attempt_name(era, generation, step, save)

    def read_local_step(self, step: int) -> LocalStep:
        """The files of a local step this process uploads, and what identifies the save."""
        folder = self.local_dir / str(step)
        pid = self.config.process_id
        own_metadata = layout.metadata_name(pid)
        files: dict[str, Path] = {}
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            linked = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
            if linked:  # os.walk would skip it: the step would be uploaded without its files
                raise NotRegularFileError(f"step {step}: {Path(dirpath) / linked[0]} is a link: the step is not uploaded")
            rel_dir = Path(dirpath).relative_to(folder)
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                if rel_dir == Path(".") and _is_local_only(name, own_metadata):
                    continue
                if not regular_file(Path(dirpath) / name):  # never uploaded through a link, never a FIFO read
                    raise NotRegularFileError(f"step {step}: {Path(dirpath) / name} is not a regular file (a link, "
                                              "a FIFO, a device): the step is not uploaded")
                files[(rel_dir / name).as_posix()] = Path(dirpath) / name
        # Several processes sharing one host folder (tests) each write _METADATA.<id>.json; the
        # persistent step has one _METADATA.json.
        if layout.METADATA_FILE not in files and regular_file(folder / own_metadata):
            files[layout.METADATA_FILE] = folder / own_metadata
        commit_path = local_commit_marker(folder, pid)
        commit_body = read_step_file(commit_path, MARKER_CAP) if commit_path is not None else b""
        era, generation = self._epoch_of(commit_body, files.get(layout.METADATA_FILE))
        if layout.METADATA_FILE in files:
            digest = hashlib.sha256(read_step_file(files[layout.METADATA_FILE], METADATA_CAP)).hexdigest()
        else:
            listing = "\n".join(f"{k}\t{p.stat().st_size}" for k, p in sorted(files.items()))
            digest = hashlib.sha256(listing.encode()).hexdigest()
        save = ""
        with contextlib.suppress(ValueError, AttributeError):
            save = str(json.loads(commit_body).get("save") or "")
        attempt = layout.upload_attempt_name(era, generation, step, save)
        process, count = saving_process(commit_body, pid, self.config.num_processes)
        return LocalStep(step, folder, files, generation, digest,
                         commit_body_naming(commit_body, step, (era, generation), attempt), era, attempt,
                         process, count)

    def _epoch_of(self, commit_body: bytes, metadata: Path | None) -> fencing.Epoch:
        """The epoch (era, generation) of the trainer that committed the local step (its marker)."""
        epoch = fencing.parse_marker_epoch(commit_body)
        if epoch != (-1, -1):
            return epoch
        for raw in (read_step_file(metadata, METADATA_CAP) if metadata is not None else b"",):
            with contextlib.suppress(ValueError, TypeError, AttributeError, KeyError):
                return 0, int(json.loads(raw)["generation"])
        return 0, self.config.generation

    # ---- the persistent tier ----------------------------------------------------------------------

    def scan_persisted(self, list_root: bool = True) -> list[int]:
        """The persistent tier's visible committed steps: a `_COMMIT` that no newer generation's fence
        and no `_bad/` record hides (what the library's readers see, resilax_ckpt.commit.list_visible).
        `list_root=False`: from what the uploader knows (the last listing, its own commits and
        deletions since), listing nothing but the branch records while they may still change."""
        memory = self.memory
        known_committed = memory.known_committed
        if list_root or memory.listed is None:
            steps = [s for s in map(layout.parse_step, self.store.list_dir("")) if s is not None]
            present = set(steps)
            for gone in set(known_committed) - present:
                del known_committed[gone]
                memory.objects.pop(gone, None)
            fences, bad = self._hiding(bool(present - memory.folders))
            memory.listed, memory.folders = present, set(present)
            for step in steps:
                known = known_committed.get(step)
                if known is not None and fencing.decide_visible(step, known, fences):
                    continue
                # New, or hidden so far (its marker may since have been re-pointed by a newer save).
                body = self.read_commit(step)
                if body is None:
                    known_committed.pop(step, None)
                else:
                    known_committed[step] = fencing.parse_marker_epoch(body)
        else:
            fences, bad = self._hiding(False)
        # A rollback's branch record is written by a new generation's restore, before its first save:
        # listed again when a local save appears until this generation's first commit (an idle turn
        # lists nothing; a new generation resets committed_own: Uploader.set_config).
        local = tuple(list_local_steps(self.local_dir, self.config.process_id))
        if self._branches is None or (not memory.committed_own and local != self._branches_local):
            self._branches_local = local
            self.branches()
        branches = self._branches or []
        return sorted(s for s, epoch in known_committed.items()
                      if s not in bad and fencing.decide_visible(s, epoch, fences)
                      and timelines.decide_superseded(s, epoch, branches) is None)

    def _hiding(self, changed: bool) -> tuple[dict[fencing.Epoch, int | None], set[int]]:
        """The fences and the bad records, as `scan_persisted` uses them: read again when a root
        listing found step folders appear that this uploader did not write (`changed`: a new
        generation or job saving; another process's retention only removes folders), or their last read is `HIDING_REFRESH_SECONDS` old, not on every pass (both
        change only when a generation starts or a restore marks a step bad; a new generation of this
        sidecar reads them again: `forget_hiding`). Each commit's check reads the fences fresh
        (`try_commit`), which also serves here."""
        now = self._clock()
        fences, bad = self._fences_read, self._bad_read
        if fences is None or changed or now - fences[0] >= HIDING_REFRESH_SECONDS:
            self.read_fences()
        if bad is None or changed or now - bad[0] >= HIDING_REFRESH_SECONDS:
            self.bad_steps()
        assert self._fences_read is not None and self._bad_read is not None
        return self._fences_read[1], self._bad_read[1]

    def forget_hiding(self) -> None:
        """Read the fences and bad records again at the next pass (a new generation started)."""
        self._fences_read = self._bad_read = None

    def bad_steps(self) -> set[int]:
        """The persistent tier's steps a restore marked bad (`_bad/<step>.json`)."""
        bad = list_bad_steps(self.store.list_dir(layout.BAD_DIR))
        self._bad_read = (self._clock(), bad)
        return bad

    def read_commit(self, step: int) -> bytes | None:
        try:
            return self.store.read_bytes(f"{step}/{layout.COMMIT_FILE}")
        except FileNotFoundError:
            return None

    def visible(self, step: int, epoch: fencing.Epoch) -> bool:
        """Whether a step committed at `epoch` is visible now (fences, bad records, branches)."""
        if step in self.bad_steps() or timelines.decide_superseded(step, epoch, self.branches()) is not None:
            return False
        return fencing.decide_visible(step, epoch, self.read_fences())

    def branches(self) -> list[timelines.Branch]:
        """The rollbacks recorded in the persistent tier (`_branches/`; one listing, new records read;
        `scan_local` uses the last list, so an idle turn lists nothing on the persistent tier)."""
        self._branches = [r for r in self._read_records(layout.BRANCHES_DIR, timelines.parse_branch)
                          if isinstance(r, timelines.Branch)]
        return self._branches

    def newest_branch(self) -> timelines.Branch | None:
        """The newest rollback of the branch records last read (no storage I/O)."""
        return timelines.newest_branch(self._branches or [])

    _branches: list[timelines.Branch] | None = None
    _branches_local: tuple[int, ...] = ()

    def kept_attempts(self, step: int) -> set[str]:
        """The attempts under `<step>/` that kept records protect (a bad or superseded copy whose
        number was saved again): never deleted."""
        kept = [r for r in self._read_records(layout.KEPT_DIR, timelines.parse_kept) if isinstance(r, timelines.Kept)]
        return timelines.kept_attempts(kept, step)

    def _read_records(self, folder: str, parse: Callable[[str, bytes], object | None]) -> list[object]:
        names = self.store.list_dir(folder)
        cache = self._records[folder]
        for name in names:
            if name in cache:
                continue
            try:
                parsed = parse(name, self.store.read_bytes(f"{folder}/{name}"))
            except FileNotFoundError:
                continue
            if parsed is not None:
                cache[name] = parsed
        return [cache[n] for n in names if n in cache]

    def read_fences(self) -> dict[fencing.Epoch, int | None]:
        """Every fence record (resilax_ckpt.history.fencing). On gs:// a record whose MD5 (free in the
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
        self._fences_read = (self._clock(), fences)
        return fences

    def committed_elsewhere(self, local: LocalStep) -> bool:
        """Whether `_COMMIT` of the step names another attempt and is visible: the step is committed
        and this upload has nothing to add (it could never be read)."""
        body = self.read_commit(local.step)
        if body is None or named_attempt(body) == local.attempt:
            return False
        epoch = fencing.parse_marker_epoch(body)
        if not self.visible(local.step, epoch):
            return False
        log.info("step %d: already committed by another save (%s, era %d generation %d); not uploading ours",
                 local.step, named_attempt(body) or "in place", *epoch)
        self.memory.known_committed[local.step] = epoch
        return True
