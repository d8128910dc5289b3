"""status.recoveryNotice (pure): the last "still recovering" Event the operator emitted for the current
wait (policies/recovery_wait.py decides when), parsed from and rendered to the status subresource. It is
the operator's memory of that Event: one per change of what the generation waits for, else one per
`REPEAT_SECONDS` (policies/recovery_wait.py), also across operator restarts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True)
class RecoveryNotice:
    """The last `RecoveryWaiting` Event of the current wait."""

    #: The generation it was about.
    generation: int
    #: What the generation waited for, in short (the Ready condition's reason): a change emits again.
    waiting_for: str
    #: When it was emitted.
    time: datetime


def parse_recovery_notice(raw: Any) -> RecoveryNotice | None:
    """status.recoveryNotice → RecoveryNotice (None when absent or unreadable)."""
    if not isinstance(raw, Mapping) or not raw.get("time"):
        return None
    try:
        when = datetime.fromisoformat(str(raw["time"]).replace("Z", "+00:00"))
        return RecoveryNotice(int(raw.get("generation") or 0), str(raw.get("waitingFor") or ""),
                              when if when.tzinfo else when.replace(tzinfo=UTC))
    except (TypeError, ValueError):
        return None


def build_recovery_notice(notice: RecoveryNotice | None) -> dict[str, Any] | None:
    """RecoveryNotice → status.recoveryNotice (None: a merge patch removes the member)."""
    if notice is None:
        return None
    return {"generation": notice.generation, "waitingFor": notice.waiting_for,
            "time": notice.time.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
