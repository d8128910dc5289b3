"""CheckpointManager in one process: async saves, failures, policy, retention, fencing, requests,
SIGTERM, and kill -9 at every phase of a save."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import threading

import ckpt_worker
import jax
import numpy as np
import pytest
import resilax_ckpt as rc
from ckpt_procs import WorkerFailed, run_processes
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt import commit
from resilax_ckpt.history import fencing


def state(step: int):
    m = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    w = np.arange(64, dtype=np.float32).reshape(8, 8) + step
    return {"params": {"w": jax.device_put(w, NamedSharding(m, P("a", "b")))}, "meta": {"step": step}}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_async_save_then_wait_commits_and_second_save_queues(tmp_path, devices):
    with rc.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.save(1, state(1))
        assert mgr.save(2, state(2))  # waits for step 1's commit, then snapshots step 2
        assert mgr.steps() == [1]
        mgr.wait()
        assert mgr.steps() == [1, 2]
        assert mgr.latest_step() == 2
        assert not mgr.save(2, state(2))  # already saved
        np.testing.assert_array_equal(mgr.restore(1)["params"]["w"], np.asarray(state(1)["params"]["w"]))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


@contextlib.contextmanager
def snapshot_copy_compiles():
    """Yields a list that collects the name of the thread of every compile of the snapshot copy."""
    threads: list[str] = []

    def listener(event: str, duration: float, **kwargs: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and "_device_copy" in str(kwargs.get("fun_name")):
            threads.append(threading.current_thread().name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield threads
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def odd_state(rows: int, step: int):
    """A state whose shapes (rows x 8) no other test uses: jit's caches are per process."""
    m = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    w = np.arange(rows * 8, dtype=np.float32).reshape(rows, 8) + step
    return {"params": {"w": jax.device_put(w, NamedSharding(m, P("a", "b"))),
                       "b": jax.device_put(np.full((rows,), step, np.float32), NamedSharding(m, P()))}}


def test_the_first_save_compiles_its_copy_on_the_loop_thread_without_a_prepare(tmp_path, devices):
    # The control of the two tests below: a save as the manager's first call compiles in the loop.
    with snapshot_copy_compiles() as threads, rc.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.save(1, odd_state(24, 1))
        mgr.wait()
    assert threads == [threading.main_thread().name]


def test_a_save_that_does_not_save_compiles_the_first_saves_copy_in_the_background(tmp_path, devices):
    opts = rc.ManagerOptions(save_every_steps=2)
    with snapshot_copy_compiles() as threads, rc.CheckpointManager(str(tmp_path), opts) as mgr:
        assert not mgr.save(1, odd_state(40, 1))
        assert mgr.save(2, odd_state(40, 2))
        mgr.wait()
        assert not mgr.save(3, odd_state(48, 3))  # after the first save: nothing compiled ahead
        assert mgr.save(4, odd_state(48, 4))
        mgr.wait()
        got = mgr.restore(2, target={"params": odd_state(40, 0)["params"]})["params"]
    assert len(threads) == 2 and threads[0].startswith("resilax-ckpt") and threads[1] == threading.main_thread().name
    np.testing.assert_array_equal(got["w"], np.asarray(odd_state(40, 2)["params"]["w"]))
    assert got["w"].sharding == odd_state(40, 0)["params"]["w"].sharding


def test_after_restore_the_first_save_of_the_restored_state_compiles_nothing_in_the_loop(tmp_path, devices):
    with rc.CheckpointManager(str(tmp_path / "a")) as mgr:  # saved from host arrays: no device copy
        mgr.save(5, jax.tree.map(np.asarray, odd_state(56, 5)))
    with snapshot_copy_compiles() as threads, rc.CheckpointManager(str(tmp_path / "a")) as mgr:
        restored = mgr.restore(target=odd_state(56, 0))
        assert mgr.save(6, restored)
        mgr.wait()
        again = mgr.restore(6, target=odd_state(56, 0))
    assert threads and all(t.startswith("resilax-ckpt") for t in threads)
    np.testing.assert_array_equal(again["params"]["w"], np.asarray(odd_state(56, 5)["params"]["w"]))


def test_a_restore_to_host_arrays_leaves_the_compile_ahead_to_the_next_save_call(tmp_path, devices):
    with rc.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, jax.tree.map(np.asarray, odd_state(64, 1)))
    opts = rc.ManagerOptions(save_every_steps=4)
    with snapshot_copy_compiles() as threads, rc.CheckpointManager(str(tmp_path), opts) as mgr:
        host = mgr.restore()  # NumPy arrays: nothing to compile yet
        assert isinstance(host["params"]["w"], np.ndarray)
        assert not mgr.save(2, odd_state(64, 2))
        assert mgr.save(4, odd_state(64, 4))
        mgr.wait()
    assert len(threads) == 1 and threads[0].startswith("resilax-ckpt")


def test_background_failure_surfaces_from_wait_and_next_save(tmp_path, devices):
    mgr = rc.CheckpointManager(str(tmp_path))
    (tmp_path / ".tmp-5-g0").write_text("a file where the step folder goes")
    assert mgr.save(5, state(5))
    with pytest.raises(rc.StorageError, match=r"\.tmp-5-g0"):
        mgr.wait()
    (tmp_path / ".tmp-6-g0").write_text("again")
    mgr.save(6, state(6))
    with pytest.raises(rc.StorageError):
        mgr.save(7, state(7))  # the failure of step 6 is raised here, before step 7 is taken
    assert mgr.steps() == []
    mgr.close()


def test_policy_every_steps_and_seconds_with_injected_clock(tmp_path, devices):
    clock = FakeClock()
    opts = rc.ManagerOptions(save_every_steps=3, save_every_seconds=60, clock=clock)
    with rc.CheckpointManager(str(tmp_path), opts) as mgr:
        saved = [s for s in range(1, 8) if mgr.save(s, state(s))]
        assert saved == [3, 6]
        clock.now += 61
        assert mgr.save(7, state(7))
        assert not mgr.save(8, state(8))
        assert mgr.save(8, state(8), force=False) is False
        assert mgr.save(10, state(10), force=True)
        assert not mgr.save(10, state(10), force=True)  # the step is saved already
        mgr.wait()
        assert mgr.steps() == [3, 6, 7, 10]


def test_retention_keeps_last_and_every(tmp_path, devices):
    opts = rc.ManagerOptions(keep_last=2, keep_every_steps=4, async_save=False)
    with rc.CheckpointManager(str(tmp_path), opts) as mgr:
        for step in range(1, 10):
            mgr.save(step, state(step))
        assert mgr.steps() == [4, 8, 9]


def test_retention_never_deletes_the_step_being_restored(tmp_path, devices):
    with rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(keep_last=1, async_save=False)) as mgr:
        mgr.save(1, state(1))
        mgr.restore(1)
        mgr.save(2, state(2))
        mgr.save(3, state(3))
        assert mgr.steps() == [1, 3]


def test_fencing_old_generation_cannot_commit(tmp_path, devices):
    old = rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(generation=1))
    old.save(1, state(1))
    old.wait()
    new = rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(generation=2))
    assert fencing.read_fences(new._storage, str(tmp_path)) == {(0, 1): None, (0, 2): 1}
    old.save(2, state(2))
    with pytest.raises(rc.FencedError, match="generation 1 may not commit; a newer set of workers exists \\(generation 2\\)"):
        old.wait()
    assert new.steps() == [1]
    new.save(2, state(2))
    new.wait()
    assert new.steps() == [1, 2]
    old.close()
    new.close()


def test_fencing_hides_a_commit_that_raced_the_fence(tmp_path, devices, monkeypatch):
    old = rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(generation=1, async_save=False))
    old.save(1, state(1))
    new = rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(generation=2, async_save=False))
    # The old generation checked the fences just before the new one wrote its fence, then committed:
    monkeypatch.setattr(fencing, "check_not_fenced", lambda *a, **k: None)
    old.save(5, state(5))
    monkeypatch.undo()
    assert commit.list_committed(new._storage, str(tmp_path)) == [1, 5]
    assert new.steps() == [1]
    assert new.latest_step() == 1
    with pytest.raises(rc.StepNotCommittedError):
        new.restore(5)
    new.save(5, state(50))  # the new generation may reuse the step number
    np.testing.assert_array_equal(new.restore(5)["params"]["w"], np.asarray(state(50)["params"]["w"]))
    restarted = rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(generation=3))
    assert restarted.steps() == [1, 5]
    for m in (old, new, restarted):
        m.close()


def write_request(control, rid, stop):
    os.makedirs(control / "requests", exist_ok=True)
    (control / "requests" / f"{rid}.json.tmp").write_text(json.dumps({"id": rid, "reason": "manual", "stop": stop}))
    os.rename(control / "requests" / f"{rid}.json.tmp", control / "requests" / f"{rid}.json")


def test_save_request_file_forces_a_save_and_writes_a_result(tmp_path, devices):
    control = tmp_path / "control"
    opts = rc.ManagerOptions(save_every_steps=100, control_dir=str(control))
    with rc.CheckpointManager(str(tmp_path / "ck"), opts) as mgr:
        assert not mgr.save(1, state(1))
        write_request(control, "a", stop=False)
        assert mgr.save(2, state(2))
        assert not mgr.should_stop
        mgr.wait()
        assert json.loads((control / "results" / "a.json").read_text()) == {
            "id": "a", "step": 2, "committed": True, "error": None}
        assert not (control / "requests" / "a.json").exists()
        assert not mgr.save(3, state(3))
        write_request(control, "b", stop=True)
        assert mgr.save(4, state(4))
        assert mgr.should_stop
        assert json.loads((control / "results" / "b.json").read_text())["step"] == 4
        assert mgr.steps() == [2, 4]


def _exclusive_lock_free(path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_live_manager_holds_the_trainer_lock_until_closed(tmp_path, devices):
    control = tmp_path / "control"
    mgr = rc.CheckpointManager(str(tmp_path / "ck"), rc.ManagerOptions(control_dir=str(control)))
    assert not _exclusive_lock_free(control / "trainer.lock")  # the sidecar sees a live trainer
    mgr.close()
    assert _exclusive_lock_free(control / "trainer.lock")


def test_sigterm_is_a_stop_request(tmp_path, devices):
    with rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(save_every_steps=100)) as mgr:
        assert not mgr.save(1, state(1))
        os.kill(os.getpid(), signal.SIGTERM)
        assert mgr.save(2, state(2))
        assert mgr.should_stop
        assert mgr.steps() == [2]
    assert rc.EXIT_CODE_STOPPED == 75


def test_from_env(tmp_path, devices):
    env = {"RESILAX_CHECKPOINT_DIR": str(tmp_path), "RESILAX_SAVE_EVERY_STEPS": "5", "RESILAX_KEEP_LAST": "2",
           "RESILAX_GENERATION": "4", "RESILAX_SAVE_EVERY_SECONDS": "", "RESILAX_RESTORE_STEP": "none"}
    with rc.CheckpointManager.from_env(env) as mgr:
        assert mgr._options.save_every_steps == 5 and mgr._options.keep_last == 2
        assert mgr._options.generation == 4 and mgr._options.save_every_seconds is None
        assert mgr.restore_step_from_env(env) is None
        assert mgr.restore_step is None or mgr.restore_step == mgr.latest_step()
    with pytest.raises(rc.InvalidOptionsError, match="RESILAX_KEEP_LAST: 'x' is not an integer"):
        rc.ManagerOptions.from_env({"RESILAX_KEEP_LAST": "x"})
    assert rc.initialize_distributed_from_env({}) is False


PHASES = ["before_writes", "mid_writes", "after_writes", "before_commit", "after_commit"]


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_kill_during_save_leaves_the_last_commit_intact(tmp_path, devices, phase):
    root = str(tmp_path / "ck")
    mesh = ckpt_worker.global_mesh([4, 2])
    with rc.CheckpointManager(root) as mgr:
        mgr.save(1, {"params": ckpt_worker.make_state(1, mesh)})
    with pytest.raises(WorkerFailed) as failed:
        run_processes({"scenario": "save", "root": root, "mesh": [4, 2], "steps": [2]},
                      env={"RESILAX_CKPT_TEST_CRASH_AT": phase})
    assert failed.value.code == -signal.SIGKILL
    want = 2 if phase == "after_commit" else 1
    leftovers = [n for n in os.listdir(root) if n.startswith(".tmp")]
    assert bool(leftovers) == (phase in ("mid_writes", "after_writes", "before_commit"))
    mgr = rc.CheckpointManager(root)  # a new generation's start cleans the leftovers
    assert not [n for n in os.listdir(root) if n.startswith(".tmp")]
    assert mgr.steps() == [1, 2][:want]
    m2 = ckpt_worker.global_mesh([2, 4])
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(m2, P("b")))
                         for k, v in ckpt_worker.expected(want).items()}}
    out = mgr.restore(target=target, items=["params"])
    for name, value in ckpt_worker.expected(want).items():
        np.testing.assert_array_equal(np.asarray(out["params"][name]), value)
    mgr.close()
