"""Fencing: a worker of an old generation — of this job or of any earlier job on the same storage —
never commits once a newer one exists.

Workers are ordered by their epoch `(era, generation)`. The generation is the JAXJob's
`status.generation` (it restarts at 1 for a new JAXJob object); the era orders the JAXJob objects
that used this storage, so a job deleted and re-applied (a new uid) outranks every generation of the
old one:
0. The era of a job uid is claimed in storage, create-only: `<root>/_fences/era-<E>.json` =
   `{"job_uid": U}`, E = one more than the highest claimed era (`claim_era`; idempotent for a uid, and
   safe when several processes or jobs race). Without a job uid (tests, a job run by hand) the era
   is 0, which is also the era of fences written before eras existed.
1. At start, the primary of epoch (E, G) writes `<root>/_fences/<fence_name>` =
   `{"era": E, "generation": G, "latest_step": L}` with L the newest step it sees committed.
2. Right before committing (rename or marker), the committer reads the fences and refuses
   (FencedError) when one has a higher epoch.
3. A step committed at epoch e is visible only if no fence of an epoch > e has `latest_step` < that
   step. This closes the race between check 2 and the commit: an old generation that passed the
   check just before the new fence appeared commits a step readers ignore (and the new generation's
   primary cleans up).

JAX-free: the sidecar imports this module for the same rule.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

from resilax_ckpt import layout
from resilax_ckpt.errors import FencedError
from resilax_ckpt.storage import Storage

#: (era, generation): what orders the sets of workers that ever wrote to one storage.
Epoch = tuple[int, int]
Fences = Mapping[Epoch, int | None]


def epoch_of(value: int | Epoch) -> Epoch:
    """An epoch; a bare generation is one of era 0."""
    return (0, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def parse_marker_epoch(data: bytes) -> Epoch:
    """The epoch of a commit marker's body (`{"generation": G, "era": E}`; no era: 0). An unreadable
    marker (e.g. an empty one) counts as oldest (pure)."""
    try:
        raw = json.loads(data)
        return int(raw.get("era", 0)), int(raw["generation"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return (-1, -1)


def fence_name(epoch: Epoch) -> str:
    """`<generation>.json` in era 0 (the names fences had before eras), else `e<era>-g<generation>.json`."""
    era, generation = epoch
    return f"{generation}.json" if era == 0 else f"e{era}-g{generation}.json"


def parse_fence(name: str, data: bytes) -> tuple[Epoch, int | None] | None:
    """(epoch, latest_step) of a fence record, or None if it is not one or unreadable (pure)."""
    if not name.endswith(".json") or name.startswith("era-"):
        return None
    try:
        raw = json.loads(data)
        latest = raw.get("latest_step")
        return (int(raw.get("era", 0)), int(raw["generation"])), (None if latest is None else int(latest))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # half-written by a crashed primary: its generation is gone anyway


def claim_era(storage: Storage, root: str, job_uid: str | None) -> int:
    """The era of `job_uid` on this storage, claimed on first use (see the module docstring).
    Called on: any process that writes a fence or a commit marker; idempotent."""
    if not job_uid:
        return 0
    folder = storage.join(root, layout.FENCES_DIR)
    claimed: dict[int, str | None] = {}
    for name in storage.list_dir(folder):
        era = _parse_era_name(name)
        if era is not None:
            claimed[era] = _claim_owner(storage, storage.join(folder, name))
            if claimed[era] == job_uid:
                return era
    era = max(claimed, default=0) + 1
    body = json.dumps({"job_uid": job_uid, "time": time.time()}).encode()
    while True:
        path = storage.join(folder, f"era-{era}.json")
        try:
            storage.write_bytes(path, body, create_only=True)
            return era
        except FileExistsError:
            if _claim_owner(storage, path) == job_uid:
                return era  # another process of this job claimed it first
            era += 1


def _parse_era_name(name: str) -> int | None:
    if name.startswith("era-") and name.endswith(".json") and name[4:-5].isdigit():
        return int(name[4:-5])
    return None


def _claim_owner(storage: Storage, path: str) -> str | None:
    try:
        return str(json.loads(storage.read_bytes(path)).get("job_uid"))
    except (FileNotFoundError, ValueError, AttributeError):
        return None


def write_fence(storage: Storage, root: str, generation: int | Epoch, latest_step: int | None) -> None:
    """Record that `generation` (an epoch, or a generation of era 0) started when `latest_step` was
    the newest committed step. Called on: primary only, at manager start."""
    era, gen = epoch_of(generation)
    data = json.dumps({"era": era, "generation": gen, "latest_step": latest_step, "time": time.time()})
    storage.write_bytes(storage.join(root, layout.FENCES_DIR, fence_name((era, gen))), data.encode())


def read_fences(storage: Storage, root: str) -> dict[Epoch, int | None]:
    """All fences: epoch to the latest step it saw (None: none)."""
    fences: dict[Epoch, int | None] = {}
    folder = storage.join(root, layout.FENCES_DIR)
    for name in storage.list_dir(folder):
        if not name.endswith(".json") or name.startswith("era-"):
            continue
        try:
            data = storage.read_bytes(storage.join(folder, name))
        except FileNotFoundError:
            continue
        parsed = parse_fence(name, data)
        if parsed is not None:
            fences[parsed[0]] = parsed[1]
    return fences


def _normalized(fences: Mapping[int, int | None] | Fences) -> dict[Epoch, int | None]:
    return {epoch_of(k): v for k, v in fences.items()}


def check_not_fenced(fences: Mapping[int, int | None] | Fences, generation: int | Epoch, where: str) -> None:
    own = epoch_of(generation)
    newer = sorted(e for e in _normalized(fences) if e > own)
    if newer:
        shown = ", ".join(f"era {e} generation {g}" if e else f"generation {g}" for e, g in newer)
        mine = f"era {own[0]} generation {own[1]}" if own[0] else f"generation {own[1]}"
        raise FencedError(
            f"{where}: {mine} may not commit; a newer "
            f"set of workers exists ({shown}) — this worker belongs to a replaced generation or job"
        )


def decide_visible(step: int, step_generation: int | Epoch, fences: Mapping[int, int | None] | Fences) -> bool:
    """Whether a step committed at `step_generation` is visible under the fences (pure)."""
    own = epoch_of(step_generation)
    for epoch, latest in _normalized(fences).items():
        if epoch > own and (latest is None or step > latest):
            return False
    return True


def min_fenceable_step(fences: Mapping[int, int | None] | Fences) -> int | None:
    """Steps above this may be fenced out and need their generation checked; None: no fences."""
    if not fences:
        return None
    return min(-1 if latest is None else latest for latest in fences.values())
