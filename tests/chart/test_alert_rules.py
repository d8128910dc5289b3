"""`promtool test rules` over the chart's alerts: a unit test file per alert group
(tests/chart/alert_tests/<group>.test.yaml) in which every alert fires under its condition, with its
labels and rendered annotations, and stays silent otherwise. promtool is Debian's (scripts/setup-prometheus),
found on PATH like prometheus; a missing one fails the test."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import ROOT
from prometheus_tool import ALERT_TESTS, ALERTS

GROUPS: list[dict[str, Any]] = yaml.safe_load(ALERTS.read_text())["groups"]


def _test_file(group: str) -> Path:
    return ALERT_TESTS / f"{group}.test.yaml"


@pytest.mark.parametrize("group", [g["name"] for g in GROUPS])
def test_promtool_unit_tests_of_each_alert_group_pass(group: str, promtool: str) -> None:
    path = _test_file(group)
    assert path.exists(), f"alert group {group!r} has no promtool unit tests ({path.name})"
    proc = subprocess.run([promtool, "test", "rules", path.name], capture_output=True, text=True,
                          timeout=120, cwd=path.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


@pytest.mark.parametrize("group", GROUPS, ids=lambda g: g["name"])
def test_every_alert_is_tested_firing_and_silent(group: dict[str, Any]) -> None:
    tests = yaml.safe_load(_test_file(group["name"]).read_text())
    assert [(ALERT_TESTS / f).resolve() for f in tests["rule_files"]] == [ALERTS.resolve()]
    cases = [case for test in tests["tests"] for case in test.get("alert_rule_test", [])]
    for rule in group["rules"]:
        name = rule["alert"]
        mine = [case for case in cases if case["alertname"] == name]
        assert any(case["exp_alerts"] for case in mine), f"{name}: no case in which it fires"
        assert any(not case["exp_alerts"] for case in mine), f"{name}: no case in which it stays silent"
        # A firing case names the rule's own labels (severity) and renders both annotations.
        for case in mine:
            for alert in case["exp_alerts"]:
                assert rule["labels"].items() <= alert["exp_labels"].items(), (name, alert)
                assert set(alert["exp_annotations"]) == set(rule["annotations"]), (name, alert)
    assert {case["alertname"] for case in cases} <= {r["alert"] for r in group["rules"]}


REPO_DOCS = "https://github.com/resilax/resilax/blob/main/"


@pytest.mark.parametrize("rule", [r for g in GROUPS for r in g["rules"]], ids=lambda r: r["alert"])
def test_every_alert_has_a_runbook_url_resolving_to_an_anchor_in_the_docs(rule: dict[str, Any]) -> None:
    """The runbook is the alert's row of the troubleshooting table (docs/operations.md, "Alerts: what to
    do"): the page exists in the repository and holds the anchor, and the row names the alert."""
    url = rule["annotations"].get("runbook_url", "")
    assert url.startswith(REPO_DOCS) and "#" in url, (rule["alert"], url)
    page, anchor = url.removeprefix(REPO_DOCS).split("#", 1)
    text = (ROOT / page).read_text()
    row = next((line for line in text.splitlines() if f'<a id="{anchor}"></a>' in line), None)
    assert row is not None, f"{rule['alert']}: no anchor {anchor!r} in {page}"
    assert row.startswith("| ") and f"`{rule['alert']}`" in row, row
