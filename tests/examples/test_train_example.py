"""The example training job restores onto a different mesh and its loss curve continues unbroken."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"


def run_example(tmp_path: Path, ckpt: Path, devices: int, steps: int) -> tuple[list[dict], dict[int, float]]:
    """Run examples/train.py; (its restore lines, the loss per step)."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "RESILAX_CHECKPOINT_DIR": str(ckpt),
        "RESILAX_SAVE_EVERY_STEPS": "5",
    }
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(steps)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode in (0, 75), proc.stderr[-3000:]
    losses, restores = {}, []
    for line in proc.stdout.splitlines():
        record = json.loads(line)
        if "restored" in record:
            restores.append(record)
            continue
        assert record["devices"] == devices
        losses[record["step"]] = record["loss"]
    return restores, losses


@pytest.mark.slow
def test_loss_continues_after_restore_on_a_smaller_mesh(tmp_path):
    _, straight = run_example(tmp_path, tmp_path / "straight", devices=8, steps=14)
    restores, first = run_example(tmp_path, tmp_path / "resumed", devices=8, steps=12)
    assert restores == []
    # Steps 11 and 12 were not checkpointed (every 5 steps, plus the final save at 12), so a restart
    # resumes after step 12 on 4 devices.
    restores, second = run_example(tmp_path, tmp_path / "resumed", devices=4, steps=14)
    assert [(r["restored"], r["from"], r["process"]) for r in restores] == [(12, "persistent", 0)]
    assert sorted(first) == list(range(1, 13))
    assert sorted(second) == [13, 14]
    for step in (13, 14):
        assert second[step] == pytest.approx(straight[step], rel=1e-4), step


def test_runs_by_hand_outside_a_pod_into_a_local_folder(tmp_path: Path) -> None:
    """Without the operator's RESILAX_* variables, from_env() saves to ./resilax-checkpoints and says so."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILAX_")}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "3"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = tmp_path / "resilax-checkpoints"
    assert f"RESILAX_CHECKPOINT_DIR is not set (not in a JAXJob pod): checkpoints go to {folder}" in proc.stderr
    assert [json.loads(line)["step"] for line in proc.stdout.splitlines()] == [1, 2, 3]
    assert folder.is_dir()
