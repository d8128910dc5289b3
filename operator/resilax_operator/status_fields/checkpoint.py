"""status.checkpoint (pure): the newest checkpoint the operator knows of, and the rollback whose branch
it is on; which of two sightings is the newer.

A rollback (a generation restoring a step older than the newest visible one: `checkpoint.restore.step`
edited on a running job, a job re-created with it, a fallback from a damaged step) starts a new branch
(resilax_ckpt.history.timelines): the old timeline's later steps are superseded, kept but never restored. The
sidecars say which rollback the step they report comes from (`branch` in `/v1/state` and in their last
words: the branch record of the newest epoch), so a step seen before a rollback is never taken for
newer than one seen after it, however the numbers compare:

| current (status)          | seen (a sidecar, its last words) | the newer                      |
|---------------------------|----------------------------------|--------------------------------|
| step 44, no branch        | step 8, branch (e1, g2, parent 8) | step 8: the rollback's branch   |
| step 12, branch (e1, g2)  | step 44, no branch (old words)    | step 12: 44 is superseded       |
| step 12, branch (e1, g2)  | step 16, branch (e1, g2)          | step 16                         |
| same branch, same step    | committed persistent vs local     | committed persistent            |

"No branch" ranks below every branch: a sidecar that names none read no branch record (the storage
had not rolled back when it listed). A final save's outcome names none either; final_save.py gives it
the current branch (the current generation's own step).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, order=True)
class CheckpointBranch:
    """The rollback a branch comes from: the epoch (era, generation) that restored step `parent`."""

    era: int
    generation: int
    parent: int


@dataclass(frozen=True)
class CheckpointInfo:
    """The newest checkpoint the operator knows of."""

    step: int
    time: datetime | None = None
    committed: bool = True
    tier: str = "persistent"
    #: The rollback whose branch the step is on (None: the storage never rolled back, or not said).
    branch: CheckpointBranch | None = None


def parse_branch(raw: Any) -> CheckpointBranch | None:
    """`{"era", "generation", "parent"}` (the sidecar's `branch`, status.checkpoint.branch), or None
    when absent or malformed."""
    if not isinstance(raw, Mapping):
        return None
    era, generation, parent = (raw.get(k) for k in ("era", "generation", "parent"))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (era, generation, parent)):
        return None
    return CheckpointBranch(int(era), int(generation), int(parent))  # type: ignore[arg-type]


def build_branch(branch: CheckpointBranch | None) -> dict[str, int] | None:
    if branch is None:
        return None
    return {"era": branch.era, "generation": branch.generation, "parent": branch.parent}


def _rank(branch: CheckpointBranch | None) -> tuple[int, int]:
    return (-1, -1) if branch is None else (branch.era, branch.generation)


def newer_checkpoint(current: CheckpointInfo | None, seen: CheckpointInfo | None) -> CheckpointInfo | None:
    """The newer of two checkpoints (the module's table): the newer rollback's branch first, then the
    higher step, then committed persistent over local."""
    if seen is None:
        return current
    if current is None:
        return seen
    if (_rank(seen.branch), seen.step, seen.committed, seen.tier == "persistent") > (
            _rank(current.branch), current.step, current.committed, current.tier == "persistent"):
        return seen
    return current
