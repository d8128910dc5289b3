"""docs/checkpointing.md's training-loop example runs as written (in this process: 8 fake devices)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_guide_example_runs(devices):
    text = (ROOT / "docs" / "checkpointing.md").read_text()
    match = re.search(r"<!-- guide-example -->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/checkpointing.md lost its guide example"
    exec(compile(match.group(1), "docs/checkpointing.md", "exec"), {"__name__": "guide"})
