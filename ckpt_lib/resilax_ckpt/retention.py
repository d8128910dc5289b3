"""Retention: which committed steps a manager deletes after each commit (the rule is
policy.plan_retention; this applies it). Retired steps of a local shared folder are kept for
recycling (commit.retire_step); on object stores the marker goes first, so a half-deleted step never
looks committed. The local tier's retention is the sidecar's (this manager keeps every local step);
its start-up and rollback rules are in tiers.py."""

from __future__ import annotations

import logging

from resilax_ckpt import commit, fencing, layout, policy
from resilax_ckpt.tiers import Tiers

log = logging.getLogger(__name__)


def apply_retention(tiers: Tiers) -> None:
    """Delete (or retire for recycling) the steps retention does not keep; never the step the last
    restore read. Called on: the primary, after a commit."""
    opts = tiers.options
    if opts.keep_last is None:
        return
    storage, root = tiers.local.storage, tiers.local.root
    doomed = policy.plan_retention(tiers.steps(), opts.keep_last, opts.keep_every_steps,
                                   protected=tiers.protected_steps)
    if doomed and opts.live_job_uids:  # never a step another live job committed (a taken-over storage)
        live = {c.era for c in fencing.read_claims(storage, root) if c.job_uid in opts.live_job_uids}
        doomed = [s for s in doomed if not live or commit.read_marker_epoch(
            storage, storage.join(root, layout.step_name(s)))[0] not in live]
    for step in doomed:
        if tiers.recycles and commit.retire_step(root, step, opts.recycle_pool):
            log.info("retention retired step %d in %s for recycling", step, root)
            continue
        # The marker first on object stores; never an attempt a `_kept/` record names (timelines.py).
        commit.delete_step(storage, root, step)
        log.info("retention deleted step %d in %s", step, root)
