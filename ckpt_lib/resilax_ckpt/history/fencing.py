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
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from resilax_ckpt import layout
from resilax_ckpt.errors import FencedError, StorageInUseError
from resilax_ckpt.storage import ReadStorage, Storage

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


@dataclass(frozen=True)
class EraClaim:
    """`<root>/_fences/era-<era>.json`: which JAXJob claimed an era of this storage."""

    era: int
    job_uid: str | None
    job: str | None = None
    """`<namespace>/<name>` of the JAXJob, when the claim recorded it."""

    def describe(self) -> str:
        return f"JAXJob {self.job} (uid {self.job_uid})" if self.job else f"the job with uid {self.job_uid}"


@dataclass(frozen=True)
class ClaimDecision:
    """What a job does at start with the era claims of its storage (`decide_claim`)."""

    era: int | None
    """The era to use (claimed already, or to claim now); None when refused."""
    holder: EraClaim | None = None
    """Refused: the live job of another uid that holds the storage."""
    taken_over: bool = False
    """Refused, and this job had claimed the storage before the holder took it over."""


def decide_claim(claims: Iterable[EraClaim], job_uid: str, live_uids: Collection[str], take_over: bool) -> ClaimDecision:
    """Which era a job of `job_uid` works in, or that it must not (pure). The newest claim holds the
    storage. A job that holds it keeps its era. The newest claim being another job's that is live
    (`live_uids`: the other non-finished JAXJobs the operator knows with the same storage) refuses this
    one unless `take_over`: its commits would fence the live job out, and their retentions would delete
    each other's steps. Otherwise a job that claimed before keeps its older era (a job replaced on this
    storage stays fenced out), and a new one, or one taking over, claims the era above the newest."""
    claims = sorted(claims, key=lambda c: c.era)
    if not claims:
        return ClaimDecision(1)
    top = claims[-1]
    own = max((c.era for c in claims if c.job_uid == job_uid), default=None)
    if own == top.era:
        return ClaimDecision(own)
    if top.job_uid in live_uids and not take_over:
        return ClaimDecision(None, top, taken_over=own is not None)
    if own is not None and not take_over:
        return ClaimDecision(own)
    return ClaimDecision(top.era + 1)


def claim_era(storage: Storage, root: str, job_uid: str | None, *, job: str | None = None,
              live_uids: Collection[str] = (), take_over: bool = False) -> int:
    """The era of `job_uid` on this storage, claimed on first use (see the module docstring and
    `decide_claim`); raises StorageInUseError when a live job of another uid holds the storage and
    `take_over` is false. Called on: any process that writes a fence or a commit marker; idempotent."""
    if not job_uid:
        return 0
    folder = storage.join(root, layout.FENCES_DIR)
    claims = read_claims(storage, root)
    decision = decide_claim(claims, job_uid, live_uids, take_over)
    if decision.era is None:
        assert decision.holder is not None
        raise _in_use(root, decision.holder, decision.taken_over)
    era = decision.era
    if any(c.era == era and c.job_uid == job_uid for c in claims):
        return era
    body = json.dumps({"job_uid": job_uid, "job": job, "time": time.time()}).encode()
    while True:
        path = storage.join(folder, f"era-{era}.json")
        try:
            storage.write_bytes(path, body, create_only=True)
            return era
        except FileExistsError:
            other = _read_claim(storage, folder, f"era-{era}.json")
            if other is None or other.job_uid == job_uid:
                return era  # another process of this job claimed it first
            if other.job_uid in live_uids and not take_over:
                raise _in_use(root, other, False) from None  # a live job claimed it just before us
            era += 1


def read_claims(storage: Storage, root: str) -> list[EraClaim]:
    """Every era claim of the storage (`<root>/_fences/era-<E>.json`)."""
    folder = storage.join(root, layout.FENCES_DIR)
    return [c for c in (_read_claim(storage, folder, name) for name in storage.list_dir(folder)) if c is not None]


def _in_use(root: str, holder: EraClaim, taken_over: bool) -> StorageInUseError:
    if taken_over:
        what = (f"{root}: the checkpoint storage was taken over by {holder.describe()} (era {holder.era}), a live "
                "job: this job can no longer commit there")
    else:
        what = (f"{root}: the checkpoint storage is in use by {holder.describe()} (era {holder.era}), a live job; "
                "this job does not take it over (its commits would fence that job out and their retentions would "
                "delete each other's steps)")
    return StorageInUseError(f"{what}; give this job a storage of its own, or set spec.checkpoint.takeOver: "
                             "true to take the storage over", holder.job_uid, holder.job, taken_over)


def _read_claim(storage: Storage, folder: str, name: str) -> EraClaim | None:
    era = _parse_era_name(name)
    if era is None:
        return None
    try:
        raw = json.loads(storage.read_bytes(storage.join(folder, name)))
        job = raw.get("job")
        return EraClaim(era, str(raw.get("job_uid")), str(job) if job else None)
    except (FileNotFoundError, ValueError, AttributeError):
        return EraClaim(era, None)


def _parse_era_name(name: str) -> int | None:
    if name.startswith("era-") and name.endswith(".json") and name[4:-5].isdigit():
        return int(name[4:-5])
    return None


def write_fence(storage: Storage, root: str, generation: int | Epoch, latest_step: int | None) -> None:
    """Record that `generation` (an epoch, or a generation of era 0) started when `latest_step` was
    the newest committed step. Called on: primary only, at manager start."""
    era, gen = epoch_of(generation)
    data = json.dumps({"era": era, "generation": gen, "latest_step": latest_step, "time": time.time()})
    storage.write_bytes(storage.join(root, layout.FENCES_DIR, fence_name((era, gen))), data.encode())


def read_fences(storage: ReadStorage, root: str) -> dict[Epoch, int | None]:
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
