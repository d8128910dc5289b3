"""Scale, in both senses: `kubectl scale` on a JAXJob, and the operator at fleet scale.

`kubectl scale jj/NAME --replicas N` writes spec.slices.count through the CRD's /scale subresource;
the API server checks the result against the elastic bounds (the CRD's CEL rules) and refuses a value
outside them, naming the bound. A shrink within the bounds, with its final save, is driven through
`kubectl scale` in test_op_e2e_faults.py (test_user_resize_saves_and_moves_to_the_new_shape).

The fleet: 20 JAXJobs x 4 hosts on 84 no-process nodes of a cluster of its own.

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
from op_cluster import Jobs, job_manifest, unique_name

ROOT = Path(__file__).resolve().parents[3]
JOBS, HOSTS, WINDOW = 20, 4, 30


@pytest.mark.cluster
def test_kubectl_scale_outside_the_elastic_bounds_is_refused_naming_the_bound(crds: None, jobs: Jobs,
                                                                               tmp_path: Path) -> None:
    """No operator and no workers: the API server alone refuses (the job is never touched)."""
    name = unique_name("scale")
    jobs.create(job_manifest(name, tmp_path / "ckpt", count=2, elastic={"minCount": 2, "maxCount": 3}))
    above, below = jobs.scale(name, 4), jobs.scale(name, 1)
    assert above.returncode != 0 and "slices.count 4 is above elastic.maxCount 3; allowed: 2..3" in above.stderr, \
        above.stderr
    assert below.returncode != 0 and "slices.count 1 is below elastic.minCount 2; allowed: 2..3" in below.stderr, \
        below.stderr
    assert jobs.get(name)["spec"]["slices"]["count"] == 2
    within = jobs.scale(name, 3)
    assert within.returncode == 0, within.stderr
    assert jobs.get(name)["spec"]["slices"]["count"] == 3


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
