"""Applies retention (the rules are retention.py's, pure) after each commit, and deletes a step on
request (`CheckpointManager.delete`). Retired steps of a local shared folder are kept for recycling
(commit.retire_step); on object stores the marker goes first, so a half-deleted step never looks
committed. The local tier's retention is the sidecar's (this manager keeps every local step); its
start-up and rollback rules are in tiers.py."""

from __future__ import annotations

import logging

from resilax_ckpt import commit, layout
from resilax_ckpt.errors import MetadataError
from resilax_ckpt.history import fencing
from resilax_ckpt.metadata import StepMetadata
from resilax_ckpt.saving import retention
from resilax_ckpt.tiers import Tiers

log = logging.getLogger(__name__)


class Pruner:
    """Deletes committed steps of a manager's tier. Keeps each step's retention facts (metrics, save
    time: a committed step's metadata never changes) so that a step's metadata is read at most once
    per manager. A step whose metadata could not be read (a GCS 503 is an OSError) is kept by that
    pass and read again by the next: a failed read is never remembered as "no metrics", which would
    let best-N retention delete the best step. Called on: the primary."""

    def __init__(self, tiers: Tiers) -> None:
        self._tiers = tiers
        self._facts: dict[int, retention.StepFacts] = {}

    def remember(self, metadata: StepMetadata) -> None:
        """The facts of a step this manager just committed (no read needed)."""
        self._facts[metadata.step] = retention.StepFacts(metadata.time or None, dict(metadata.metrics))

    def apply_retention(self) -> None:
        """Delete (or retire for recycling) the steps retention does not keep; never the step the last
        restore read. Called on: the primary, after a commit."""
        tiers = self._tiers
        rule = tiers.options.retention_rule
        if not rule.deletes or tiers.local_tier:
            return
        steps = tiers.steps()
        facts, unread = self._read_facts(steps) if rule.needs_facts else ({}, set())
        doomed = retention.decide_retention(steps, rule, facts, protected=set(tiers.protected_steps) | unread)
        for step in self._not_live(doomed):
            self._delete(step)
            log.info("retention deleted step %d in %s", step, tiers.local.root)

    def delete(self, step: int) -> None:
        """Delete one committed step of the current branch (the caller checked it is one)."""
        self._delete(step)
        log.info("deleted step %d in %s on request", step, self._tiers.local.root)

    def _delete(self, step: int) -> None:
        tiers = self._tiers
        self._facts.pop(step, None)
        if tiers.recycles and commit.retire_step(tiers.local.root, step, tiers.options.recycle_pool):
            return
        # The marker first on object stores; never an attempt a `_kept/` record names (timelines.py).
        commit.delete_step(tiers.local.storage, tiers.local.root, step)

    def _not_live(self, doomed: list[int]) -> list[int]:
        """Never a step another live job committed (a taken-over storage)."""
        opts, storage, root = self._tiers.options, self._tiers.local.storage, self._tiers.local.root
        if not doomed or not opts.live_job_uids:
            return doomed
        live = {c.era for c in fencing.read_claims(storage, root) if c.job_uid in opts.live_job_uids}
        return [s for s in doomed if not live or commit.read_marker_epoch(
            storage, storage.join(root, layout.step_name(s)))[0] not in live]

    def _read_facts(self, steps: list[int]) -> tuple[dict[int, retention.StepFacts], set[int]]:
        """The facts of each step, and the steps whose metadata could not be read this time (kept,
        not remembered). Metadata that reads but does not parse is a fact of a write-once step: no
        metrics, kept by recency rules only."""
        tier = self._tiers.local
        unread: set[int] = set()
        for step in steps:
            if step in self._facts:
                continue
            where = tier.storage.join(tier.data_path(step), layout.METADATA_FILE)
            try:
                raw = tier.storage.read_bytes(where)
            except OSError as e:
                log.warning("retention: could not read the metadata of step %d (%s); kept, read again next time",
                            step, e)
                unread.add(step)
                continue
            try:
                meta: StepMetadata | None = StepMetadata.from_bytes(raw, where)
            except MetadataError as e:  # kept by recency rules, as a step without metrics
                log.warning("retention: no metrics for step %d (%s)", step, e)
                meta = None
            self._facts[step] = (retention.StepFacts(meta.time or None, dict(meta.metrics)) if meta is not None
                                 else retention.StepFacts())
        return {s: self._facts[s] for s in steps if s in self._facts}, unread
