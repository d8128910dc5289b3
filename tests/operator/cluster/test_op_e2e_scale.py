"""The operator at fleet scale, lean: 20 JAXJobs x 4 hosts on 84 no-process nodes of a cluster of its own.

The scale benchmark's own harness (bench/resilax_bench/scale.py, `--variants after`) at CI size: one
operator process under the chart's RBAC, all jobs Running, a steady window in which the API server's
audit log counts the operator's own requests, one host killed. Asserted (no timings): every job runs,
only the jobs on the killed host move to a new generation while the others keep theirs, and the
operator's requests besides its watches stay within 1 per job per minute over the window (30 s, so
the bound is jobs x 30 / 60; the requests a steady operator makes are periodic or none, so half a
minute's count is half a minute's worth).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
JOBS, HOSTS, WINDOW = 20, 4, 30


@pytest.mark.cluster
def test_twenty_jobs_run_one_node_loss_moves_only_its_job_and_steady_requests_stay_bounded(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "bench"), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(
        [sys.executable, "-m", "resilax_bench.scale", "--jobs", str(JOBS), "--hosts", str(HOSTS),
         "--variants", "after", "--settle-seconds", "5", "--steady-seconds", str(WINDOW),
         "--lease-seconds", "5", "--node-monitor-grace-seconds", "16", "--running-timeout-seconds", "240",
         "--timeout-seconds", "300", "--run-dir", str(tmp_path / "run"), "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = json.loads(out.read_text())["variants"]["after"]
    assert run["running_jobs"] == JOBS and run["all_running_seconds"] is not None, proc.stderr[-3000:]

    loss = run["node_loss"]
    victim = loss["victim_job"]
    assert loss["jobs_on_node"] == [victim]  # one worker per node; jobs never share a slice
    assert loss["unknown_to_new_generation_seconds"] is not None, loss
    assert loss["moved_jobs"] == [victim], loss
    assert loss["generations_after"][victim] == loss["generations_before"][victim] + 1
    others = {j: g for j, g in loss["generations_after"].items() if j != victim}
    assert others == {j: g for j, g in loss["generations_before"].items() if j != victim}
    assert len(others) == JOBS - 1

    steady = run["steady"]
    bound = JOBS * steady["window_seconds"] / 60
    assert steady["requests"] <= bound, (
        f"{steady['requests']} requests besides watches in {steady['window_seconds']} s (bound {bound:.0f}): "
        f"{steady['by_verb']}")
    assert steady["reconciles"] >= JOBS, steady  # the operator was at work in the window, not stalled
