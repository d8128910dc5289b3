"""The alert rules and the dashboard of charts/resilax/files: promtool accepts the rules, every rule
and dashboard query names only metrics the operator, sidecar or trainer exports, and no query or rule
groups by `job`."""

from __future__ import annotations

import re
import subprocess

import yaml
from prometheus_tool import ALERTS, binary, dashboard_queries

EXPORTED = {
    # operator/resilax_operator/metrics.py
    "resilax_operator_recoveries_total", "resilax_operator_recovery_seconds_bucket", "resilax_operator_steps_lost_sum",
    "resilax_operator_steps_lost_count", "resilax_operator_checkpoint_age_seconds", "resilax_operator_generations_total",
    "resilax_operator_goodput_ratio", "resilax_operator_goodput_seconds",
    # sidecar/resilax_sidecar/metrics.py (and the trainer's figures it exports)
    "resilax_sidecar_upload_failures_total", "resilax_sidecar_lag_steps", "resilax_sidecar_http_unauthorized_total",
    "resilax_sidecar_newest_step", "resilax_trainer_step", "resilax_trainer_steps_per_second",
    "resilax_trainer_save_blocking_seconds_total", "resilax_trainer_last_save_blocking_seconds",
    "resilax_trainer_restore_seconds",
}


def test_promtool_accepts_the_rules() -> None:
    proc = subprocess.run([binary("promtool"), "check", "rules", str(ALERTS)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 7 rules found" in proc.stdout


def _names(expr: str) -> set[str]:
    return set(re.findall(r"\bresilax_[a-z_]+", expr))


def test_rules_and_panels_name_only_exported_metrics_and_never_group_by_job() -> None:
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    exprs = [r["expr"] for r in rules] + [q for _, q in dashboard_queries()]
    for expr in exprs:
        assert _names(expr) <= EXPORTED, (expr, _names(expr) - EXPORTED)
        assert not re.search(r"\bjob\b", expr), expr
    for rule in rules:
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
