"""The layout rules of issue 29: no product file over 500 lines, the import-linter contracts kept, and
the checkpoint library's restore path through the modules docs/architecture.md names (and no others
of the manager's side), never back to manager.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_DIRS = ["ckpt_lib", "operator", "sidecar", "localcluster"]
MAX_LINES = 500

#: Product files still over MAX_LINES, until issue 29 splits them. Shrink only: a file split below the
#: limit must leave this list (the test says so), and no file may join it.
OVER_THE_LIMIT_FOR_NOW: set[str] = set()


def product_files() -> dict[str, int]:
    """Every Python file of the product packages (`<dir>/resilax_*/`), with its line count."""
    out: dict[str, int] = {}
    for top in PRODUCT_DIRS:
        for path in sorted((ROOT / top).glob("resilax_*/**/*.py")):
            out[str(path.relative_to(ROOT))] = len(path.read_text().splitlines())
    return out


def test_no_product_file_over_500_lines() -> None:
    files = product_files()
    assert len(files) > 50, f"found only {len(files)} product files under {PRODUCT_DIRS}"
    over = {f: n for f, n in files.items() if n > MAX_LINES and f not in OVER_THE_LIMIT_FOR_NOW}
    assert not over, f"over {MAX_LINES} lines (split by concern, issue 29): {over}"
    split = sorted(f for f in OVER_THE_LIMIT_FOR_NOW if files.get(f, 0) <= MAX_LINES)
    assert not split, f"no longer over {MAX_LINES} lines (or gone): remove from OVER_THE_LIMIT_FOR_NOW: {split}"


def test_the_import_linter_contracts_are_kept() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert exe, "lint-imports (import-linter, the test extra) is not installed"
    done = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", done.stdout)
    assert kept and int(kept.group(1)) >= 10, done.stdout[-2000:]


# ---------------------------------------------------------------------------- the restore path


def documented_restore_path() -> tuple[list[str], list[str]]:
    """(the numbered module list of docs/architecture.md's "The restore path", the format vocabulary
    the same section names)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("**The restore path.**", 1)[1].split("\n## ", 1)[0]
    path = re.findall(r"^\d+\. `resilax_ckpt\.([\w.]+)`", section, flags=re.M)
    vocabulary = re.search(r"The format vocabulary they use: (.*?)\.\s", section, flags=re.S)
    assert vocabulary, "docs/architecture.md: the restore path section names no format vocabulary"
    return path, re.findall(r"`([\w.]+)`", vocabulary.group(1))


def chunk_io_modules() -> set[str]:
    """The chunk I/O layer: the modules of pyproject.toml's chunk I/O contract and the backends."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    chunk = next(c for c in contracts if c["name"].startswith("The chunk I/O modules"))
    return {m.removeprefix("resilax_ckpt.") for m in chunk["source_modules"]} | {
        "chunks.backends", "chunks.chunk_writer", "chunks.file_reader", "tensorstore_io"}


def test_the_documented_restore_path_names_existing_modules() -> None:
    path, vocabulary = documented_restore_path()
    assert path and len(path) <= 4, f"docs/architecture.md: the restore path crosses {path}: at most 4 modules"
    assert "manager" not in path
    package = ROOT / "ckpt_lib" / "resilax_ckpt"
    missing = [m for m in path + vocabulary if not (package / f"{m.replace('.', '/')}.py").is_file()]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


class _ModuleTrace:
    """The resilax_ckpt modules whose functions run (a profile hook on every thread), in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []  # (module, function)
        self.package = str(ROOT / "ckpt_lib" / "resilax_ckpt") + os.sep

    def hook(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(self.package):
            module = frame.f_code.co_filename[len(self.package):].removesuffix(".py").replace(os.sep, ".")
            self.calls.append((module, frame.f_code.co_name))

    def __enter__(self) -> _ModuleTrace:
        threading.setprofile(self.hook)
        sys.setprofile(self.hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def test_a_two_tier_restore_goes_through_the_documented_modules_and_never_back(tmp_path: Path) -> None:
    import jax.numpy as jnp
    import numpy as np
    import resilax_ckpt as rc

    persistent, local = tmp_path / "persistent", tmp_path / "local"
    state = {"w": jnp.arange(64, dtype=jnp.float32).reshape(8, 8), "b": np.ones(3, np.int32)}
    with rc.CheckpointManager(str(persistent), rc.ManagerOptions(async_save=False)) as mgr:
        mgr.save(7, {"params": state, "meta": {"epoch": 2}})
    opts = rc.ManagerOptions(local_tier=True, async_save=False)
    with rc.CheckpointManager(str(local), opts, persistent_directory=str(persistent)) as mgr:
        with _ModuleTrace() as trace:
            out = mgr.restore()
        assert mgr.restored_from == "persistent" and mgr.restore_report == {"step": 7, "skipped": [], "generation": 0,
                                                                  "source": "persistent"}
    np.testing.assert_array_equal(out["params"]["w"], np.arange(64, dtype=np.float32).reshape(8, 8))
    assert out["meta"] == {"epoch": 2}

    path, vocabulary = documented_restore_path()
    modules = [m for m, _ in trace.calls]
    restorer = "restoring.restorer"
    assert modules[0] == "manager" and restorer in modules, trace.calls[:5]
    first, last = modules.index(restorer), len(modules) - 1 - modules[::-1].index(restorer)
    back = [f for m, f in trace.calls[first:] if m == "manager"]
    assert not back, f"the restore came back to manager.py: {back}"
    during = set(modules[first:last + 1])
    assert set(path) <= during, f"the restore never entered {sorted(set(path) - during)} (docs/architecture.md)"
    allowed = set(path) | set(vocabulary) | chunk_io_modules()
    others = sorted(during - allowed)
    assert not others, (f"the restore entered modules docs/architecture.md's restore path does not name: "
                        f"{others}")

