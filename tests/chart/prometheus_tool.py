"""Prometheus and promtool for the metrics tests: Debian's `prometheus` package, installed by
scripts/setup-prometheus (which .ci/run calls); a missing binary fails the test, never skips it."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "charts" / "resilax" / "files" / "alerts.yaml"
DASHBOARD = ROOT / "charts" / "resilax" / "files" / "dashboard.json"


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"{name} is not installed: run scripts/setup-prometheus (Debian's prometheus package)")
    return path


def dashboard_queries(namespace: str = ".*", jaxjob: str = ".*") -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel of the dashboard, its variables filled in."""
    import json

    dash = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"].replace("$namespace", namespace).replace("$jaxjob", jaxjob))
            for panel in dash["panels"] for target in panel["targets"]]
