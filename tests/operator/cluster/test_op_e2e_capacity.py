"""Issue 18, item 3, end to end with real JAX workers (examples/train.py) on the session's local cluster:
capacity that does not exist yet (`capacity.provisioning: Autoscaled`) and `spec.suspend`.

One job, one flow, to keep CI time low: 2 slices of tpu-v5-lite-podslice 2x2 (one 4-chip host each)
where the cluster has a single such node pool, added by the test (the session's other pools are 2x4):
1. the declared shape anyway: slice 1's pod Pending (Unschedulable: what an autoscaler adds nodes for),
   WaitingForCapacity naming the missing node; the test adds a node pool as an autoscaler would and the
   same generation runs at the declared shape;
2. `suspend: true`: final save, no workers, Suspended; `false`: a new generation restores it (0 steps lost);
3. a node pool goes and none comes: the new generation waits, then shrinks to 1 slice after
   `shrinkAfterSeconds` (40 s while the test adds a pool in 1, edited to 15 s for this wait, which the
   test waits out) and restores the newest committed step;
4. settled at 1 slice, the job keeps a probe pod of the missing slice Pending (an autoscaler's demand);
   the test adds a node pool as the autoscaler would: the job grows back and the probe is deleted. The
   probe comes once the generation ran the operator's growBackSettleSeconds: 10 s here (CI time: the test
   waits it out; 20 s in the other e2e tests)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from op_cluster import Jobs, OperatorProcess, committed_steps, job_manifest, unique_name
from resilax_local.cluster import LocalCluster
from resilax_local.errors import KubeAPIError
from resilax_local.testing import wait_for

EVERY = 4
SHRINK_AFTER = 40  # room for the test, playing the autoscaler, to add a node pool in step 1
#: step 3's shrinkAfterSeconds (an edit: it is not part of what a generation is planned from, so it moves
#: no generation); the test waits it out (CI time), and the waiting generation is seen before it passes
SHRINK_AFTER_3 = 15


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def _running(jobs: Jobs, name: str, generation: int, count: int, timeout: float = 600) -> dict[str, Any]:
    status = jobs.wait_status(
        name, lambda s: s.get("generation", 0) >= generation and s.get("phase") == "Running"
        and (s.get("shape") or {}).get("count") == count, timeout, f"generation {generation} Running on {count} slice(s)")
    assert status["generation"] == generation, status
    return status


def _trained(jobs: Jobs, name: str, generation: int, past: int, storage: Path) -> None:
    wait_for(lambda: max(jobs.losses(name, generation), default=0) >= past and committed_steps(storage),
             timeout=600, interval=1, message=f"{name}: generation {generation} past step {past} with a checkpoint")


def test_autoscaled_capacity_waits_then_runs_suspend_saves_and_resumes_then_shrinks_after_the_timeout(
        operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster, tmp_path: Path) -> None:
    operator.kill()
    operator.settings_env["RESILAX_OPERATOR_GROW_BACK_SETTLE_SECONDS"] = "10"
    operator.start()
    name, storage = unique_name("cap"), tmp_path / "ckpt"
    pool_a, pool_b = unique_name("cap-a"), unique_name("cap-b")
    added: list[str] = []
    try:
        added += cluster.add_tpu_slice(pool_a, topology="2x2")
        cluster.wait_nodes_ready(added)
        manifest = job_manifest(name, storage, count=2, elastic={"minCount": 1, "maxCount": 2}, every_steps=EVERY,
                                steps=5000, step_seconds=0.5, final_save_timeout=60)
        manifest["spec"]["slices"]["topology"] = "2x2"
        manifest["spec"]["capacity"] = {"provisioning": "Autoscaled", "shrinkAfterSeconds": SHRINK_AFTER}
        jobs.create(manifest)

        # 1. Larger than the Ready capacity: generation 1 at the declared shape, slice 1 Pending.
        status = jobs.wait_status(name, lambda s: _condition(s, "Ready").get("reason") == "WaitingForCapacity",
                                  300, "WaitingForCapacity")
        assert status["generation"] == 1 and status["shape"]["count"] == 2 and status["pools"] == [pool_a, ""], status
        message = _condition(status, "Ready")["message"]
        assert ("generation 1: 1 of 2 workers wait for nodes that do not exist yet" in message
                and "slice 1 each need a node pool of 1 node(s) with 4 google.com/tpu each labelled "
                    "cloud.google.com/gke-tpu-accelerator=tpu-v5-lite-podslice, cloud.google.com/gke-tpu-topology=2x2"
                in message), message
        def unschedulable() -> dict[str, Any] | None:
            pod = next((p for p in jobs.pods(name, 1) if p["metadata"]["name"] == f"{name}-g1-s1-h0"), None)
            conditions = (pod or {}).get("status", {}).get("conditions") or []
            return pod if any(c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
                              for c in conditions) else None

        pending = wait_for(unschedulable, timeout=120, interval=1, message=f"{name}: slice 1's pod Unschedulable")
        assert not pending["spec"].get("nodeName") and pending["status"]["phase"] == "Pending", pending
        assert "WaitingForCapacity" in jobs.event_reasons(name, "WaitingForCapacity")
        # The autoscaler adds a node pool: the same generation runs at the declared shape.
        added += cluster.add_tpu_slice(pool_b, topology="2x2")
        cluster.wait_nodes_ready(added)
        status = _running(jobs, name, 1, count=2)
        assert status["pools"] == [pool_a, pool_b] and status["restarts"] == 0, status
        _trained(jobs, name, 1, 10, storage)

        # 2. Suspend: a final save, no workers; resume: a new generation restores it, 0 steps lost.
        jobs.patch_spec(name, {"suspend": True})
        status = jobs.wait_status(name, lambda s: s.get("phase") == "Suspended"
                                  and _condition(s, "Suspended").get("status") == "True", 300, "Suspended")
        wait_for(lambda: not jobs.pods(name), timeout=120, interval=1, message=f"{name}: no workers while suspended")
        gen1 = jobs.losses(name, 1)
        assert max(gen1) in committed_steps(storage), (max(gen1), committed_steps(storage))  # the final save
        reasons = jobs.event_reasons(name, "Suspending", "FinalSaveDone", "Suspended")
        assert {"Suspending", "FinalSaveDone", "Suspended"} <= set(reasons), reasons
        jobs.patch_spec(name, {"suspend": False})
        _running(jobs, name, 2, count=2)
        _trained(jobs, name, 2, max(gen1) + 4, storage)
        gen2 = jobs.losses(name, 2)
        assert min(gen2) - 1 == max(gen1), (max(gen1), min(gen2))
        assert "Resumed" in jobs.event_reasons(name, "Resumed")

        # 3. A node pool goes for good and none comes: the next generation waits for it, then shrinks.
        jobs.patch_spec(name, {"capacity": {"shrinkAfterSeconds": SHRINK_AFTER_3}})
        victim = next(p["spec"]["nodeName"] for p in jobs.pods(name, 2) if p["metadata"]["name"] == f"{name}-g2-s1-h0")
        committed_before = max(committed_steps(storage))
        cluster.remove_node(victim)
        added.remove(victim)
        status = jobs.wait_status(name, lambda s: s.get("generation") == 3
                                  and _condition(s, "Ready").get("reason") == "WaitingForCapacity", 300,
                                  "generation 3 waiting for capacity")
        assert status["shape"]["count"] == 2 and "" in status["pools"], status
        status = _running(jobs, name, 4, count=1, timeout=SHRINK_AFTER_3 + 600)
        assert _condition(status, "Degraded").get("status") == "True", status
        assert "CapacityTimeout" in jobs.event_reasons(name, "CapacityTimeout")
        timeout = [e["message"] for e in jobs.events(name) if e["reason"] == "CapacityTimeout"]
        assert any(f"within capacity.shrinkAfterSeconds={SHRINK_AFTER_3}" in m for m in timeout), timeout
        wait_for(lambda: jobs.losses(name, 4), timeout=600, interval=1, message=f"{name}: a step of generation 4")
        gen2, gen4 = jobs.losses(name, 2), jobs.losses(name, 4)
        restored = min(gen4) - 1
        assert restored in committed_steps(storage) and restored >= committed_before, (restored, committed_before)
        assert max(gen2) - restored <= EVERY + 1, (max(gen2), restored)
        assert not jobs.losses(name, 3)  # the waiting generation never trained

        # 4. The grow-back probe (the local cluster has no autoscaler; the test is one): settled below its
        # declared shape, the job keeps a Pending probe pod of the missing 2x2 slice, which is what an
        # autoscaler scales up for; the test then adds the pool, the job grows back and the probe goes.
        uid = jobs.get(name)["metadata"]["uid"]

        def probes() -> list[dict[str, Any]]:
            return [p for p in jobs.pods(name) if p["metadata"]["labels"].get("resilax.dev/role") == "probe"]

        (probe,) = wait_for(probes, timeout=180, interval=1, message=f"{name}: the grow-back probe of slice 2")
        assert probe["metadata"]["name"].startswith(f"{name}-probe-g4r"), probe["metadata"]
        assert [(o["kind"], o["uid"], o.get("controller")) for o in probe["metadata"]["ownerReferences"]] == [
            ("JAXJob", uid, True)]
        assert probe["spec"]["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                                 "cloud.google.com/gke-tpu-topology": "2x2"}, probe["spec"]
        assert probe["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == "4"
        assert not probe["spec"].get("nodeName") and "resilax.dev/generation" not in probe["metadata"]["labels"]
        added += cluster.add_tpu_slice(pool_c := unique_name("cap-c"), topology="2x2")
        cluster.wait_nodes_ready(added)
        status = _running(jobs, name, 5, count=2)
        assert pool_c in status["pools"], status
        wait_for(lambda: not probes(), timeout=60, interval=1, message=f"{name}: grow-back probe removed")
        assert "GrowBack" in jobs.event_reasons(name, "GrowBack")
        # The grown-back generation trains. (Its trainers then hold their trainer.lock: deleted still
        # starting, each new pod's sidecar would wait finalSave.timeoutSeconds for an answer.)
        wait_for(lambda: jobs.losses(name, 5), timeout=600, interval=1, message=f"{name}: a step of generation 5")
    finally:
        with contextlib.suppress(KubeAPIError):
            jobs.delete(name)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: not jobs.pods(name), timeout=180, interval=1, message=f"{name}: workers gone")
        for node in added:
            cluster.remove_node(node)
