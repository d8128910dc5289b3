"""Shrink and grow restore from the in-cluster tiers (issue 26, item 4; docs/checkpointing.md §9,
"Restores from the in-cluster tiers"): which host serves each chunk file (pure tables), and a real
shrink: four JAX processes save on a 4x2 mesh into four nodes' local tiers, with the peer replicas
the sidecars keep; slice 1 (two nodes) is lost; two processes on the surviving nodes, numbered the
other way round, restore the newest local step onto a 2x4 mesh through real sidecars, each from its
own node and the other's, none of it from the persistent tier (which lags behind)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from resilax_ckpt import layout
from resilax_ckpt.incluster import peers as rules
from resilax_ckpt.incluster.chunk_sources import Copy, Source, complete_saves, other_files, plan_file_sources

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "sidecar"))
from ckpt_procs import run_processes
from sidecar_harness import SidecarProcess, build_sidecar_env
from test_local_tier import merge_like_the_uploader


def copy(step: int, folder: str, chunks: set[str], save: str = "s1", total: int = 4,
         others: frozenset[str] = frozenset()) -> Copy:
    return Copy(step, save, folder, frozenset(chunks), others, total, "_METADATA.0.json")


A, B, C, D = "p/w/c/0/0", "p/w/c/1/0", "p/w/c/2/0", "p/w/c/3/0"


# ---------------------------------------------------------------- which host serves what (pure)


@pytest.mark.parametrize(("views", "complete"), [
    ({0: [copy(10, "local", {A, B})], 1: [copy(10, "local", {C, D})]}, {10: "s1"}),
    ({0: [copy(10, "local", {A, B})], 1: [copy(10, "local", {C})]}, {}),  # D on no surviving node
    ({0: [copy(10, "local", {A}), copy(10, "p2", {C, D})], 1: [copy(10, "local", {B})]}, {10: "s1"}),  # replicas
    ({0: [copy(10, "local", {A, B})], 1: [copy(10, "local", {C, D}, save="s2")]}, {}),  # two saves never mix
    ({0: [copy(10, "local", {A, B, C, D}, save="s1"), copy(10, "p1", {A, B, C, D}, save="s2")]},
     {10: "s2"}),  # both whole: the same choice on every process
    ({0: [copy(10, "local", {A, B, C, D}), copy(15, "local", {A})], 1: []}, {10: "s1"}),
    ({0: [copy(10, "local", set(), total=0)]}, {}),
], ids=["split-over-two-nodes", "a-chunk-lost", "with-replicas", "saves-differ", "two-saves-whole",
        "older-whole-newer-partial", "empty"])
def test_complete_saves(views, complete) -> None:
    assert complete_saves(views) == complete


VIEWS = {0: [copy(10, "local", {A, B}), copy(10, "p3", {D})],
         1: [copy(10, "p2", {C, D}), copy(10, "local", {B, C})],
         2: [copy(10, "local", {A, D})]}


@pytest.mark.parametrize(("me", "needed", "plan"), [
    (0, [A], {A: [Source(0, "local"), Source(2, "local")]}),  # own node first, then process order
    (1, [A], {A: [Source(0, "local"), Source(2, "local")]}),
    (1, [B], {B: [Source(1, "local"), Source(0, "local")]}),  # own local step before anyone else
    (1, [D], {D: [Source(1, "p2"), Source(0, "p3"), Source(2, "local")]}),  # a node's local step before its replicas
    (2, [B, C], {B: [Source(0, "local"), Source(1, "local")], C: [Source(1, "local"), Source(1, "p2")]}),
    (0, ["p/w/c/9/9"], {"p/w/c/9/9": []}),  # nobody: the persistent tier
], ids=["own-first", "others-in-order", "own-step", "local-before-replica", "two-files", "nobody"])
def test_plan_file_sources(me, needed, plan) -> None:
    assert plan_file_sources(VIEWS, me, 10, "s1", needed) == plan


def test_other_files_are_every_process_s_shared_files_and_only_its_own_per_process_ones() -> None:
    views = {0: [copy(10, "local", {A}, others=frozenset({"p/w/zarr.json", "data/process_0.json", "m.json"}))],
             1: [copy(10, "local", {B}, others=frozenset({"p/w/zarr.json", "data/process_1.json"}))]}
    assert other_files(views, 10, "s1", 1) == ["data/process_1.json", "m.json", "p/w/zarr.json"]
    assert other_files(views, 10, "s2", 1) == []


# ---------------------------------------------------------------- a real shrink


def replicate_like_the_sidecars(nodes: list[Path], step: int) -> dict[int, int]:
    """What each holder's replicator keeps (resilax_sidecar.peers with the placement of
    resilax_ckpt.incluster.peers.plan_peers): `<holder>/_peer/p<origin>/<step>/` and its `_REPLICA.json`."""
    from resilax_sidecar.peers import build_manifest, save_identity

    hosts = [rules.PeerHost(p, p // 2, f"n{p}") for p in range(len(nodes))]
    placement = rules.plan_peers(hosts)
    for origin, holder in placement.items():
        src = nodes[origin] / str(step)
        dst = nodes[holder] / rules.PEER_DIR / rules.origin_dir_name(origin) / str(step)
        shutil.copytree(src, dst)
        manifest = build_manifest(src, origin, step, save_identity(src / layout.commit_name(origin)))
        (dst / rules.REPLICA_FILE).write_text(json.dumps(manifest))
    return placement


@pytest.mark.slow
def test_a_shrunk_generation_restores_onto_a_new_mesh_from_the_survivors_local_tiers_and_replicas(
        tmp_path: Path) -> None:
    nodes = [tmp_path / f"n{p}" / "local" for p in range(4)]
    persistent = tmp_path / "persistent"
    # Generation 1: 2 slices x 2 hosts, one process per node, a 4x2 mesh ("w" split by rows over the
    # processes: each holds its own rows); local steps 5 and 10, only 5 in the persistent tier.
    run_processes({"scenario": "save", "root": str(tmp_path / "n{pid}" / "local"), "mesh": [4, 2], "steps": [5, 10],
                   "options": {"local_tier": True, "generation": 1}}, num_processes=4)
    merge_like_the_uploader([str(n) for n in nodes], 5, str(persistent), generation=1)
    assert replicate_like_the_sidecars(nodes, 10) == {0: 2, 1: 3, 2: 0, 3: 1}
    # Slice 1 is lost, its nodes' disks with it.
    for lost in nodes[2:]:
        shutil.rmtree(lost.parent)
    # Generation 2: one slice, 2 processes x 4 devices on the survivors, numbered the other way round
    # (process 0 on old process 1's node), each with its sidecar; a 2x4 mesh.
    survivors = [nodes[1], nodes[0]]
    sidecars = []
    try:
        options = []
        for pid, local in enumerate(survivors):
            env = build_sidecar_env(local.parent)
            env.update({"RESILAX_LOCAL_DIR": str(local), "RESILAX_CHECKPOINT_DIR": str(persistent),
                        "JAX_PROCESS_ID": str(pid), "JAX_NUM_PROCESSES": "2", "RESILAX_PEER_BYTES_PER_SECOND": "0",
                        "RESILAX_PERSIST_EVERY_STEPS": "1000", "RESILAX_GENERATION": "2"})
            sidecar = SidecarProcess(env, tmp_path / f"sidecar-{pid}.log")
            sidecars.append(sidecar)
            sidecar.wait_ready()
            # control_dir: the trainer writes peers.json there, the only sources its sidecar fetches from
            options.append({"sidecar_address": f"127.0.0.1:{sidecar.port}", "control_dir": env["RESILAX_CONTROL_DIR"],
                            "sidecar_token_file": env["RESILAX_SIDECAR_TOKEN_FILE"], "node_name": local.parent.name})
        restored = run_processes({"scenario": "restore", "roots": [str(n) for n in survivors],
                                  "persistent": str(persistent), "mesh": [2, 4], "latest_from_env": True,
                                  "options": {"local_tier": True, "generation": 2}, "process_options": options},
                                 num_processes=2)
        logs = [s.log() for s in sidecars]
    finally:
        for s in sidecars:
            s.close()
    print(json.dumps([r["report"] for r in restored], indent=1))
    # Every shard checked against the saved values in the workers; the newest step, not the persistent 5.
    assert [r["step"] for r in restored] == [10, 10]
    for r in restored:
        sources = r["report"]["sources"]
        assert r["restored_from"] == "peer", r
        # Process 0 (on n1) reads old 1's rows from its node, old 0's from n0; process 1 (on n0) old 2's
        # from its node's replica, old 3's from the replica on n1: local and peer, never persistent.
        assert sources["local"]["files"] > 0 and sources["peer"]["files"] > 0, sources
        assert sources["persistent"] == {"files": 0, "bytes": 0}, sources
        assert sources["refused"] == []
    assert all("fetched from peers" in log for log in logs), logs
    for local in survivors:  # the assembled folders are gone
        assert not [p for p in local.iterdir() if p.name.startswith(".tmp-fetch")]
