"""Helpers of the chart tests: where the chart is, helm (built from its Go module through the local
cluster's binary builder, cached), the rules file, and small lookups over rendered objects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from resilax_local import binaries

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "resilax"
RULES_FILE = CHART / "files" / "operator-rules.yaml"

HELM_PACKAGE = "helm.sh/helm/v4/cmd/helm"
HELM_VERSION = "v4.3.2"
# The Kubernetes version `helm template` renders for (the local cluster's).
KUBE_VERSION = binaries.KUBERNETES_VERSION
RELEASE = "resilax"
RELEASE_NAMESPACE = "resilax-system"


def ensure_helm(build: bool = True) -> Path:
    """helm from KUBEBUILDER_ASSETS, the cache, or built with `go install` (only when missing)."""
    # The builder's generic `go install` step; a public `ensure_helm` belongs in resilax_local.binaries.
    return binaries._go_install(HELM_PACKAGE, HELM_VERSION, "helm", build)


def write_values(path: Path, values: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def operator_rules() -> list[dict[str, Any]]:
    """The rules file, as the operator's cluster tests load it."""
    rules: list[dict[str, Any]] = yaml.safe_load(RULES_FILE.read_text())
    return rules


def is_node_sweeper(obj: dict[str, Any]) -> bool:
    """An object of the node sweeper (its DaemonSet, ServiceAccount, ClusterRole and binding)."""
    return (obj["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "node-sweeper"


def by_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def doc_jaxjobs(path: Path) -> list[dict[str, Any]]:
    """The complete JAXJobs (```yaml blocks with `kind: JAXJob`) a document shows."""
    import re

    blocks = re.findall(r"```yaml\n(.*?)```", path.read_text(), flags=re.S)
    return [doc for block in blocks for doc in yaml.safe_load_all(block)
            if isinstance(doc, dict) and doc.get("kind") == "JAXJob"]
