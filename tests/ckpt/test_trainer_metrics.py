"""The manager's figures for the sidecar (trainer.json in the control folder): the step reached,
saves and the loop time they blocked, restores and their time."""

from __future__ import annotations

import numpy as np
import resilax_ckpt as rc
from resilax_ckpt.trainer_metrics import read_trainer_figures


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
