"""Pure choices of a restore: which steps each process offers, which steps all processes can get and
from where, and what one collective try of a step tells (restorer.py does the I/O and the exchanges).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def local_candidates(local_steps: Iterable[int], persistent_steps: Sequence[int], step: int | None) -> list[int]:
    """The local steps a process offers to the two-tier agreement: `step` alone when given, else
    those no older than the persistent tier's newest (older ones are read from the persistent tier,
    or locally when this host holds them: restorer.py)."""
    newest_persistent = persistent_steps[-1] if persistent_steps else None
    return [s for s in local_steps if (step is None or s == step)
            and (newest_persistent is None or s >= newest_persistent or s == step)]


def decide_prefetch_step(local_steps: Sequence[int], persistent_steps: Sequence[int],
                         asked: int | None) -> tuple[int, str] | None:
    """The step a restarting process reads ahead of its restore (prefetch.py), and from which tier
    ("local": where saves go; "persistent": the tier behind a local tier): the step the restore will
    try first as far as this process alone can tell. `asked`: the step RESILAX_RESTORE_STEP names
    (None: the newest). Local steps offered as `local_candidates` offers them, the newest of the
    two tiers, the local copy when both hold it (the restore reads its own tier first). The restore
    may still choose another (the processes' agreement, a copy that turns out unreadable): the
    prefetch is then unused, never restored from."""
    local = local_candidates(local_steps, persistent_steps, asked)
    persistent = [s for s in persistent_steps if asked is None or s == asked]
    newest_local = max(local, default=None)
    newest_persistent = max(persistent, default=None)
    if newest_local is not None and (newest_persistent is None or newest_local >= newest_persistent):
        return newest_local, "local"
    if newest_persistent is not None:
        return newest_persistent, "persistent"
    return None


def steps_to_try(agreed: Iterable[int], step: int | None, fallback: bool) -> list[int]:
    """The agreed steps a two-tier restore tries, newest first: with a fallback from `step` (the
    step `latest` resolved to), those no newer than it."""
    ordered = sorted(agreed, reverse=True)
    if fallback and step is not None:
        return [c for c in ordered if c <= step]
    return ordered


def decide_agreed_steps(plan: Mapping[int, Mapping[int, list[int]]], me: int,
                        peer_addresses: Mapping[int, str]) -> tuple[dict[int, list[str]], set[int]]:
    """From peers.decide_sources' `plan` (step -> process -> the processes holding its shards, empty
    for its own tier): (step -> the sidecars `me` fetches its replica from, when it has no own copy;
    the steps every process can get from its own tier or a peer whose sidecar address is known)."""
    sources = {s: [peer_addresses[q] for q in by[me] if q in peer_addresses]
               for s, by in plan.items() if by.get(me)}
    agreed = {s for s, by in plan.items()
              if all(not holders or any(q in peer_addresses for q in holders) for holders in by.values())}
    return sources, agreed


#: Where a process may read its restore from, nearest first (CheckpointManager.restored_from).
SOURCES = ("local", "peer", "persistent")


def farthest_source(sources: Iterable[str | None]) -> str | None:
    """The farthest tier any process read its restore from (persistent, else peer, else local): where
    the restore as a whole came from, for the restore report (None when no process names one)."""
    named = [SOURCES.index(s) for s in sources if s in SOURCES]
    return SOURCES[max(named)] if named else None


@dataclasses.dataclass(frozen=True)
class TryOutcome:
    """What the processes' views of one try of a step say (each view: {"local", "persistent",
    "error"}, why each tier failed on that process, None where nothing failed)."""

    failed: list[str]
    """The processes' reasons the step failed for them (empty: every process read it)."""
    recovered: list[str]
    """Local copies that could not be read while the persistent tier's copy could."""
    bad_persistent: list[str]
    """Why the persistent tier's copy failed, per process that tried it."""


def judge_try(views: Iterable[Mapping[str, Any]]) -> TryOutcome:
    views = list(views)
    return TryOutcome(failed=[v["error"] for v in views if v.get("error")],
                      recovered=sorted(v["local"] for v in views if v.get("local") and not v.get("error")),
                      bad_persistent=[v["persistent"] for v in views if v.get("persistent")])
