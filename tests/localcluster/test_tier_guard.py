"""The fast tier's guard (resilax_local/tier_guard.py): with RESILAX_FAST_TIER set, as `scripts/test
--fast` sets it, a local cluster or fake-gcs-server refuses to start, by any route, naming the marker
the test lacks; a test that builds a LocalCluster itself (no fixture, no marker) fails in that tier.
These run in the fast tier: the guard refuses before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from resilax_local.cluster import LocalCluster
from resilax_local.errors import FastTierError
from resilax_local.gcs.server import FakeGCS
from resilax_local.tier_guard import FAST_TIER_ENV, refuse_in_fast_tier


def test_the_guard_refuses_only_in_the_fast_tier() -> None:
    refuse_in_fast_tier("a local cluster", "cluster", {})
    refuse_in_fast_tier("a local cluster", "cluster", {FAST_TIER_ENV: "0"})
    with pytest.raises(FastTierError, match=r"a local cluster started in the fast test tier .*needs the 'cluster' "
                                            r"marker \(@pytest.mark.cluster"):
        refuse_in_fast_tier("a local cluster", "cluster", {FAST_TIER_ENV: "1"})


def test_a_local_cluster_and_fake_gcs_refuse_to_start_in_the_fast_tier(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAST_TIER_ENV, "1")
    with pytest.raises(FastTierError, match="'cluster' marker"):
        LocalCluster(tmp_path / "run", profile="cpu").start()
    assert not (tmp_path / "run").exists()  # refused before anything was made
    with pytest.raises(FastTierError, match="'gcs' marker"):
        FakeGCS(log_dir=tmp_path).start()


def test_an_unmarked_test_that_builds_a_local_cluster_fails_in_the_fast_tier(tmp_path: Path) -> None:
    """As scripts/test --fast runs it: the marker expression lets the unmarked test through, the guard stops it."""
    (tmp_path / "test_sneaky.py").write_text(
        "from resilax_local.cluster import LocalCluster\n\n"
        "def test_sneaky(tmp_path):\n"
        "    LocalCluster(tmp_path / 'run', profile='cpu').start()\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cluster",
                           str(tmp_path / "test_sneaky.py")], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**os.environ, FAST_TIER_ENV: "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FastTierError" in proc.stdout and "needs the 'cluster' marker" in proc.stdout, proc.stdout
