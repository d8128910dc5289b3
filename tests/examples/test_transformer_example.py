"""The transformer example (examples/transformer.py) is killed mid-run and restored onto a smaller mesh,
and its loss curve continues where a run without the kill goes: real processes on CPU devices, the
parameters and Adam moments sharded over every device (FSDP), so the restore really reshards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transformer.py"
STEPS = 14


def example_env(ckpt: Path, cache: Path, devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILAX_")}
    env.update({"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
                "RESILAX_CHECKPOINT_DIR": str(ckpt), "RESILAX_SAVE_EVERY_STEPS": "5",
                # the runs share a compilation cache: the killed run loads the straight run's programs
                "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    return env


def parse(lines: list[str], devices: int) -> tuple[list[dict], dict[int, float]]:
    """(the restore lines, the loss per step) of one run's stdout."""
    restores, losses = [], {}
    for line in lines:
        record = json.loads(line)
        if "restored" in record:
            restores.append(record)
            continue
        assert record["devices"] == devices
        losses[record["step"]] = record["loss"]
    return restores, losses


def run_to_end(tmp_path: Path, ckpt: Path, devices: int) -> tuple[list[dict], dict[int, float]]:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(STEPS)],
                          env=example_env(ckpt, tmp_path / "jax-cache", devices), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return parse(proc.stdout.splitlines(), devices)


def run_until_killed(tmp_path: Path, ckpt: Path, devices: int, kill_after: int) -> dict[int, float]:
    """Run to the end but SIGKILL the process once it printed step `kill_after`'s loss."""
    lines = []
    with subprocess.Popen([sys.executable, str(EXAMPLE), "--steps", str(STEPS)],
                          env=example_env(ckpt, tmp_path / "jax-cache", devices), cwd=tmp_path,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                lines.append(line)
                if json.loads(line).get("step") == kill_after:
                    proc.send_signal(signal.SIGKILL)
                    break
        finally:
            proc.kill()
            proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    restores, losses = parse(lines, devices)
    assert restores == []
    return losses


@pytest.mark.slow
def test_killed_run_restores_on_half_the_devices_and_continues_the_same_loss_curve(tmp_path: Path) -> None:
    _, straight = run_to_end(tmp_path, tmp_path / "straight", devices=4)
    assert sorted(straight) == list(range(1, STEPS + 1))
    assert straight[STEPS] < straight[1]  # it learns
    killed = run_until_killed(tmp_path, tmp_path / "killed", devices=4, kill_after=12)
    assert sorted(killed) == list(range(1, 13))
    for step in killed:  # same devices, same programs: the same numbers
        assert killed[step] == straight[step], step

    restores, resumed = run_to_end(tmp_path, tmp_path / "killed", devices=2)
    # Saved every 5 steps, asynchronously: step 10's save may still have been writing at the kill
    # (an uncommitted step is never restored); step 5's was committed before step 10's began.
    assert [r["process"] for r in restores] == [0]
    restored = restores[0]["restored"]
    assert restored in (5, 10), restores
    assert sorted(resumed) == list(range(restored + 1, STEPS + 1))
    for step in resumed:  # another mesh, other reduction orders: equal to float32 rounding
        assert resumed[step] == pytest.approx(straight[step], rel=1e-4), step


def test_bad_sizes_are_named_with_what_is_allowed(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--width", "60", "--heads", "8", "--dtype", "float16"],
                          env=example_env(tmp_path / "c", tmp_path / "jax-cache", 1), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--width 60 is not a multiple of --heads 8" in proc.stderr
    assert "--dtype 'float16'; allowed: float32, bfloat16" in proc.stderr
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--batch", "6"],
                          env=example_env(tmp_path / "c", tmp_path / "jax-cache", 4), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--batch 6 does not split over this generation's 4 devices" in proc.stderr
