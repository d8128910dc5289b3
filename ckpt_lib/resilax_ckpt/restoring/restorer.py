"""The restore path of a manager: the newest good step, the fallback to older steps, the two tiers,
peer fetches and the cross-process agreement on what to read.

One tier (a shared folder or gs://): `newest_good` tries the committed steps newest first; a step
any process cannot read is marked bad (kept) and all processes move on together. Two tiers (a local
tier with a persistent tier behind it): `two_tiers` first agrees (`agree_two_tiers`: every process's
local steps, peer replicas and persistent listing, restore_choice.py decides), then tries each agreed
step: this host's local copy, a peer's replica fetched by the sidecar, or the persistent copy.
Step folders are read by step_reader.py. Called on: all processes (each public method a collective).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable, Mapping
from typing import Any

from resilax_ckpt import commit, layout, pytrees
from resilax_ckpt.chunks import host_ring, reader
from resilax_ckpt.control.requests import write_restore_report
from resilax_ckpt.errors import (
    CorruptCheckpointError,
    MetadataError,
    StepNotCommittedError,
    StepNotFoundError,
)
from resilax_ckpt.history import timelines
from resilax_ckpt.incluster import chunk_fetch, chunk_sources, peer_client, peers
from resilax_ckpt.restoring import prefetch, restore_choice
from resilax_ckpt.restoring.step_reader import UNREADABLE_STEP_ERRORS, missing_chunk_file, restore_step
from resilax_ckpt.tiers import Tier, Tiers, node_copies, own_holdings, withdraw_local_steps_after

log = logging.getLogger(__name__)


class Restorer:
    """Restores a manager's steps (see CheckpointManager.restore). Called on: all processes."""

    def __init__(self, tiers: Tiers) -> None:
        self._tiers = tiers
        self.report: dict[str, Any] | None = None
        """What the last restore of the newest step did (CheckpointManager.restore_report)."""
        self.restored_from: str | None = None
        """Two tiers: "local", "peer" or "persistent" (CheckpointManager.restored_from)."""
        self.latest_from_env: int | None = None
        """The step `resolve_latest` resolved "latest" to: restoring it may fall back."""
        self.asked_from_env: int | None = None
        """The step RESILAX_RESTORE_STEP named: restoring it starts the generation's timeline there (a
        rollback when newer steps are visible: timelines.py)."""
        self._count = 0
        self._local_misses: dict[int, str] = {}
        """This process's local steps (of the last two-tier agreement) it could not read whole locally, and why."""
        self._peer_sources: dict[int, list[str]] = {}
        """step -> the sidecars holding this process's replica of it (of the last two-tier agreement)."""
        self._copies: dict[int, list[chunk_sources.Copy]] = {}
        """process -> what its node holds (of the last two-tier agreement; chunk_sources.py)."""
        reader.warm_read_pool(tiers.options.io_concurrency)  # while the trainer starts: restore does not wait for it
        # On accelerators, the same for the ring, unless the restore prefetch holds every leaf (then the
        # ring would be faulted in, ~1 s per GiB on some hosts, for nothing).
        if host_ring.ring_expected(tiers.options.restore_reuse_host_buffers) and not prefetch.reads_every_leaf():
            host_ring.warm_host_ring(tiers.options.restore_host_buffer_bytes)
        self._complete: dict[int, str] = {}
        """step -> the save the in-cluster tiers hold whole (of the last two-tier agreement)."""
        self._sources: dict[str, Any] | None = None
        """What the restored step's files came from, per source (a restore from the in-cluster tiers)."""

    # ------------------------------------------------------------------ which step

    def resolve_latest(self, target: Any, items: Iterable[str] | None) -> int | None:
        """The step `latest` means: with a persistent tier the newest one every process can read
        (a collective), else this process's newest committed one."""
        t = self._tiers
        if t.persistent is not None:
            named, unwrap = pytrees.as_target(target)
            candidates, _, _ = self.agree_two_tiers(None, named, [pytrees.STATE_ITEM] if unwrap else items)
            self.latest_from_env = candidates[0] if candidates else None
            return self.latest_from_env
        steps = t.steps() + t.persistent_steps()
        self.latest_from_env = max(steps) if steps else None
        return self.latest_from_env

    # ------------------------------------------------------------------ restore

    def restore(self, step: int | None, target: Mapping[str, Any] | None,
                items: Iterable[str] | None) -> dict[str, Any]:
        """Restore `items` of `step` (None: the newest good one) onto `target` (named items)."""
        t = self._tiers
        if t.persistent is not None:
            return self.two_tiers(step, target, items)
        if step is None or step == self.latest_from_env:
            return self.newest_good(target, items)
        t.protected_steps = (step,)
        step_path = t.local.step_path(step)
        view = commit.scan_steps(t.local.storage, t.local.root)
        committed = view.visible
        if step not in committed:
            if step in view.superseded:
                raise StepNotCommittedError(f"{step_path}: {timelines.describe_superseded(step, view.superseded[step])}; "
                                            f"committed steps: {committed}")
            if t.local.storage.exists(step_path):
                raise StepNotCommittedError(
                    f"{step_path}: step {step} is not committed (interrupted or fenced-out save); "
                    f"committed steps: {committed}")
            raise StepNotFoundError(f"{step_path}: step {step} does not exist; committed steps: {committed}")
        out = self._read(t.local, t.local.data_path(step), step, target, items)
        if step == self.asked_from_env and t.is_primary:
            timelines.record_rollback(t.local.storage, t.local.root, t.epoch, step, committed[-1])
        self._report(step, [], source="persistent")  # a pinned step reports like any other (status.history)
        return out

    def newest_good(self, target: Mapping[str, Any] | None, items: Iterable[str] | None) -> dict[str, Any]:
        """The newest committed step every process can read. A step that fails (a corrupt, truncated or
        missing file, bad metadata) on any process is marked bad (`<root>/_bad/<step>.json`, never
        deleted), reported, and the next older step is tried; all processes agree on each try."""
        t = self._tiers
        storage, root = t.local.storage, t.local.root
        candidates = sorted(t.steps(), reverse=True)
        if not candidates:
            raise StepNotFoundError(f"{root}: no committed checkpoint")
        self._count += 1
        skipped: list[dict[str, Any]] = []
        for step in candidates:
            t.protected_steps = (step,)
            out: dict[str, Any] | None = None
            error = "ok"
            try:
                out = self._read(t.local, t.local.data_path(step), step, target, items)
            except UNREADABLE_STEP_ERRORS as e:
                error = f"process {t.coord.process_index}: {type(e).__name__}: {e}"
            failures = sorted(v for v in t.exchange(f"{t.key}/restore/{self._count}/{step}", error) if v != "ok")
            if not failures:
                assert out is not None
                if t.is_primary:  # a fallback to an older step starts a branch (timelines.py)
                    timelines.record_rollback(storage, root, t.epoch, step, candidates[0])
                self._report(step, skipped, source="persistent")  # the one tier (restored_from's word)
                return out
            reason = "; ".join(failures)
            if t.is_primary:
                commit.mark_bad(storage, root, step, reason)
            log.warning("step %d in %s cannot be restored, marked bad (kept), trying an older step: %s",
                        step, root, reason)
            skipped.append({"step": step, "reason": reason})
        self._report(None, skipped)
        raise CorruptCheckpointError(
            f"{root}: no committed step can be restored: "
            + "; ".join(f"step {s['step']}: {s['reason']}" for s in skipped))

    def two_tiers(self, step: int | None, target: Mapping[str, Any] | None,
                  items: Iterable[str] | None) -> dict[str, Any]:
        """Local tier first, persistent tier behind it. Each process finds the local steps whose
        chunks its target shards need are all on this host; the processes agree on the newest step
        every one of them can read from its local tier or the persistent tier. Restoring the newest
        step (`step` None, or the one `resolve_latest` resolved "latest" to) falls back like
        `newest_good`: a process whose local copy cannot be read (a corrupt, truncated or missing
        file, bad metadata) marks it bad in its local tier (`<local>/_bad/<step>.json`, kept; its
        sidecar never uploads it) and reads the persistent tier's copy of the same step; a step no
        tier can serve on some process is skipped by all (the persistent copy marked bad) and the
        next older one tried. The report lists what was skipped, why, naming the file."""
        t = self._tiers
        assert t.persistent is not None
        fallback = step is None or step == self.latest_from_env
        agreed, local_ok, persistent = self.agree_two_tiers(None if fallback else step, target, items)
        candidates = restore_choice.steps_to_try(agreed, step, fallback)
        if not candidates:
            raise StepNotFoundError(f"{t.local.root} and {t.persistent.root}: no committed checkpoint "
                                    "that every process can read")
        self._count += 1
        skipped: list[dict[str, Any]] = []
        own_local = set(t.steps())
        for cand in candidates:
            t.protected_steps = (cand,)
            # An older persistent step this host also holds (left out of the agreement, which looks at
            # local steps from the newest persistent one up): read locally when it covers this process.
            has_local = cand in local_ok or (cand in own_local and cand in persistent and cand not in self._local_misses
                                             and self._local_covers(cand, target, items) is None)
            from_peer = not has_local and self._fetch_from_peers(cand, target, items)
            self._sources = None
            if not has_local and not from_peer and cand in self._complete:  # any mesh: chunks from the hosts
                out, source, errors = self._read_from_cluster(cand, cand in persistent, target, items)
                if out is None and cand in persistent:
                    out, source, more = self._read_either_tier(cand, False, True, target, items, fallback)
                    errors = {**more, "local": errors["local"]}
            else:
                out, source, errors = self._read_either_tier(cand, has_local or from_peer, cand in persistent,
                                                             target, items, mark_persistent=fallback)
            if from_peer and source == "local":
                source = "peer"
            views = [json.loads(v) for v in t.exchange(f"{t.key}/restore2/{self._count}/{cand}",
                                                        json.dumps({**errors, "source": source}))]
            outcome = restore_choice.judge_try(views)
            if t.coord.process_index == 0 and outcome.bad_persistent and fallback:
                commit.mark_bad(t.persistent.storage, t.persistent.root, cand, "; ".join(outcome.bad_persistent))
            if outcome.recovered:  # a local copy could not be read; the persistent tier's was
                skipped.append({"step": cand, "tier": "local",
                                "reason": "; ".join(outcome.recovered) + " (read from the persistent tier instead)"})
            if not outcome.failed:
                assert out is not None
                # Local steps after the restored one belong to a timeline this generation abandons; it
                # may save the same step numbers into the same folders: withdraw them first.
                withdraw_local_steps_after(t, cand)
                if t.coord.process_index == 0 and (fallback or step == self.asked_from_env):
                    # Before any process saves on: the old timeline above `cand` is superseded.
                    timelines.record_rollback(t.persistent.storage, t.persistent.root, t.epoch, cand,
                                              max([cand, *agreed, *persistent]))
                self.restored_from = source
                self._report(cand, skipped, [
                    {"step": m, "reason": why} for m, why in sorted(self._local_misses.items()) if m >= cand],
                    source=restore_choice.farthest_source(v.get("source") for v in views))
                return out
            reason = "; ".join(sorted(outcome.failed))
            skipped.append({"step": cand, "tier": "all", "reason": reason})
            if not fallback:
                self._report(None, skipped)
                raise CorruptCheckpointError(f"step {cand} cannot be restored: {reason}")
            log.warning("step %d cannot be restored from either tier, trying an older step: %s", cand, reason)
        self._report(None, skipped)
        raise CorruptCheckpointError(
            f"{t.local.root} and {t.persistent.root}: no committed step can be restored: "
            + "; ".join(f"step {s['step']}: {s['reason']}" for s in skipped if s["tier"] == "all"))

    def agree_two_tiers(self, step: int | None, target: Mapping[str, Any] | None,
                        items: Iterable[str] | None) -> tuple[list[int], list[int], list[int]]:
        """(the steps every process can read, newest first — with `step` given, just `step`; this
        process's local steps that cover its restore; the persistent tier's steps). Called on: all
        processes (a collective with several)."""
        t = self._tiers
        persistent = t.persistent_steps()
        local = restore_choice.local_candidates(t.steps(), persistent, step)
        misses = {s: self._local_covers(s, target, items) for s in local}
        local_ok = [s for s in local if misses[s] is None]
        self._local_misses = {s: why for s, why in misses.items() if why is not None}
        agreed_persistent = set(persistent)
        if t.coord.process_count > 1:
            # The persistent lists too: a sidecar's commit landing between two processes' listings
            # must not give them different candidates (every try below is a collective).
            key = f"{t.key}/restore-agree{t.next_ordinal()}"
            mine = own_holdings(t, local_ok, persistent[-1] if persistent else None)
            copies = [c.to_json() for c in node_copies(t, persistent[-1] if persistent else None)]
            t.coord.publish(f"{key}/{t.coord.process_index}",
                            json.dumps({"process": t.coord.process_index, "persistent": persistent,
                                        **mine.to_json(), "copies": copies}))
            t.coord.barrier(key, t.options.barrier_timeout_seconds)
            raw = [json.loads(v) for v in t.coord.fetch_dir(f"{key}/").values()]
            agreed_persistent = set.intersection(*(set(v["persistent"]) for v in raw)) if raw else set()
            # Which step every process can get, each from its own tier or a peer's (peers.py).
            plan = peers.decide_sources({int(v["process"]): peers.Holdings.from_json(v) for v in raw})
            self._peer_sources, agreed_local = restore_choice.decide_agreed_steps(
                plan, t.coord.process_index, t.peer_addresses)
            # Whatever the mesh: the steps whose chunks the reachable nodes hold between them.
            self._copies = {int(v["process"]): [chunk_sources.Copy.from_json(c) for c in v.get("copies", [])]
                            for v in raw if int(v["process"]) == t.coord.process_index
                            or int(v["process"]) in t.peer_addresses}
            self._complete = chunk_sources.complete_saves(self._copies)
            agreed_local |= set(self._complete)
        else:
            agreed_local = set(local_ok)
        if step is not None:
            return [step], local_ok, persistent
        return sorted(agreed_local | agreed_persistent, reverse=True), local_ok, persistent

    # ------------------------------------------------------------------ reads

    def _read(self, tier: Tier, path: str, step: int, target: Mapping[str, Any] | None,
              items: Iterable[str] | None, own_metadata: bool = True) -> dict[str, Any]:
        """`restore_step` with this manager's options; `own_metadata`: this process's metadata file
        (the local tier's per-process name), else the step's shared one."""
        t = self._tiers
        return restore_step(tier.storage, tier.backend, path, step, target, items, t.options.max_inflight_bytes,
                            t.coord.process_index,
                            layout.metadata_name(t.own_suffix) if own_metadata else layout.METADATA_FILE,
                            t.options.io_concurrency, prefetch.claim(tier.storage, path, step),
                            reuse_host_buffers=t.options.restore_reuse_host_buffers,
                            host_buffer_bytes=t.options.restore_host_buffer_bytes)

    def _read_either_tier(self, step: int, local_ok: bool, in_persistent: bool,
                          target: Mapping[str, Any] | None, items: Iterable[str] | None,
                          mark_persistent: bool) -> tuple[dict[str, Any] | None, str | None, dict[str, str | None]]:
        """(what this process read of `step`, from which tier, and {"local", "persistent", "error"}:
        why each tier failed, and why the step failed for this process; None where nothing failed)."""
        t = self._tiers
        assert t.persistent is not None
        pid = t.coord.process_index
        errors: dict[str, str | None] = {"local": None, "persistent": None, "error": None}
        if local_ok:  # this host holds what this process needs (same bytes as persistent)
            try:
                return self._read(t.local, t.local.step_path(step), step, target, items), "local", errors
            except UNREADABLE_STEP_ERRORS as e:
                reason = f"process {pid}: local tier: {type(e).__name__}: {e}"
                errors["local"] = reason
                commit.mark_bad(t.local.storage, t.local.root, step, reason)
                log.warning("step %d in this host's local tier %s cannot be read, marked bad (kept): %s",
                            step, t.local.root, reason)
        if in_persistent:
            try:
                out = self._read(t.persistent, t.persistent.data_path(step), step, target, items, own_metadata=False)
                return out, "persistent", errors
            except UNREADABLE_STEP_ERRORS as e:
                errors["persistent"] = f"process {pid}: persistent tier: {type(e).__name__}: {e}"
                errors["error"] = "; ".join(x for x in (errors["local"], errors["persistent"]) if x)
                if mark_persistent:
                    log.warning("step %d in the persistent tier %s cannot be read: %s", step,
                                t.persistent.root, errors["persistent"])
                return None, None, errors
        errors["error"] = errors["local"] or (
            f"process {pid}: step {step}: neither this host's local tier {t.local.root} holds what this process "
            f"needs nor is it committed in {t.persistent.root}")
        return None, None, errors

    def _read_from_cluster(self, step: int, in_persistent: bool, target: Mapping[str, Any] | None,
                           items: Iterable[str] | None) -> tuple[dict[str, Any] | None, str | None,
                                                                 dict[str, str | None]]:
        """Read `step` from the files this process's target needs, assembled from this node, the other
        hosts (through the sidecars, checksummed) and, for what no host holds, the persistent tier
        (chunk_fetch.py); like `_read_either_tier`'s answer, the in-cluster tiers as "local"."""
        t = self._tiers
        assert t.persistent is not None
        pid = t.coord.process_index
        errors: dict[str, str | None] = {"local": None, "persistent": None, "error": None}
        persistent = (t.persistent.storage, t.persistent.data_path(step)) if in_persistent else None
        folder = None
        try:
            folder, sources = chunk_fetch.assemble_step(
                t.local.root, self._copies, pid, t.options.generation, step, self._complete[step], target, items,
                t.peer_addresses, t.options.sidecar_address, t.options.sidecar_token_file, persistent)
            out = self._read(t.local, folder, step, target, items, own_metadata=False)
        except (*UNREADABLE_STEP_ERRORS, peer_client.PeerFetchError, OSError) as e:
            errors["local"] = f"process {pid}: in-cluster tiers: {type(e).__name__}: {e}"
            errors["error"] = None if in_persistent else errors["local"]
            log.warning("step %d cannot be read from the in-cluster tiers: %s", step, errors["local"])
            return None, None, errors
        finally:
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
        self._sources = sources
        source = ("persistent" if sources["persistent"]["files"] else "peer" if sources["peer"]["files"]
                  else "local")
        log.info("step %d read from the in-cluster tiers (%s): %s", step, source, sources)
        return out, source, errors

    def _local_covers(self, step: int, target: Mapping[str, Any] | None, items: Iterable[str] | None) -> str | None:
        """Why this host's local step lacks a chunk this process's restore would read (naming the
        file), or None when it has every one. A missing chunk is not proof of damage (after a change
        of mesh, another host holds it): the step is just not read locally. Unreadable metadata is:
        the step is marked bad (`<local>/_bad/<step>.json`, kept), so its sidecar never uploads it."""
        t = self._tiers
        try:
            return missing_chunk_file(t.local.storage, t.local.step_path(step), step,
                                      layout.metadata_name(t.own_suffix), target, items)
        except MetadataError as e:
            reason = f"process {t.coord.process_index}: local tier: {type(e).__name__}: {e}"
            commit.mark_bad(t.local.storage, t.local.root, step, reason)
            log.warning("step %d in this host's local tier cannot be read, marked bad (kept): %s", step, reason)
            return reason

    def _fetch_from_peers(self, step: int, target: Mapping[str, Any] | None, items: Iterable[str] | None) -> bool:
        """Have the sidecar copy this process's replica of `step` from the peers holding it into the
        local tier (checksums checked there; the next peer tried when one fails); whether the local
        tier then covers this process's restore."""
        t = self._tiers
        sources = self._peer_sources.get(step)
        if not sources or not t.options.sidecar_address:
            return False
        try:
            source = peer_client.request_fetch(t.options.sidecar_address, t.options.sidecar_token_file,
                                               t.coord.process_index, step, sources)
        except peer_client.PeerFetchError as e:
            log.warning("step %d: no peer replica of process %d could be fetched: %s", step,
                        t.coord.process_index, e)
            return False
        why = self._local_covers(step, target, items)
        if why is not None:
            log.warning("step %d fetched from peer %s does not cover this process's restore: %s", step, source, why)
            return False
        log.info("step %d of process %d fetched from peer %s", step, t.coord.process_index, source)
        return True

    def _report(self, step: int | None, skipped: list[dict[str, Any]],
                local_misses: list[dict[str, Any]] | None = None, source: str | None = None) -> None:
        """`report` (and restore.json): the step restored, the steps skipped, this generation, and where
        the processes read the step (`source`: the farthest tier any of them needed)."""
        self.report = {"step": step, "skipped": skipped, "generation": self._tiers.options.generation}
        if source is not None:
            self.report["source"] = source
        if step is not None and self._sources is not None:
            self.report["sources"] = self._sources
        if local_misses:
            self.report["local_misses"] = local_misses
        if self._tiers.options.control_dir:
            write_restore_report(self._tiers.options.control_dir, self.report)
