"""Fencing: a worker of an old generation never commits once a newer generation exists.

1. At start, the primary of generation G writes `<root>/_fences/G.json` =
   `{"generation": G, "latest_step": L}` with L the newest step it sees committed.
2. Right before committing (rename or marker), the committer lists the fences and refuses
   (FencedError) when one has a higher generation.
3. A step committed by generation g is visible only if no fence of a generation > g has
   `latest_step` < that step. This closes the race between check 2 and the commit: an old
   generation that passed the check just before the new fence appeared commits a step readers
   ignore (and the new generation's primary deletes).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

from resilax_ckpt import layout
from resilax_ckpt.errors import FencedError
from resilax_ckpt.storage import Storage


def write_fence(storage: Storage, root: str, generation: int, latest_step: int | None) -> None:
    """Record that `generation` started when `latest_step` was the newest committed step.
    Called on: primary only, at manager start."""
    data = json.dumps({"generation": generation, "latest_step": latest_step, "time": time.time()})
    storage.write_bytes(storage.join(root, layout.FENCES_DIR, layout.fence_name(generation)), data.encode())


def read_fences(storage: Storage, root: str) -> dict[int, int | None]:
    """All fences: generation to the latest step it saw (None: none)."""
    fences: dict[int, int | None] = {}
    folder = storage.join(root, layout.FENCES_DIR)
    for name in storage.list_dir(folder):
        if not name.endswith(".json") or not name[:-5].isdigit():
            continue
        try:
            raw = json.loads(storage.read_bytes(storage.join(folder, name)))
            fences[int(raw["generation"])] = raw.get("latest_step")
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            continue  # half-written by a crashed primary: its generation is gone anyway
    return fences


def check_not_fenced(fences: Mapping[int, int | None], generation: int, where: str) -> None:
    newer = sorted(g for g in fences if g > generation)
    if newer:
        raise FencedError(
            f"{where}: generation {generation} may not commit; a newer generation exists "
            f"({', '.join(map(str, newer))}) — this worker belongs to a replaced set of workers"
        )


def decide_visible(step: int, step_generation: int, fences: Mapping[int, int | None]) -> bool:
    """Whether a committed step is visible under the fences (pure)."""
    for gen, latest in fences.items():
        if gen > step_generation and (latest is None or step > latest):
            return False
    return True


def min_fenceable_step(fences: Mapping[int, int | None]) -> int | None:
    """Steps above this may be fenced out and need their generation checked; None: no fences."""
    if not fences:
        return None
    return min(-1 if latest is None else latest for latest in fences.values())
