"""The built wheel, installed as its users install it, each in a fresh venv: `resilax[train]` alone
trains and checkpoints with examples/train.py (no operator dependencies); `resilax[operator,sidecar]`
alone (the default image's install, read from the Dockerfile) imports every module of the operator and
the sidecar and runs a real `resilax sidecar` that uploads a step and answers `/v1/state`, without JAX;
a bare `resilax` says which extra a subcommand needs instead of a traceback.

Installs are offline from a wheelhouse under ~/.cache/resilax (`--no-index --find-links`); only when
it lacks something (a cold machine, a changed dependency) does `pip download` fill it, through pip's
own cache, so a warm run downloads nothing. The venvs are made without pip of their own: this
interpreter's pip installs into each (`pip --python`, which runs pip under the venv's interpreter, so it
resolves for that environment), with `--no-compile` (a module is byte-compiled when first imported
instead). That spares each venv ensurepip and the byte-compiling of every
installed module, most of the module's CPU time (2-core CPU VM, resilax[operator,sidecar]: ~24 -> ~4
CPU-seconds per venv)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import venv
from pathlib import Path

import pytest
from resilax_local.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
# (aiohttp comes with gcsfs, which a trainer writing to gs:// needs.)
OPERATOR_ONLY = ("kopf", "kubernetes", "prometheus-client", "pyyaml", "matplotlib")
WHEELHOUSE = Path(os.environ.get("RESILAX_CACHE", Path.home() / ".cache" / "resilax")) / "wheelhouse"


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
    venv.EnvBuilder(with_pip=False, clear=True).create(path)
    return path / "bin" / "python"


def pip_for(python: Path) -> list[str]:
    """This interpreter's pip, acting on the venv of `python` (module docstring)."""
    return [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check"]


def pip_install(python: Path, wheel: Path, *requirements: str) -> None:
    """Install `requirements` (the wheel's extras as `resilax[...]`) into the venv of `python`, offline
    from the wheelhouse; fill the wheelhouse first if that fails for want of a distribution."""
    reqs = [f"{r} @ {wheel.as_uri()}" if r.startswith("resilax") else r for r in requirements]
    offline = [*pip_for(python), "install", "--quiet", "--no-compile", "--no-index",
               "--find-links", str(WHEELHOUSE), *reqs]
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    if subprocess.run(offline, capture_output=True, text=True, timeout=1200).returncode == 0:
        return
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                    "--only-binary", ":all:", "--dest", str(WHEELHOUSE), *reqs],
                   check=True, capture_output=True, text=True, timeout=1800)
    proc = subprocess.run(offline, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]


def installed(python: Path) -> set[str]:
    out = subprocess.run([*pip_for(python), "list", "--format=json"], check=True, capture_output=True,
                         text=True).stdout
    return {p["name"].lower() for p in json.loads(out)}


@pytest.mark.slow
def test_train_install_alone_runs_the_example(wheel: Path, tmp_path: Path) -> None:
    python = fresh_venv(tmp_path / "venv")
    # The example's own optimizer (optax) beside the training install; nothing else.
    pip_install(python, wheel, "resilax[train]", "optax")
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
    # Its supervisor too: the same example continues to step 6 as `resilax run`'s child, exit code passed on.
    control = tmp_path / "control"
    proc = subprocess.run([str(python.parent / "resilax"), "run", "--", str(python), str(ROOT / "examples" / "train.py"),
                           "--steps", "6"], env=dict(env, RESILAX_CONTROL_DIR=str(control)), cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [json.loads(line)["step"] for line in proc.stdout.splitlines() if '"loss"' in line] == [5, 6]
    record = json.loads((control / "incarnation.json").read_text())
    assert (record["incarnation"], record["state"], record["exit_code"]) == (1, "exited", 0)
    # The operator's side is not in this install: its subcommand says which extra brings it.
    proc = subprocess.run([str(python.parent / "resilax"), "operator"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3 and "pip install 'resilax[operator]'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def default_image_extras() -> str:
    """The extras the Dockerfile's default target (`resilax`: the operator and the sidecar) installs."""
    stage = (ROOT / "Dockerfile").read_text().split(" AS resilax", 1)[1]
    match = re.search(r'"resilax\[([a-z,]+)\] @', stage)
    assert match, "the Dockerfile's resilax stage installs no resilax[...] extras"
    return match.group(1)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.slow
def test_operator_and_sidecar_extras_alone_start_a_real_sidecar(wheel: Path, tmp_path: Path) -> None:
    """The default image's install (`resilax[operator,sidecar]`, from the Dockerfile) in a fresh venv:
    every module of resilax_operator and resilax_sidecar imports (no JAX loaded), and a real `resilax
    sidecar` with a local tier uploads a committed step to its persistent folder and answers `/v1/state`."""
    extras = default_image_extras()
    assert extras == "operator,sidecar", extras
    python = fresh_venv(tmp_path / "venv")
    pip_install(python, wheel, f"resilax[{extras}]")
    have = installed(python)
    assert not have & {"jax", "jaxlib"}, have & {"jax", "jaxlib"}
    code = ("import importlib, pkgutil, sys\n"
            "names = []\n"
            "for pkg in ('resilax_operator', 'resilax_sidecar'):\n"
            "    mod = importlib.import_module(pkg)\n"
            "    for info in pkgutil.walk_packages(mod.__path__, pkg + '.'):\n"
            "        importlib.import_module(info.name)\n"
            "        names.append(info.name)\n"
            "print(len(names), 'jax' in sys.modules)\n")
    proc = subprocess.run([str(python), "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, jax_loaded = proc.stdout.split()
    assert int(count) >= 30 and jax_loaded == "False", proc.stdout

    local, persistent, control = tmp_path / "local", tmp_path / "persistent", tmp_path / "control"
    step = local / "7"
    (step / "state" / "w").mkdir(parents=True)
    (step / "state" / "w" / "0").write_bytes(os.urandom(4096))
    (step / "_METADATA.json").write_text(json.dumps({"version": 1, "step": 7, "generation": 0}))
    (step / "_COMMIT").write_text(json.dumps({"generation": 0, "time": time.time()}))
    (tmp_path / "token").write_text("packaging-test-token\n")
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RESILAX_CONTROL_DIR": str(control),
           "RESILAX_LOCAL_DIR": str(local), "RESILAX_CHECKPOINT_DIR": str(persistent),
           "RESILAX_SIDECAR_TOKEN_FILE": str(tmp_path / "token"), "RESILAX_SIDECAR_HOST": "127.0.0.1",
           "RESILAX_SIDECAR_PORT": str(port), "RESILAX_SIDECAR_POLL_SECONDS": "0.2"}
    log_path = tmp_path / "sidecar.log"
    with open(log_path, "wb") as log:
        sidecar = subprocess.Popen([str(python.parent / "resilax"), "sidecar"], env=env, cwd=tmp_path,
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        state: dict = {}
        while state.get("newest_persisted_step") != 7:
            assert sidecar.poll() is None, f"the sidecar exited with {sidecar.returncode}:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"no upload of step 7; last state {state}\n{log_path.read_text()}"
            with contextlib.suppress(urllib.error.URLError, ConnectionError):
                state = get_json(f"http://127.0.0.1:{port}/v1/state")
            time.sleep(0.2)
        assert (persistent / "7" / "_COMMIT").is_file()
    finally:
        sidecar.send_signal(signal.SIGTERM)
        try:
            sidecar.wait(30)
        except subprocess.TimeoutExpired:
            sidecar.kill()
            sidecar.wait(10)


@pytest.mark.slow
def test_bare_install_names_the_extra_each_command_needs(wheel: Path, tmp_path: Path) -> None:
    """`pip install resilax` alone: the console script answers --version, and each subcommand says
    which extra to install (exit 3), not an import traceback."""
    python = fresh_venv(tmp_path / "venv")
    pip_install(python, wheel, "resilax")
    resilax = str(python.parent / "resilax")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([resilax, "--version"], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "resilax 0.1.0"
    # the trainer's supervisor needs no extra
    proc = subprocess.run([resilax, "run", "--", "sh", "-c", "exit 7"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 7, proc.stderr
    for command, extra in [("sidecar", "sidecar"), ("operator", "operator"), ("local", "local"), ("demo", "local")]:
        proc = subprocess.run([resilax, command], env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 3, (command, proc.returncode, proc.stderr)
        assert f"pip install 'resilax[{extra}]'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_cli_extra_alone_runs_the_kubectl_plugin(wheel: Path, tmp_path: Path) -> None:
    """`pip install "resilax[cli]"` (issue 41: the slim plugin install): the kubernetes client and YAML,
    no JAX, tensorstore, numpy or kopf; `kubectl-resilax` answers --help and `version -o json` (its own
    version; the server's is reported missing without a cluster), and a read command reaches the
    kubeconfig, not an import error."""
    python = fresh_venv(tmp_path / "venv")
    pip_install(python, wheel, "resilax[cli]")
    have = installed(python)
    assert {"resilax", "kubernetes", "pyyaml"} <= have, have
    assert not have & {"jax", "jaxlib", "tensorstore", "numpy", "kopf", "prometheus-client", "gcsfs"}, have
    plugin = str(python.parent / "kubectl-resilax")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "no-such-kubeconfig")}
    proc = subprocess.run([plugin, "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "list" in proc.stdout and "logs" in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run([plugin, "list"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "No module named" not in proc.stderr and "pip install" not in proc.stderr, proc.stderr


@pytest.mark.slow
def test_operator_and_sidecar_extras_resolve_without_jax(wheel: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    resolve = [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
               "--report", str(report), f"resilax[operator,sidecar] @ {wheel.as_uri()}"]
    # From the wheelhouse the installs above filled (4 s here against 42 s through the index); through
    # the index only when it lacks a distribution (this test run alone on a cold machine).
    offline = subprocess.run([*resolve, "--no-index", "--find-links", str(WHEELHOUSE)], capture_output=True,
                             text=True, timeout=600)
    if offline.returncode != 0:
        subprocess.run(resolve, check=True, capture_output=True, text=True, timeout=600)
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
            assert z.read(f"resilax_local/demo/files/{name}") == (ROOT / source).read_bytes(), name
    assert not any(n.startswith("resilax_operator/") and "demo" in n for n in zipfile.ZipFile(wheel).namelist())


@pytest.mark.slow
def test_wheel_carries_each_package_data_file_where_the_code_looks(wheel: Path) -> None:
    """Every file beside the operator's code that is not Python (py.typed; pods/podtemplate_schema.json,
    which pods/podtemplate.py reads from its own package) is in the wheel at the same path, and each
    package is typed."""
    import zipfile

    tracked = subprocess.run(["git", "ls-files", "operator/resilax_operator"], cwd=ROOT, capture_output=True, text=True,
                     check=True).stdout.split()
    data = sorted(p.removeprefix("operator/") for p in tracked if not p.endswith(".py"))
    assert "resilax_operator/pods/podtemplate_schema.json" in data, data
    names = set(zipfile.ZipFile(wheel).namelist())
    assert [p for p in data if p not in names] == []
    assert {f"{pkg}/py.typed" for pkg in ("resilax_operator", "resilax_sidecar", "resilax_ckpt", "resilax_local")} <= names


@pytest.mark.slow
def test_wheel_carries_every_module_of_the_packages(wheel: Path) -> None:
    """Every module of the four packages, subpackages included (resilax_ckpt's are grouped by concern:
    saving/, restoring/, chunks/...), is in the wheel: a subpackage that packages.find missed would
    import in the checkout and fail in an install."""
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for top, package in [("operator", "resilax_operator"), ("sidecar", "resilax_sidecar"),
                         ("ckpt_lib", "resilax_ckpt"), ("localcluster", "resilax_local")]:
        folder = ROOT / top / package
        modules = {str(p.relative_to(ROOT / top)) for p in folder.rglob("*.py") if "__pycache__" not in p.parts}
        assert modules, folder
        missing = sorted(modules - names)
        assert not missing, f"not in the wheel: {missing}"
    assert {n for n in names if n.startswith("resilax_ckpt/") and n.endswith("/__init__.py")} >= {
        f"resilax_ckpt/{sub}/__init__.py" for sub in ("chunks", "saving", "restoring", "incluster", "history",
                                                      "control", "trainer")}
