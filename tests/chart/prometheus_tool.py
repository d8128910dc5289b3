"""Prometheus and promtool for the metrics tests: Debian's `prometheus` package, installed by
scripts/setup-prometheus (which .ci/run calls); a missing binary fails the test, never skips it."""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "charts" / "resilax" / "files" / "alerts.yaml"
DASHBOARD = ROOT / "charts" / "resilax" / "files" / "dashboard.json"
#: `promtool test rules` files, one per alert group of ALERTS: `<group>.test.yaml`.
ALERT_TESTS = Path(__file__).resolve().parent / "alert_tests"


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


def dashboard_variables() -> list[tuple[str, str, str]]:
    """(name, series selector, label) of every `label_values(selector, label)` query variable of the
    dashboard, `$namespace` filled in with `.*`."""
    import json
    import re

    dash = json.loads(DASHBOARD.read_text())
    found = []
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
        assert m, f"dashboard variable {var['name']}: {query!r} is not label_values(selector, label)"
        found.append((var["name"], m.group(1).replace("$namespace", ".*"), m.group(2)))
    return found
