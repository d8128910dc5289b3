"""The generation-start bench's figures (bench/resilax_bench/genstart.py `summarize`), on synthetic
trainer output with known answers."""

from __future__ import annotations

import json

import pytest
from resilax_bench.genstart import summarize


def _out(began: float, ended: float, steps: list[float]) -> str:
    lines = [json.dumps({"restored": 4, "began": began, "time": ended, "process": 0})]
    lines += [json.dumps({"step": 5 + n, "loss": 0.5, "time": t}) for n, t in enumerate(steps)]
    return "\n".join(["[Gloo] Rank 0 is connected to 1 peer ranks.", *lines])


def test_figures_count_from_the_last_launch_to_the_last_restore_and_process_0s_first_step() -> None:
    launches = [102.0, 100.0, 100.5]  # process 0 launched last
    outputs = [_out(110.0, 111.0, [120.0, 121.0]), _out(109.0, 112.5, []), _out(111.5, 112.0, [])]
    assert summarize(launches, outputs) == {"to_restore": 9.5, "to_restore_end": 10.5, "to_first_step": 18.0}


def test_a_process_without_its_restore_line_is_refused() -> None:
    with pytest.raises(ValueError, match="1 of 2"):
        summarize([0.0, 0.0], [_out(1.0, 2.0, [3.0]), "[Gloo] nothing"])
