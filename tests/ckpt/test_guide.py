"""docs/checkpointing.md's training-loop example runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_guide_example_runs(tmp_path):
    pytest.importorskip("flax")
    text = (ROOT / "docs" / "checkpointing.md").read_text()
    match = re.search(r"<!-- guide-example -->\n```python\n(.*?)```", text, re.S)
    assert match, "docs/checkpointing.md lost its guide example"
    script = tmp_path / "guide.py"
    script.write_text(match.group(1))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
