"""The alert rules and the dashboard of charts/resilax/files: promtool accepts the rules, every rule
and dashboard query names only metrics the operator, sidecar or trainer exports, no query or rule
groups by `job`, and the dashboard's variables list the jobs from the operator's series alone (no
sidecar monitor) as well as from the sidecars' alone."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from prometheus_tool import ALERTS, dashboard_queries, dashboard_variables

EXPORTED = {
    # operator/resilax_operator/metrics.py
    "resilax_operator_recoveries_total", "resilax_operator_recovery_seconds_bucket", "resilax_operator_steps_lost_sum",
    "resilax_operator_steps_lost_count", "resilax_operator_checkpoint_age_seconds", "resilax_operator_generations_total",
    "resilax_operator_goodput_ratio", "resilax_operator_goodput_seconds", "resilax_operator_job_phase",
    "resilax_operator_job_generation", "resilax_operator_job_invalid_spec", "resilax_build_info",
    # sidecar/resilax_sidecar/metrics.py (and the trainer's figures it exports)
    "resilax_sidecar_upload_failures_total", "resilax_sidecar_lag_steps", "resilax_sidecar_http_unauthorized_total",
    "resilax_sidecar_newest_step", "resilax_trainer_step", "resilax_trainer_steps_total",
    "resilax_trainer_save_blocking_seconds_total", "resilax_trainer_last_save_blocking_seconds",
    "resilax_trainer_restore_seconds",
}


def test_promtool_accepts_the_rules(promtool: str) -> None:
    proc = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 11 rules found" in proc.stdout


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


# What each side exports for one job: the operator's per-job series (labels from honorLabels) and a
# sidecar's (labels from the PodMonitor).
OPERATOR_SERIES = ['resilax_operator_job_generation{namespace="team-a", jaxjob="llama"}',
                   'resilax_operator_job_phase{namespace="team-a", jaxjob="llama", phase="Running"}',
                   'resilax_operator_checkpoint_age_seconds{namespace="team-a", jaxjob="llama"}']
SIDECAR_SERIES = ['resilax_trainer_step{namespace="team-a", jaxjob="llama", pod="llama-g1-0"}',
                  'resilax_sidecar_lag_steps{namespace="team-a", jaxjob="llama", pod="llama-g1-0"}']


def test_dashboard_variables_list_the_job_without_the_sidecar_monitor(tmp_path: Path, promtool: str) -> None:
    """Each `label_values(selector, label)` variable, as `group by (label) (selector)`, evaluated by
    promtool over the series of the operator alone, then of the sidecars alone: both list the job."""
    variables = dashboard_variables()
    assert {name for name, _, _ in variables} == {"namespace", "jaxjob"}
    expected = {"namespace": '{namespace="team-a"}', "jaxjob": '{jaxjob="llama"}'}
    tests = [{
        "name": f"only the {side} is scraped",
        "interval": "1m",
        "input_series": [{"series": s, "values": "1x10"} for s in series],
        "promql_expr_test": [{"expr": f"group by ({label}) ({selector})", "eval_time": "5m",
                              "exp_samples": [{"labels": expected[name], "value": 1}]}
                             for name, selector, label in variables],
    } for side, series in (("operator", OPERATOR_SERIES), ("sidecar", SIDECAR_SERIES))]
    path = tmp_path / "dashboard-variables.test.yaml"
    path.write_text(yaml.safe_dump({"tests": tests}))
    proc = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
