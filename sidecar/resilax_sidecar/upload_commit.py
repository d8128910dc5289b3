"""The uploader's commit of a step (step 5 of the pass described in resilax_sidecar.uploader): once
every process's `_UPLOADED` marker of one save is in the attempt, every listed file is there with its
size and no newer generation's fence hides the step, `<step>/_COMMIT` naming the attempt is created
(create-only); a commit that fences, a bad record or a rollback hide is re-pointed (a bad or superseded
one recorded in `_kept/` first, resilax_ckpt.history.timelines), a visible one never touched."""

from __future__ import annotations

import json
import logging
from collections.abc import Collection, Mapping
from typing import Any

from resilax_ckpt import layout
from resilax_ckpt.history import fencing, timelines

from resilax_sidecar.config import SidecarConfig
from resilax_sidecar.errors import StoreError
from resilax_sidecar.metrics import SidecarMetrics
from resilax_sidecar.store import BlobStore
from resilax_sidecar.upload_scan import LocalStep, TierView, UploadMemory, named_attempt

log = logging.getLogger(__name__)


def decide_lost_processes(local: LocalStep, lost: Mapping[int, Collection[int]]) -> list[int]:
    """The processes of `local`'s save that the operator said are lost (`lost`: generation -> processes,
    `POST /v1/peers/lost`: their nodes are proven down), sorted: those of the save's own generation only
    (another generation numbers its processes otherwise), within its process count, never this
    process itself (pure)."""
    said = lost.get(local.generation, ())
    return sorted({p for p in said if 0 <= p < local.process_count and p != local.process})


class StepCommitter:
    """Commits a save's attempt in the persistent tier when every process's upload is complete."""

    def __init__(
        self, config: SidecarConfig, store: BlobStore, metrics: SidecarMetrics, view: TierView, memory: UploadMemory
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.view = view
        self.memory = memory

    def try_commit(self, local: LocalStep, verified: bool = False) -> bool:
        """Create `<step>/_COMMIT` naming the save's attempt if every process's upload of this save is
        complete; True when the step is committed (by this save, or visibly by another one).
        `verified`: this pass copied and verified every file of this process and wrote its marker
        (StepCopier.copy_and_mark); with one process that is the whole save, so the attempt is not
        listed: the fences are the one listing of the commit."""
        step = local.step
        known_committed = self.memory.known_committed
        existing = self.view.read_commit(step)
        if existing is not None:
            if named_attempt(existing) == local.attempt:
                known_committed[step] = local.epoch
                self.memory.committed_own = True
                self._committed_here(step, local.attempt, None)  # by another host of this save
                return True
            if self.view.committed_elsewhere(local):
                return True
            # Hidden (a fenced-out older generation's commit, or a step marked bad): a complete
            # upload of ours re-points it below; the attempt it named is left as it is.
        base = f"{step}/{local.attempt}"
        markers: dict[int, dict[str, Any]] = {}
        alone = verified and local.process_count == 1
        listing = {} if alone else self.store.list_files(base)
        if alone:
            markers[local.process] = {"era": local.era, "generation": local.generation, "files": {}}
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
        missing = sorted(set(range(local.process_count)) - set(markers))
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
                        self.store.delete(f"{base}/{layout.uploaded_name(local.process)}")
                        self.memory.marker_done.pop(step, None)
                    return False
        fences = self.view.read_fences()
        if not fencing.decide_visible(step, local.epoch, fences):
            raise StoreError(
                f"step {step} of era {local.era} generation {local.generation} is fenced out by a newer "
                f"generation or job (fences {sorted(fences)}); not committing it"
            )
        commit_key = f"{step}/{layout.COMMIT_FILE}"
        # Every object of the attempt, for retention to delete the step without listing it.
        objects = sorted({*local.files, layout.writer_name(local.process), layout.uploaded_name(local.process)}
                         if alone else listing)
        if existing is None:
            if self.store.create_bytes(commit_key, local.commit_body):
                self._committed_here(step, local.attempt, objects)
                self.metrics.commits.inc()
                log.info("step %d: committed in %s (all %d processes uploaded into %s)",
                         step, self.store.url, len(markers), local.attempt)
                known_committed[step] = local.epoch
                self.memory.committed_own = True
                return True
            existing = self.view.read_commit(step)
            if existing is not None and named_attempt(existing) == local.attempt:
                log.info("step %d: already committed by another sidecar", step)
                known_committed[step] = local.epoch
                self.memory.committed_own = True
                return True
            return self.view.committed_elsewhere(local)
        # Re-point a hidden commit, as resilax_ckpt.commit.commit_object does: only an older epoch's
        # that the fences hide, or a step marked bad, never a visible one.
        old_epoch = fencing.parse_marker_epoch(existing)
        bad = step in self.view.bad_steps()
        superseded = timelines.decide_superseded(step, old_epoch, self.view.branches()) is not None
        if not bad and not superseded and old_epoch >= local.epoch:
            log.warning("step %d: committed by era %d generation %d, which is hidden; not replacing it with "
                        "era %d generation %d's", step, *old_epoch, *local.epoch)
            return False
        if bad or superseded:
            # A real save (marked bad, or of an abandoned timeline): recorded as kept before the
            # marker moves on, so no cleanup ever deletes its attempt (resilax_ckpt.history.timelines).
            why = timelines.BAD if bad else timelines.SUPERSEDED
            self.store.create_bytes(f"{layout.KEPT_DIR}/{timelines.kept_name(step)}",
                                    timelines.build_kept(step, why, existing, attempt=named_attempt(existing)))
        self.store.write_bytes(commit_key, local.commit_body)
        self._committed_here(step, local.attempt, objects)
        if bad:
            self.store.delete(f"{layout.BAD_DIR}/{layout.bad_name(step)}")
        self.metrics.commits.inc()
        log.info("step %d: committed in %s (all %d processes uploaded into %s), replacing %s's hidden commit",
                 step, self.store.url, len(markers), local.attempt, named_attempt(existing) or "an in-place")
        known_committed[step] = local.epoch
        self.memory.committed_own = True
        return True

    def lost_uploads(self, local: LocalStep, lost: Mapping[int, Collection[int]]) -> list[int]:
        """The lost processes (`decide_lost_processes`) whose `_UPLOADED` marker this save's attempt
        lacks (one stat each, no listing): while one is missing the step can never be committed, as
        `try_commit` needs every process's marker and a lost process writes none. A lost process that
        uploaded before it died is not counted: this process's upload may still complete the step."""
        base = f"{local.step}/{local.attempt}"
        return [p for p in decide_lost_processes(local, lost)
                if self.store.stat(f"{base}/{layout.uploaded_name(p)}") is None]

    def _committed_here(self, step: int, attempt: str, objects: list[str] | None) -> None:
        """What this uploader knows of a step its save just committed: its objects (None: not all of
        them), and whether other attempts can be beside it. A folder the last root listing did not
        have was new to this save (its hosts wrote it): nothing stale to clean there, unless a stale
        writer raced in since (its attempt goes with the step's retention, or at the next start's
        cleanup: the library's primary and this sidecar's first pass clean every committed step)."""
        memory = self.memory
        if objects is not None and self.config.process_id == 0 and self.config.retention_rule.deletes:
            memory.objects[step] = [f"{attempt}/{k}" for k in objects]
        if memory.listed is not None and step not in memory.listed:
            memory.cleaned[step] = attempt
