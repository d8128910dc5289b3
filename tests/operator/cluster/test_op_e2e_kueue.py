"""Issue 27: a real Kueue (built from its Go module, started on the session's local cluster by the
`kueue` fixture) admits a JAXJob's generation as one pod group, preempts it for a workload of higher
priority, and admits the next generation once that workload is done.

One job, one flow (real JAX workers, examples/train.py):
1. A ClusterQueue of 8 google.com/tpu (one 2x4 slice: 2 hosts x 4 chips) for this test's namespace, a
   LocalQueue and a WorkloadPriorityClass. The JAXJob (1 slice, the queue label) is admitted as one
   Workload (the pod group `<job>-g1` of 2 pods), runs and commits checkpoints.
2. A pod of higher priority asks for 4 chips in the same queue: Kueue preempts the job's Workload
   (TerminationTarget on its pods, then deletes them). The workers save on SIGTERM: the final save
   commits the last step trained (0 steps lost); the job records QueueEviction, not a failure
   (`failures` and `podLosses` stay 0, no backoff event).
3. Generation 2 (the pod group `<job>-g2`) waits for admission while the preemptor runs; the test
   lets the preemptor end; Kueue admits generation 2, which restores the saved step."""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any

from op_cluster import Jobs, OperatorProcess, committed_steps, job_manifest, unique_name
from resilax_local.controlplane import kueue_manifests as km
from resilax_local.controlplane.kueue import KueueState
from resilax_local.errors import KubeAPIError
from resilax_local.kubeapi import KubeClient
from resilax_local.testing import wait_for

EVERY = 4
QUOTA = {"cpu": "100", "memory": "100Gi", "google.com/tpu": "8"}  # one 2x4 slice of tpu-v5-lite-podslice


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    """The condition `kind` of a status (a JAXJob's, a Workload's), {} when it has none."""
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def _workload_condition(workload: dict[str, Any], kind: str) -> dict[str, Any]:
    return _condition(workload.get("status") or {}, kind)


def _workload(kube: KubeClient, namespace: str, name: str) -> dict[str, Any]:
    return kube.get(f"/apis/{km.API_VERSION}/namespaces/{namespace}/workloads/{name}")


def _preemptor(name: str, queue: str, priority: str, release: Path) -> dict[str, Any]:
    """A pod of the queue at `priority` holding 4 chips until `release` exists."""
    wait = f"import os, time\nwhile not os.path.exists({str(release)!r}):\n    time.sleep(0.2)\n"
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": {km.QUEUE_NAME_LABEL: queue, km.PRIORITY_CLASS_LABEL: priority}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
                     "containers": [{"name": "main", "image": "resilax-worker:local",
                                     "command": [sys.executable, "-c", wait],
                                     "resources": {"requests": {"google.com/tpu": "4", "cpu": "100m",
                                                                "memory": "64Mi"},
                                                   "limits": {"google.com/tpu": "4"}}}]}}


def test_admitted_preempted_with_a_final_save_then_resumed(
        kueue: KueueState, operator: OperatorProcess, jobs: Jobs, kube: KubeClient, namespace: str,
        tmp_path: Path) -> None:
    name, storage = unique_name("kq"), tmp_path / "ckpt"
    queue, high = f"{namespace}-cq"[:63], f"{namespace}-high"[:63]
    cluster_scoped = [km.build_cluster_queue(queue, QUOTA, namespace_selector={
                          "matchLabels": {"kubernetes.io/metadata.name": namespace}}),
                      km.build_priority_class(high, 1000, "the preemptor of test_op_e2e_kueue")]
    release = tmp_path / "release-preemptor"
    try:
        for doc in cluster_scoped:
            kube.create(km.object_path(doc), doc)
        local_queue = km.build_local_queue(namespace, "team", queue)
        kube.create(km.object_path(local_queue), local_queue)

        # 1. Admitted as one Workload (the generation's pod group), then trains.
        manifest = job_manifest(name, storage, count=1, every_steps=EVERY, steps=5000, step_seconds=0.5,
                                final_save_timeout=60)
        manifest["metadata"]["labels"] = {km.QUEUE_NAME_LABEL: "team"}
        jobs.create(manifest)
        jobs.wait_status(name, lambda s: s.get("phase") == "Running" and s.get("generation") == 1, 600,
                         "generation 1 admitted and Running")
        group1 = _workload(kube, namespace, f"{name}-g1")
        assert _workload_condition(group1, "Admitted").get("status") == "True", group1.get("status")
        assert sum(int(ps["count"]) for ps in group1["spec"]["podSets"]) == 2, group1["spec"]
        assert {p["metadata"]["labels"].get("kueue.x-k8s.io/managed") for p in jobs.pods(name, 1)} == {"true"}
        wait_for(lambda: max(jobs.losses(name, 1), default=0) >= 10 and committed_steps(storage), timeout=600,
                 interval=1, message=f"{name}: generation 1 past step 10 with a checkpoint")
        before = jobs.status(name)

        # 2. A higher priority preempts it: the workers' final save, no failure counted.
        fault = time.time()
        preemptor = _preemptor("preemptor", "team", high, release)
        kube.create(f"/api/v1/namespaces/{namespace}/pods", preemptor)
        evicted = wait_for(lambda: _workload_condition(_workload(kube, namespace, f"{name}-g1"), "Evicted").get("status")
                           == "True" and _workload(kube, namespace, f"{name}-g1"), timeout=300, interval=1,
                           message=f"{name}-g1 evicted by Kueue")
        assert _workload_condition(evicted, "Evicted").get("reason") == "Preempted", evicted["status"]
        # 3. Generation 2 waits for admission while the preemptor holds the quota.
        waiting = jobs.wait_status(
            name, lambda s: s.get("generation") == 2
            and _condition(s, "Ready").get("reason") == "WaitingForAdmission", 600, "generation 2 waiting for Kueue")
        assert f"pod group {name}-g2" in _condition(waiting, "Ready")["message"], waiting
        gen1 = jobs.losses(name, 1)
        assert max(gen1) in committed_steps(storage), (max(gen1), committed_steps(storage))  # the final save
        preempted_at = time.time()
        assert all(int(waiting.get(k) or 0) == int(before.get(k) or 0) == 0 for k in ("failures", "podLosses")), (
            before, waiting)
        wait_for(lambda: kube.get(f"/api/v1/namespaces/{namespace}/pods/preemptor")["status"].get("phase")
                 == "Running", timeout=300, interval=1, message="the preemptor running")
        release.touch()
        released_at = time.time()
        status = jobs.wait_status(name, lambda s: s.get("generation") == 2 and s.get("phase") == "Running", 600,
                                  "generation 2 admitted and Running")
        assert _workload_condition(_workload(kube, namespace, f"{name}-g2"), "Admitted").get("status") == "True"
        wait_for(lambda: jobs.losses(name, 2), timeout=600, interval=1, message=f"{name}: a step of generation 2")
        gen2 = jobs.losses(name, 2)
        restored = min(gen2) - 1
        assert restored == max(gen1), f"restored {restored}, generation 1 reached {max(gen1)}: steps lost"
        assert int(status.get("failures") or 0) == 0 and int(status.get("podLosses") or 0) == 0, status
        reasons = jobs.event_reasons(name, "QueueEvicted", "WaitingForAdmission")
        assert "QueueEvicted" in reasons and "WaitingForAdmission" in reasons, reasons
        assert not {"PodLossBackoff", "Backoff", "PodLost", "WorkerStopped"} & set(reasons), reasons
        first_step = min(r["time"] for r in gen2.values())
        print(f"\nKueue preemption of {name}: 0 steps lost (restored {restored}); preemptor created -> generation 2 "
              f"waiting for admission: {preempted_at - fault:.1f} s (eviction, final save, teardown); preemptor "
              f"released -> generation 2's first step: {first_step - released_at:.1f} s (the preemptor ends, "
              "Kueue admits, scheduling, JAX start-up, restore)")
    finally:
        release.touch()
        with contextlib.suppress(KubeAPIError):
            kube.delete(f"/api/v1/namespaces/{namespace}/pods/preemptor")
        with contextlib.suppress(KubeAPIError):
            jobs.delete(name)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not jobs.pods(name), timeout=180, interval=1, message=f"{name}: workers gone")
        for doc in cluster_scoped:
            with contextlib.suppress(KubeAPIError):
                kube.delete(f"{km.object_path(doc)}/{doc['metadata']['name']}")
