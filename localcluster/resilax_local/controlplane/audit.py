"""The API server's audit log of service-account requests (opt-in: `ControlPlaneSettings.audit_service_accounts`):
who asked what, when. The scale benchmark and its cluster test count the operator's own requests from it
(`apiserver_request_total` cannot tell one client from another).

The policy logs, at level Metadata (no bodies), every request of a ServiceAccount outside kube-system
(the controller manager's controllers act as kube-system accounts and are left out); nothing else.
`logs/audit.log` holds one JSON event per line: a plain request is one `ResponseComplete` event; a
watch is a `ResponseStarted` event when it opens and a `ResponseComplete` one when it ends.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

AUDIT_LOG = "audit.log"

POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
        {"level": "Metadata", "userGroups": ["system:serviceaccounts"]},
        {"level": "None"},
    ],
}


def service_account_user(namespace: str, name: str) -> str:
    """The user name a ServiceAccount's token authenticates as."""
    return f"system:serviceaccount:{namespace}:{name}"


@dataclass(frozen=True)
class RequestCount:
    """One user's requests received in a time window, watches apart."""

    requests: int
    """Requests other than watches that completed (any answer, errors included)."""
    watches_opened: int
    """Watches that started (each list-then-watch informer opens one per server timeout)."""
    by_verb: dict[str, int] = field(default_factory=dict)
    """`requests` per `verb resource` (e.g. `list nodes`, `patch jaxjobs/status`)."""

    def to_json(self) -> dict[str, Any]:
        return {"requests": self.requests, "watches_opened": self.watches_opened, "by_verb": self.by_verb}


def _received(event: dict[str, Any]) -> float:
    stamp = str(event.get("requestReceivedTimestamp") or event.get("stageTimestamp") or "")
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _what(event: dict[str, Any]) -> str:
    ref = event.get("objectRef") or {}
    resource = str(ref.get("resource") or event.get("requestURI") or "?")
    if ref.get("subresource"):
        resource += "/" + str(ref["subresource"])
    return f"{event.get('verb')} {resource}"


def count_requests(lines: Iterable[str], user: str, start: float, end: float) -> RequestCount:
    """Requests of `user` received in [start, end) (Unix seconds) among audit log lines."""
    requests = watches = 0
    by_verb: Counter[str] = Counter()
    for line in lines:
        if user not in line:  # cheap filter before parsing
            continue
        event = json.loads(line)
        if (event.get("user") or {}).get("username") != user or not start <= _received(event) < end:
            continue
        stage, verb = event.get("stage"), event.get("verb")
        if verb == "watch":
            watches += stage == "ResponseStarted"
        elif stage == "ResponseComplete":
            requests += 1
            by_verb[_what(event)] += 1
    return RequestCount(requests, watches, dict(sorted(by_verb.items())))


def read_request_count(log_dir: Path, user: str, start: float, end: float) -> RequestCount:
    """`count_requests` over `<log_dir>/audit.log` (the cluster's `logs/` folder)."""
    with (log_dir / AUDIT_LOG).open(errors="replace") as f:
        return count_requests(f, user, start, end)
