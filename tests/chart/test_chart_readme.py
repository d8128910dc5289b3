"""charts/resilax/README.md is generated from values.yaml's `# --` comments; CI fails on drift."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "chart-readme"


def load_script():
    loader = importlib.machinery.SourceFileLoader("chart_readme", str(SCRIPT))
    spec = importlib.util.spec_from_loader("chart_readme", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_readme_matches_values() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_changed_comment_or_default_changes_the_readme() -> None:
    chart_readme = load_script()
    text = (ROOT / "charts" / "resilax" / "values.yaml").read_text()
    readme = chart_readme.render(text)
    assert "| `sidecar.resources` |" in readme and "| `operator.readinessProbe` |" in readme
    assert chart_readme.render(text.replace("# -- Create a PodDisruptionBudget", "# -- Make a PodDisruptionBudget")) != readme
    assert chart_readme.render(text.replace("maxUnavailable: 1", "maxUnavailable: 2")) != readme


def test_nested_keys_and_multi_line_comments() -> None:
    chart_readme = load_script()
    text = "a:\n  # -- first line\n  # second line\n  b: 1\n\n  # not documented\n  c: 2\n# -- top\nd: x\n"
    assert chart_readme.documented_keys(text) == [("a.b", "first line second line"), ("d", "top")]
    assert "| `a.b` | `1` | first line second line |" in chart_readme.render(text)
