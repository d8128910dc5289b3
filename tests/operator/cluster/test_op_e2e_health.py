"""Health-checked starts end to end (issue 39): real `resilax health-check` init containers, real JAX
workers (examples/train.py), the sidecars and the operator on the local cluster.

Job: 1 slice of tpu-v5-lite-podslice 2x4 (2 hosts of 4 fake CPU devices), `recovery.healthCheck`
enabled. Before it starts, node `tpu-slice-0-h1` gets the node agent's `unhealthy` fault (it stays
Ready; the containers it starts fail the check's matmul). Generation 1 goes on pool tpu-slice-0 (the
first that fits): process 1's check fails on its own part, process 0's collective fails without blame.
The operator must name the node (Event, condition, status.unhealthyNodes, the platform metric) and start
generation 2 on healthy nodes only: tpu-slice-0 has one healthy host left, so the other pool.
"""

from __future__ import annotations

from pathlib import Path

from op_cluster import Jobs, OperatorProcess, job_manifest, unique_name, worker_template
from resilax_local.cluster import LocalCluster
from resilax_local.testing import wait_for

BAD_NODE = "tpu-slice-0-h1"


def test_a_node_that_fails_its_check_gets_no_trainer_of_the_new_generation(
        operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster, tmp_path: Path) -> None:
    name = unique_name("health")
    cluster.make_node_unhealthy(BAD_NODE, "matmul")  # the cluster fixture restores it after the test
    # job_manifest's finalSave of 60 s: a kubelet stops a failed pod's sidecar with the pod's whole grace
    # the moment its check fails (restartPolicy Never: terminal), and the operator's 2 s delete does not
    # cut that short (kubelet v1.37, and the node agent alike). The check's health.json tells the sidecar
    # that no trainer ran, so it exits at once; before, generation 2 waited for it (64 s for this call
    # instead of 32, measured at e1f1259).
    manifest = job_manifest(name, tmp_path / "ckpt", count=1, steps=100000, step_seconds=0.2,
                            recovery={"healthCheck": {"enabled": True, "timeoutSeconds": 90}},
                            template=worker_template(steps=100000, step_seconds=0.2, devices=4))
    jobs.create(manifest)
    status = jobs.wait_status(name, lambda s: s.get("generation") == 2 and s.get("phase") == "Running", 900,
                              "generation 2 Running after the failed check")
    [entry] = status["unhealthyNodes"]
    assert entry["node"] == BAD_NODE and entry["part"] == "matmul" and entry["failures"] == 1, entry
    # the scheduler places either host of slice 0 on the bad node
    assert entry["generation"] == 1 and entry["pod"] in {f"{name}-g1-s0-h0", f"{name}-g1-s0-h1"}, entry
    assert "wrong checksum on local device 0" in entry["reason"], entry
    # Its sidecar, SIGTERMed with the pod's whole grace the moment the check failed, made no final save:
    # the check's health.json said no trainer would run (before, it waited out finalSave.timeoutSeconds).
    sidecar_logs = "\n".join(jobs.pod_logs(entry["pod"], "resilax-sidecar"))
    assert "SIGTERM: no final save: the health check failed (matmul: wrong checksum" in sidecar_logs, \
        sidecar_logs[-3000:]
    condition = next(c for c in status["conditions"] if c["type"] == "UnhealthyNodes")
    assert condition["status"] == "True" and condition["reason"] == "NodesKeptOut", condition
    assert BAD_NODE in condition["message"], condition
    assert "HealthCheckFailed" in jobs.event_reasons(name, "HealthCheckFailed")
    events = [e for e in jobs.events(name) if e.get("reason") == "HealthCheckFailed"]
    assert events and events[0]["type"] == "Warning", events
    assert str(events[0]["message"]).startswith(f"node {BAD_NODE} failed the health check of generation 1"), events
    assert status.get("failures", 0) == 0, status  # the node's fault, not the worker's
    assert status["pools"] == ["tpu-slice-1"], status  # tpu-slice-0 has one healthy host left
    nodes = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in jobs.pods(name, 2)}
    assert len(nodes) == 2 and BAD_NODE not in nodes.values(), nodes
    # the new generation's trainers run (their own checks passed on healthy nodes)
    wait_for(lambda: jobs.losses(name, 2), timeout=600, interval=1, message=f"{name}: a step of generation 2")
    metric = f'resilax_operator_node_health_check_failures_total{{node="{BAD_NODE}"}} 1.0'
    assert metric in operator.metrics(), operator.metrics()[-3000:]
