"""docs/gke-quickstart.md runs as written, as far as can be told without a Google Cloud project: its
shell blocks pass `bash -n`, every variable they use is defined earlier (in an earlier block or line),
and every resource an IAM binding grants on is created before it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "docs" / "gke-quickstart.md"
#: Variables the shell or the reader's session has: none of the quickstart's own.
ENVIRONMENT = {"HOME", "PATH", "USER", "PWD"}


def shell_blocks() -> list[str]:
    return re.findall(r"^```shell\n(.*?)^```", QUICKSTART.read_text(), flags=re.M | re.S)


def _expanded(script: str) -> str:
    """The parts of `script` where the shell expands `$NAME`: without single-quoted strings, comments
    and the bodies of quoted here-documents (`<<'EOF'`)."""
    out: list[str] = []
    quoted_end: str | None = None
    for line in script.splitlines():
        if quoted_end is not None:
            if line.strip() == quoted_end:
                quoted_end = None
            continue
        heredoc = re.search(r"<<-?\s*'(\w+)'", line)
        if heredoc:
            quoted_end = heredoc.group(1)
        line = re.sub(r"'[^']*'", "''", line)
        line = re.sub(r"(^|\s)#.*$", "", line)
        out.append(line)
    return "\n".join(out)


def test_the_quickstart_has_shell_blocks() -> None:
    assert len(shell_blocks()) >= 8


@pytest.mark.parametrize("index", range(len(shell_blocks())))
def test_each_shell_block_parses(index: int) -> None:
    block = shell_blocks()[index]
    proc = subprocess.run(["bash", "-n"], input=block, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"block {index}:\n{block}\n{proc.stderr}"


def test_every_variable_is_defined_before_it_is_used() -> None:
    defined = set(ENVIRONMENT)
    problems = []
    for index, block in enumerate(shell_blocks()):
        for line in _expanded(block).splitlines():
            used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", line))
            # An assignment's right-hand side may only use what is defined before it on the line.
            for name in sorted(used - defined):
                problems.append(f"block {index}: ${name} used before it is defined: {line.strip()}")
            defined |= set(re.findall(r"(?:^|[\s;(])(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=", line))
            defined |= set(re.findall(r"\b(?:export|for)\s+([A-Za-z_][A-Za-z0-9_]*)", line))
            for exported in re.findall(r"export\s+(.*)", line):
                defined |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", exported))
    assert problems == []


def test_every_iam_binding_is_on_a_resource_created_before() -> None:
    """`gcloud <group> add-iam-policy-binding RESOURCE` after `gcloud <group> create RESOURCE`."""
    text = "\n".join(shell_blocks())
    commands = re.sub(r"\\\n\s*", " ", text).splitlines()
    created: set[tuple[str, str]] = set()
    bindings = 0
    for command in commands:
        create = re.search(r"gcloud ([a-z -]+?) create (\S+)", command)
        if create:
            created.add((create.group(1).strip(), create.group(2)))
        grant = re.search(r"gcloud ([a-z -]+?) add-iam-policy-binding (\S+)", command)
        if grant:
            bindings += 1
            assert (grant.group(1).strip(), grant.group(2)) in created, f"granted before it is created: {command}"
    assert bindings >= 2


def test_the_quickstart_names_prerequisites_cleanup_and_an_amd64_build() -> None:
    text = QUICKSTART.read_text()
    for needed in ("## Before you start: roles, quota, cost", "TPU quota starts at zero", "## 7. Clean up",
                   "gcloud container clusters delete", "--platform linux/amd64",
                   'if [ "$NODE_SA" = default ]', "grep -qxE 'Succeeded|Failed'", "jsonpath='{.spec.nodeName}'"):
        assert needed in text, needed
    assert "docker build -t" not in text and "docker build --target" not in text  # every build names the platform


def test_the_validated_on_table_names_the_versions_the_project_pins() -> None:
    """The "Validated on" table states the versions that actually ran: the local cluster's binaries as
    resilax_local.binaries pins them, the worker image's JAX, and the TPU runs' versions as
    docs/benchmarks.md records them; and it says that nothing ran on GKE."""
    from resilax_local import binaries

    text = QUICKSTART.read_text()
    section = text.split("## Validated on", 1)[1].split("\n## ", 1)[0]
    for version in (binaries.KUBERNETES_VERSION, binaries.ETCD_VERSION, binaries.HELM_VERSION,
                    binaries.KUEUE_VERSION, binaries.FAKE_GCS_SERVER_VERSION):
        assert version.lstrip("v") in section, version
    jax = re.search(r"^ARG JAX_VERSION=(\S+)$", (ROOT / "Dockerfile").read_text(), flags=re.M)
    assert jax and f"JAX {jax.group(1)}" in section
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text()
    for fact in ("libtpu 0.0.42.1", "tensorstore 0.1.85", "Orbax 0.12.4"):
        assert fact in section and fact in benchmarks, fact
    assert "Nothing of Resilax has run on a GKE cluster yet" in section
    assert "| not run |" in section


def test_the_managed_prometheus_step_sets_only_values_the_chart_has() -> None:
    """Every `--set` of the quickstart's helm commands names a key of the chart's values.yaml (a typo
    would pass `helm upgrade --reuse-values` only to fail the schema at the reader's cluster)."""
    import yaml

    values = yaml.safe_load((ROOT / "charts" / "resilax" / "values.yaml").read_text())
    sets = [s for block in shell_blocks() for s in re.findall(r"--set(?:-string)? ([\w.]+)=", block)]
    assert "metrics.managedPrometheus.sidecarMetrics" in sets and "metrics.managedPrometheus.enabled" in sets
    for key in sets:
        node = values
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"--set {key}: no such value in values.yaml"
            node = node[part]
