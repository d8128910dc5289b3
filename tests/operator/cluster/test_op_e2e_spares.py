"""Spare slices end to end (issue 39): real placeholder pods of a low PriorityClass, real JAX workers
(examples/train.py), the sidecars and the operator on the local cluster (2 pools of tpu-v5-lite-podslice
2x4: 2 hosts of 4 chips each).

Job: 1 slice of 2x4 with `recovery.spareSlices: 1`. Generation 1 goes on tpu-slice-0; the spare's two
placeholders hold tpu-slice-1 (the test's PriorityClass, value -10). A hard loss of one of generation 1's
nodes: generation 2 takes the spare's pool at once, at the spec's shape (no generation ever ran shrunk),
and trains on from the checkpoint. The new spare waits for capacity (one pool is short a node); when the
node returns it is placed there and ready. With a local tier (as the goodput bench runs it): the lost
slice's surviving pod, not kept, is told that process 1 is lost, and its sidecar's final upload ends
by itself within its grace, never waiting for process 1's marker (issue 39, goodput seed 1).
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

from op_cluster import Jobs, OperatorProcess, job_manifest, unique_name, worker_template
from resilax_local.cluster import LocalCluster
from resilax_local.errors import KubeAPIError
from resilax_local.kubeapi import KubeClient
from resilax_local.testing import wait_for

PRIORITY_CLASSES = "/apis/scheduling.k8s.io/v1/priorityclasses"


def _spares(jobs: Jobs, name: str) -> list[dict[str, Any]]:
    return [p for p in jobs.pods(name) if p["metadata"]["labels"].get("resilax.dev/role") == "spare"]


def _pool(node: str | None) -> str:
    return (node or "").rsplit("-h", 1)[0]  # tpu-slice-1-h0 -> tpu-slice-1 (profiles.build_tpu_slice)


def test_a_hard_loss_takes_the_spare_at_full_size_and_the_spare_is_replenished(
        operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster, kube: KubeClient, namespace: str,
        tmp_path: Path) -> None:
    klass = f"{namespace}-spare"[:63]
    kube.create(PRIORITY_CLASSES, {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                                   "metadata": {"name": klass}, "value": -10, "preemptionPolicy": "Never"})
    try:
        operator.settings_env["RESILAX_OPERATOR_SPARE_PRIORITY_CLASS"] = klass
        operator.restart()
        _flow(operator, jobs, cluster, tmp_path, klass)
    finally:
        with contextlib.suppress(KubeAPIError):
            kube.delete(f"{PRIORITY_CLASSES}/{klass}")


def _flow(operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster, tmp_path: Path, klass: str) -> None:
    name = unique_name("spares")
    manifest = job_manifest(name, tmp_path / "ckpt", count=1, every_steps=4, recovery={"spareSlices": 1},
                            template=worker_template(steps=100000, step_seconds=0.2, devices=4))
    manifest["spec"]["checkpoint"]["local"] = {}  # uploads from the local tier, as the goodput bench's job
    jobs.create(manifest)
    status = jobs.wait_status(name, lambda s: s.get("phase") == "Running" and (s.get("spares") or {}).get("ready") == 1,
                              600, "generation 1 Running with its spare ready")
    assert status["generation"] == 1 and status["pools"] == ["tpu-slice-0"], status
    assert status["spares"]["desired"] == 1 and status["spares"]["pools"] == ["tpu-slice-1"], status
    placeholders = _spares(jobs, name)
    assert sorted(p["metadata"]["name"] for p in placeholders) == [f"{name}-spare-s0-h0", f"{name}-spare-s0-h1"]
    for p in placeholders:
        assert _pool(p["spec"].get("nodeName")) == "tpu-slice-1" and p["status"]["phase"] == "Running", p["status"]
        assert p["spec"]["priorityClassName"] == klass and p["spec"]["priority"] == -10, p["spec"]
        assert p["spec"]["containers"][0]["resources"]["requests"]["google.com/tpu"] == "4"
    jobs.wait_status(name, lambda s: (s.get("checkpoint") or {}).get("step", 0) >= 4, 600, "a committed checkpoint")

    # A hard loss of one of generation 1's hosts: the next generation takes the spare's pool at once.
    victim = next(p["spec"]["nodeName"] for p in jobs.pods(name, 1) if p["metadata"]["name"] == f"{name}-g1-s0-h1")
    cluster.kill_node(victim)
    status = jobs.wait_status(name, lambda s: s.get("generation") == 2 and s.get("phase") == "Running", 600,
                              "generation 2 Running on the spare")
    assert status["shape"]["count"] == 1 and status["pools"] == ["tpu-slice-1"], status
    assert status["spares"]["takenTotal"] == 1 and status["spares"]["lastTaken"] == {
        "generation": 2, "pools": ["tpu-slice-1"]}, status
    # no generation ever ran below the spec's shape: 0 s shrunk
    assert [h["shape"]["count"] for h in status["history"]] == [1, 1], status["history"]
    assert "SpareTaken" in jobs.event_reasons(name, "SpareTaken")
    nodes = {p["spec"].get("nodeName") for p in jobs.pods(name, 2)}
    assert {_pool(n) for n in nodes} == {"tpu-slice-1"} and len(nodes) == 2, nodes
    wait_for(lambda: jobs.losses(name, 2), timeout=600, interval=1, message=f"{name}: a step of generation 2")
    assert min(jobs.losses(name, 2)) > 4  # it restored a checkpoint of generation 1, not from scratch
    # The lost slice's other pod went with the survivors' grace, its sidecar told that process 1 is lost
    # (told, or gone already): its final upload never waited for process 1's marker, which never comes,
    # until SIGKILL (goodput seed 1 of 2026-12-07: 5 s, and generation 2 waited for the pod to go).
    survivor = f"{name}-g1-s0-h0"
    assert re.search(rf"(told {survivor}|{survivor} not told) that processes \[1\] are lost", operator.logs()), \
        operator.logs()[-3000:]
    said = cluster.logs(jobs.namespace, survivor, "resilax-sidecar")
    assert "resilax sidecar exiting" in said and "not persisted within the grace period" not in said, said[-3000:]
    print("\n".join(f"  {survivor} sidecar: {line[:200]}" for line in said.splitlines()
                    if any(w in line for w in ("SIGTERM", "final save", "are lost", "waiting for the uploads"))))

    # The new spare waits: tpu-slice-0 is short a node, tpu-slice-1 has the workers.
    status = jobs.wait_status(name, lambda s: len(_spares(jobs, name)) == 2, 120, "the new placeholders")
    assert status["spares"]["ready"] == 0, status
    cluster.restore_node(victim)
    status = jobs.wait_status(name, lambda s: (s.get("spares") or {}).get("ready") == 1, 300,
                              "the spare replenished on the returned node")
    assert status["spares"]["pools"] == ["tpu-slice-0"] and status["generation"] == 2, status
    assert {_pool(p["spec"].get("nodeName")) for p in _spares(jobs, name)} == {"tpu-slice-0"}
    metric = f'resilax_operator_spare_slices{{jaxjob="{name}",namespace="{jobs.namespace}",state="ready"}} 1.0'
    assert metric in operator.metrics(), operator.metrics()[-3000:]


def test_a_lower_priority_job_serves_as_the_spare_and_resumes_with_no_step_lost(
        operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster, tmp_path: Path) -> None:
    """A (1 slice) runs on tpu-slice-0; B (1 slice, `resilax.dev/spare-for: A`) on tpu-slice-1. A hard loss
    of A's host leaves A nothing to plan on: B is suspended with its final save, A's generation 2 takes
    B's pool at full size, B is resumed and waits; when the node returns B runs again from its final
    save, no step lost."""
    high, low = unique_name("high"), unique_name("low")
    template = worker_template(steps=100000, step_seconds=0.2, devices=4)
    jobs.create(job_manifest(high, tmp_path / "high", count=1, template=template))
    jobs.wait_status(high, lambda s: s.get("phase") == "Running", 600, "A Running")
    spare = job_manifest(low, tmp_path / "low", count=1, template=template)
    spare["metadata"]["annotations"] = {"resilax.dev/spare-for": high}
    jobs.create(spare)
    status = jobs.wait_status(low, lambda s: s.get("phase") == "Running" and (s.get("checkpoint") or {}).get("step", 0) >= 4,
                              600, "B Running with a checkpoint")
    assert jobs.status(high)["pools"] == ["tpu-slice-0"] and status["pools"] == ["tpu-slice-1"], status
    jobs.wait_status(high, lambda s: (s.get("checkpoint") or {}).get("step", 0) >= 4, 600, "A's checkpoint")

    victim = next(p["spec"]["nodeName"] for p in jobs.pods(high, 1) if p["metadata"]["name"] == f"{high}-g1-s0-h1")
    cluster.kill_node(victim)
    status = jobs.wait_status(high, lambda s: s.get("generation") == 2 and s.get("phase") == "Running", 600,
                              "A's generation 2 Running on B's nodes")
    assert status["shape"]["count"] == 1 and status["pools"] == ["tpu-slice-1"], status
    assert [h["shape"]["count"] for h in status["history"]] == [1, 1], status["history"]
    assert {"SpareJobSuspended", "SpareJobResumed"} <= set(jobs.event_reasons(high, "SpareJobSuspended", "SpareJobResumed"))
    wait_for(lambda: jobs.losses(high, 2), timeout=600, interval=1, message=f"{high}: a step of generation 2")
    # B was suspended after its final save, then resumed: it waits for capacity of its own
    b = jobs.get(low)
    assert b["spec"]["suspend"] is False and "resilax.dev/suspended-for" not in b["metadata"].get("annotations", {}), b
    assert "Suspended" in jobs.event_reasons(low, "Suspended")
    assert not jobs.pods(low, 2)

    cluster.restore_node(victim)
    status = jobs.wait_status(low, lambda s: s.get("generation") == 2 and s.get("phase") == "Running", 600,
                              "B Running again on the returned capacity")
    assert status["pools"] == ["tpu-slice-0"], status
    wait_for(lambda: jobs.losses(low, 2), timeout=600, interval=1, message=f"{low}: a step of generation 2")
    reached, resumed = max(jobs.losses(low, 1)), min(jobs.losses(low, 2))
    assert resumed == reached + 1, (reached, resumed)  # from its final save: no step lost
