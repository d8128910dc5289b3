"""The pure modules stay pure: no kopf, no Kubernetes client, no I/O modules, no clock."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import resilax_operator

PACKAGE = Path(resilax_operator.__file__).parent
PURE = ["api", "errors", "spec", "validation", "topology", "builders", "reconcile", "status"]
FORBIDDEN_MODULES = ("kopf", "kubernetes", "aiohttp", "requests", "resilax_operator.k8s",
                     "resilax_operator.handlers", "resilax_operator.main", "time")


def _imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = "resilax_operator" + ("." + base if base else "")
                out |= {f"{base}.{a.name}" for a in node.names}
            out.add(base)
    return out


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports(module: str) -> None:
    bad = sorted(i for i in _imports(module) for f in FORBIDDEN_MODULES if i == f or i.startswith(f + "."))
    assert not bad, f"{module} imports {bad}"


@pytest.mark.parametrize("module", PURE)
def test_pure_module_never_reads_the_clock(module: str) -> None:
    text = (PACKAGE / f"{module}.py").read_text()
    for call in ("datetime.now(", "datetime.utcnow(", "time.time(", "os.environ"):
        assert call not in text, f"{module} calls {call}"
