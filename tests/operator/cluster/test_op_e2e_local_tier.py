"""Issue 5's "Done means" end to end on the local cluster: a JAXJob with `checkpoint.local` (the fast
per-host tier, an emptyDir on node disk) and a persistent `checkpoint.storage` (a folder under the test's
tmp dir). A preemption notice on a node hosting a worker makes the operator drive a final save through the
sidecars: the step lands in every worker's local tier, the sidecars upload it and commit it in the
persistent tier, and the next generation (other pods, empty local tiers) restores it from there with no
step lost.

Same job shape as test_op_e2e_faults.py: 2 slices of 2 hosts (4 processes x 2 fake CPU devices), 0.5 s
per step, elastic down to 1 slice, but no routine save before the fault (every 1000 steps): the only step
in either tier can only come from the final save."""

from __future__ import annotations

import json
import time
from pathlib import Path

from op_cluster import Jobs, OperatorProcess, committed_steps, job_manifest, recovery_breakdown, unique_name
from resilax_local.cluster import LocalCluster
from resilax_local.testing import wait_for

EVERY = 1000  # no routine save within the test
ELASTIC = {"minCount": 1, "maxCount": 2, "growBack": True}
LOCAL_VOLUME = "resilax-local"  # resilax_operator.api.LOCAL_VOLUME


def local_tier(cluster: LocalCluster, namespace: str, pod: str) -> Path:
    """A worker pod's local tier on this cluster: its emptyDir folder (node disk, kept after the pod)."""
    return cluster.pod_dir(namespace, pod) / "volumes" / LOCAL_VOLUME


def local_steps(folder: Path) -> list[int]:
    """Steps this host committed in its local tier (`_COMMIT` or `_COMMIT.<process_id>`)."""
    if not folder.exists():
        return []
    return sorted(int(p.name) for p in folder.iterdir()
                  if p.name.isdigit() and any(f.name.startswith("_COMMIT") for f in p.iterdir()))


def test_preemption_final_save_goes_local_then_persistent_and_restores(
        operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster, namespace: str, tmp_path: Path) -> None:
    name, storage = unique_name("ltier"), tmp_path / "ckpt"
    manifest = job_manifest(name, storage, elastic=ELASTIC, every_steps=EVERY, steps=5000, step_seconds=0.5)
    # scope Pod (an emptyDir on node disk; the local cluster keeps its folder after the pod for the asserts):
    # generation 2 may land on generation 1's nodes, and must still restore from the persistent tier
    manifest["spec"]["checkpoint"]["local"] = {"scope": "Pod"}
    # every pod replaced (the flow under test: new pods with empty local tiers restore from the persistent
    # tier); an in-place restart would keep the survivors and their local tiers (test_op_e2e_inplace.py)
    manifest["spec"]["recovery"]["inPlace"] = "Never"
    jobs.create(manifest)
    jobs.wait_status(name, lambda s: s.get("phase") == "Running" and s.get("generation") == 1, 600,
                     "generation 1 Running")
    gen1_pods = sorted(p["metadata"]["name"] for p in jobs.pods(name, 1))
    assert len(gen1_pods) == 4, gen1_pods
    wait_for(lambda: max(jobs.losses(name, 1), default=0) >= 10, timeout=600, interval=1,
             message=f"{name}: generation 1 past step 10")
    assert not committed_steps(storage)
    for pod in gen1_pods:
        assert not local_steps(local_tier(cluster, namespace, pod)), f"{pod}: a step before any save"

    victim = str(next(p for p in jobs.pods(name, 1)
                      if p["metadata"]["name"] == f"{name}-g1-s1-h0")["spec"]["nodeName"])
    fault = time.time()
    cluster.preempt_node(victim, delay_seconds=900)  # the notice now; the kill long after the test
    try:
        status = jobs.wait_status(
            name, lambda s: s.get("generation", 0) >= 2 and s.get("phase") == "Running"
            and (s.get("shape") or {}).get("count") == 1, 900, "generation 2 Running on 1 slice")
        assert status["generation"] == 2, status
        wait_for(lambda: jobs.losses(name, 2), timeout=600, interval=1,
                 message=f"{name}: a training step of generation 2")

        gen1, gen2 = jobs.losses(name, 1), jobs.losses(name, 2)
        restored = min(gen2) - 1
        final = max(gen1)
        persisted = committed_steps(storage)
        locals_ = {pod: local_steps(local_tier(cluster, namespace, pod)) for pod in gen1_pods}
        gen2_pods = sorted(p["metadata"]["name"] for p in jobs.pods(name, 2))
        gen2_locals = {pod: local_steps(local_tier(cluster, namespace, pod)) for pod in gen2_pods}
        print(f"\nlocal tier: generation 1 reached step {final}; its local tiers hold {locals_}; "
              f"persistent tier commits {persisted}; generation 2 restored step {restored}; "
              f"generation 2 local tiers {gen2_locals}")

        # 0 steps lost: the final save is the last step generation 1 computed, and generation 2 resumes after it.
        assert restored == final, f"restored {restored}, generation 1 reached {final}"
        # The final save landed in every generation-1 host's local tier ...
        for pod, steps in locals_.items():
            assert steps == [final], f"{pod}: local tier {steps}, final step {final}"
        # ... and the sidecars uploaded it and committed it in the persistent tier (every process's marker).
        assert persisted == [final], f"persistent tier commits {persisted}, final step {final}"
        # Write-once uploads: the markers are in the attempt that `_COMMIT` names.
        attempt = json.loads((storage / str(final) / "_COMMIT").read_text())["attempt"]
        uploaded = sorted(p.name for p in (storage / str(final) / attempt).glob("_UPLOADED.*"))
        assert len(uploaded) == 4, uploaded
        # Generation 2 runs in new pods off the preempted node: their local tiers never held that step,
        # so it came from the persistent tier.
        assert victim not in {p["spec"].get("nodeName") for p in jobs.pods(name, 2)}
        assert not set(gen2_pods) & set(gen1_pods)
        for pod, steps in gen2_locals.items():
            assert restored not in steps, f"{pod}: step {restored} in a generation-2 local tier {steps}"
        # Loss continues: generation 2 keeps training past the restored step.
        wait_for(lambda: max(jobs.losses(name, 2)) >= restored + 3, timeout=300, interval=1,
                 message=f"{name}: generation 2 trains past step {restored + 3}")
        gen2 = jobs.losses(name, 2)
        assert all(r["devices"] == 4 for r in gen2.values())  # 1 slice x 2 hosts x 2 devices
        reasons = jobs.event_reasons(name, "PreemptionNotice", "FinalSaveDone")
        assert "PreemptionNotice" in reasons and "FinalSaveDone" in reasons, reasons
        sidecar_logs = "\n".join(cluster.logs(namespace, pod, "resilax-sidecar") for pod in gen1_pods)
        assert f"step {final}: committed in" in sidecar_logs or f"step {final}: already committed" in sidecar_logs
        recovery_breakdown(jobs, name, 2, fault, ("PreemptionNotice",))
    finally:
        cluster.restore_node(victim)
