"""The krew manifest of `kubectl resilax` (plugins/krew/resilax.yaml, issue 41): filled as the release
workflow fills it, it passes the checks of krew's own validation (kubernetes-sigs/krew
internal/index/validation: apiVersion and kind, a safe name equal to the file's, a one-line short
description, a `v`-semver version, and per platform an https uri, a sha256 of 64 hex digits, a bin, a
non-empty os/arch selector, `files` with from and to), one archive per (os, arch), the binary named as
pyproject's console script, and exactly the placeholders the workflow sets."""

from __future__ import annotations

import re
import string
import tomllib
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "plugins" / "krew" / "resilax.yaml"
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
SEMVER = re.compile(r"^v(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$")


def placeholders(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"\$\{([A-Z0-9_]+)\}", text)}


def filled(version: str = "v0.1.0") -> dict[str, Any]:
    """The manifest as the release workflow's envsubst leaves it (a distinct digest per platform)."""
    text = MANIFEST.read_text()
    values = {name: f"{i:064x}" for i, name in enumerate(sorted(placeholders(text)))}
    values["VERSION"] = version
    return dict(yaml.safe_load(string.Template(text).substitute(values)))


def krew_problems(name: str, plugin: dict[str, Any]) -> list[str]:
    """What krew's ValidatePlugin(name, plugin) would refuse, all at once."""
    spec, problems = plugin.get("spec") or {}, []
    if plugin.get("apiVersion") != "krew.googlecontainertools.github.com/v1alpha2":
        problems.append(f"apiVersion {plugin.get('apiVersion')!r}")
    if plugin.get("kind") != "Plugin":
        problems.append(f"kind {plugin.get('kind')!r}")
    if not re.fullmatch(r"[\w-]+", name) or (plugin.get("metadata") or {}).get("name") != name:
        problems.append(f"metadata.name {(plugin.get('metadata') or {}).get('name')!r}, file {name!r}")
    short = spec.get("shortDescription") or ""
    if not short or "\n" in short or "\r" in short:
        problems.append(f"shortDescription {short!r}")
    if not SEMVER.match(str(spec.get("version", ""))):
        problems.append(f"version {spec.get('version')!r}")
    if not spec.get("platforms"):
        problems.append("no platforms")
    for i, p in enumerate(spec.get("platforms") or []):
        where = f"platforms[{i}]"
        if not str(p.get("uri", "")).startswith("https://"):
            problems.append(f"{where}.uri {p.get('uri')!r}")
        if not re.fullmatch(r"[a-f0-9]{64}", str(p.get("sha256", ""))):
            problems.append(f"{where}.sha256 {p.get('sha256')!r}")
        if not p.get("bin"):
            problems.append(f"{where}.bin")
        files = p.get("files")
        if files is not None and (not files or not all(f.get("from") and f.get("to") for f in files)):
            problems.append(f"{where}.files {files!r}")
        labels = (p.get("selector") or {}).get("matchLabels") or {}
        if not labels or set(labels) - {"os", "arch"}:
            problems.append(f"{where}.selector {p.get('selector')!r}")
    return problems


def test_the_filled_manifest_passes_krews_validation() -> None:
    plugin = filled()
    assert krew_problems(MANIFEST.stem, plugin) == []
    platforms = plugin["spec"]["platforms"]
    pairs = [(p["selector"]["matchLabels"]["os"], p["selector"]["matchLabels"]["arch"]) for p in platforms]
    assert sorted(pairs) == sorted({("linux", "amd64"), ("linux", "arm64"), ("darwin", "amd64"), ("darwin", "arm64")})
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for p, (os_name, arch) in zip(platforms, pairs, strict=True):
        assert p["bin"] in scripts, p["bin"]  # the same command as `pip install "resilax[cli]"` gives
        assert p["uri"].endswith(f"/v0.1.0/kubectl-resilax-v0.1.0-{os_name}-{arch}.tar.gz"), p["uri"]
    assert len({p["sha256"] for p in platforms}) == len(platforms)


def test_the_checker_refuses_what_krew_refuses() -> None:
    plugin = filled(version="0.1.0")  # no leading v
    plugin["spec"]["shortDescription"] = "two\nlines"
    plugin["spec"]["platforms"][0]["sha256"] = "ABC"
    plugin["spec"]["platforms"][1]["selector"] = {"matchLabels": {"os": "linux", "distro": "debian"}}
    problems = krew_problems("resilax", plugin)
    assert [p.split(" ")[0] for p in problems] == ["shortDescription", "version", "platforms[0].sha256",
                                                   "platforms[1].selector"], problems
    assert krew_problems("kubectl-resilax", filled())  # the file's name must be the plugin's


def test_the_release_workflow_sets_exactly_the_manifests_placeholders() -> None:
    workflow = WORKFLOW.read_text()
    exported = set(re.findall(r"export ([A-Z0-9_]+)=", workflow))
    assert exported == placeholders(MANIFEST.read_text()), exported
    assert "envsubst < plugins/krew/resilax.yaml" in workflow
