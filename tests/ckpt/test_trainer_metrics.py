"""The manager's figures for the sidecar (trainer.json in the control folder): the step reached,
saves and the loop time they blocked, restores and their time."""

from __future__ import annotations

import numpy as np
import resilax_ckpt as rc
from resilax_ckpt.control.trainer_metrics import read_trainer_figures


def test_the_manager_writes_its_figures_into_the_control_folder(tmp_path, devices):
    control = str(tmp_path / "control")
    options = rc.ManagerOptions(save_every_steps=5, control_dir=control, async_save=False)
    with rc.CheckpointManager(str(tmp_path / "ckpt"), options) as mgr:
        assert read_trainer_figures(control) is None or read_trainer_figures(control)["saves"] == 0
        for step in range(1, 11):
            mgr.save(step, {"w": np.full((64,), step, np.float32)})
        figures = read_trainer_figures(control)
        assert figures is not None
        assert figures["saves"] == 2 and figures["step"] == 10
        assert figures["save_blocking_seconds"] >= figures["last_save_blocking_seconds"] > 0
        mgr.restore(5)
        figures = read_trainer_figures(control)
        assert figures["restores"] == 1 and figures["restored_step"] == 5 and figures["last_restore_seconds"] > 0


def test_the_figures_carry_the_wall_times_the_goodput_accounting_reads(tmp_path):
    """When the loop first reached its newest step and its first step, and when the restore ended
    (the operator's goodput accounting, resilax_operator.status_fields.goodput, reads them from /v1/state)."""
    from resilax_ckpt.control.trainer_metrics import TrainerMetrics

    wall = [0.0]
    m = TrainerMetrics(str(tmp_path), clock=lambda: wall[0], wall_clock=lambda: wall[0])
    wall[0] = 100.0
    m.restored(7, 2.5)
    wall[0] = 103.0
    m.step(8)
    wall[0] = 103.5
    m.step(8)  # the same step again: its time stays
    wall[0] = 110.0
    m.step(9)
    wall[0] = 110.2
    m.step(9)  # within the write interval: not written, the file keeps step 9 reached at 110
    f = read_trainer_figures(str(tmp_path))
    assert f is not None
    assert (f["restored_time"], f["last_restore_seconds"], f["restored_step"]) == (100.0, 2.5, 7)
    assert (f["first_step"], f["first_step_time"]) == (8, 103.0)
    assert (f["step"], f["step_time"], f["time"]) == (9, 110.0, 110.0)


def test_the_phase_follows_the_manager_and_a_heartbeat_thread_rewrites_the_file_while_the_loop_is_blocked(
        tmp_path, devices):
    """init until the first step, restore while restoring (then init until the loop steps again), train,
    save while a save blocks; the heartbeat keeps moving with no call from the loop (hang detection:
    a stopped process's heartbeat stops, a loop stuck in a collective keeps one)."""
    import time

    control = str(tmp_path / "control")
    options = rc.ManagerOptions(save_every_steps=2, control_dir=control, async_save=False)
    phases = []
    with rc.CheckpointManager(str(tmp_path / "ckpt"), options) as mgr:
        trainer = mgr._trainer
        written = trainer._write_locked

        def spy(now: float) -> None:  # every phase the file was written with, in order
            if not phases or phases[-1] != trainer.figures.phase:
                phases.append(trainer.figures.phase)
            written(now)

        trainer._write_locked = spy
        first = read_trainer_figures(control)
        for step in range(1, 3):
            mgr.save(step, {"w": np.full((64,), step, np.float32)})
        mgr.restore(2)
        figures = read_trainer_figures(control)
        assert figures["phase"] == "init" and figures["phase_since"] == figures["restored_time"]
        mgr.save(3, {"w": np.full((64,), 3, np.float32)})
        beat = read_trainer_figures(control)["heartbeat"]
        deadline = time.monotonic() + 30
        while read_trainer_figures(control)["heartbeat"] == beat:  # no loop call: the thread writes
            assert time.monotonic() < deadline, "no heartbeat within 30 s"
            time.sleep(0.05)
        assert read_trainer_figures(control)["step"] == 3
    assert first is None or first["phase"] == "init"
    if phases[:1] == ["init"]:  # the heartbeat wrote before the first step (a slow start)
        phases = phases[1:]
    assert phases == ["train", "save", "train", "restore", "init", "train"], phases


def test_step_times_leave_out_the_warm_up_and_the_barrier_wait(tmp_path):
    """The p99 of the time between steps (the operator's automatic hang timeout) and the host's own
    median step time (the straggler figure: the time between steps less the barrier wait) count only
    steps after WARMUP_STEPS; the saves' p99 comes from the blocking time of each save."""
    from resilax_ckpt.control.trainer_metrics import WARMUP_STEPS, TrainerMetrics, p99

    clock = [0.0]
    m = TrainerMetrics(str(tmp_path), clock=lambda: clock[0], wall_clock=lambda: clock[0])
    for step in range(1, WARMUP_STEPS + 2):
        clock[0] += 30.0  # compiling: never counted
        m.step(step)
    assert m.figures.step_seconds_p99 is None
    for step in range(WARMUP_STEPS + 2, WARMUP_STEPS + 102):
        clock[0] += 2.0 if step in (WARMUP_STEPS + 50, WARMUP_STEPS + 80) else 0.5  # two slow steps of 100
        if step % 10 == 0:
            m.waited(0.4)  # waited for a slower peer at the barrier
        m.step(step)
    f = m.figures
    assert f.step_seconds_p99 == 2.0 and f.step_seconds == 0.5
    assert abs(f.barrier_wait_seconds - 0.4 * 10) < 1e-9
    m.saved(0.2)
    m.saved(1.5)
    assert m.figures.save_seconds_p99 == 1.5
    assert p99([float(i) for i in range(1, 101)]) == 99.0 and p99([]) is None


def test_a_process_the_watchdog_ends_at_once_still_tells_its_last_step(tmp_path):
    """A peer's loss ends a trainer with os._exit(76) (multihost.arm_exit_watchdog), which skips atexit and
    finally; the step figures are written at most once a second, so its last steps would go untold and the
    operator's count of the steps a recovery lost would be short (issue 26 item 5). The manager's exit hook
    writes them first. A real process: a manager, steps 1..3 within the write interval, then a peer loss."""
    import subprocess
    import sys
    from pathlib import Path

    control = tmp_path / "control"
    script = f"""
import numpy as np, resilax_ckpt as rc
from resilax_ckpt.multihost import arm_exit_watchdog
arm_exit_watchdog(60)
mgr = rc.CheckpointManager({str(tmp_path / "ckpt")!r}, rc.ManagerOptions(save_every_steps=100, control_dir={str(control)!r}))
for step in (1, 2, 3):
    mgr.save(step, {{"w": np.zeros((4,), np.float32)}})
raise RuntimeError("gloo: connection closed by peer")
"""
    root = Path(__file__).resolve().parents[2]
    env = {**__import__("os").environ, "PYTHONPATH": str(root / "ckpt_lib")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 76, done.stderr
    figures = read_trainer_figures(str(control))
    assert figures is not None and figures["step"] == 3, figures
