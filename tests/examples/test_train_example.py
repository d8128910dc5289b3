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


#: Runs examples/train.py's main in one process, recording (in order) its state-making and restore calls.
DRIVER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import resilax_ckpt as rc
import train
events = []
def record(name, fn):
    def wrapped(*args, **kwargs):
        events.append(name)
        return fn(*args, **kwargs)
    return wrapped
for name in ("init_state", "init_params"):
    if hasattr(train, name):
        setattr(train, name, record(name, getattr(train, name)))
rc.CheckpointManager.restore = record("restore", rc.CheckpointManager.restore)
code = train.main(sys.argv[2:])
print("EVENTS " + json.dumps(events))
"""


def test_a_restart_restores_into_an_abstract_target_and_makes_no_state_of_its_own(tmp_path: Path) -> None:
    """A restarting generation does not compute a fresh state that its restore then overwrites: the
    restore is the first thing to touch the state (the target is shapes and shardings only); a fresh
    job makes its state once. Both come out on the same loss curve as a straight run."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
           "RESILAX_CHECKPOINT_DIR": str(tmp_path / "ck"), "RESILAX_SAVE_EVERY_STEPS": "3"}

    def run(steps: int) -> tuple[list[str], dict[int, float]]:
        proc = subprocess.run([sys.executable, "-c", DRIVER, str(EXAMPLE.parent), "--steps", str(steps)], env=env,
                              cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        events = json.loads(next(line for line in lines if line.startswith("EVENTS "))[len("EVENTS "):])
        losses = {r["step"]: r["loss"] for r in map(json.loads, (line for line in lines if line.startswith("{")))
                  if "step" in r}
        return events, losses

    fresh, first = run(3)
    assert fresh == ["init_state", "init_params"]  # nothing to restore: the state is made once
    restarted, second = run(5)
    assert restarted == ["restore"]  # no init_params before (or after) the restore
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5]
    _, straight = run_example(tmp_path, tmp_path / "straight", devices=4, steps=5)
    for step in (4, 5):
        assert second[step] == pytest.approx(straight[step], rel=1e-4), step
