"""The uploader's cleanup (step 6 of the pass described in resilax_sidecar.uploader): retention on
both tiers, and (process 0) deleting attempts that a visible step's marker does not name and partial
or fenced-out steps older than every kept one. Only what Resilax provably wrote is ever deleted
(`layout.is_attempt_name` entries, `layout.owns_step_folder` folders); a step marked bad or superseded
by a rollback, and an attempt a kept record names, is kept (resilax_ckpt.history.timelines)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable

from resilax_ckpt import layout
from resilax_ckpt.errors import MetadataError
from resilax_ckpt.history import fencing, timelines
from resilax_ckpt.metadata import StepMetadata
from resilax_ckpt.saving import retention

from resilax_sidecar.config import SidecarConfig
from resilax_sidecar.metrics import SidecarMetrics
from resilax_sidecar.store import BlobStore
from resilax_sidecar.upload_scan import TierView, UploadMemory, list_local_steps, named_attempt

log = logging.getLogger(__name__)


class Cleaner:
    """Retention on both tiers and the persistent tier's leftovers, for one process's uploader."""

    def __init__(
        self,
        config: SidecarConfig,
        store: BlobStore,
        metrics: SidecarMetrics,
        view: TierView,
        memory: UploadMemory,
        persists: Callable[[int], bool],
    ) -> None:
        assert config.local_dir is not None
        self.config = config
        self.local_dir = config.local_dir
        self.store = store
        self.metrics = metrics
        self.view = view
        self.memory = memory
        self._persists = persists
        """Whether a local step goes to the persistent tier (resilax_sidecar.uploader.Uploader.persists)."""
        self.trimmed_local: set[int] = set()
        """The local steps retention deleted in the current pass (set by Uploader.run_once)."""
        self._facts: dict[tuple[int, str], retention.StepFacts] = {}
        """(step, the attempt its marker names) -> its metrics and save time: read once (write-once steps)."""

    def clean_stale_attempts(self, persisted: list[int]) -> list[str]:
        """Delete the attempts under visible committed steps that their `_COMMIT` does not name (a
        stale or losing upload's, never readable), once per step in this sidecar's life; only entries of
        the attempt form, only in steps whose marker names an attempt. Called on: process 0's
        sidecar, each pass (the library's primary does the same at each generation's start)."""
        cleaned = self.memory.cleaned
        deleted: list[str] = []
        for step in persisted:
            if step in cleaned:
                continue  # a visible commit is never re-pointed: its named attempt stays the same
            body = self.view.read_commit(step)
            won = named_attempt(body) if body is not None else None
            if won is None:
                cleaned[step] = ""
                continue
            others = [n for n in self.store.list_dir(str(step)) if layout.is_attempt_name(n) and n != won]
            keep = self.view.kept_attempts(step) if others else set()
            for name in others:
                if name not in keep:
                    self.store.delete_prefix(f"{step}/{name}")
                    deleted.append(f"{step}/{name}")
            cleaned[step] = won
        if deleted:
            log.info("deleted attempts no commit marker names in %s: %s", self.store.url, ", ".join(deleted))
        return deleted

    def apply_retention(self, persisted: list[int], in_flight: int | None, sweep: bool = True) -> bool:
        """The persistent tier keeps what `config.retention_rule` keeps (resilax_ckpt.saving.retention: the
        newest `keep_last`, the best `keep_best`, the preserved ones); the local tier the newest
        `local_keep_last` (else `keep_last`). The persistent tier is trimmed by process 0 only (one
        deleter); each host trims its own local tier. `sweep`: also clear the leftovers the root
        listing just made (`memory.listed`) shows (a pass that listed the root). True when something
        was deleted."""
        cfg = self.config
        if cfg.process_id == 0:
            self.clean_stale_attempts(persisted)
        rule = cfg.retention_rule
        local_keep = cfg.local_keep_last if cfg.local_keep_last is not None else cfg.keep_last
        if not rule.deletes and local_keep is None:
            return False
        deleted = False
        protect = {in_flight} if in_flight is not None else set()
        if rule.deletes and cfg.process_id == 0 and persisted and self.memory.committed_own:
            deleted = self._trim_persistent(persisted, protect, sweep)
        if local_keep is None:
            return deleted
        return self._trim_local(persisted, local_keep, protect) or deleted

    def _trim_persistent(self, persisted: list[int], protect: set[int], sweep: bool) -> bool:
        rule = self.config.retention_rule
        memory = self.memory
        known_committed = memory.known_committed
        deleted = False
        facts, unread = self._read_facts(persisted) if rule.needs_facts else ({}, set())
        retired = set()
        for step in retention.decide_retention(persisted, rule, facts, protect | unread):
            retired.add(step)
            named = memory.cleaned.get(step)
            if named is None:
                body = self.view.read_commit(step)
                named = (named_attempt(body) if body is not None else None) or ""
            # _COMMIT first: a half-deleted step must never look committed.
            self.store.delete(f"{step}/{layout.COMMIT_FILE}")
            known_committed.pop(step, None)
            memory.cleaned.pop(step, None)
            objects = memory.objects.pop(step, None)
            if objects is not None and named and all(k.startswith(f"{named}/") for k in objects):
                # Every object this uploader's commit knew of: nothing to list. Whatever else is there
                # (an attempt raced in by another save) keeps the folder, and the next root listing finds it.
                self.store.delete_keys([f"{step}/{k}" for k in objects])
            else:
                self._delete_step_files(step, named or None)
            memory.folders.discard(step)
            self.metrics.retention_deletes.labels(tier="persistent").inc()
            deleted = True
            log.info("retention: deleted step %d from %s", step, self.store.url)
        if sweep and memory.listed is not None:
            self._sweep(persisted, memory.listed - retired)
        return deleted

    def _sweep(self, persisted: list[int], listed: set[int]) -> None:
        """Partial uploads older than every kept (visible) step (a save abandoned for a newer one, a
        host that died mid-upload, what a deletion left) will never be committed, and a commit there
        that the fences hide (a stale generation's) will never be read: clear them out too. Not a
        step marked bad (kept), never a folder of someone else's. Only the folders the last root
        listing had; each one left (kept attempts, data not Resilax's) is not looked at again."""
        memory = self.memory
        known_committed = memory.known_committed
        kept = sorted(s for s in persisted if s in known_committed)
        if not kept:
            return
        hiding: tuple[dict[fencing.Epoch, int | None], set[int], list[timelines.Branch]] | None = None
        for step in sorted(s for s in listed if s < kept[0] and s not in memory.settled):
            memory.settled.add(step)  # whatever is left there after this stays (kept, or not Resilax's)
            body = self.view.read_commit(step)
            if body is None:
                if layout.owns_step_folder(self.store.list_dir(str(step))) and self._delete_step_files(step, None):
                    log.info("retention: deleted the abandoned partial upload of step %d", step)
                continue
            if hiding is None:
                hiding = self.view.read_fences(), self.view.bad_steps(), self.view.branches()
            fences, bad, branches = hiding
            epoch = fencing.parse_marker_epoch(body)
            # A step marked bad or superseded by a rollback is a real save: kept, never deleted.
            if (step not in bad and timelines.decide_superseded(step, epoch, branches) is None
                    and not fencing.decide_visible(step, epoch, fences)):
                self.store.delete(f"{step}/{layout.COMMIT_FILE}")
                known_committed.pop(step, None)
                self._delete_step_files(step, None)
                log.info("retention: deleted step %d, committed by a fenced-out generation (never visible)", step)

    def _delete_step_files(self, step: int, named: str | None) -> bool:
        """Delete a persistent step's files (one listing), except the attempts kept records protect
        (a bad or superseded copy of the same number: read only when the folder holds an attempt
        other than `named`, the one its commit named) and, beside attempts, names Resilax never
        writes there; whether anything was deleted."""
        listing = list(self.store.list_files(str(step)))
        tops = {k: k.split("/", 1)[0] for k in listing}
        attempts = {t for k, t in tops.items() if k != t and layout.is_attempt_name(t)}
        keep = self.view.kept_attempts(step) if named is None or attempts - {named} else set()
        # A step committed in place (no attempts) is all the library's; beside attempts only
        # Resilax's own names are (layout.owns_step_folder): anything else arrived after the upload.
        doomed = [f"{step}/{k}" for k, top in tops.items()
                  if top not in keep and (not attempts or layout.owns_step_folder([top]))]
        self.store.delete_keys(doomed)
        return bool(doomed)

    def _trim_local(self, persisted: list[int], local_keep: int, protect: set[int]) -> bool:
        # Steps a restore marked bad count like the others (kept until they age out, never uploaded).
        local_steps = list_local_steps(self.local_dir, self.config.process_id)
        newest_persisted = max(persisted, default=None)
        local_protect = set(protect)
        # A local step newer than everything persisted is still to be uploaded: keep the newest one.
        waiting = [s for s in self.view.scan_local()
                   if (newest_persisted is None or s > newest_persisted) and self._persists(s)]
        if waiting:
            local_protect.add(waiting[-1])
        deleted = False
        for step in retention.decide_retention(local_steps, retention.RetentionRule(keep_last=local_keep), None,
                                               local_protect):
            folder = self.local_dir / str(step)
            trash = self.local_dir / f"{layout.TRASH_PREFIX}{step}-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(folder, trash)
            except FileNotFoundError:
                continue  # the trainer's own retention got there first
            shutil.rmtree(trash, ignore_errors=True)
            self.memory.marker_done.pop(step, None)
            self.trimmed_local.add(step)
            self.metrics.retention_deletes.labels(tier="local").inc()
            deleted = True
            log.info("retention: deleted local step %d", step)
        return deleted

    def _read_facts(self, persisted: list[int]) -> tuple[dict[int, retention.StepFacts], set[int]]:
        """The metrics (the step's `_METADATA.json`) and save time (its marker's `time`) of each persisted
        step, read once per step and attempt; and the steps whose metadata could not be read this time
        (a GCS 503 is an OSError): those are kept by this pass and read again by the next, never
        remembered as "no metrics" (best-N would then delete the best step). Metadata that reads but
        does not parse is a fact of a write-once step: no metrics, kept by recency rules
        (resilax_ckpt.saving.retention)."""
        out: dict[int, retention.StepFacts] = {}
        unread: set[int] = set()
        for step in persisted:
            attempt = self.memory.cleaned.get(step)
            body = self.view.read_commit(step) if attempt is None else None
            if attempt is None:
                attempt = (named_attempt(body) if body is not None else None) or ""
            key = (step, attempt)
            if key not in self._facts:
                body = body if body is not None else self.view.read_commit(step)
                where = f"{step}/{attempt}/{layout.METADATA_FILE}" if attempt else f"{step}/{layout.METADATA_FILE}"
                try:
                    raw = self.store.read_bytes(where)
                except OSError as e:
                    log.warning("retention: could not read the metadata of step %d (%s); kept, read again "
                                "next time", step, e)
                    unread.add(step)
                    continue
                try:
                    meta = StepMetadata.from_bytes(raw, where)
                    self._facts[key] = retention.StepFacts(meta.time or _marker_time(body), dict(meta.metrics))
                except MetadataError as e:
                    log.warning("retention: no metrics for step %d (%s)", step, e)
                    self._facts[key] = retention.StepFacts(_marker_time(body))
            out[step] = self._facts[key]
        return out, unread


def _marker_time(body: bytes | None) -> float | None:
    try:
        value = json.loads(body or b"").get("time")
    except (ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
