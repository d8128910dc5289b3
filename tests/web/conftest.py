"""Fixtures of the web page's tests: a headless Chromium (Debian's package, installed by
scripts/setup-chromium when missing; the `chromium` fixture marks its tests `browser`, so the fast tier
skips them) and the fixed histories of tests/cli/history_fixtures.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_CLI_TESTS = ROOT / "tests" / "cli"
if str(_CLI_TESTS) not in sys.path:
    sys.path.insert(0, str(_CLI_TESTS))  # history_fixtures


@pytest.fixture(scope="session")
def chromium() -> str:
    """The browser's path: $RESILAX_CHROMIUM, one on PATH, else Debian's package installed now (apt-get,
    cached by the system: the next run finds it). Fails, never skips, when it cannot be had."""
    proc = subprocess.run([str(ROOT / "scripts" / "setup-chromium")], capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, f"scripts/setup-chromium failed:\n{proc.stderr[-3000:]}"
    return proc.stdout.strip().splitlines()[-1]
