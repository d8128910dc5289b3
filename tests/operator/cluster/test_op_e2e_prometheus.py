"""A real Prometheus (Debian's package, scripts/setup-prometheus) scrapes the operator and the sidecars
of a running JAXJob on the local cluster, with the target labels the chart's ServiceMonitor and
PodMonitor give (honor_labels for the operator; jaxjob, namespace, pod, resilax_dev_* for sidecars).
The chart's alert rules load and evaluate, and every query of the chart's dashboard returns series."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from op_cluster import Jobs, OperatorProcess, job_manifest, unique_name, worker_template
from resilax_local.testing import wait_for
from resilax_operator import api
from resilax_operator.settings import OperatorSettings

ROOT = Path(__file__).resolve().parents[3]
ALERTS = ROOT / "charts" / "resilax" / "files" / "alerts.yaml"
DASHBOARD = ROOT / "charts" / "resilax" / "files" / "dashboard.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def _get(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return dict(json.load(r))


def test_prometheus_scrapes_operator_and_sidecars_rules_load_and_dashboard_queries_return_series(
        operator: OperatorProcess, jobs: Jobs, namespace: str, tmp_path: Path) -> None:
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus is not installed: run scripts/setup-prometheus (Debian's prometheus package)"
    name = unique_name("prom")
    template = worker_template(steps=100000, step_seconds=0.2)
    jobs.create(job_manifest(name, tmp_path / "ckpt", count=1, every_steps=5, template=template))
    jobs.wait_status(name, lambda s: s.get("phase") == "Running", 300, "generation 1 Running")
    pods = wait_for(lambda: [p for p in jobs.pods(name, 1) if (p.get("status") or {}).get("podIP")] or None,
                    timeout=120, message="worker pods with IPs")
    sidecar_port = OperatorSettings().sidecar_port
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {"job_name": "resilax-operator", "honor_labels": True,
             "static_configs": [{"targets": [f"127.0.0.1:{operator.metrics_port}"]}]},
            {"job_name": "resilax-sidecars", "static_configs": [
                {"targets": [f"{p['status']['podIP']}:{sidecar_port}"],
                 "labels": {"jaxjob": p["metadata"]["labels"][api.LABEL_JOB], "namespace": namespace,
                            "pod": p["metadata"]["name"],
                            "resilax_dev_generation": p["metadata"]["labels"][api.LABEL_GENERATION]}}
                for p in pods]},
        ],
    }
    config_file = tmp_path / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen([prometheus, f"--config.file={config_file}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        def ready() -> bool:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5).status == 200
            except OSError:
                return False

        wait_for(ready, timeout=60, message="prometheus ready")

        # The rules load: every one of alerts.yaml, healthy once evaluated.
        want = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}

        def rules_healthy() -> list[dict[str, Any]] | None:
            groups = _get(port, "/api/v1/rules")["data"]["groups"]
            rules = [r for g in groups for r in g["rules"]]
            ok = {r["name"] for r in rules if r.get("health") == "ok"}
            return rules if ok == want else None

        wait_for(rules_healthy, timeout=60, message=f"rules {sorted(want)} loaded and healthy")

        # Both kinds of targets are up.
        def targets_up() -> bool:
            active = _get(port, "/api/v1/targets")["data"]["activeTargets"]
            return len(active) == 1 + len(pods) and all(t["health"] == "up" for t in active)

        wait_for(targets_up, timeout=60, message="operator and sidecar targets up")

        # Every dashboard query returns series (the trainer has saved and the operator seen a checkpoint).
        dash = json.loads(DASHBOARD.read_text())
        queries = [(panel["title"], t["expr"].replace("$namespace", namespace).replace("$jaxjob", name))
                   for panel in dash["panels"] for t in panel["targets"]]
        empty: list[str] = []

        def all_return_series() -> bool:
            empty[:] = [title for title, expr in queries if not _query(port, expr)]
            return not empty

        try:
            wait_for(all_return_series, timeout=120, interval=2, message="every dashboard query returns series")
        except TimeoutError as e:
            raise AssertionError(f"dashboard panels without series: {empty}") from e

        # The labels survive the scrape: the job's name as jaxjob, the job's namespace, no exported_*.
        steps = _query(port, "resilax_trainer_step")
        assert {s["metric"]["jaxjob"] for s in steps} == {name}
        assert {s["metric"]["pod"] for s in steps} == {p["metadata"]["name"] for p in pods}
        age = _query(port, "resilax_operator_checkpoint_age_seconds")
        assert [(s["metric"]["namespace"], s["metric"]["jaxjob"]) for s in age] == [(namespace, name)]
        assert not _query(port, '{__name__=~"resilax_.+", exported_job!=""}')
        assert not _query(port, '{__name__=~"resilax_.+", exported_namespace!=""}')
        assert float(_query(port, f'max(resilax_trainer_step{{jaxjob="{name}"}})')[0]["value"][1]) > 0
        # The build info of both components; the job's phase and generation; the step rate from the counter.
        assert {s["metric"]["component"] for s in _query(port, "resilax_build_info")} == {"operator", "sidecar"}
        phase = _query(port, f'resilax_operator_job_phase{{jaxjob="{name}"}} == 1')
        assert [(s["metric"]["namespace"], s["metric"]["phase"]) for s in phase] == [(namespace, "Running")]
        assert float(_query(port, f'resilax_operator_job_generation{{jaxjob="{name}"}}')[0]["value"][1]) == 1
        assert float(_query(port, f'max(rate(resilax_trainer_steps_total{{jaxjob="{name}"}}[1m]))')[0]["value"][1]) > 0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        if proc.returncode not in (0, -15):
            print((tmp_path / "prometheus.log").read_text()[-5000:])
