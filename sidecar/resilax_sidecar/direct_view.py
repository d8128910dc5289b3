"""What a sidecar without an uploader tells of the persistent tier: its newest visible step.

Without a local tier the trainer saves straight into the persistent tier and no uploader lists it; the
sidecar's state (`newest_persisted_step` and the rollback its `branch` comes from, which the operator's
status.checkpoint, history, freshness annotation and steps at risk follow) comes from here. The step is the one a restore would
see newest, by the library's own rules (resilax_ckpt.history.visibility.newest_visible): a step on a timeline
a rollback abandoned, one a restore marked bad and one a replaced generation committed after a newer
one started are never reported (docs/checkpointing.md, "Timelines").
"""

from __future__ import annotations

from dataclasses import dataclass

from resilax_ckpt.history import timelines, visibility

from resilax_sidecar.store import BlobStore
from resilax_sidecar.uploader import IDLE_SCAN_SECONDS, SAVE_SETTLE_SECONDS, plan_direct_listing


class StoreReader:
    """A BlobStore read as the library's `ReadStorage` (resilax_ckpt.storage): paths are the store's
    keys, relative to its root ("" is the root)."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store

    def join(self, *parts: str) -> str:
        return "/".join(p.strip("/") for p in parts if p.strip("/"))

    def read_bytes(self, path: str) -> bytes:
        return self.store.read_bytes(path)

    def exists(self, path: str) -> bool:
        return self.store.stat(path) is not None

    def list_dir(self, path: str) -> list[str]:
        return self.store.list_dir(path)


@dataclass
class DirectView:
    """What the sidecar last listed of the persistent tier, and when it lists it again."""

    listed_at: float | None = None
    newest: int | None = None
    branch: dict[str, int] | None = None
    """The rollback `newest`'s branch comes from (resilax_ckpt.history.timelines.describe_branch), same listing."""
    saves: int | None = None
    """The trainer's save count at the last look."""
    looking_until: float = 0.0
    """Until then (monotonic), a save of the trainer's may be committing: listed once a poll."""

    def look(self, store: BlobStore, now: float, saves: int | None, stopping: bool, poll_seconds: float) -> int | None:
        """The newest visible committed step, listed as `uploader.plan_direct_listing` says (once a poll
        while the trainer's newest save may be committing or the sidecar is stopping, else once every
        IDLE_SCAN_SECONDS); between listings, the last one's answer. Blocks (storage I/O)."""
        if saves != self.saves:
            if self.saves is not None:  # a save since the last look: its commit comes within seconds
                self.looking_until = now + SAVE_SETTLE_SECONDS
            self.saves = saves
        since = None if self.listed_at is None else now - self.listed_at
        if not plan_direct_listing(since, stopping or now < self.looking_until, poll_seconds, IDLE_SCAN_SECONDS):
            return self.newest
        newest, branch = visibility.newest_visible_on_branch(StoreReader(store), "")
        if self.listed_at is not None and newest != self.newest:
            self.looking_until = 0.0  # the save's commit is seen
        self.listed_at, self.newest, self.branch = now, newest, timelines.describe_branch(branch)
        return newest
