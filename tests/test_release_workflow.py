"""The release workflow (.github/workflows/release.yml, issue 41) is not run by CI; its shape is: a tag
vX.Y.Z builds the multi-arch images from the Dockerfile's targets, packages and pushes the chart as an
OCI artefact, builds the wheel, and builds the kubectl plugin on one runner per platform of the krew
manifest; its version check matches the files as they are, and every `run:` block parses as bash."""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"


def workflow() -> dict[Any, Any]:
    return dict(yaml.safe_load(WORKFLOW.read_text()))


def steps_text(job: dict[str, Any]) -> str:
    return "\n".join(str(step.get("run", "")) + str(step.get("with", "")) + str(step.get("uses", ""))
                     for step in job["steps"])


def test_a_version_tag_triggers_it() -> None:
    on = workflow()[True]  # YAML 1.1 reads the key `on` as true
    assert on == {"push": {"tags": ["v*.*.*"]}}


def test_the_version_check_matches_the_files_of_this_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    run = workflow()["jobs"]["versions"]["steps"][1]["run"]
    checks = re.findall(r'grep -qx "(.+)" (\S+)', run)
    assert {path for _, path in checks} == {"pyproject.toml", "charts/resilax/Chart.yaml", "Dockerfile"}
    for pattern, path in checks:
        line = pattern.replace("$version", version).replace('\\"', '"')
        assert line in (ROOT / path).read_text().splitlines(), (line, path)


def test_images_are_multi_arch_from_the_dockerfiles_targets() -> None:
    job = workflow()["jobs"]["images"]
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", (ROOT / "Dockerfile").read_text(), flags=re.M))
    for entry in job["strategy"]["matrix"]["include"]:
        assert entry["target"] in targets, entry
        platforms = set(entry["platforms"].split(","))
        assert platforms == ({"linux/amd64"} if entry["jax"] == "tpu" else {"linux/amd64", "linux/arm64"}), entry
    assert {e["name"] for e in job["strategy"]["matrix"]["include"]} == {"resilax", "resilax-worker",
                                                                         "resilax-worker-tpu"}


def test_chart_wheel_and_plugin_are_built_and_published() -> None:
    jobs = workflow()["jobs"]
    chart = steps_text(jobs["chart"])
    assert "helm package charts/resilax" in chart and 'oci://$REGISTRY/charts' in chart
    assert "pip wheel --no-deps" in steps_text(jobs["wheel"])
    plugin = jobs["kubectl-plugin"]
    assert "scripts/build-kubectl-plugin" in steps_text(plugin)
    assert (ROOT / "scripts" / "build-kubectl-plugin").stat().st_mode & 0o111
    manifest = yaml.safe_load((ROOT / "plugins" / "krew" / "resilax.yaml").read_text().replace("${", "x{"))
    wanted = {(p["selector"]["matchLabels"]["os"], p["selector"]["matchLabels"]["arch"])
              for p in manifest["spec"]["platforms"]}
    assert {(e["os"], e["arch"]) for e in plugin["strategy"]["matrix"]["include"]} == wanted
    assert set(jobs["release"]["needs"]) == set(jobs) - {"release"}


def test_every_run_block_and_the_build_script_parse_as_bash() -> None:
    for name, job in workflow()["jobs"].items():
        for step in job["steps"]:
            if "run" in step:
                script = re.sub(r"\$\{\{[^}]*\}\}", "X", step["run"])
                proc = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, check=False)
                assert proc.returncode == 0, (name, step["run"], proc.stderr)
    proc = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "build-kubectl-plugin")], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr
