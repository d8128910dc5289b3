"""Several real JAX processes (jax.distributed on 127.0.0.1, gloo): save with 2 x 4 devices, restore
with 4 x 2 and 1 x 8; per-process items; one agreed step for a save request."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
import resilax_ckpt as rc
from ckpt_procs import WorkerFailed, run_processes
from ckpt_worker import expected, global_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

pytestmark = pytest.mark.slow


def test_save_2x4_restore_4x2_and_1x8(tmp_path, devices):
    root = str(tmp_path / "ck")
    saved = run_processes({"scenario": "save", "root": root, "mesh": [4, 2], "steps": [3, 4]}, num_processes=2)
    assert [r["steps"] for r in saved] == [[3, 4], [3, 4]]
    assert sorted(os.listdir(os.path.join(root, "4", "data"))) == ["process_0.json", "process_1.json"]

    four = run_processes({"scenario": "restore", "root": root, "mesh": [2, 4],
                          "specs": {"w": ["b", "a"], "b": ["b"], "e": [None, "a"]}}, num_processes=4)
    assert [r["step"] for r in four] == [4, 4, 4, 4]
    assert all(r["meta"] == {"step": 4} for r in four)
    # per-process items come back to the process with the same index; new processes get None
    assert [r["data"] for r in four] == [{"process": 0, "step": 4}, {"process": 1, "step": 4}, None, None]

    # 1 process x 8 devices: this one
    mesh = global_mesh([8, 1])
    specs = {"w": P("a", None), "b": P(), "e": P("a", None)}
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
                         for k, v in expected(3).items()}}
    out = rc.CheckpointManager(root).restore(3, target=target)
    for name, value in expected(3).items():
        assert out["params"][name].sharding == target["params"][name].sharding
        np.testing.assert_array_equal(np.asarray(out["params"][name]), value)
    assert out["data"] == {"process": 0, "step": 3} and out["meta"] == {"step": 3}


def test_two_processes_store_column_major_leaves_alike_and_four_restore_them(tmp_path):
    """Every process chooses the same order for the same array (host_layout.landing_order: the array's
    layout, here forced by RESILAX_CKPT_FORCE_COLUMN_MAJOR on each), so the primary's metadata and
    zarr.json describe every process's shard files; 4 processes restore them onto (2, 4) bit-exact."""
    root = str(tmp_path / "ck")
    run_processes({"scenario": "save", "root": root, "mesh": [4, 2], "steps": [4]}, num_processes=2,
                  env={"RESILAX_CKPT_FORCE_COLUMN_MAJOR": "1"})
    with open(os.path.join(root, "4", "_METADATA.json")) as f:
        leaves = json.load(f)["items"]["params"]["leaves"]
    assert {leaf["keystr"]: leaf.get("transpose") for leaf in leaves} == {"['w']": [1, 0], "['b']": None,
                                                                          "['e']": [1, 0]}
    four = run_processes({"scenario": "restore", "root": root, "mesh": [2, 4],
                          "specs": {"w": ["b", "a"], "b": ["b"], "e": [None, "a"]}}, num_processes=4)
    assert [r["step"] for r in four] == [4, 4, 4, 4]  # each checked its shards against the saved values


@pytest.mark.parametrize("stop", [False, True], ids=["save", "save-and-stop"])
def test_request_on_one_process_saves_one_agreed_step_everywhere(tmp_path, stop):
    root = str(tmp_path / "ck")
    results = run_processes({"scenario": "requests", "root": root, "mesh": [4, 2], "steps": 8,
                             "control": str(tmp_path / "control"), "requester": 1, "request_at": 4,
                             "stop": stop}, num_processes=2)
    saved = [r["saved"] for r in results]
    assert saved[0] == saved[1] and len(saved[0]) == 1, saved
    step = saved[0][0]
    assert step >= 4
    assert results[0]["steps"] == [step]
    assert results[1]["results"] == {"r1.json": {"id": "r1", "step": step, "committed": True, "error": None}}
    assert results[0]["results"] == {}
    if stop:
        assert [r["stopped_at"] for r in results] == [step, step]
    else:
        assert [r["stopped_at"] for r in results] == [None, None]


@pytest.mark.parametrize(("local_tier", "processes", "requester"), [(False, 2, 0), (True, 4, 2)],
                         ids=["shared-folder-2-processes", "local-tier-4-processes"])
def test_sigterm_to_one_process_saves_one_agreed_step_and_stops_all(tmp_path, local_tier, processes, requester):
    """SIGTERM is a stop request in every mode: the process that got it and all the others save the
    same step (with a local tier, each its own copy with its own marker), record it for the sidecar,
    and stop."""
    results = run_processes({"scenario": "requests", "root": str(tmp_path / "ck"), "mesh": [4, 2], "steps": 100,
                             "control": str(tmp_path / "control"), "requester": requester, "request_at": 3,
                             "sigterm": True, "step_seconds": 0.05, "options": {"local_tier": local_tier}},
                            num_processes=processes)
    saved = [r["saved"] for r in results]
    assert all(s == saved[0] for s in saved) and len(saved[0]) == 1, saved
    step = saved[0][0]
    assert step >= 3
    assert [r["stopped_at"] for r in results] == [step] * processes
    assert [r["steps"] for r in results] == [[step]] * processes  # committed: each process's view of its tier
    assert [r["stop_record"] for r in results] == [step] * processes
    assert all(r["results"] == {} for r in results)  # no request file asked: nothing to answer
    if local_tier:
        markers = sorted(p.name for p in (tmp_path / "ck" / str(step)).iterdir() if p.name.startswith("_COMMIT"))
        assert markers == [f"_COMMIT.{i}" for i in range(processes)]


def test_kill_one_of_two_saving_processes_mid_writes(tmp_path, devices):
    root = str(tmp_path / "ck")
    run_processes({"scenario": "save", "root": root, "mesh": [4, 2], "steps": [1]}, num_processes=2)
    with pytest.raises(WorkerFailed) as failed:
        run_processes({"scenario": "save", "root": root, "mesh": [4, 2], "steps": [2]}, num_processes=2,
                      env={"RESILAX_CKPT_TEST_CRASH_AT": "mid_writes:1"}, timeout=90)
    assert failed.value.code != 0
    assert [n for n in os.listdir(root) if n.startswith(".tmp")]  # process 0 got as far as writing
    mgr = rc.CheckpointManager(root)  # the next generation: cleans up, sees step 1 only
    assert mgr.steps() == [1]
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")]
    out = mgr.restore(target={"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
        global_mesh([2, 4]), P("b"))) for k, v in expected(1).items()}})
    for name, value in expected(1).items():
        np.testing.assert_array_equal(np.asarray(out["params"][name]), value)
    mgr.close()


def test_init_timeout_from_the_environment_ends_a_lonely_process() -> None:
    """RESILAX_INIT_TIMEOUT_SECONDS (the operator sets it where workers may wait for others' nodes) is
    how long `initialize_distributed_from_env` waits for the other processes: process 0 of 2, alone,
    gives up after 3 s instead of JAX's default 300 s (the subprocess limit, 150 s, would end it then)."""
    import subprocess
    import sys

    from resilax_local.processes import free_port

    code = ("from resilax_ckpt.multihost import initialize_distributed_from_env\n"
            f"initialize_distributed_from_env({{'JAX_COORDINATOR_ADDRESS': '127.0.0.1:{free_port()}', "
            "'JAX_NUM_PROCESSES': '2', 'JAX_PROCESS_ID': '0', 'RESILAX_INIT_TIMEOUT_SECONDS': '3'})\n"
            "print('INITIALIZED')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=150,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode != 0 and "INITIALIZED" not in done.stdout, done.stderr[-2000:]
    assert "Deadline" in done.stderr or "DEADLINE" in done.stderr or "timed out" in done.stderr, done.stderr[-2000:]
