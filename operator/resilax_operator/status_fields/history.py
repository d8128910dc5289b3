"""status.history (pure): one entry per generation, oldest first, the newest `MAX_ENTRIES` kept; its types
and how they are read from and written to the status subresource (/work/history-schema.md is the agreed
shape; docs/jaxjob-reference.md documents each field).

What fills the entries is policies/history_status.py's: it derives them from the status transitions the
operator already writes (a generation started, a transition begun, an in-place restart, the job ended),
the goodput ledger and pod 0's reports, and only ever rides on a status write that happens anyway.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

#: Generations kept (older ones are dropped).
MAX_ENTRIES: Final = 50
#: Checkpoint steps kept per generation (the newest).
MAX_CHECKPOINTS: Final = 20
#: Characters kept of an end message.
MAX_MESSAGE: Final = 200
#: Where a generation's restore read from (restoredFrom).
RESTORE_SOURCES: Final = ("local", "peer", "persistent")


@dataclass(frozen=True)
class HistoryEntry:
    """One generation of the job (status.history[]). Times have whole seconds."""

    generation: int
    #: Its generationStartTime.
    start: datetime
    topology: str = ""
    count: int = 0
    hosts: int = 0
    pools: tuple[str, ...] = ()
    #: Started by an in-place restart of the survivors.
    in_place: bool = False
    #: When it ended (the transition or in-place restart began, the job ended); None while it runs.
    end: datetime | None = None
    #: The Event reason that ended it ("" while it runs).
    end_reason: str = ""
    end_message: str = ""
    #: The step it restored (None: a fresh start, or not reported yet).
    restored_step: int | None = None
    #: "local", "peer" or "persistent" ("" when unknown or fresh).
    restored_from: str = ""
    first_step: int | None = None
    last_step: int | None = None
    #: Steps it reached beyond the step the next generation restored (0 until that is known).
    lost_steps: int = 0
    #: Seconds of its goodput window by bucket (status.goodput.breakdown's keys), sorted by key.
    goodput: tuple[tuple[str, float], ...] = ()
    #: Steps seen committed while it was the current generation, the newest MAX_CHECKPOINTS.
    checkpoints: tuple[int, ...] = ()

    @property
    def open(self) -> bool:
        return self.end is None


def clip_message(message: str) -> str:
    """`message` cut to MAX_MESSAGE characters (with "..." where cut)."""
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE - 3] + "..."


def _time(raw: Any) -> datetime | None:
    if not raw:
        return None
    t = datetime.fromisoformat(str(raw).replace("Z", "+00:00"))
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _format(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _int(raw: Any) -> int | None:
    return None if raw is None else int(raw)


def parse_entry(raw: Mapping[str, Any]) -> HistoryEntry:
    """One status.history[] item -> HistoryEntry (KeyError, TypeError, ValueError when unreadable)."""
    shape = raw.get("shape") or {}
    start = _time(raw["start"])
    if start is None:
        raise ValueError("history entry without start")
    goodput = raw.get("goodput") or {}
    return HistoryEntry(
        generation=int(raw["generation"]), start=start, topology=str(shape.get("topology") or ""),
        count=int(shape.get("count") or 0), hosts=int(shape.get("hosts") or 0),
        pools=tuple(str(p) for p in raw.get("pools") or ()), in_place=bool(raw.get("inPlace", False)),
        end=_time(raw.get("end")), end_reason=str(raw.get("endReason") or ""),
        end_message=str(raw.get("endMessage") or ""), restored_step=_int(raw.get("restoredStep")),
        restored_from=str(raw.get("restoredFrom") or ""), first_step=_int(raw.get("firstStep")),
        last_step=_int(raw.get("lastStep")), lost_steps=int(raw.get("lostSteps") or 0),
        goodput=tuple(sorted((str(k), float(v)) for k, v in goodput.items())),
        checkpoints=tuple(int(s) for s in raw.get("checkpoints") or ()))


def parse_history(raw: Any) -> tuple[HistoryEntry, ...]:
    """status.history -> the entries, oldest first; () when absent or unreadable (the history starts
    again from the current generation rather than failing the job's reconcile)."""
    if not isinstance(raw, list):
        return ()
    try:
        return tuple(parse_entry(e) for e in raw if isinstance(e, Mapping))
    except (KeyError, TypeError, ValueError):
        return ()


def build_entry(e: HistoryEntry) -> dict[str, Any]:
    """HistoryEntry -> its status.history[] item. Absent fields are left out, not null (a list is
    written whole; a null inside it would not read back the same)."""
    out: dict[str, Any] = {
        "generation": e.generation, "start": _format(e.start),
        "shape": {"count": e.count, "topology": e.topology, "hosts": e.hosts},
        "pools": list(e.pools), "inPlace": e.in_place, "lostSteps": e.lost_steps,
        "goodput": dict(e.goodput),
    }
    optional: dict[str, Any] = {
        "end": None if e.end is None else _format(e.end), "endReason": e.end_reason or None,
        "endMessage": e.end_message or None, "restoredStep": e.restored_step,
        "restoredFrom": e.restored_from or None, "firstStep": e.first_step, "lastStep": e.last_step,
        "checkpoints": list(e.checkpoints) or None,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    return out


def build_history(entries: tuple[HistoryEntry, ...]) -> list[dict[str, Any]]:
    return [build_entry(e) for e in entries[-MAX_ENTRIES:]]
