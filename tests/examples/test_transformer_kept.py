"""The transformer example kept across a generation (issue 38): under `resilax run`, a stop and the next
generation's start run the next incarnation in the same process (`rc.run_kept`: backends dropped,
devices reopened), which restores its own final save from the local tier and continues on the loss
curve of a run without restarts, bit for bit; a restart that may not be kept (here a hang's stop,
which asks for stacks) is a fresh process that does the same; a rollback (the operator's: only
RESILAX_RESTORE_STEP changes) is kept too and restores the older step asked, never the newer local
steps of the timeline it abandons. Real processes on CPU devices, driven through the supervisor's control
files as the sidecar does."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from resilax_ckpt.control import trainer_control as tc

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transformer.py"
RESILAX = Path(sys.executable).with_name("resilax")
STEPS = 16
DEADLINE = 300.0  # a bound on hangs under load, not a timing claim


def example_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILAX_", "JAX_"))}
    env.update({"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
                "RESILAX_CHECKPOINT_DIR": str(tmp / "persistent"), "RESILAX_LOCAL_DIR": str(tmp / "local"),
                "RESILAX_SAVE_EVERY_STEPS": "1000000",  # only forced saves: a stop's and the last step's
                "JAX_COMPILATION_CACHE_DIR": str(tmp / "jax-cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    return env


def losses_of(lines: list[str]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "step" in r}


@pytest.mark.slow
def test_a_kept_restart_keeps_the_process_restores_bit_exact_and_continues_the_same_loss_curve(tmp_path: Path) -> None:
    straight_run = subprocess.run([sys.executable, str(EXAMPLE), "--steps", str(STEPS)], env=example_env(tmp_path / "a"),
                                  capture_output=True, text=True, timeout=DEADLINE)
    assert straight_run.returncode == 0, straight_run.stderr[-3000:]
    straight = losses_of(straight_run.stdout.splitlines())
    assert sorted(straight) == list(range(1, STEPS + 1))

    control = tmp_path / "control"
    env = {**example_env(tmp_path / "b"), "RESILAX_CONTROL_DIR": str(control), "RESILAX_GENERATION": "1",
           "RESILAX_RESTART_GRACE_SECONDS": "120"}
    log = tmp_path / "supervisor.log"
    lines: queue.Queue[str | None] = queue.Queue()
    records: list[dict[str, Any]] = []
    with log.open("w") as err, subprocess.Popen(
            [str(RESILAX), "run", "--", sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--step-seconds", "0.5",
             "--report-startup"], env=env, stdout=subprocess.PIPE, stderr=err, text=True,
            start_new_session=True) as proc:
        assert proc.stdout is not None
        out = proc.stdout
        threading.Thread(target=lambda: [lines.put(line) for line in out] + [lines.put(None)], daemon=True).start()

        def until(what: str, done: Any) -> None:
            end = time.monotonic() + DEADLINE
            while not done():
                line = lines.get(timeout=max(0.1, end - time.monotonic()))
                if line is None and what == "the end":
                    return
                if line is None or time.monotonic() > end:
                    raise AssertionError(f"no {what}; supervisor log:\n{log.read_text()[-4000:]}")
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))

        def restart(generation: int, stacks: bool = False, env: dict[str, str] | None = None) -> None:
            tc.write_json(str(control), tc.STOP_FILE, {"generation": generation, "reason": "test", "stacks": stacks})
            tc.write_json(str(control), tc.ASSIGNMENT_FILE, {"generation": generation, "env": env or {}})

        def steps_of(generation: int) -> list[int]:
            return [r["step"] for r in records if "step" in r and r["generation"] == generation]

        try:
            until("step 3 of generation 1", lambda: 3 in steps_of(1))
            restart(2)
            until("a step of generation 2", lambda: len(steps_of(2)) >= 1)
            restart(3, stacks=True)  # a hang's stop: never kept
            until("two steps of generation 3", lambda: len(steps_of(3)) >= 2)
            # a rollback to generation 1's final save, which generations 2 and 3 went past (their newer
            # local steps, generation 3's final save among them, are the abandoned timeline's)
            back = next(r["restored"] for r in records if r.get("generation") == 2 and "restored" in r)
            restart(4, env={"RESILAX_RESTORE_STEP": str(back)})
            until("the end", lambda: False)
            proc.wait(timeout=DEADLINE)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, log.read_text()[-4000:]
    startups = [r["startup"] for r in records if "startup" in r]
    restores = [r for r in records if "restored" in r]
    assert [s["kept"] for s in startups] == [False, True, False, True]
    assert startups[0]["pid"] == startups[1]["pid"] != startups[2]["pid"], "generation 2 ran in generation 1's process"
    assert startups[2]["pid"] == startups[3]["pid"], "the rollback's generation 4 ran in generation 3's process"
    assert startups[1]["compilation_cache"]["hits"] > startups[0]["compilation_cache"]["hits"]
    assert startups[1]["marks"]["live_arrays_at_drop"] == 0, "generation 1's device arrays were all freed"
    # each later generation restored the stop's final save from the local tier, and went on from there
    assert [(r["generation"], r["from"]) for r in restores] == [(2, "local"), (3, "local"), (4, "local")]
    assert restores[0]["restored"] == max(steps_of(1)) and restores[1]["restored"] == max(steps_of(2))
    assert min(steps_of(2)) == restores[0]["restored"] + 1 and min(steps_of(3)) == restores[1]["restored"] + 1
    # the rollback restored the step asked, not generation 3's newer final save still in the local tier
    assert restores[2]["restored"] == restores[0]["restored"] < max(steps_of(3))
    assert min(steps_of(4)) == restores[2]["restored"] + 1 and max(steps_of(4)) == STEPS
    # the same loss curve, bit for bit: the restored state is the saved one
    for generation in (1, 2, 3, 4):
        for r in (r for r in records if "step" in r and r["generation"] == generation):
            assert r["loss"] == straight[r["step"]], (generation, r["step"])
    record = tc.read_incarnation(str(control))
    assert record is not None and record["incarnation"] == 4
    assert record["restarts"] == {"kept": 2, "fresh": {"hang": 1}}
    text = log.read_text()
    assert "runs in the kept process" in text and "gets a fresh trainer process (hang)" in text
