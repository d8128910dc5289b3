"""The trainer-restart bench (issue 38): its accounting of a start's parts, and one run on CPU devices
through the same script the TPU run calls (bench/tpu/restart), with the smallest model.

No time is checked: the run's own checks are that every phase printed its parts, the restore phases
restored the cold phase's saved step from the local tier, and the step after the restore has the same
loss whether the compile ran under the restore or after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from resilax_bench import restart

ROOT = Path(__file__).resolve().parents[2]

MARKS = {"launch": 100.0, "process_start": 100.01, "script_start": 100.1, "line0_done": 100.5, "imports_done": 102.0,
         "devices_start": 102.0, "devices_done": 108.0, "manager_done": 108.2, "lower_start": 108.2,
         "restore_start": 108.2, "lower_done": 109.0, "restore_returned": 110.0, "restore_on_device": 110.5,
         "compile_done": 112.0, "first_step_done": 113.0}


def test_parts_are_measured_from_launch_and_the_first_step_waits_for_the_later_of_state_and_compile() -> None:
    parts = {p["part"]: p for p in restart.plan_parts(MARKS)}
    assert parts["open the devices (jax.devices())"]["seconds"] == pytest.approx(6.0)
    assert parts["compile or compilation-cache load"]["seconds"] == pytest.approx(3.0)
    assert parts["restore: read (transfers issued)"]["seconds"] == pytest.approx(1.8)
    assert parts["restore: host-to-device wait"]["seconds"] == pytest.approx(0.5)
    first = parts["first step"]
    assert (first["start_s"], first["end_s"], first["seconds"]) == (12.0, 13.0, 1.0)
    assert parts["launch to first step done"]["seconds"] == pytest.approx(13.0)
    assert "init a fresh state (its own compile or cache load + run)" not in parts  # a restoring start has none


def test_overlapping_parts_are_named_with_the_time_they_share() -> None:
    found = restart.overlaps(restart.plan_parts(MARKS))
    assert "trace + lower || restore: read (transfers issued): 0.80 s" in found
    assert "compile or compilation-cache load || restore: read (transfers issued): 1.00 s" in found
    assert not any(f.startswith("launch to") or "|| launch to" in f for f in found)


def test_the_summary_compares_a_restart_with_the_warm_start_that_restores_nothing() -> None:
    warm = {"launch": 0.0, "script_start": 0.1, "line0_done": 0.2, "imports_done": 2.0, "devices_start": 2.0, "devices_done": 8.0,
            "manager_done": 8.1, "lower_start": 8.1, "lower_done": 9.0, "compile_done": 11.0, "init_start": 11.0,
            "init_done": 11.5, "first_step_done": 12.0}
    phases = {"warm": {"parts": restart.plan_parts(warm)}, "restore-overlap": {"parts": restart.plan_parts(MARKS)}}
    summary = restart.summarize(phases)
    # floor = open devices 6 + cache load 2 + first step 0.5 (from the later of init and compile)
    assert summary["warm_open_compile_first_step_s"] == pytest.approx(8.5)
    assert summary["restore-overlap"] == {"launch_to_first_step_s": 13.0,
                                          "vs_warm_launch_to_first_step": round(13.0 / 12.0, 3),
                                          "vs_open_compile_first_step": round(13.0 / 8.5, 3)}
    text = restart.build_markdown({"phases": phases, "summary": summary, "environment": {}, "commit": "abc"})
    assert "| launch to first step done | 12.00 | 13.00 |" in text


def test_a_kept_restart_is_measured_from_the_stop_request_and_its_launch_is_the_resume_in_the_same_process() -> None:
    kept = {"stop_requested": 50.0, "entry_returned": 51.0, "backends_dropped": 51.2, "resume_received": 51.3,
            "prefetch_started": 51.4, "devices_reopened": 51.5, "process_start": 51.3, "devices_start": 51.6,
            "devices_done": 51.6, "manager_done": 51.7, "lower_start": 51.7, "restore_start": 51.7, "lower_done": 52.0,
            "restore_returned": 52.5, "restore_on_device": 52.6, "compile_done": 52.4, "first_step_done": 53.0}
    parts = {p["part"]: p for p in restart.plan_parts(kept)}
    assert parts["kept: stop request to the entry's return (final save)"]["seconds"] == pytest.approx(1.0)
    assert parts["kept: drop the backends (clear_backends)"]["seconds"] == pytest.approx(0.2)
    assert parts["kept: reopen the devices"]["seconds"] == pytest.approx(0.1)
    assert parts["kept: stop request to first step done"]["seconds"] == pytest.approx(3.0)
    assert parts["launch to first step done"]["seconds"] == pytest.approx(1.7)  # from the resume
    assert parts["kept: drop the backends (clear_backends)"]["start_s"] == pytest.approx(-0.3)  # before the launch
    warm = {p["part"]: p for p in restart.plan_parts(MARKS)}
    summary = restart.summarize({"warm": {"parts": list(warm.values())}, "kept": {"parts": list(parts.values())}})
    assert summary["kept"]["launch_to_first_step_s"] == pytest.approx(1.7)


@pytest.mark.slow
def test_the_tpu_script_runs_every_phase_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OUT": str(out), "PYTHON": sys.executable,
           "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    env = {k: v for k, v in env.items() if not k.startswith("RESILAX_")}
    env["RESILAX_TPU_RESTART_S"] = "0"  # no time budget: a loaded machine must not skip phases
    proc = subprocess.run(["bash", str(ROOT / "bench" / "tpu" / "restart"), "--workdir", str(tmp_path / "w")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "restart-tpu.json").read_text())
    phases = result["phases"]
    assert result["environment"]["platform"] == "cpu"
    assert set(phases) == set(restart.DEFAULT_PHASES)
    for name in restart.DEFAULT_PHASES:
        assert phases[name]["parts"], name
        marks = phases[name]["startup"]["marks"]  # incarnation 2's launch is its own process start
        assert marks["first_step_done"] > marks.get("launch", marks["process_start"]), name
    assert phases["cold"]["startup"]["compilation_cache"]["hits"] == 0
    assert phases["warm"]["startup"]["compilation_cache"]["hits"] > 0
    # The kept phase: incarnation 1 restored the cold phase's save; incarnation 2 ran in the same process
    # and restored incarnation 1's final save from the local tier, one step past it.
    kept = phases["kept"]
    assert kept["first_incarnation"]["restored"] == {"restored": restart.TRAIN_STEPS, "from": "local", "sources": None}
    assert kept["same_process"] is True and kept["startup"]["kept"] is True and "error" not in kept
    assert kept["restarts"] == {"kept": 1, "fresh": {}}
    kept_saved = kept["stop"]["saved_step"]
    assert kept_saved > restart.TRAIN_STEPS
    assert kept["restored"]["restored"] == kept_saved and kept["restored"]["from"] == "local"
    assert [s["step"] for s in kept["steps"]] == [kept_saved + 1]
    assert 0 < kept["stop"]["request_to_resume_s"] < kept["stop"]["request_to_first_step_s"]
    # The prefetch phase restored that save, as incarnation 1 under the supervisor (keeping off); its
    # stop's final save is what incarnation 2 (a fresh process) and the later phases restore.
    assert phases["prefetch"]["restored"] == {"restored": kept_saved, "from": "local", "sources": None}
    assert phases["prefetch"]["under_supervisor"] is True
    assert phases["inplace"]["startup"]["kept"] is False
    assert phases["inplace"]["startup"]["pid"] != phases["prefetch"]["startup"]["pid"]
    saved = phases["inplace"]["stop"]["saved_step"]
    assert saved > kept_saved
    for name in ("inplace", "restore", "restore-overlap"):
        assert phases[name]["restored"]["restored"] == saved, name
        assert phases[name]["restored"]["from"] == "local", name
        assert [s["step"] for s in phases[name]["steps"]] == [saved + 1], name
    assert phases["restore"]["steps"] == phases["restore-overlap"]["steps"] == phases["inplace"]["steps"]
    assert phases["inplace"]["startup"]["marks"]["first_step_done"] > phases["inplace"]["stop"]["requested"]
    # The prefetch read the step before the devices opened and the restore took all of it; without it, none.
    for name in ("prefetch", "inplace", "kept"):
        prefetched = phases[name]["startup"]["prefetch"]
        assert prefetched["taken_leaves"] == prefetched["leaves"] > 0, (name, prefetched)
        marks = phases[name]["startup"]["marks"]
        assert marks["prefetch_read_start"] < marks["devices_start"], name
    assert phases["restore"]["startup"]["prefetch"] is None
    assert "| launch to first step done |" in (out / "restart-tpu.md").read_text()
    assert not (tmp_path / "w").exists()  # the tmpfs folder is not left behind


def test_the_tpu_script_spends_at_most_its_device_time_budget_and_runs_the_bench_once(tmp_path: Path) -> None:
    """bench/tpu/restart hands the bench what is left of RESILAX_TPU_RESTART_S (default 270 s, 4.5 min
    of device time, its installs included) and runs it once: no second try at another size, even
    after an out-of-memory failure (the exit code is the bench's)."""
    out = tmp_path / "out"
    out.mkdir()
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    "case \"$*\" in *resilax_bench.restart*) echo \"$*\" >> " + str(calls) + ";"
                    " echo '{\"error\": \"RESOURCE_EXHAUSTED\"}' > " + str(out / "restart-tpu.json") + "; exit 3;; esac\n"
                    "exit 0\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILAX_", "JAX_"))}
    env.update(OUT=str(out), PYTHON=str(fake))
    for budget, most in ((None, 270), ("120", 120), ("0", 0)):
        calls.unlink(missing_ok=True)
        if budget is not None:
            env["RESILAX_TPU_RESTART_S"] = budget
        proc = subprocess.run(["bash", str(ROOT / "bench" / "tpu" / "restart")], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 3, proc.stderr
        (line,) = calls.read_text().splitlines()
        given = float(line.split("--budget ")[1].split()[0])
        assert (given == 0) if most == 0 else (most - 10 <= given <= most), (budget, line)
        assert "--phases" not in line  # every phase, in restart.PHASES' order
    assert restart.PHASES.index("restore-overlap") < restart.PHASES.index("reopen")  # reopen is the one cut first


@pytest.mark.slow
def test_the_reopen_probe_gives_the_cpu_devices_back_and_opens_them_again() -> None:
    """Not in the default phases any more (`kept` measures it inside the trainer); `--phases ...,reopen` runs it."""
    probe = restart.run_reopen(120)
    assert probe["reopened"] is True, probe
    assert set(probe["seconds"]) >= {"first open", "clear_backends", "second open"}
