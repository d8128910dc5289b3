"""Timelines: the branches a job's history takes at a rollback, and the hidden steps Resilax keeps.

A rollback (a generation restores a step older than the newest visible one: a fallback from a damaged
step, or `RESILAX_RESTORE_STEP=<n>`) starts a new branch. From then on the old timeline's later
steps are hidden from this and every later generation of the job, kept on storage and listed as
superseded, never deleted by retention or cleanup, never restored:
1. During the restore, before the restored state is returned (so before any save of the new branch),
   the primary of epoch (E, G) writes `<root>/_branches/e<E>-g<G>-s<S>.json` =
   `{"era", "generation", "parent": S, "seen": L, "time"}` create-only, in the root where the fences
   live (the persistent tier behind a local tier). S is the restored step, L the newest step that was
   visible (for the report only).
2. A step committed at epoch e is superseded when a branch record of an epoch > e has a parent below
   the step (`decide_superseded`). Like a fence, the record orders by epoch, so a zombie of an older
   generation can never add a step to the current branch; unlike a fence-hidden step (a stale commit
   nobody ever saw, deleted at the next start), a superseded step was a real save: it is kept.
3. Readers (`steps()`, restore, the uploader's view of the persistent tier, each host's local tier)
   see only the current branch: committed, not bad, not fenced out, not superseded.
4. A step number saved again on the current branch while a hidden copy of it is kept (a superseded
   or bad step): the old copy is recorded first, create-only, in `<root>/_kept/<step>-<ns>.json`
   (`{"step", "why", "attempt" | "folder", "marker", "reason", "time"}`), then the new commit re-points
   the marker (object stores: the old attempt stays where it is) or moves the old folder aside to
   `.superseded-<step>-<ns>/` / `.bad-<step>-<ns>/` (local folders). Every deleter (retention, the
   start's cleanup, stale-attempt cleanup, the uploader) leaves the attempts the records name.
Crash safety: each record is written before the change it protects and is create-only; a crash after
the record and before the change leaves a record naming an attempt the marker still names, which only
keeps it. Nothing here is ever rewritten or deleted.

JAX-free (the sidecar's uploader imports it, like fencing.py and layout.py).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from resilax_ckpt import layout
from resilax_ckpt.history import fencing
from resilax_ckpt.storage import ReadStorage, Storage

#: Why a hidden step's copy is kept: it failed to restore, or it belongs to an abandoned timeline.
BAD = "bad"
SUPERSEDED = "superseded"


@dataclass(frozen=True)
class Branch:
    """A rollback: epoch `epoch` restored step `parent` while `seen` was the newest visible step."""

    epoch: fencing.Epoch
    parent: int
    seen: int | None = None


@dataclass(frozen=True)
class Kept:
    """A hidden step's copy kept after its number was saved again."""

    step: int
    why: str
    attempt: str | None
    folder: str | None
    epoch: fencing.Epoch


def branch_name(branch: Branch) -> str:
    era, generation = branch.epoch
    return f"e{era}-g{generation}-s{branch.parent}.json"


def build_branch(branch: Branch) -> bytes:
    era, generation = branch.epoch
    return json.dumps({"era": era, "generation": generation, "parent": branch.parent, "seen": branch.seen,
                       "time": time.time()}).encode()


def parse_branch(name: str, data: bytes) -> Branch | None:
    """A branch record, or None when `name` is not one or it is unreadable (pure)."""
    if not name.endswith(".json"):
        return None
    try:
        raw = json.loads(data)
        seen = raw.get("seen")
        return Branch((int(raw["era"]), int(raw["generation"])), int(raw["parent"]),
                      None if seen is None else int(seen))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def decide_superseded(step: int, epoch: fencing.Epoch, branches: Iterable[Branch]) -> Branch | None:
    """The oldest branch that hides `step` committed at `epoch` (one of a newer epoch that rolled back
    below it), or None when the step is on the current branch (pure)."""
    hiding = [b for b in branches if b.epoch > epoch and b.parent < step]
    return min(hiding, key=lambda b: b.epoch) if hiding else None


def min_branch_parent(branches: Iterable[Branch]) -> int | None:
    """Steps above this may be superseded and need their marker's epoch read; None: no branches."""
    return min((b.parent for b in branches), default=None)


def newest_branch(branches: Iterable[Branch]) -> Branch | None:
    """The rollback the current branch comes from: the branch record of the newest epoch, or None when
    the root never rolled back (pure). Readers that report a newest step report it with this, so that
    a step seen before a rollback is never taken for newer than one seen after it."""
    return max(branches, key=lambda b: b.epoch, default=None)


def describe_branch(branch: Branch | None) -> dict[str, int] | None:
    """`newest_branch` as the sidecar's state and last words say it: {"era", "generation", "parent"}."""
    if branch is None:
        return None
    era, generation = branch.epoch
    return {"era": era, "generation": generation, "parent": branch.parent}


def decide_branch(restored: int, newest_visible: int | None, epoch: fencing.Epoch) -> Branch | None:
    """The branch record a restore of `restored` needs, or None when it restores the newest visible
    step (nothing to hide) (pure)."""
    if newest_visible is None or restored >= newest_visible:
        return None
    return Branch(fencing.epoch_of(epoch), restored, newest_visible)


def current_steps(steps: Iterable[int], epoch_of: Callable[[int], fencing.Epoch],
                  branches: Iterable[Branch]) -> list[int]:
    """The `steps` that are on the current branch; `epoch_of(step)` reads a step's marker epoch, only
    for steps above the lowest branch parent (a local tier's steps: the persistent tier's branches
    apply to them too)."""
    branches = list(branches)
    floor = min_branch_parent(branches)
    return [s for s in steps if floor is None or s <= floor or decide_superseded(s, epoch_of(s), branches) is None]


def describe_superseded(step: int, branch: Branch) -> str:
    """Why `step` is hidden, for an error message (pure)."""
    era, generation = branch.epoch
    return (f"step {step} is superseded: era {era} generation {generation} rolled back to step {branch.parent}, "
            "which abandoned the timeline it belongs to (kept on storage, listed by superseded_steps(), never "
            "restored)")


def record_rollback(storage: Storage, root: str, epoch: fencing.Epoch, restored: int,
                    newest_visible: int | None) -> Branch | None:
    """Write the branch record a restore of `restored` needs (`decide_branch`), if any. Called on: the
    primary (process 0), after every process read the step, before the restore returns."""
    branch = decide_branch(restored, newest_visible, epoch)
    if branch is not None:
        write_branch(storage, root, branch)
    return branch


def build_kept(step: int, why: str, marker: bytes, *, attempt: str | None = None, folder: str | None = None,
               reason: str = "") -> bytes:
    try:
        old = json.loads(marker)
    except ValueError:
        old = None
    return json.dumps({"step": step, "why": why, "attempt": attempt, "folder": folder,
                       "marker": old if isinstance(old, dict) else None, "reason": reason[:2000],
                       "time": time.time()}).encode()


def parse_kept(name: str, data: bytes) -> Kept | None:
    """A kept record, or None when `name` is not one or it is unreadable (pure)."""
    if not name.endswith(".json"):
        return None
    try:
        raw = json.loads(data)
        attempt, folder = raw.get("attempt"), raw.get("folder")
        marker = raw.get("marker") or {}
        epoch = (int(marker.get("era", 0)), int(marker.get("generation", -1)))
        return Kept(int(raw["step"]), str(raw.get("why", "")),
                    attempt if isinstance(attempt, str) and layout.is_attempt_name(attempt) else None,
                    folder if isinstance(folder, str) else None, epoch)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def kept_name(step: int) -> str:
    return f"{layout.step_name(step)}-{time.time_ns()}.json"


def kept_attempts(kept: Iterable[Kept], step: int) -> set[str]:
    """The attempt names under `<root>/<step>/` that kept records protect (pure)."""
    return {k.attempt for k in kept if k.step == step and k.attempt}


# ---------------------------------------------------------------- records on a library Storage


def read_branches(storage: ReadStorage, root: str) -> list[Branch]:
    folder = storage.join(root, layout.BRANCHES_DIR)
    out = []
    for name in storage.list_dir(folder):
        with contextlib.suppress(FileNotFoundError):
            branch = parse_branch(name, storage.read_bytes(storage.join(folder, name)))
            if branch is not None:
                out.append(branch)
    return out


def write_branch(storage: Storage, root: str, branch: Branch) -> None:
    """Record a rollback, create-only (a second write of the same record keeps the first).
    Called on: the primary of the generation that restores, before the restore returns."""
    with contextlib.suppress(FileExistsError):
        storage.write_bytes(storage.join(root, layout.BRANCHES_DIR, branch_name(branch)), build_branch(branch),
                            create_only=True)


def read_kept(storage: Storage, root: str) -> list[Kept]:
    folder = storage.join(root, layout.KEPT_DIR)
    out = []
    for name in storage.list_dir(folder):
        with contextlib.suppress(FileNotFoundError):
            kept = parse_kept(name, storage.read_bytes(storage.join(folder, name)))
            if kept is not None:
                out.append(kept)
    return out


def write_kept(storage: Storage, root: str, step: int, why: str, marker: bytes, *, attempt: str | None = None,
               folder: str | None = None, reason: str = "") -> None:
    """Record a hidden step's copy before its number is committed again (create-only).
    Called on: the committer (primary), before it re-points the marker or moves the folder aside."""
    storage.write_bytes(storage.join(root, layout.KEPT_DIR, kept_name(step)),
                        build_kept(step, why, marker, attempt=attempt, folder=folder, reason=reason),
                        create_only=True)
