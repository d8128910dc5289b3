"""`resilax demo` end to end on its own local cluster: node lost, recovered on one slice, grown back, done."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EVERY_STEPS = 10  # examples/jaxjob-demo.yaml: checkpoint.every.steps
#: --fault-step, --dwell-steps: the node is killed past step 20 (a checkpoint at 10 at least), and comes
#: back once the smaller generation trained 10 steps; growBack then waits for its settle anyway (30 s
#: from that generation's start, in which it trains at most ~80 steps of 0.3 s: its JAX start comes first).
FAULT_STEP, DWELL_STEPS = 20, 10
#: --steps: the job file's 300 less what the story does not need (CI time). Room is left after the
#: fault, the settle and the grow-back's final save for the grown-back generation to train (>= 20 steps).
STEPS = 140


def _leftover_processes(marker: str) -> list[str]:
    """Processes (other than this one) whose command line or environment names `marker`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes()
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            continue
        if marker.encode() in cmdline or marker.encode() in environ:
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")
            out.append(f"{entry}: {command[:200]}")
    return out


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_demo_recovers_grows_back_and_finishes(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    resilax = shutil.which("resilax") or str(Path(sys.executable).with_name("resilax"))
    proc = subprocess.run([resilax, "demo", "--run-dir", str(run_dir), "--timeout", "1500", "--steps", str(STEPS),
                           "--fault-step", str(FAULT_STEP), "--dwell-steps", str(DWELL_STEPS)],
                          capture_output=True, text=True, timeout=1700)
    output = proc.stdout + proc.stderr
    assert (run_dir / "result.json").exists(), output[-6000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert proc.returncode == 0, output[-6000:]

    assert result["recovered_smaller"] and result["grew_back"] and result["succeeded"], result
    assert result["continuous"], (run_dir / "timeline.txt").read_text()
    assert result["max_step"] == STEPS
    shrink, grow = result["transitions"][0], result["transitions"][-1]
    assert shrink["cause"] == "kill-node" and shrink["devices"] == [8, 4], result["transitions"]
    assert shrink["restored_step"] > 0 and shrink["restored_step"] % EVERY_STEPS == 0
    # A hard loss loses the steps since the last committed checkpoint (one interval; the save of the
    # step just due may still be in flight when the node dies).
    assert shrink["steps_lost"] <= 2 * EVERY_STEPS, shrink
    assert grow["cause"] == "restore-node" and grow["devices"] == [4, 8], result["transitions"]
    assert grow["steps_lost"] == 0, grow  # growBack saves before it resizes

    timeline = (run_dir / "timeline.txt").read_text()
    # The node loss as the operator's Event names it (Events persist; the Recovering phase may last less
    # than the demo's one-second status poll now that the operator replaces a generation whose survivors
    # exited 76 at once, so the phase line is not asserted).
    assert "NodeLost: node " in timeline and "-> Succeeded" in timeline
    # The operator's goodput account of the run (status.goodput): the fault cost time, the rest trained.
    goodput = result["goodput"]
    assert goodput and 0 < goodput["ratio"] < 1 and goodput["breakdown"]["detection"] > 0, goodput
    assert "Goodput (the operator's account: status.goodput)" in timeline and "  goodput " in timeline
    png = Path(result["png"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert (run_dir / "operator.log").stat().st_size > 0
    assert "logs and results in" in proc.stdout
    assert not _leftover_processes(str(run_dir)), "the demo left processes behind"
