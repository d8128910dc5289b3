"""Where one manager's steps live: the tier it saves to, the persistent tier behind a local tier, the
state its saver and restorer share, the start-up (fences, leftovers, peers), and the local tier's
rules (clean at start, withdraw a rolled-back timeline).

A `Tier` is one storage root and its chunk backend; `Tiers` holds the one or two of a manager with
what both halves of the manager need (options, coordinator, keys, epoch, the protected step).
Called on: all processes (`open_tiers` and `exchange_peers` in the constructor's order).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading

from resilax_ckpt import commit, layout
from resilax_ckpt.chunks import backends
from resilax_ckpt.history import fencing, timelines
from resilax_ckpt.incluster import chunk_fetch, chunk_sources, peer_client, peers
from resilax_ckpt.multihost import Coordinator
from resilax_ckpt.options import ManagerOptions
from resilax_ckpt.storage import Storage, open_storage

log = logging.getLogger(__name__)

_manager_count = 0
_manager_count_lock = threading.Lock()


def next_manager_key(generation: int) -> str:
    """The coordination-service prefix of a new manager (the same on every process: managers are
    built in the same order everywhere)."""
    global _manager_count
    with _manager_count_lock:
        _manager_count += 1
        return f"resilax_ckpt/{generation}/{_manager_count}"


@dataclasses.dataclass(frozen=True)
class Tier:
    """One root a manager reads steps from: its storage and the chunk backend for it."""

    storage: Storage
    root: str
    backend: backends.ChunkBackend

    def step_path(self, step: int) -> str:
        return self.storage.join(self.root, layout.step_name(step))

    def data_path(self, step: int) -> str:
        """Where a committed step's files are (its attempt on object stores: commit.step_data_path)."""
        return commit.step_data_path(self.storage, self.root, step)


@dataclasses.dataclass
class Tiers:
    """The tiers of one manager and the state its saver and restorer share."""

    options: ManagerOptions
    coord: Coordinator
    key: str
    """The coordination-service prefix of this manager's exchanges."""
    local: Tier
    """Where saves go: the shared folder or gs:// root, or this host's local tier."""
    persistent: Tier | None
    """The persistent tier behind a local tier (restore falls back to it; only its fence is written)."""
    epoch: fencing.Epoch
    protected_steps: tuple[int, ...] = ()
    """The step the last restore read (or tried): retention never deletes it."""
    peer_addresses: dict[int, str] = dataclasses.field(default_factory=dict)
    """process -> its sidecar's address (exchanged at start when peer replicas are on)."""
    _ordinal: int = 0

    @property
    def local_tier(self) -> bool:
        return self.options.local_tier

    @property
    def is_primary(self) -> bool:
        """Writes the metadata and commits: process 0, or every process of a local tier."""
        return self.local_tier or self.coord.process_index == 0

    @property
    def own_suffix(self) -> int | None:
        """Local tier with several processes: per-process marker and metadata names, so several
        processes may share one host folder (docs/architecture.md, "Checkpoint layout")."""
        return self.coord.process_index if self.local_tier and self.coord.process_count > 1 else None

    @property
    def recycles(self) -> bool:
        """Retired steps are recycled: local shared folders committed by rename (not gs://, not the
        local tier, whose retention is the sidecar's)."""
        return self.local.storage.is_local and not self.local_tier

    def next_ordinal(self) -> int:
        """The next number of this manager's keyed exchanges (saves and restore agreements)."""
        self._ordinal += 1
        return self._ordinal

    @property
    def fence_tier(self) -> Tier:
        """Where the fences and branch records live: the persistent tier behind a local tier."""
        return self.persistent if self.persistent is not None else self.local

    def steps(self) -> list[int]:
        """Committed steps of the current branch (not fenced out, not superseded: timelines.py) of
        the tier saves go to, ascending."""
        storage, root = self.local.storage, self.local.root
        if not self.local_tier:
            return commit.list_visible(storage, root)
        # Without the steps a restore found unreadable and those of a timeline a rollback abandoned.
        return commit.list_local_tier(storage, root, layout.commit_name(self.own_suffix),
                                      None if self.persistent is None
                                      else (self.persistent.storage, self.persistent.root))

    def superseded_steps(self) -> list[int]:
        """The steps of timelines a rollback abandoned, kept on storage (timelines.py)."""
        return commit.list_superseded(self.fence_tier.storage, self.fence_tier.root)

    def persistent_steps(self) -> list[int]:
        """Committed steps of the persistent tier behind a local tier (empty without one)."""
        if self.persistent is None:
            return []
        return commit.list_visible(self.persistent.storage, self.persistent.root)

    def exchange(self, key: str, value: str) -> list[str]:
        """Every process's `value` under `key`. Called on: all processes (a collective)."""
        if self.coord.process_count == 1:
            return [value]
        self.coord.publish(f"{key}/{self.coord.process_index}", value)
        self.coord.barrier(key, self.options.barrier_timeout_seconds)
        return list(self.coord.fetch_dir(f"{key}/").values())


def open_tiers(directory: str, options: ManagerOptions, coord: Coordinator, key: str,
               persistent_directory: str | None) -> Tiers:
    """Open the tiers and prepare them for this generation: claim the era where the fences live,
    claim the root, clean what interrupted saves and losing attempts left, write the fences.
    Called on: all processes, at start."""
    root = directory.rstrip("/") or "/"
    storage = open_storage(root, fsync=options.fsync)
    persistent: Tier | None = None
    if persistent_directory and options.local_tier:
        proot = persistent_directory.rstrip("/")
        pstorage = open_storage(proot, fsync=options.fsync)
        persistent = Tier(pstorage, proot, backends.for_storage(pstorage, options))
    tiers = Tiers(options, coord, key, Tier(storage, root, backends.for_storage(storage, options)), persistent,
                  (0, options.generation))
    if storage.is_local:
        os.makedirs(root, exist_ok=True)
    # The epoch of this generation (fencing.py): the era is claimed where the fences live.
    if tiers.is_primary:
        fences = persistent if persistent is not None else tiers.local
        tiers.epoch = (fencing.claim_era(fences.storage, fences.root, options.job_uid, job=options.job_name,
                                         live_uids=options.live_job_uids, take_over=options.take_over),
                       options.generation)
    if tiers.is_primary and not tiers.local_tier:
        commit.claim_root(storage, root)
        commit.clean_leftovers(storage, root, options.generation)
        if tiers.recycles:
            commit.clean_recycled(root, options.recycle_pool)
        visible = commit.list_visible(storage, root)
        if not storage.is_local:
            commit.clean_stale_attempts(storage, root, visible)
        fencing.write_fence(storage, root, tiers.epoch, visible[-1] if visible else None)
    elif tiers.local_tier:
        clean_local_tier(storage, root)
    if persistent is not None and coord.process_index == 0:
        # The sidecars' uploads into the persistent tier are fenced by this generation's record.
        commit.claim_root(persistent.storage, persistent.root)
        visible = commit.list_visible(persistent.storage, persistent.root)
        # What stale or losing uploads left in committed steps (the sidecars' write-once attempts).
        commit.clean_stale_attempts(persistent.storage, persistent.root, visible)
        fencing.write_fence(persistent.storage, persistent.root, tiers.epoch, visible[-1] if visible else None)
    return tiers


def exchange_peers(tiers: Tiers) -> None:
    """The start barrier; with a local tier, a persistent tier, several processes and a sidecar,
    first every process's sidecar address, slice and node: for the sidecar's replicator
    (peers.json) and the restore's peer fetches (`tiers.peer_addresses`). Called on: all processes."""
    o, coord = tiers.options, tiers.coord
    info: str | None = None
    if tiers.persistent is not None and coord.process_count > 1 and o.sidecar_address:
        info = json.dumps({"process": coord.process_index, "slice": o.slice_id, "node": o.node_name,
                           "address": o.sidecar_address})
        coord.publish(f"{tiers.key}/peers/{coord.process_index}", info)
    coord.barrier(f"{tiers.key}/start", o.barrier_timeout_seconds)
    if info is None:
        return
    raw = [json.loads(v) for v in coord.fetch_dir(f"{tiers.key}/peers/").values()]
    hosts = sorted((peers.PeerHost(int(h["process"]), int(h["slice"]), str(h["node"]), str(h["address"]))
                    for h in raw), key=lambda h: h.process)
    tiers.peer_addresses = {h.process: h.address for h in hosts}
    if o.control_dir:
        peer_client.write_peers(o.control_dir, coord.process_index, hosts, o.generation)


# ---------------------------------------------------------------------------- local tier rules


def clean_local_tier(storage: Storage, root: str) -> None:
    """Delete temporary folders and step folders without any commit marker (interrupted saves).
    Called on: every process of the local tier, at start."""
    for name in storage.list_dir(root):
        path = storage.join(root, name)
        leftover = name.startswith((layout.TMP_PREFIX, layout.TRASH_PREFIX))
        names = storage.list_dir(path) if layout.parse_step(name) is not None else []
        uncommitted = (layout.parse_step(name) is not None and layout.owns_step_folder(names)
                       and not any(n == layout.COMMIT_FILE or n.startswith(layout.COMMIT_FILE + ".")
                                   for n in names))
        if leftover or uncommitted:
            storage.delete_tree(path)


def withdraw_local_steps_after(tiers: Tiers, step: int) -> None:
    """Withdraw this process's commit marker of every local step newer than `step`, marker
    first, then the step's folder if no other process's marker is left in it (a crash in
    between leaves an uncommitted folder, never a committed mix). Called on: every process of
    the local tier, at restore."""
    storage, root = tiers.local.storage, tiers.local.root
    marker = layout.commit_name(tiers.own_suffix)
    for old in tiers.steps():
        if old <= step:
            continue
        path = storage.join(root, layout.step_name(old))
        storage.delete_tree(storage.join(path, marker))
        storage.sync_dir(path)
        if not any(n == layout.COMMIT_FILE or n.startswith(layout.COMMIT_FILE + ".")
                   for n in storage.list_dir(path)):
            storage.delete_tree(path)
        log.info("withdrew local step %d (newer than the restored step %d) in %s", old, step, root)
    # Replicas held for peers of steps newer than `step` belong to the abandoned timeline too.
    if storage.is_local:
        for origin, got in peer_client.held_replicas(root).items():
            for old in got:
                if old > step:
                    storage.delete_tree(storage.join(
                        root, peers.PEER_DIR, peers.origin_dir_name(origin), layout.step_name(old)))


def own_holdings(tiers: Tiers, steps: list[int], newest_persistent: int | None) -> peers.Holdings:
    """This process's local steps `steps` and the peer replicas on this host (no older than the
    persistent tier's newest), with their save identities."""
    storage, root = tiers.local.storage, tiers.local.root

    def identity(step: int) -> str:
        path = storage.join(root, layout.step_name(step), layout.commit_name(tiers.own_suffix))
        try:
            return str(json.loads(storage.read_bytes(path)).get("save", ""))
        except (OSError, ValueError):
            return ""
    held = {} if not storage.is_local else peer_client.held_replicas(root)
    floor = -1 if newest_persistent is None else newest_persistent
    return peers.Holdings({s: identity(s) for s in steps},
                          {p: {s: v for s, v in got.items() if s >= floor} for p, got in held.items()})


def node_copies(tiers: Tiers, newest_persistent: int | None) -> list[chunk_sources.Copy]:
    """What this node holds for a restore from the in-cluster tiers (chunk_sources.py): the local
    steps any process committed here and the peer replicas, no older than the persistent tier's
    newest, on the current branch, not marked bad. Empty off a local folder."""
    storage, root = tiers.local.storage, tiers.local.root
    if not storage.is_local or not tiers.local_tier:
        return []
    bad = commit.read_bad(storage, root)
    markers: dict[int, str] = {}
    for name in storage.list_dir(root):
        step = layout.parse_step(name)
        if step is None or step in bad:
            continue
        found = sorted(n for n in storage.list_dir(storage.join(root, name))
                       if n == layout.COMMIT_FILE or n.startswith(layout.COMMIT_FILE + "."))
        if found:
            markers[step] = found[0]
    branches = timelines.read_branches(tiers.fence_tier.storage, tiers.fence_tier.root)
    current = timelines.current_steps(sorted(markers), lambda s: commit.read_marker_epoch(
        storage, storage.join(root, layout.step_name(s)), markers[s]), branches)
    replicas = {s for got in peer_client.held_replicas(root).values() for s in got}
    return chunk_fetch.scan_node(root, newest_persistent, set(current) | replicas)
