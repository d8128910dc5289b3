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
   (`<root>/<step>/_COMMIT` that no newer generation's fence and no `_bad/` record hides): listed
   on the first pass and then at most every `IDLE_SCAN_SECONDS` (`plan_listing`); the passes between
   use what the uploader knows (that listing, its own commits and deletions since);
2. take the newest local step that is newer than the newest persisted one (older ones would only add
   lag; every host picks the same newest step, so their uploads meet in one persistent step);
3. copy each of its files to `<root>/<step>/<attempt>/` with bounded concurrency, skipping files
   already there with the same size and MD5 (a resumed upload, or another host's identical copy; an
   attempt of one process in a folder the last listing did not have holds nothing: not listed), and
   verify each copy (size, or MD5 with `RESILAX_SIDECAR_VERIFY=md5`);
4. write `<attempt>/_UPLOADED.<process_id>` listing the files and sizes this process needs;
5. if every process's marker is in the attempt, all from the same save (generation), every listed
   file exists with its size (one process that just copied and verified its files knows that without
   listing), and no newer generation's fence hides the step (listed fresh), create `_COMMIT` naming
   the attempt (create-only; the losers of a race see it exists and are done). A `_COMMIT` that
   fences or a bad record hide (a fenced-out older generation's, a step a restore marked bad) is
   re-pointed to our attempt, as the library's commit does; a visible one is never touched;
6. retention on both tiers (a step whose objects its commit recorded is deleted without listing it),
   and (process 0) deleting attempts that a visible step's marker does not name, in folders that were
   there before the upload (`layout.is_attempt_name` entries only: never anything Resilax did not
   write); leftovers older than every kept step on the passes that list the root.
On gs:// a save so costs one LIST (the fences), and the root one every `IDLE_SCAN_SECONDS`.
Any error aborts the pass; `run_forever` records it, counts it and retries with exponential back-off.
A restart simply runs the passes again: files that are there are skipped, nothing is committed before
step 5's checks pass, so a killed upload resumes and a partial step never looks committed.

This module is the loop and its step selection (steps 2 and the publishing of `/v1/state`); each part
of a pass lives in a module of its own, over one shared `UploadMemory`:
`upload_scan` (step 1: what both tiers hold; `TierView`), `upload_copy` (steps 3-4: `StepCopier`),
`upload_commit` (step 5: `StepCommitter`) and `upload_cleanup` (step 6: `Cleaner`; the rules are resilax_ckpt.saving.retention's).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from resilax_ckpt import layout
from resilax_ckpt.control.requests import read_stop_record
from resilax_ckpt.history import fencing, timelines

from resilax_sidecar.config import SidecarConfig
from resilax_sidecar.errors import StoreError
from resilax_sidecar.metrics import SidecarMetrics
from resilax_sidecar.store import BlobStore
from resilax_sidecar.upload_cleanup import Cleaner
from resilax_sidecar.upload_commit import StepCommitter
from resilax_sidecar.upload_copy import StepCopier, Superseded
from resilax_sidecar.upload_scan import (
    LocalStep,
    TierView,
    UploadMemory,
    commit_body_naming,
    list_bad_steps,
    list_local_steps,
    local_commit_marker,
    named_attempt,
)

__all__ = [
    "LocalStep", "UploadState", "Uploader", "commit_body_naming", "layout", "list_bad_steps", "list_local_steps",
    "local_commit_marker", "named_attempt",
]

log = logging.getLogger(__name__)


@dataclass
class UploadState:
    """What `/v1/state` reports; written by the uploader thread, read by the HTTP handlers."""

    newest_local: int | None = None
    newest_persisted: int | None = None
    branch: dict[str, int] | None = None
    """The rollback the newest steps' branch comes from (resilax_ckpt.history.timelines.describe_branch)."""
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
            "branch": self.branch,
            "upload_in_flight": self.in_flight,
            "last_error": self.last_error,
            "last_error_time": self.last_error_time,
            "consecutive_failures": self.consecutive_failures,
            "last_upload": self.last_upload,
        }


IDLE_SCAN_SECONDS = 90.0
"""How often the uploader lists the persistent tier's root, idle or saving (other hosts' commits and
deletions, leftovers): one LIST on gs://, plus the fences' and bad records' every
`upload_scan.HIDING_REFRESH_SECONDS` (600) unless a commit read the fences since: 15 LISTs in 20 idle
minutes (tests/sidecar/test_scan_cost.py), against one or more per poll second before."""


def plan_full_pass(local_steps: list[int], last_local_steps: list[int] | None, woken: bool, pending: bool,
                   since_last: float | None, idle_seconds: float) -> bool:
    """Whether `run_forever`'s next turn is a full pass (both tiers, uploads, commits, retention) or
    an idle one that reads only the local tier (pure): full on the first turn and after a failure,
    when the local steps changed (a save committed or retention ran), when woken (`wake()`: a save
    request, a stop; `urgent`), while a local step waits for its upload, and every `idle_seconds`
    (other hosts' commits, another generation's fences). An idle job so lists the persistent tier's
    root once per `idle_seconds`, not once per poll."""
    if last_local_steps is None or since_last is None:
        return True
    return local_steps != last_local_steps or woken or pending or since_last >= idle_seconds


SAVE_SETTLE_SECONDS = 120.0
"""A sidecar without an uploader (the trainer commits to the persistent tier itself): how long after
the trainer's save count moved it keeps listing once a poll for the commit (`plan_direct_listing`)."""


def plan_direct_listing(since_listing: float | None, looking: bool, poll_seconds: float,
                        idle_seconds: float) -> bool:
    """Whether `/v1/state` of a sidecar without an uploader lists the persistent root for the newest
    committed step (pure): the first time, at most once a poll while `looking` (a trainer's save may be
    committing; a stop), else once every `idle_seconds` (another writer's steps, retention). The
    operator reads /v1/state every few seconds: one LIST each would be ~12 a minute per job."""
    return since_listing is None or since_listing >= (poll_seconds if looking else idle_seconds)


def plan_listing(since_listing: float | None, idle_seconds: float) -> bool:
    """Whether a full pass lists the persistent root (pure): the first one, the first after a
    failure or a new generation (`since_listing` None), and then at most once every `idle_seconds`.
    The passes between work from what the uploader knows (the last listing, its own commits and
    deletions since): a save so costs the persistent tier one LIST, its commit's look at the fences."""
    return since_listing is None or since_listing >= idle_seconds


def plan_retry_wait(backoff: float, draw: float) -> float:
    """Seconds before the retry after a failed pass (pure): "equal jitter" on the exponential back-off,
    half of it fixed and half drawn (`draw` uniform in [0, 1)), so that after a storage incident the
    sidecars of a fleet spread their retries over the window instead of retrying in lockstep, and none
    retries sooner than half its back-off."""
    return backoff / 2 + backoff / 2 * draw


class Uploader:
    """Copies this host's local steps to the persistent tier. Thread-safe to read `state`."""

    def __init__(
        self,
        config: SidecarConfig,
        store: BlobStore,
        metrics: SidecarMetrics,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
    ) -> None:
        if config.local_dir is None:
            raise ValueError("the uploader needs RESILAX_LOCAL_DIR")
        self.config = config
        self.local_dir = config.local_dir
        self.store = store
        self.metrics = metrics
        self.state = UploadState()
        self._clock = clock
        self._draw = draw
        self._wake = threading.Event()
        self.urgent = threading.Event()
        """Set when a final save is coming (SIGTERM, a stop request): a newer local step then
        supersedes the upload in flight. Not otherwise: with saves more frequent than uploads take,
        superseding would starve the persistent tier."""
        self.requested_steps: set[int] = set()
        """Steps that answered a save request of this sidecar's (a final save, the operator's): they
        go to the persistent tier whatever `persist_every_steps` says."""
        self.memory = UploadMemory()
        self.view = TierView(config, store, self.memory, clock)
        self.copier = StepCopier(config, store, metrics, self.memory, clock, self.urgent, self._newer_to_persist,
                                 self._record_upload)
        self.committer = StepCommitter(config, store, metrics, self.view, self.memory)
        self.cleaner = Cleaner(config, store, metrics, self.view, self.memory, self.persists)
        self._changed = threading.Condition()
        self._woken = False
        self._last_full: tuple[list[int], float] | None = None
        """The local steps and the time of the last full pass of `run_forever` (None: none yet, or it failed)."""
        self._last_listing: float | None = None
        """When a pass last listed the persistent root (None: never, or a pass failed since)."""
        self._retry_delay = config.retry_initial_seconds
        self._retention_seen: tuple[tuple[int, ...], tuple[int, ...]] | None = None

    def set_config(self, config: SidecarConfig) -> None:
        """New generation-dependent settings (an in-place restart's assignment): each part reads them
        at its next use. A step keeps the identity its own local `_COMMIT` records."""
        if config.generation != self.config.generation:
            # A new generation's trainer restores first (maybe a rollback): persistent retention waits
            # for its first commit again, and the branch records are listed until then.
            self.memory.committed_own = False
            self._last_listing = None  # its restore may have changed the tier: list it at the next pass
            self.view.forget_hiding()
        self.config = config
        for part in (self.view, self.copier, self.committer, self.cleaner):
            part.config = config

    # ---- the loop -------------------------------------------------------------------------------

    def wake(self) -> None:
        """Start the next pass now (a save was just committed locally)."""
        self._wake.set()

    def run_forever(self, stop: threading.Event) -> None:
        """Passes until `stop` is set; errors back off exponentially, with jitter, and never escape."""
        while not stop.is_set():
            self._wake.wait(self.tick())
            self._woken = self._wake.is_set()
            self._wake.clear()

    def tick(self) -> float:
        """One turn of `run_forever`: a full pass when `plan_full_pass` says so, else only the local
        tier published; the seconds to wait before the next turn."""
        try:
            local_steps = self.scan_local()
            if self._needs_full_pass(local_steps):
                self._woken = False
                now = self._clock()
                self.run_once(plan_listing(None if self._last_listing is None else now - self._last_listing,
                                           IDLE_SCAN_SECONDS))
                # The pass's own local retention is no change to act on (a save during the pass is).
                self._last_full = ([s for s in local_steps if s not in self.cleaner.trimmed_local], now)
            else:
                self._publish(local_steps, self.state.committed_steps)
        except Exception as e:  # every failure is recorded and retried; nothing may kill the loop
            self._last_full = None  # the next turn is a full pass
            self._last_listing = None  # that lists the persistent root
            self._record_failure(e)
            wait = plan_retry_wait(self._retry_delay, self._draw())
            self._retry_delay = min(self._retry_delay * 2, self.config.retry_max_seconds)
            return wait
        self._retry_delay = self.config.retry_initial_seconds
        return self.config.poll_seconds

    def _needs_full_pass(self, local_steps: list[int]) -> bool:
        persisted = self.state.committed_steps
        newest = max(persisted, default=None)
        pending = any((newest is None or s > newest) and self.persists(s) for s in local_steps)
        last = self._last_full
        return plan_full_pass(local_steps, None if last is None else last[0], self._woken or self.urgent.is_set(),
                              pending, None if last is None else self._clock() - last[1], IDLE_SCAN_SECONDS)

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

    def is_persisted(self, step: int) -> bool:
        """Whether this host's save of `step` is in the persistent tier: that very save (its commit
        marker names the attempt of this save's identity, resilax_ckpt.layout.upload_attempt_name) is
        committed and visible, or a newer step of the current branch saved by this save's epoch or a
        later one is (an urgent upload moved on to it). A step of an abandoned timeline with the same
        number or a higher one never counts (resilax_ckpt.history.timelines)."""
        committed = self.state.committed_steps
        attempt = self.view.local_attempt(step)
        if attempt is None:  # gone from the local tier: only the current branch's numbers are left
            return any(s >= step for s in committed)
        if step in committed:
            body = self.view.read_commit(step)
            if body is not None and named_attempt(body) == attempt:
                return True
        epoch = self.view.local_epoch(step)
        return any(s > step and self.memory.known_committed.get(s, (-1, -1)) >= epoch for s in committed)

    def lost_uploads(self, step: int, lost: Mapping[int, Collection[int]]) -> list[int]:
        """The processes of this host's save of `step` that the operator said are lost and whose upload
        marker its attempt lacks (StepCommitter.lost_uploads): the step can then never be committed."""
        return self.committer.lost_uploads(self.read_local_step(step), lost)

    def wait_persisted(self, step: int, timeout: float) -> bool:
        """Block until this host's save of `step` is persisted (`is_persisted`), or `timeout`."""
        deadline = self._clock() + timeout
        with self._changed:
            while True:
                if self.is_persisted(step):
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

    def run_once(self, list_root: bool = True) -> None:
        """One pass: see both tiers, upload and commit the newest new step, apply retention.
        `list_root=False`: the persistent tier as the uploader knows it (`plan_listing`)."""
        local_steps = self.scan_local()
        self.cleaner.trimmed_local = set()
        if list_root:
            self._last_listing = self._clock()
        persisted = self.view.scan_persisted(list_root)
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
            except Superseded as e:
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
        # Retention again only when a tier changed since it last ran (on gs:// it lists the root).
        seen = (tuple(self.scan_local()), tuple(persisted))
        if (seen != self._retention_seen or list_root) and self.cleaner.apply_retention(
                persisted, self.state.in_flight, sweep=list_root):
            self._publish(self.scan_local(), self.view.scan_persisted(list_root=False))
        self._retention_seen = seen
        self.state.consecutive_failures = 0
        self.state.passes += 1

    def _publish(self, local_steps: list[int], persisted: list[int]) -> None:
        newest_local = max(local_steps, default=None)
        newest_persisted = max(persisted, default=None)
        self.state.newest_local = newest_local
        self.state.newest_persisted = newest_persisted
        self.state.branch = timelines.describe_branch(self.view.newest_branch())
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

    def _record_upload(self, summary: dict[str, int | float]) -> None:
        self.state.last_upload = dict(summary)

    def _newer_to_persist(self, step: int) -> int | None:
        """The newest local step to be persisted if it is newer than `step` (superseding, when urgent)."""
        newest = max((s for s in self.scan_local() if self.persists(s)), default=None)
        return newest if newest is not None and newest > step else None

    # ---- the parts of a pass (upload_scan, upload_copy, upload_commit, upload_cleanup) ------------

    def scan_local(self) -> list[int]:
        """This process's locally committed steps that a restore did not mark bad (what is uploaded)."""
        return self.view.scan_local()

    def read_local_step(self, step: int) -> LocalStep:
        """The files of a local step this process uploads, and what identifies the save."""
        return self.view.read_local_step(step)

    def scan_persisted(self) -> list[int]:
        """The persistent tier's visible committed steps (TierView.scan_persisted)."""
        return self.view.scan_persisted()

    def read_fences(self) -> dict[fencing.Epoch, int | None]:
        """Every fence record (resilax_ckpt.history.fencing)."""
        return self.view.read_fences()

    def upload_step(self, local: LocalStep) -> bool:
        """Copy, verify, mark and (when every process is done) commit one step; True if the step is
        committed (by this save or, visibly, by another one)."""
        if self.view.committed_elsewhere(local):
            return True
        verified = self.copier.copy_and_mark(local)
        return self.committer.try_commit(local, verified)

    def try_commit(self, local: LocalStep) -> bool:
        """Commit the save's attempt if every process's upload of it is complete (StepCommitter)."""
        return self.committer.try_commit(local)

    def clean_stale_attempts(self, persisted: list[int]) -> list[str]:
        """Process 0: delete the attempts no visible commit names (Cleaner.clean_stale_attempts)."""
        return self.cleaner.clean_stale_attempts(persisted)

    def apply_retention(self, persisted: list[int]) -> bool:
        """Retention on both tiers (Cleaner.apply_retention); True when something was deleted."""
        return self.cleaner.apply_retention(persisted, self.state.in_flight)
