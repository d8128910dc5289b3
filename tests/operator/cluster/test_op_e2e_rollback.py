"""A rollback is told truly (issue 40, item 6), end to end with real JAX workers (examples/train.py) on
the local cluster, in one flow:
1. a running job rolled back by editing `spec.checkpoint.restore.step` (what `kubectl resilax rollback`
   does): the current step is saved, generation 2 restores the step asked **in place** (recovery.inPlace
   Auto, the default: the same pod, same UID, and the same trainer process: the supervisor keeps it,
   since examples/train.py runs under `rc.run_kept` and only the generation's own variables change), the newer
   steps stay on storage (superseded on their branch: nothing committed is lost), and from the moment
   the status names the new branch every status the operator writes shows a step of that branch;
2. the job deleted and applied again with `checkpoint.restore.step` of an older step: the new object's
   status never shows a superseded step once it restored, and its history carries the restored step
   and its source.

Helpers as in test_op_e2e_faults.py; the job runs one process (1 slice of tpu-v5-lite-podslice
2x2, one host, on a node pool the test adds to the shared cluster and removes after), a checkpoint every
4 steps into a folder: the persistent tier only; 0.25 s per step (the flow waits for 9 commits)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from op_cluster import Jobs, OperatorProcess, committed_steps, job_manifest, unique_name
from resilax_ckpt import commit
from resilax_ckpt.storage import open_storage
from resilax_local.cluster import LocalCluster
from resilax_local.node.profiles import build_tpu_slice
from resilax_local.testing import wait_for
from test_op_e2e_faults import EVERY, wait_generation

#: The node pool of one 2x2 slice (one host) that the test adds to the shared cluster, and removes after.
POOL = "tpu-rollback-2x2"


def _marker(storage: Path, step: int) -> dict[str, Any] | None:
    try:
        return dict(json.loads((storage / str(step) / "_COMMIT").read_text()))
    except FileNotFoundError:
        return None


def _epoch(storage: Path, step: int) -> tuple[int, int] | None:
    marker = _marker(storage, step)
    return None if marker is None else (int(marker.get("era", 0)), int(marker["generation"]))


def _kept(storage: Path, step: int) -> bool:
    """Step `step` of the old timeline is still on storage: its folder committed, or moved aside with its
    marker when the new branch saved that number again (docs/checkpointing.md, "Timelines")."""
    return _marker(storage, step) is not None or any((p / "_COMMIT").exists()
                                                      for p in storage.glob(f".superseded-{step}-*"))


def _watch_until_on_branch(jobs: Jobs, name: str, storage: Path, epoch: tuple[int, int], restored: int,
                           commits: int) -> list[dict[str, Any]]:
    """Every status the operator writes (a watch) until status.checkpoint is on the branch `epoch`
    restored and `commits` steps of that branch were seen; from the first one on the branch, each
    shows a step of the branch (the restored one, or one committed at `epoch`): never a superseded step."""
    seen: list[dict[str, Any]] = []

    def check(status: dict[str, Any]) -> bool:
        ck = status.get("checkpoint") or {}
        branch = ck.get("branch") or {}
        if (branch.get("era"), branch.get("generation")) != epoch:
            assert not seen, f"status left the branch {epoch}: {ck}"
            return False
        step = int(ck["step"])
        assert step == restored or _epoch(storage, step) == epoch, (step, _epoch(storage, step), ck)
        seen.append(ck)
        return len({c["step"] for c in seen} - {restored}) >= commits

    jobs.wait_status(name, check, 600, f"status.checkpoint on the branch of epoch {epoch}, {commits} commits")
    return seen


def test_a_rollback_by_edit_and_by_re_creation_is_told_truly(operator: OperatorProcess, jobs: Jobs,
                                                                cluster: LocalCluster, tmp_path: Path) -> None:
    nodes = cluster.add_nodes(build_tpu_slice(POOL, "tpu-v5-lite-podslice", "2x2"))
    try:
        cluster.wait_nodes_ready(nodes, timeout=120)
        _rollback_by_edit_and_by_re_creation(jobs, tmp_path)
    finally:
        for node in nodes:
            cluster.remove_node(node)


def _manifest(name: str, storage: Path) -> dict[str, Any]:
    """One process: a slice of one host (2x2), on the pool this test adds."""
    manifest = job_manifest(name, storage, count=1, every_steps=EVERY, steps=5000, step_seconds=0.25)
    manifest["spec"]["slices"]["topology"] = "2x2"
    return manifest


def _rollback_by_edit_and_by_re_creation(jobs: Jobs, tmp_path: Path) -> None:
    name, storage = unique_name("rollback"), tmp_path / "ckpt"
    jobs.create(_manifest(name, storage))
    jobs.wait_status(name, lambda s: s.get("phase") == "Running" and s.get("generation") == 1, 600,
                     "generation 1 Running")
    wait_for(lambda: len(committed_steps(storage)) >= 5, timeout=300, interval=1, message=f"{name}: 5 commits")
    era = _epoch(storage, committed_steps(storage)[0])[0]  # type: ignore[index]

    # 1. The edit: roll back to the second committed step.
    pods = {p["metadata"]["name"]: p["metadata"]["uid"] for p in jobs.pods(name)}
    assert len(pods) == 1, pods
    before = committed_steps(storage)
    back = before[1]
    jobs.patch_spec(name, {"checkpoint": {"restore": {"step": back}}})
    status = wait_generation(jobs, name, 2, count=1)
    gen1, gen2 = jobs.losses(name, 1), jobs.losses(name, 2)
    assert min(gen2) == back + 1, (back, min(gen2))  # generation 2 trains on from the step asked
    reasons = jobs.event_reasons(name, "RollbackAsked", "FinalSaveDone", "RestartingInPlace")
    assert "RollbackAsked" in reasons and "FinalSaveDone" in reasons, reasons
    # In place: the same pod (name and UID) serves generation 2, and its supervisor kept the trainer
    # process (examples/train.py runs under rc.run_kept; one process, only the generation's own variables
    # change): the same pid restored the step asked.
    assert "RestartingInPlace" in reasons and "InPlaceUnavailable" not in reasons, reasons
    assert status.get("inPlaceRestarts") == 1 and sorted(status["workerPods"]) == sorted(pods), status
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in jobs.pods(name)} == pods
    restores = wait_for(lambda: jobs.restores(name, 2), timeout=60, interval=1,
                        message=f"{name}: the restore of generation 2")
    assert {r["restored"] for r in restores.values()} == {back}, restores
    log = "".join(jobs.trainer_logs(name))
    started = re.search(r"incarnation 1 \(generation 1\) started, pid (\d+)", log)
    kept = re.search(r"incarnation 2 \(generation 2\) runs in the kept process (\d+)", log)
    assert started and kept and started.group(1) == kept.group(1), log[-4000:]
    final = max(gen1)  # the current step, saved first
    done = [e["message"] for e in jobs.events(name) if e["reason"] == "FinalSaveDone"]
    assert any(f"step {final} committed" in m for m in done), (final, done)
    old = sorted({*before, *(s for s in committed_steps(storage) if _epoch(storage, s) == (era, 1))})
    assert final in old, (final, old)

    seen = _watch_until_on_branch(jobs, name, storage, (era, 2), back, commits=2)
    assert seen[-1]["branch"] == {"era": era, "generation": 2, "parent": back}
    status = jobs.status(name)
    assert status["restoreAsked"] == str(back)
    e1, e2 = status["history"][-2:]
    assert (e1["generation"], e1["endReason"]) == (1, "RollbackAsked"), e1
    assert (e2["generation"], e2["restoredStep"], e2["restoredFrom"], e2["inPlace"]) == (2, back, "persistent", True), e2
    assert all(s == back or _epoch(storage, s) == (era, 2) for s in e2.get("checkpoints") or []), e2
    # Nothing committed is lost: every step generation 1 committed is still there, those after the
    # step asked superseded (kept, never restored) by the library's own rules.
    assert all(_kept(storage, s) for s in old), (old, sorted(p.name for p in storage.iterdir()))
    root = open_storage(str(storage))
    superseded = set(commit.list_superseded(root, str(storage)))
    assert {s for s in old if s > back and _epoch(storage, s) == (era, 1)} <= superseded, (old, superseded)

    # 2. Delete and apply again, restoring a step of generation 2's branch older than its newest.
    new_steps = sorted(s for s in committed_steps(storage) if _epoch(storage, s) == (era, 2))
    again = new_steps[0]
    assert again < new_steps[-1], new_steps
    jobs.delete(name)
    wait_for(lambda: not jobs.pods(name) and not jobs.exists(name), timeout=300, interval=1,
             message=f"{name}: deleted with its workers")
    manifest = _manifest(name, storage)
    manifest["spec"]["checkpoint"]["restore"] = {"step": again}
    jobs.create(manifest)
    seen = _watch_until_on_branch(jobs, name, storage, (era + 1, 1), again, commits=2)
    # (its pod has the old job's generation 1 name: read its restore line, which a fresh start never prints)
    assert {r["restored"] for r in jobs.restores(name, 1).values()} == {again}
    status = jobs.status(name)
    (entry,) = status["history"]
    assert (entry["restoredStep"], entry["restoredFrom"]) == (again, "persistent"), entry
    assert all(s == again or _epoch(storage, s) == (era + 1, 1) for s in entry.get("checkpoints") or []), entry
    assert new_steps[-1] in set(commit.list_superseded(root, str(storage))) or _epoch(storage, new_steps[-1]) == (
        era + 1, 1)  # superseded, or saved again by the new job on its branch
    jobs.delete(name)
    wait_for(lambda: not jobs.pods(name), timeout=300, interval=1, message=f"{name}: worker pods gone")
