"""The pure modules stay pure: no kopf, no Kubernetes client, no I/O modules, no clock."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import resilax_operator

PACKAGE = Path(resilax_operator.__file__).parent
PURE = ["api", "errors", "spec", "validation", "pods/podtemplate", "topology", "builders", "status",
        "observed/snapshot", "observed/nodes", "observed/pods", "observed/sidecar", "actions", "capacity", "reconcile",
        "status_fields/goodput", "status_fields/history", "status_fields/unhealthy_nodes", "status_fields/merge_patch",
        *sorted(f"policies/{p.stem}" for p in (PACKAGE / "policies").glob("*.py"))]
FORBIDDEN_MODULES = ("kopf", "kubernetes", "aiohttp", "requests", "urllib3", "threading", "time",
                     *(f"resilax_operator.{m}" for m in ("k8s", "observed.cache", "observed.observe", "execute",
                                                         "handlers", "main", "metrics")))


def _imports(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = ["resilax_operator", *module.split("/")[:-1]][: max(1, len(module.split("/")) + 1 - node.level)]
                base = ".".join(package) + ("." + base if base else "")
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
    for call in ("datetime.now(", "datetime.utcnow(", "time.time(", "time.monotonic(", "os.environ"):
        assert call not in text, f"{module} calls {call}"


@pytest.mark.parametrize("module", PURE)
def test_pure_module_keeps_no_state(module: str) -> None:
    """No module-level dict, list or set a decision could write to (tables marked `Final` are constants):
    what a decision remembers goes into the status (an operator restart must not lose it)."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    for node in tree.body:
        constant = isinstance(node, ast.AnnAssign) and "Final" in ast.unparse(node.annotation)
        value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) and not constant else None
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in ("dict", "list", "set"))
        assert not mutable, f"{module}:{node.lineno} keeps module-level state"
    assert "global " not in (PACKAGE / f"{module}.py").read_text(), f"{module} rebinds a global"
