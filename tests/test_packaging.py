"""The built wheel, installed as its users install it: `resilax[train]` alone in a fresh venv trains and
checkpoints with examples/train.py (no operator dependencies), and the operator/sidecar side resolves
without JAX. Installs go through pip's own cache, so only a cold machine downloads the wheels."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# (aiohttp comes with gcsfs, which a trainer writing to gs:// needs.)
OPERATOR_ONLY = ("kopf", "kubernetes", "prometheus-client", "pyyaml", "matplotlib")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built from a copy of what the Dockerfile's builder copies (the checkout stays clean)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("operator", "sidecar", "ckpt_lib", "localcluster"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(src)],
                   check=True, capture_output=True, text=True, timeout=600)
    (built,) = out.glob("resilax-*-py3-none-any.whl")
    return built


def fresh_venv(path: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return path / "bin" / "python"


def installed(python: Path) -> set[str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], check=True, capture_output=True,
                         text=True).stdout
    return {p["name"].lower() for p in json.loads(out)}


@pytest.mark.slow
def test_train_install_alone_runs_the_example(wheel: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path / "venv")
    # The example's own optimizer (optax) beside the training install; nothing else.
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"resilax[train] @ {wheel.as_uri()}", "optax"],
                   check=True, capture_output=True, text=True, timeout=1200)
    have = installed(python)
    assert {"resilax", "jax", "numpy", "tensorstore", "gcsfs"} <= have
    assert not have & set(OPERATOR_ONLY), have & set(OPERATOR_ONLY)
    ckpt = tmp_path / "ckpt"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RESILAX_CHECKPOINT_DIR": str(ckpt),
           "RESILAX_SAVE_EVERY_STEPS": "2", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.run([str(python), str(ROOT / "examples" / "train.py"), "--steps", "4"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in proc.stdout.splitlines() if '"loss"' in line]
    assert steps == [1, 2, 3, 4]
    assert (ckpt / "4").is_dir() or any(p.name.startswith("4") for p in ckpt.iterdir()), sorted(ckpt.iterdir())
    # The console script works in this install too (it imports nothing heavy).
    version = subprocess.run([str(python.parent / "resilax"), "--version"], capture_output=True, text=True,
                             check=True).stdout
    assert version.strip() == "resilax 0.1.0"


@pytest.mark.slow
def test_operator_and_sidecar_extras_resolve_without_jax(wheel: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                    "--report", str(report), f"resilax[operator,sidecar] @ {wheel.as_uri()}"],
                   check=True, capture_output=True, text=True, timeout=600)
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"kopf", "kubernetes", "aiohttp", "tensorstore"} <= names
    assert not names & {"jax", "jaxlib"}, names


@pytest.mark.slow
def test_wheel_carries_the_demo_files(wheel: Path) -> None:
    """`resilax demo` from a wheel: the job, the CRDs, the operator's rules and the training example are
    in the package, as the files themselves (the repository's links are followed)."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        for name, source in [("jaxjob-demo.yaml", "examples/jaxjob-demo.yaml"),
                             ("examples/train.py", "examples/train.py"),
                             ("operator-rules.yaml", "charts/resilax/files/operator-rules.yaml"),
                             ("crds/jaxjobs.resilax.dev.yaml", "charts/resilax/crds/jaxjobs.resilax.dev.yaml"),
                             ("crds/kopf-peering.yaml", "charts/resilax/crds/kopf-peering.yaml")]:
            assert z.read(f"resilax_local/demo_files/{name}") == (ROOT / source).read_bytes(), name
    assert not any(n.startswith("resilax_operator/") and "demo" in n for n in zipfile.ZipFile(wheel).namelist())
