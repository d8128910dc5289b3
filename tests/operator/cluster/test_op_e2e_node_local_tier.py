"""Issue 5's last gap end to end on the local cluster: a JAXJob with `checkpoint.local` (scope Node: a
folder per job on each node, kept across generations) recovers from the local tier when it can and from
the persistent tier when it must.

(a) A worker's process fails: the next generation's workers land on the same nodes (status.workerNodes,
    preferred node affinity) and all restore from their local tiers a step newer than anything in the
    persistent tier (which lags by design: `persistEverySteps`). Then a graceful node shutdown (a spot
    VM's SIGTERM, no request before it) on one of the 4 workers' nodes: all agree on one step, save it
    locally, stop; it is uploaded, and generation 3 restores it with no step lost.
(b) Then, on the same job (generations 4 and 5): a node is lost (removed, its disk with it) and replaced
    by a new, empty one: the survivors restore from their local tiers, the replacement from its peers'
    local tiers (issues 19 and 26), all the same step, newer than anything persistent; then two nodes are
    lost together and the next generation still restores a local step: the others hold every shard (data
    parallel).
(d) A shrink (issue 26, item 4): a host of slice 0 killed near step 73; the one-slice job restores the
    newest local step from the in-cluster tiers, none of it from the persistent tier.
(c) A namespace enforcing Pod Security `baseline` refuses the hostPath: `PodCreationRefused` names the fix,
    and `scope: Pod` gets the pods created.

Job shape as in test_op_e2e_faults.py: 2 slices x 2 hosts (4 processes x 2 fake CPU devices), a save every
2 steps, 0.5 s per step. Each worker prints one JSON line `{"restored": step, "from": tier, ...}`."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from op_cluster import Jobs, OperatorProcess, committed_steps, job_manifest, recovery_breakdown, unique_name
from resilax_local.cluster import LocalCluster
from resilax_local.kubeapi import KubeClient
from resilax_local.node.profiles import NodeSpec, build_tpu_slice
from resilax_local.testing import wait_for

EVERY = 2
LOCAL_ROOT = "/var/lib/resilax/local"  # OperatorSettings.local_tier_root
WORKERS = [(s, h) for s in (0, 1) for h in (0, 1)]


def start(jobs: Jobs, name: str, storage: Path, local: dict[str, Any]) -> dict[str, Any]:
    manifest = job_manifest(name, storage, every_steps=EVERY, steps=5000, step_seconds=0.5, final_save_timeout=20)
    manifest["spec"]["checkpoint"]["local"] = local
    jobs.create(manifest)
    return jobs.wait_status(name, lambda s: s.get("phase") == "Running" and s.get("generation") == 1, 600,
                            "generation 1 Running")


def pod_nodes(jobs: Jobs, name: str, generation: int) -> dict[str, str]:
    """`s<slice>-h<host>` → node of each worker pod of `generation`."""
    return {p["metadata"]["name"].rsplit("-", 2)[-2] + "-" + p["metadata"]["name"].rsplit("-", 1)[-1]:
            str(p["spec"].get("nodeName")) for p in jobs.pods(name, generation)}


def local_folder(cluster: LocalCluster, jobs: Jobs, name: str, node: str) -> Path:
    job = jobs.get(name)["metadata"]
    return cluster.node_path(node, f"{LOCAL_ROOT}/{job['namespace']}_{name}_{job['uid']}")


def local_steps(folder: Path) -> list[int]:
    """Steps committed in a local tier folder (`_COMMIT` or `_COMMIT.<process_id>`)."""
    if not folder.exists():
        return []
    return sorted(int(p.name) for p in folder.iterdir()
                  if p.name.isdigit() and any(f.name.startswith("_COMMIT") for f in p.iterdir()))


def commit_generation(storage: Path, step: int) -> int:
    return int(json.loads((storage / str(step) / "_COMMIT").read_text())["generation"])


def restored(jobs: Jobs, name: str, generation: int) -> dict[str, dict[str, Any]]:
    """`s<slice>-h<host>` → the worker's `{"restored", "from", "process", "node"}` line (process id =
    slice x 2 + host), wherever the process ran (an in-place restart keeps pods of older generations)."""
    return {f"s{p // 2}-h{p % 2}": r for p, r in jobs.restores(name, generation).items()}


def wait_restored(jobs: Jobs, name: str, generation: int) -> dict[str, dict[str, Any]]:
    return wait_for(lambda: (r := restored(jobs, name, generation)) and len(r) == len(WORKERS) and r,
                    timeout=900, interval=1, message=f"{name}: every worker of generation {generation} restored")


def history_restore(jobs: Jobs, name: str, generation: int) -> tuple[int, str]:
    """(restoredStep, restoredFrom) of `generation` in status.history, once the operator recorded it."""
    def told() -> tuple[int, str] | None:
        e = next((e for e in jobs.status(name).get("history") or [] if e["generation"] == generation), {})
        return (e["restoredStep"], e.get("restoredFrom", "")) if "restoredStep" in e else None
    return wait_for(told, timeout=120, interval=1, message=f"{name}: status.history's restore of generation {generation}")


def generation_2_restored(jobs: Jobs, name: str, storage: Path) -> tuple[dict[str, dict[str, Any]], list[int]]:
    """Once generation 2 runs and every worker printed its restore line: those lines and the steps
    generation 1 committed in the persistent tier."""
    jobs.wait_status(name, lambda s: s.get("generation") == 2 and s.get("phase") == "Running", 900,
                     "generation 2 Running")
    lines = wait_restored(jobs, name, 2)
    gen1_persisted = [s for s in committed_steps(storage) if commit_generation(storage, s) == 1]
    return lines, gen1_persisted


@pytest.mark.timeout(1800)
def test_worker_failure_restores_every_worker_from_its_local_tier(
        operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster, kube: KubeClient, tmp_path: Path) -> None:
    """(a), then (b) on the same job (CI time: one job start and one wait for the local tiers to run
    ahead of the persistent tier fewer): generations 2 and 3 as (a) says, 4 and 5 as (b) says."""
    name, storage = unique_name("nlt-fail"), tmp_path / "ckpt"
    start(jobs, name, storage, {"keepLast": 3, "persistEverySteps": 20})
    nodes1 = pod_nodes(jobs, name, 1)
    folders = {w: local_folder(cluster, jobs, name, node) for w, node in nodes1.items()}

    def local_ahead() -> bool:
        persisted = committed_steps(storage)
        newest = [max(local_steps(f), default=0) for f in folders.values()]
        return bool(persisted) and min(newest) >= max(persisted) + 2 * EVERY
    wait_for(local_ahead, timeout=900, interval=1, message=f"{name}: the local tiers ahead of the persistent tier")
    status = jobs.status(name)
    assert {int(k): v for k, v in status["workerNodes"].items()} == {
        s * 2 + h: nodes1[f"s{s}-h{h}"] for s, h in WORKERS}, status["workerNodes"]

    victim = next(p for p in cluster.pods() if p["name"] == f"{name}-g1-s1-h0")
    fault = time.time()
    os.kill(victim["processes"]["trainer"], signal.SIGKILL)
    persisted_at_fault = committed_steps(storage)
    local_at_fault = {w: local_steps(f) for w, f in folders.items()}

    lines, gen1_persisted = generation_2_restored(jobs, name, storage)
    print(f"\nworker failure: persistent tier at the fault {persisted_at_fault}, generation 1's commits there "
          f"{gen1_persisted}; local tiers at the fault {local_at_fault}; generation 2 restored {lines}")
    step = lines["s0-h0"]["restored"]
    assert pod_nodes(jobs, name, 2) == nodes1  # every worker back on its node
    assert all(r["restored"] == step and r["from"] == "local" for r in lines.values()), lines
    assert history_restore(jobs, name, 2) == (step, "local")  # every process from its own host
    assert step > max(gen1_persisted), (step, gen1_persisted)  # newer than anything persistent: local only
    assert step % 20 != 0
    assert step >= min(max(steps) for steps in local_at_fault.values()), local_at_fault
    # no step lost beyond the local tier: the restored step is generation 1's newest local step
    gen1 = jobs.losses(name, 1)
    assert max(gen1) - step <= EVERY + 1, (max(gen1), step)
    assert "WorkerFailed" in jobs.event_reasons(name, "WorkerFailed")
    # One in-place restart, no stop timed out: the killed pod (its trainer container ended, its sidecar
    # still up) is no survivor, replaced at once; the three others kept (2026-12-07: it was kept, and held
    # the restart inPlaceStopTimeoutSeconds, 30 s, before InPlaceStopTimeout replaced it).
    status = jobs.status(name)
    assert status["inPlaceRestarts"] == 1 and status["restarts"] == 1, status
    assert status["workerPods"] == [f"{name}-g1-s0-h0", f"{name}-g1-s0-h1", f"{name}-g2-s1-h0",
                                    f"{name}-g1-s1-h1"], status
    assert "InPlaceStopTimeout" not in jobs.event_reasons(name), jobs.event_reasons(name)
    wait_for(lambda: jobs.losses(name, 2), timeout=300, interval=1, message=f"{name}: a step of generation 2")
    recovery_breakdown(jobs, name, 2, fault, ("WorkerFailed",))

    graceful_node_shutdown_saves_the_agreed_step_and_the_next_generation_restores_it(
        jobs, cluster, name, storage, folders, after=step)
    node_loss_the_replacement_restores_from_its_peers_and_two_lost_still_do(
        jobs, cluster, kube, name, storage, running=3)


def graceful_node_shutdown_saves_the_agreed_step_and_the_next_generation_restores_it(
        jobs: Jobs, cluster: LocalCluster, name: str, storage: Path, folders: dict[str, Path], after: int) -> None:
    """Issue 18, item 2: a spot VM's preemption is a SIGTERM no request precedes (graceful node shutdown,
    GKE's 30 s with 15 s for system pods). The trainer on the shut-down node (process 2 of 4) and the
    three others agree on one step, save it in their local tiers and exit 75; the sidecars upload it
    although `persistEverySteps: 20` would keep it local (the trainer recorded it as its final save);
    generation 3, back on the same nodes once the victim returns (fixed shape), restores it: 0 steps lost."""
    wait_for(lambda: max(jobs.losses(name, 2), default=0) >= after + 3, timeout=300, interval=1,
             message=f"{name}: generation 2 past step {after + 3}")
    nodes2 = pod_nodes(jobs, name, 2)
    victim = nodes2["s1-h0"]  # process 2: not the one that prints the loss lines
    sidecar_pod = f"{name}-g2-s1-h0"
    fault = time.time()
    cluster.shutdown_node(victim, grace_seconds=30, critical_grace_seconds=15)
    try:
        wait_for(lambda: {n["name"]: n["state"] for n in cluster.nodes()}[victim] == "Killed", timeout=120,
                 interval=0.5, message=f"{victim}: its pods stopped, powered off")
        final = max(jobs.losses(name, 2))
        local = {w: local_steps(f) for w, f in folders.items()}
        commit_times = {w: max(p.stat().st_mtime for p in (f / str(final)).glob("_COMMIT*")) - fault
                        for w, f in folders.items() if final in local[w]}
        persisted = wait_for(lambda: final in (c := committed_steps(storage)) and c, timeout=120, interval=0.5,
                             message=f"{name}: step {final} committed in the persistent tier")
        print(f"\ngraceful shutdown of {victim}: generation 2 reached step {final}; local tiers {local}; "
              f"local commit {', '.join(f'{w} +{t:.2f} s' for w, t in sorted(commit_times.items()))} after "
              f"the SIGTERM; persistent tier {persisted}")
        # Every process saved the same final step in its local tier (the victim's too) ...
        assert all(final in steps for steps in local.values()), (final, local)
        # ... and the sidecars persisted it (the victim's while its node was shutting down).
        assert commit_generation(storage, final) == 2
        victim_log = cluster.logs(jobs.namespace, sidecar_pod, "resilax-sidecar")
        assert f"persisting its newest local step {final}" in victim_log, victim_log[-3000:]

        cluster.restore_node(victim)
        jobs.wait_status(name, lambda s: s.get("generation") == 3 and s.get("phase") == "Running", 600,
                         "generation 3 Running")
        lines = wait_restored(jobs, name, 3)
        print(f"graceful shutdown: generation 3 restored {lines}")
        assert all(r["restored"] == final for r in lines.values()), (final, lines)  # 0 steps lost
        assert pod_nodes(jobs, name, 3) == nodes2
        wait_for(lambda: jobs.losses(name, 3), timeout=300, interval=1, message=f"{name}: a step of generation 3")
        assert min(jobs.losses(name, 3)) == final + 1
        recovery_breakdown(jobs, name, 3, fault, ("NodeLost", "WorkerStopped"))
    finally:
        if {n["name"]: n["state"] for n in cluster.nodes()}[victim] != "Ready":
            cluster.restore_node(victim)


def held_replicas(cluster: LocalCluster, jobs: Jobs, name: str, nodes: list[str]) -> list[str]:
    """The complete peer replicas (`<local>/_peer/p<origin>/<step>/_REPLICA.json`) on `nodes`."""
    return [str(p) for n in nodes for p in (local_folder(cluster, jobs, name, n) / "_peer").glob("p*/*/_REPLICA.json")]


def node_spec(node: str) -> NodeSpec:
    return next(n for s in (0, 1) for n in build_tpu_slice(f"tpu-slice-{s}", "tpu-v5-lite-podslice", "2x4")
                if n.name == node)


def replace_nodes(cluster: LocalCluster, kube: KubeClient, nodes: list[str]) -> None:
    """Remove `nodes` (their disks with them) at once and add new, empty machines under the same names."""
    specs = [node_spec(n) for n in nodes]
    for node in nodes:
        cluster.remove_node(node)
    wait_for(lambda: not any(n["metadata"]["name"] in nodes for n in kube.get("/api/v1/nodes")["items"]),
             timeout=60, message=f"nodes {nodes} deleted")
    cluster.add_nodes(specs)
    cluster.wait_nodes_ready(nodes, timeout=120)


def node_loss_the_replacement_restores_from_its_peers_and_two_lost_still_do(
        jobs: Jobs, cluster: LocalCluster, kube: KubeClient, name: str, storage: Path, running: int) -> None:
    """Issues 19 and 26, on the job whose generation `running` trains on all four nodes. (a) A node is lost
    (its disk with it) while the local tiers are ahead of the persistent tier: the replacement (process 1)
    reads its shards of the newest local step from the other hosts' local tiers through their sidecars,
    the survivors read their own; every process restores that step, newer than anything persistent. No
    replica was ever sent: the example's parameters are data parallel over the hosts, so each holder's
    own step already has its origin's shards (`peers.plan_peers`' holder of process 1 is process 3).
    (b) Then the nodes of processes 1 and 3 are lost together: processes 0 and 2 still hold every shard,
    so the next generation restores the newest local step again, the replacements from peers."""
    lost, after = running + 1, running + 2
    nodes = pod_nodes(jobs, name, running)
    victim, holder = nodes["s0-h1"], nodes["s1-h1"]  # processes 1 and 3 (peers.plan_peers)
    lost_folder = local_folder(cluster, jobs, name, victim)
    holder_folder = local_folder(cluster, jobs, name, holder)

    def ahead() -> int | None:
        """Process 1's newest local step, once the holder has it too and it is newer than persistent, and
        neither it nor a save or two after it is one the persistent tier gets (a multiple of
        persistEverySteps, 20): generation `running` started at an arbitrary step (its restored final save)."""
        try:
            persisted, own, held = committed_steps(storage), local_steps(lost_folder), local_steps(holder_folder)
        except FileNotFoundError:  # a folder renamed or trimmed while listed
            return None
        if persisted and own and own[-1] in held and own[-1] > max(persisted) and 0 < own[-1] % 20 <= 14:
            return own[-1]
        return None
    victim_newest = wait_for(ahead, timeout=900, interval=0.1, message=(
        f"{name}: process 1's newest local step on {holder} too, ahead of the persistent tier"))
    # No replica kept: every holder's own step had the same shards as its origin's (a replica taken
    # before a holder's first save of its own is dropped at its next pass).
    assert not held_replicas(cluster, jobs, name, list(nodes.values())), "replicas of identical shards kept"
    fault = time.time()
    replace_nodes(cluster, kube, [victim])
    try:
        jobs.wait_status(name, lambda s: s.get("generation") == lost and s.get("phase") == "Running", 900,
                         f"generation {lost} Running")
        lines = wait_restored(jobs, name, lost)
        persisted_before = [s for s in committed_steps(storage) if commit_generation(storage, s) <= running]
        print(f"\nnode loss: process 1's newest local step {victim_newest}; the persistent tier's commits of "
              f"generations up to {running} {persisted_before}; generation {lost} restored {lines}")
        step = lines["s0-h0"]["restored"]
        assert pod_nodes(jobs, name, lost) == nodes
        assert {w: r["from"] for w, r in lines.items()} == {
            "s0-h0": "local", "s0-h1": "peer", "s1-h0": "local", "s1-h1": "local"}, lines
        assert lines["s0-h1"]["sources"]["peer"]["files"] > 0, lines["s0-h1"]
        assert lines["s0-h1"]["sources"]["persistent"]["files"] == 0, lines["s0-h1"]
        assert all(r["restored"] == step for r in lines.values()), lines
        assert step > max(persisted_before), (step, persisted_before)  # newer than anything persistent
        assert history_restore(jobs, name, lost) == (step, "peer")  # the farthest any process went
        before = jobs.losses(name, running)
        print(f"node loss: generation {running} reached step {max(before)}; process 1 had committed "
              f"{victim_newest} locally; restored {step}: {victim_newest - step} steps lost")
        assert step >= victim_newest, (step, victim_newest)  # 0 steps lost
        # The same loss curve: the arrays restored are the saved ones.
        next_losses = wait_for(lambda: (g := jobs.losses(name, lost)) and step + 1 in g and g, timeout=300,
                               interval=1, message=f"{name}: step {step + 1} of generation {lost}")
        assert min(next_losses) == step + 1
        if step + 1 in before:
            assert next_losses[step + 1]["loss"] == before[step + 1]["loss"], (before[step + 1], next_losses[step + 1])
        recovery_breakdown(jobs, name, lost, fault, ("NodeLost", "PodLost", "WorkerFailed"))

        # (b) Two hosts that are each other's replica holders lost together.
        wait_for(lambda: (n := local_steps(local_folder(cluster, jobs, name, victim))) and n[-1] > step,
                 timeout=300, interval=0.5, message=f"{name}: the replacement saving a local step of its own")
        replace_nodes(cluster, kube, [victim, holder])
        jobs.wait_status(name, lambda s: s.get("generation") == after and s.get("phase") == "Running", 900,
                         f"generation {after} Running")
        lines3 = wait_restored(jobs, name, after)
        persisted = committed_steps(storage)
        print(f"two hosts lost: persistent tier {persisted}; generation {after} restored {lines3}")
        step3 = lines3["s0-h0"]["restored"]
        assert all(r["restored"] == step3 for r in lines3.values()), lines3
        assert lines3["s0-h1"]["from"] == lines3["s1-h1"]["from"] == "peer", lines3
        assert lines3["s0-h0"]["from"] == lines3["s1-h0"]["from"] == "local", lines3
        assert step3 > step, (step3, step)
        for w in ("s0-h1", "s1-h1"):
            assert lines3[w]["sources"]["persistent"]["files"] == 0 < lines3[w]["sources"]["peer"]["files"], lines3[w]
        assert history_restore(jobs, name, after) == (step3, "peer")
        wait_for(lambda: jobs.losses(name, after), timeout=300, interval=1,
                 message=f"{name}: a step of generation {after}")
    finally:
        missing = [n for n in (victim, holder) if not any(x["name"] == n for x in cluster.nodes())]
        if missing:
            cluster.add_nodes([node_spec(n) for n in missing])
            cluster.wait_nodes_ready(missing, timeout=120)


def restore_lines(jobs: Jobs, name: str, generation: int, workers: list[tuple[int, int]]) -> dict[str, dict[str, Any]]:
    """`s<slice>-h<host>` → the `{"restored", "from", "sources", ...}` line of each of `workers`, once all printed one."""
    def lines() -> dict[str, dict[str, Any]] | None:
        every = restored(jobs, name, generation)
        out = {f"s{s}-h{h}": every[f"s{s}-h{h}"] for s, h in workers if f"s{s}-h{h}" in every}
        return out if len(out) == len(workers) else None
    return wait_for(lines, timeout=900, interval=1, message=f"{name}: every worker of generation {generation} restored")


def test_shrink_restores_from_local_and_peers(
        operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster, tmp_path: Path) -> None:
    """Issue 26, item 4. 2 slices x 2 hosts, a save every 5 steps, `persistEverySteps: 50`: a host of
    slice 0 is killed near step 73; the job shrinks to one slice, on slice 1's nodes, whose processes
    are numbered 0 and 1 now (their local steps were written by processes 2 and 3). Each process reads
    the newest local step (>= 70, newer than anything persistent) from the in-cluster tiers: the
    restore's own report says where every file came from (its node, a peer's sidecar), none from the
    persistent tier. No replica was sent: every host's own step holds the same shards as its peer's
    (the example's parameters are data parallel over the hosts). The checksum refusal and the next
    holder: tests/sidecar/test_peer_chunks.py, tests/ckpt/incluster/test_shrink_restore.py.
    Steps of 0.25 s here (CI time: the test waits for 72 of them); the kill waits for slice 1's local
    tiers to hold step 70, as the steps' pace alone made likely."""
    name, storage = unique_name("nlt-shrink"), tmp_path / "ckpt"
    manifest = job_manifest(name, storage, every_steps=5, steps=5000, step_seconds=0.25, final_save_timeout=20,
                            elastic={"minCount": 1, "maxCount": 2, "growBack": False})
    manifest["spec"]["checkpoint"]["local"] = {"keepLast": 2, "persistEverySteps": 50}
    jobs.create(manifest)
    jobs.wait_status(name, lambda s: s.get("phase") == "Running" and s.get("generation") == 1, 600,
                     "generation 1 Running")
    nodes1 = pod_nodes(jobs, name, 1)
    victim = nodes1["s0-h1"]
    survivors = [local_folder(cluster, jobs, name, nodes1[w]) for w in ("s1-h0", "s1-h1")]

    def near_73() -> bool:
        try:
            return max(jobs.losses(name, 1), default=0) >= 72 and all(
                max(local_steps(f), default=0) >= 70 for f in survivors)
        except FileNotFoundError:  # a step folder renamed or trimmed while listed
            return False
    wait_for(near_73, timeout=900, interval=0.2,
             message=f"{name}: generation 1 at step 72, step 70 in slice 1's local tiers")
    fault = time.time()
    cluster.kill_node(victim)
    try:
        persisted_at_fault = committed_steps(storage)
        jobs.wait_status(name, lambda s: s.get("generation") == 2 and s.get("phase") == "Running"
                         and (s.get("shape") or {}).get("count") == 1, 900, "generation 2 Running on one slice")
        lines = restore_lines(jobs, name, 2, [(0, 0), (0, 1)])
        gen1 = jobs.losses(name, 1)
        print(f"\nshrink: generation 1 reached {max(gen1)}; the persistent tier at the fault {persisted_at_fault}; "
              f"generation 2 restored {json.dumps(lines)}")
        step = lines["s0-h0"]["restored"]
        assert all(r["restored"] == step for r in lines.values()), lines
        assert step >= 70 and step % 50 != 0, lines  # a local step, newer than the persistent tier's 50
        assert step > max(persisted_at_fault, default=0), (step, persisted_at_fault)
        nodes2 = pod_nodes(jobs, name, 2)
        assert set(nodes2.values()) == {nodes1["s1-h0"], nodes1["s1-h1"]}, (nodes1, nodes2)
        for worker, r in lines.items():
            # From the in-cluster tiers, by the restore's own account: the files this process's new
            # mesh needs, from its node's local tier (written under another process number) or a peer.
            assert r["from"] in ("local", "peer"), (worker, r)
            sources = r["sources"]
            assert sources is not None, (worker, r)
            assert sources["persistent"] == {"files": 0, "bytes": 0}, (worker, sources)
            assert sources["local"]["files"] + sources["peer"]["files"] > 0, (worker, sources)
        # No replica kept: each holder's own step had the same shards.
        assert not held_replicas(cluster, jobs, name, sorted(set(nodes1.values()) - {victim})), "replicas kept"
        # The same loss curve: the arrays restored are the saved ones.
        gen2 = wait_for(lambda: (g := jobs.losses(name, 2)) and step + 1 in g and g, timeout=300, interval=1,
                        message=f"{name}: step {step + 1} of generation 2")
        assert min(gen2) == step + 1
        if step + 1 in gen1:
            assert gen2[step + 1]["loss"] == gen1[step + 1]["loss"], (gen1[step + 1], gen2[step + 1])
        recovery_breakdown(jobs, name, 2, fault, ("NodeLost", "NodeNotReady", "PodLost", "WorkerFailed"))
    finally:
        if {n["name"]: n["state"] for n in cluster.nodes()}.get(victim) != "Ready":
            cluster.restore_node(victim)


def test_baseline_pod_security_refuses_node_scope_with_the_fix_in_the_condition(
        operator: OperatorProcess, jobs: Jobs, kube: KubeClient, namespace: str, tmp_path: Path) -> None:
    kube.patch(f"/api/v1/namespaces/{namespace}",
               {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "baseline"}}})
    name = unique_name("nlt-pss")
    manifest = job_manifest(name, tmp_path / "ckpt", every_steps=EVERY, steps=5000, step_seconds=0.5)
    manifest["spec"]["checkpoint"]["local"] = {}
    jobs.create(manifest)

    def refused() -> dict[str, Any] | None:
        ready = next((c for c in jobs.status(name).get("conditions") or [] if c["type"] == "Ready"), None)
        return ready if ready and ready.get("reason") == "PodCreationRefused" else None
    ready = wait_for(refused, timeout=120, interval=0.5, message=f"{name}: PodCreationRefused")
    print(f"\nPodCreationRefused: {ready['message']}")
    assert ready["status"] == "False"
    assert "hostPath" in ready["message"] and "baseline" in ready["message"]  # the API server's answer
    assert "checkpoint.local.scope: Pod" in ready["message"]  # and the fix
    assert "pod-security.kubernetes.io/enforce=privileged" in ready["message"]
    def refused_events() -> list[dict[str, Any]]:
        return [e for e in jobs.events(name) if e["reason"] == "PodCreationRefused"]
    # kopf posts events from a queue of its own: the event may land just after the status
    events = wait_for(refused_events, timeout=60, interval=0.5, message=f"{name}: a PodCreationRefused event")
    assert len(events) == 1 and events[0]["type"] == "Warning"
    assert not jobs.pods(name)
    # the fix: scope Pod (an emptyDir) passes baseline
    jobs.patch_spec(name, {"checkpoint": {"local": {"scope": "Pod"}}})
    wait_for(lambda: jobs.pods(name), timeout=120, interval=0.5, message=f"{name}: a worker pod created")
