"""Which committed steps readers see: the current branch, not marked bad, not fenced out.

A root's committed steps (a `_COMMIT` marker) sort into: visible (what `steps()` and restore see);
bad (a restore could not read them, `_bad/<step>.json`: kept, never deleted); superseded (on a
timeline a rollback abandoned, timelines.py: kept, never deleted); fenced out (committed by a
replaced generation after a newer one started, fencing.py: never seen by anyone, deleted at the next
start). JAX-free.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from resilax_ckpt import layout
from resilax_ckpt.history import fencing, timelines
from resilax_ckpt.storage import ReadStorage, Storage


def read_marker_epoch(storage: ReadStorage, step_path: str, marker: str = layout.COMMIT_FILE) -> fencing.Epoch:
    return fencing.parse_marker_epoch(storage.read_bytes(storage.join(step_path, marker)))


def list_committed(storage: Storage, root: str, marker: str = layout.COMMIT_FILE) -> list[int]:
    """Steps with a commit marker, ignoring fences."""
    steps = []
    for name in storage.list_dir(root):
        step = layout.parse_step(name)
        if step is not None and storage.exists(storage.join(root, name, marker)):
            steps.append(step)
    return sorted(steps)


def read_bad(storage: ReadStorage, root: str) -> dict[int, str]:
    """Steps marked bad (a restore found them corrupt): step to the reason."""
    out: dict[int, str] = {}
    folder = storage.join(root, layout.BAD_DIR)
    for name in storage.list_dir(folder):
        step = layout.parse_step(name[:-5]) if name.endswith(".json") else None
        if step is None:
            continue
        try:
            out[step] = str(json.loads(storage.read_bytes(storage.join(folder, name))).get("reason", ""))
        except (FileNotFoundError, ValueError, AttributeError):
            out[step] = "marked bad"
    return out


def mark_bad(storage: Storage, root: str, step: int, reason: str) -> None:
    """Record that `step` failed to restore; its files stay as they are (never deleted).
    Called on: primary only."""
    body = json.dumps({"step": step, "reason": reason[:2000], "time": time.time()}).encode()
    storage.write_bytes(storage.join(root, layout.BAD_DIR, layout.bad_name(step)), body)


def clear_bad(storage: Storage, root: str, step: int) -> None:
    """A new save of `step` committed: its old bad record no longer applies. Called on: primary only."""
    path = storage.join(root, layout.BAD_DIR, layout.bad_name(step))
    if storage.exists(path):
        storage.delete_tree(path)


@dataclass(frozen=True)
class StepsView:
    """The committed steps of a root, sorted into what readers see and what is hidden, and why."""

    visible: list[int]
    bad: dict[int, str] = field(default_factory=dict)
    """Marked bad (a restore could not read them): kept, never deleted."""
    superseded: dict[int, timelines.Branch] = field(default_factory=dict)
    """On a timeline a rollback abandoned (the branch that hides each): kept, never deleted."""
    fenced: list[int] = field(default_factory=list)
    """Committed by a replaced generation after a newer one started: never visible, deleted at start."""

    def kept(self, step: int) -> str | None:
        """Why a hidden copy of `step` must be kept when its number is committed again, or None."""
        return timelines.BAD if step in self.bad else timelines.SUPERSEDED if step in self.superseded else None


def scan_steps(storage: Storage, root: str, marker: str = layout.COMMIT_FILE, use_fences: bool = True) -> StepsView:
    """Sort the committed steps (module docstring; fencing.py, timelines.py). Only steps above the
    lowest fence's `latest_step` or the lowest branch's parent need their marker read."""
    bad = read_bad(storage, root)
    committed = list_committed(storage, root, marker)
    if not use_fences:
        return StepsView([s for s in committed if s not in bad], {s: r for s, r in bad.items() if s in committed})
    hiding = _Hiding.read(storage, root)
    view = StepsView([], {s: r for s, r in bad.items() if s in committed})
    for step in committed:
        hiding.place(view, storage, root, step, marker, bad)
    return view


def newest_visible(storage: ReadStorage, root: str, marker: str = layout.COMMIT_FILE) -> int | None:
    """The newest visible committed step (the last of `list_visible`), or None: the step folders are
    looked at newest first and the walk stops at the first visible one, so a reader that wants only
    the newest (the sidecar's state, the operator's status through it) reads a few markers, not all."""
    return newest_visible_on_branch(storage, root, marker)[0]


def newest_visible_on_branch(storage: ReadStorage, root: str, marker: str = layout.COMMIT_FILE
                             ) -> tuple[int | None, timelines.Branch | None]:
    """`newest_visible`, and the rollback its branch comes from (`timelines.newest_branch`; None: the
    root never rolled back), read in the same pass."""
    bad = read_bad(storage, root)
    hiding = _Hiding.read(storage, root)
    branch = timelines.newest_branch(hiding.branches)
    view = StepsView([])
    names = (layout.parse_step(n) for n in storage.list_dir(root))
    for step in sorted((s for s in names if s is not None), reverse=True):
        if storage.exists(storage.join(root, layout.step_name(step), marker)):
            hiding.place(view, storage, root, step, marker, bad)
            if view.visible:
                return view.visible[0], branch
    return None, branch


@dataclass(frozen=True)
class _Hiding:
    """The fences and branch records of a root, and the step at or below which neither hides anything."""

    fences: dict[fencing.Epoch, int | None]
    branches: list[timelines.Branch]
    floor: int | None

    @staticmethod
    def read(storage: ReadStorage, root: str) -> _Hiding:
        fences = fencing.read_fences(storage, root)
        branches = timelines.read_branches(storage, root)
        floors = [f for f in (fencing.min_fenceable_step(fences), timelines.min_branch_parent(branches))
                  if f is not None]
        return _Hiding(fences, branches, min(floors) if floors else None)

    def place(self, view: StepsView, storage: ReadStorage, root: str, step: int, marker: str,
              bad: dict[int, str]) -> None:
        """Add the committed `step` to the part of `view` it belongs to (read its marker's epoch only
        above the floor; a step deleted since the listing is left out)."""
        if self.floor is None or step <= self.floor:
            if step not in bad:
                view.visible.append(step)
            return
        try:
            epoch = read_marker_epoch(storage, storage.join(root, layout.step_name(step)), marker)
        except FileNotFoundError:
            return  # deleted since the listing (retention, a sidecar's): no longer committed
        branch = timelines.decide_superseded(step, epoch, self.branches)
        if branch is not None:  # also when bad: both hide it, both keep it
            view.superseded[step] = branch
        elif step in bad:
            return
        elif fencing.decide_visible(step, epoch, self.fences):
            view.visible.append(step)
        else:
            view.fenced.append(step)


def list_visible(storage: Storage, root: str, marker: str = layout.COMMIT_FILE,
                 use_fences: bool = True) -> list[int]:
    """Committed steps of the current branch that the fences leave visible and no bad record hides:
    what steps() and restore() see."""
    return scan_steps(storage, root, marker, use_fences).visible


def list_local_tier(storage: Storage, root: str, marker: str,
                    branches_at: tuple[Storage, str] | None) -> list[int]:
    """A local tier's committed steps (this process's `marker`) that a restore may read: not marked
    bad (`<local>/_bad/`) and, with the persistent tier `branches_at` (its storage and root) behind
    it, not on a timeline a rollback abandoned (its branch records: a host that missed the rollback).
    No fences: the local tier's are the persistent tier's and its steps are this generation's own
    or its predecessors', which the withdrawal at restore (tiers.py) handles."""
    bad = read_bad(storage, root)
    committed = [s for s in list_committed(storage, root, marker) if s not in bad]
    if branches_at is None:
        return committed
    return timelines.current_steps(
        committed, lambda s: read_marker_epoch(storage, storage.join(root, layout.step_name(s)), marker),
        timelines.read_branches(*branches_at))


def list_superseded(storage: Storage, root: str) -> list[int]:
    """The steps of abandoned timelines kept on storage: hidden in place, or kept aside after their
    number was saved again on the current branch (timelines.py)."""
    branches = timelines.read_branches(storage, root)
    kept = {k.step for k in timelines.read_kept(storage, root)
            if k.why == timelines.SUPERSEDED or timelines.decide_superseded(k.step, k.epoch, branches)}
    return sorted(set(scan_steps(storage, root).superseded) | kept)
