"""Happy path end to end: JAXJob → generation 1 Running → training steps → all exit 0 → Succeeded, which
`kubectl wait --for=condition=Completed` (the real kubectl, started before the job ends) sees;
spec.ttlSecondsAfterFinished then deletes the JAXJob, which removes pods, Services and the token
Secret; the checkpoints stay."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from op_cluster import Jobs, OperatorProcess, committed_steps, job_manifest, unique_name
from resilax_local.cluster import LocalCluster
from resilax_local.kubeapi import KubeClient
from resilax_local.node.profiles import NODEPOOL_LABEL, build_profile
from resilax_local.testing import wait_for


def test_job_runs_to_success_and_deletion_cleans_up(operator: OperatorProcess, jobs: Jobs, kube: KubeClient,
                                                   cluster: LocalCluster, namespace: str, tmp_path: Path) -> None:
    name = unique_name("happy")
    storage = tmp_path / "ckpt"
    jobs.create(job_manifest(name, storage, count=2, steps=8, step_seconds=0.2, every_steps=4))
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed (the test runs `kubectl wait` against the local cluster)"
    # The group-qualified name: Kubeflow's JAXJob (kubeflow.org) may be installed beside ours.
    waiter = subprocess.Popen([kubectl, "--kubeconfig", str(cluster.kubeconfig), "-n", namespace, "wait",
                               "--for=condition=Completed", f"jaxjobs.resilax.dev/{name}", "--timeout=600s"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    running = jobs.wait_status(name, lambda s: s.get("phase") in ("Running", "Succeeded"), 300,
                               "generation 1 Running")
    assert running["generation"] == 1
    assert running["shape"] == {"topology": "2x4", "count": 2, "hosts": 4}
    pods = jobs.pods(name, 1)
    assert sorted(p["metadata"]["name"] for p in pods) == sorted(
        f"{name}-g1-s{s}-h{h}" for s in range(2) for h in range(2))
    # One worker per node, each slice on its own pool.
    assert len({p["spec"]["nodeName"] for p in pods}) == 4

    try:
        out, _ = waiter.communicate(timeout=600)
    finally:
        waiter.kill()
    assert waiter.returncode == 0 and "condition met" in out, out
    done = jobs.wait_status(name, lambda s: s.get("phase") in ("Succeeded", "Failed"), 300, "Succeeded")
    assert done["phase"] == "Succeeded", done
    completed = next(c for c in done["conditions"] if c["type"] == "Completed")
    assert completed["status"] == "True" and completed["reason"] == "Completed", completed
    losses = jobs.losses(name, 1)
    assert sorted(losses) == list(range(1, 9))
    assert all(r["devices"] == 8 for r in losses.values())  # 4 processes x 2 fake devices
    assert committed_steps(storage) == [4, 8]
    reasons = jobs.event_reasons(name, "WorkersRunning", "Completed")
    assert "WorkersRunning" in reasons and "Completed" in reasons
    assert_freshness_published(jobs, name, done)

    # ttlSecondsAfterFinished (mutable, as on a Job) set on the finished job: the operator deletes it,
    # and what it owns goes with it
    jobs.patch_spec(name, {"ttlSecondsAfterFinished": 1})
    wait_for(lambda: not jobs.pods(name), timeout=120, message="worker pods gone")
    wait_for(lambda: not kube.get(f"/api/v1/namespaces/{namespace}/services",
                                  labelSelector=f"resilax.dev/job={name}")["items"], timeout=120,
             message="services gone")
    wait_for(lambda: not [s for s in kube.get(f"/api/v1/namespaces/{namespace}/secrets")["items"]
                          if s["metadata"]["name"].startswith(name)], timeout=120, message="token secret gone")

    def job_gone() -> bool:
        try:
            jobs.get(name)
        except Exception:
            return True
        return False

    wait_for(job_gone, timeout=60, message="JAXJob gone (finalizer removed)")
    assert "TTLExpired" in jobs.event_reasons(name, "TTLExpired")
    assert committed_steps(storage) == [4, 8]  # checkpoints stay


def assert_freshness_published(jobs: Jobs, name: str, status: dict[str, Any]) -> None:
    """Issue 27: the newest commit the operator saw (status.checkpoint) is on the JAXJob and on each of its
    workers as the checkpoint freshness annotations, with the commit's time and step."""
    checkpoint = status.get("checkpoint") or {}
    assert checkpoint.get("step") in (4, 8) and checkpoint.get("time"), status
    want = {"resilax.dev/last-checkpoint-step": str(checkpoint["step"]),
            "resilax.dev/last-checkpoint-time": checkpoint["time"], "resilax.dev/last-checkpoint-tier": "persistent"}

    def notes(obj: dict[str, Any]) -> dict[str, str]:
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        return {k: v for k, v in annotations.items() if k in (*want, "resilax.dev/steps-at-risk")}

    def published() -> bool:
        return all({k: v for k, v in notes(o).items() if k in want} == want
                   for o in [jobs.get(name), *jobs.pods(name, 1)])

    wait_for(published, timeout=30, interval=0.5, message=f"{name}: freshness annotations of step {checkpoint['step']}")
    risks = {notes(o).get("resilax.dev/steps-at-risk") for o in [jobs.get(name), *jobs.pods(name, 1)]}
    assert len(risks) == 1 and (risks == {None} or int(risks.pop() or 0) >= 0), risks  # one value, fixed at the commit


def test_a_job_on_tpu7x_slices_runs_to_success(operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster,
                                               tmp_path: Path) -> None:
    """Issue 27: Ironwood. One tpu7x slice of the local cluster's `tpu7x` profile (2x2x2 = 8 chips, 2 hosts of
    tpu7x-standard-4t), added to the shared cluster and removed after: the job lands on it, every worker
    requests 4 google.com/tpu and gets the TPU environment, and it runs to success."""
    nodes = cluster.add_nodes([n for n in build_profile("tpu7x") if n.labels.get(NODEPOOL_LABEL) == "tpu7x-slice-0"])
    try:
        cluster.wait_nodes_ready(nodes, timeout=120)
        name = unique_name("ironwood")
        manifest = job_manifest(name, tmp_path / "ckpt", count=1, steps=4, step_seconds=0.2, every_steps=2)
        manifest["spec"]["slices"] = {"accelerator": "tpu7x", "topology": "2x2x2", "machineType": "tpu7x-standard-4t",
                                      "count": 1}
        jobs.create(manifest)
        done = jobs.wait_status(name, lambda s: s.get("phase") in ("Succeeded", "Failed"), 300, "Succeeded")
        assert done["phase"] == "Succeeded" and done["shape"] == {"topology": "2x2x2", "count": 1, "hosts": 2}, done
        pods = jobs.pods(name, 1)
        assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(nodes)
        for p in pods:
            trainer = next(c for c in p["spec"]["containers"] if c["name"] == "trainer")
            assert trainer["resources"]["limits"]["google.com/tpu"] == "4", trainer["resources"]
            assert p["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"] == "tpu7x", p["spec"]
            env = {e["name"]: e.get("value") for e in trainer["env"]}
            assert env["TPU_WORKER_HOSTNAMES"].count(",") == 1 and "MEGASCALE_NUM_SLICES" not in env, env
        assert committed_steps(tmp_path / "ckpt") == [2, 4]
        jobs.delete(name)
        wait_for(lambda: not jobs.pods(name), timeout=120, message="worker pods gone")
    finally:
        for node in nodes:
            cluster.remove_node(node)
