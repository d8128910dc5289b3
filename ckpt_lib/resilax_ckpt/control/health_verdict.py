"""`health.json` in the pod's control folder: the verdict of the pod's health check (`resilax
health-check`, trainer/health_check.py), for its sidecar (issue 39, docs/architecture.md, "Health-checked
starts"). JAX-free.

`{"passed": bool, "failed_part": str | None, "reason": str | None}`, written atomically once the check
ends, passed or not. The sidecar, SIGTERMed with the pod's whole grace the moment a failed check made
the pod terminal, reads it to know that no trainer will ever run there (no final save to wait for);
its `/v1/state` and last words carry it as `health_check`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from resilax_ckpt.control.trainer_control import read_json, write_json

HEALTH_FILE: Final = "health.json"
#: The most characters of the failure's reason kept in the file.
REASON_CAP: Final = 500


@dataclasses.dataclass(frozen=True)
class HealthVerdict:
    """What HEALTH_FILE says."""

    passed: bool
    failed_part: str | None = None
    """The part that failed (rendezvous, devices, matmul, collective), None when it passed."""
    reason: str | None = None
    """Why it failed, one line."""

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "failed_part": self.failed_part, "reason": self.reason}


def build_verdict(result: Mapping[str, Any]) -> HealthVerdict:
    """The verdict of the check's JSON result (`health_check.build_result`) (pure); the reason is cut
    to REASON_CAP characters."""
    reason = result.get("reason")
    part = result.get("failed_part")
    return HealthVerdict(bool(result.get("healthy")), str(part) if part is not None else None,
                         str(reason)[:REASON_CAP] if reason is not None else None)


def write_verdict(control_dir: str, verdict: HealthVerdict) -> None:
    """Write HEALTH_FILE atomically (temporary name, then rename). OSError when the folder is not writable."""
    write_json(control_dir, HEALTH_FILE, verdict.to_json())


def read_verdict(control_dir: str) -> HealthVerdict | None:
    """HEALTH_FILE in the pod's control folder, or None: no check ran in this pod (or it has not ended),
    or the file is not in the documented shape."""
    raw = read_json(control_dir, HEALTH_FILE)
    if raw is None or not isinstance(raw.get("passed"), bool):
        return None
    part, reason = raw.get("failed_part"), raw.get("reason")
    return HealthVerdict(raw["passed"], part if isinstance(part, str) else None,
                         reason if isinstance(reason, str) else None)
