"""status.unhealthyNodes (pure): the nodes a job keeps out of its generations after a failed health
check (policies/health_check.py records them), parsed from and rendered to the status subresource."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any


@dataclass(frozen=True)
class UnhealthyNode:
    """A node kept out of the job's generations because it failed the health check."""

    node: str
    #: The part it failed (devices, matmul) and the check's reason.
    part: str
    reason: str
    #: How many of the job's health checks it failed (one per worker pod).
    failures: int
    last_failure_time: datetime
    #: The generation and worker pod of its last failure (a pod is counted once).
    generation: int
    pod: str


def parse_unhealthy_nodes(raw: Any) -> tuple[UnhealthyNode, ...]:
    """status.unhealthyNodes → UnhealthyNode by node name (unreadable entries skipped)."""
    out: list[UnhealthyNode] = []
    for e in raw if isinstance(raw, list) else ():
        try:
            when = datetime.fromisoformat(str(e.get("lastFailureTime")).replace("Z", "+00:00")) \
                if e.get("lastFailureTime") else datetime.fromtimestamp(0, UTC)
            out.append(UnhealthyNode(str(e["node"]), str(e.get("part") or ""), str(e.get("reason") or ""),
                                     int(e.get("failures") or 1), when if when.tzinfo else when.replace(tzinfo=UTC),
                                     int(e.get("generation") or 0), str(e.get("pod") or "")))
        except (KeyError, TypeError, ValueError, AttributeError):
            continue
    return tuple(sorted(out, key=lambda n: n.node))


def build_unhealthy_nodes(nodes: tuple[UnhealthyNode, ...]) -> list[dict[str, Any]] | None:
    """UnhealthyNode → status.unhealthyNodes (None for none: a merge patch removes the member)."""
    return [{"node": n.node, "part": n.part, "reason": n.reason, "failures": n.failures,
             "lastFailureTime": n.last_failure_time.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
             "generation": n.generation, "pod": n.pod} for n in nodes] or None
