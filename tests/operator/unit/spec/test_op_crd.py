"""The CRD single source file: a valid-looking apiextensions.k8s.io/v1 CRD that matches the Python side.

The real API server checks it in the cluster tests; here: structure, descriptions for `kubectl explain`,
CEL cost bounds (maxItems/maxLength on what rules iterate over), and agreement with topology/spec.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from resilax_operator import api, spec, topology
from resilax_operator import status as st

ROOT = Path(__file__).resolve().parents[4]
CRD_PATH = ROOT / api.CRD_FILE


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    with CRD_PATH.open() as f:
        loaded: dict[str, Any] = yaml.safe_load(f)
    return loaded


@pytest.fixture(scope="module")
def version(crd: dict[str, Any]) -> dict[str, Any]:
    (v,) = crd["spec"]["versions"]
    return dict(v)


def _walk(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, child in (schema.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")


def test_identity(crd: dict[str, Any]) -> None:
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1" and crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == api.CRD_NAME
    names = crd["spec"]["names"]
    assert (names["kind"], names["plural"], names["singular"]) == (api.KIND, api.PLURAL, api.SINGULAR)
    assert api.SHORT_NAME in names["shortNames"] and "resilax" in names["categories"]
    assert "all" not in names["categories"]  # `kubectl delete all --all` must not delete training jobs
    assert crd["spec"]["group"] == api.GROUP and crd["spec"]["scope"] == "Namespaced"


def test_version_has_status_and_printer_columns(version: dict[str, Any]) -> None:
    assert version["name"] == api.VERSION and version["served"] and version["storage"]
    assert version["subresources"] == {
        "status": {}, "scale": {"specReplicasPath": ".spec.slices.count", "statusReplicasPath": ".status.shape.count"}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase" and columns["Saved"] == ".status.checkpoint.step"
    assert columns["Step"] == ".status.goodput.ledger.current.lastStep"  # the trainer's, beside the saved one
    assert columns["Reason"] == '.status.conditions[?(@.type=="Ready")].reason'
    assert {"Topology", "Count", "Restarts", "Age"} <= columns.keys()


def test_structural_every_node_typed_and_described(version: dict[str, Any]) -> None:
    root = version["schema"]["openAPIV3Schema"]
    for path, node in _walk(root):
        assert node.get("type") or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        # spec.template is Kubernetes' own PodTemplateSpec (scripts/gen-template-schema): described as upstream is
        if path.startswith((".spec", ".status")) and not path.startswith(".spec.template."):
            assert node.get("description"), f"{path} has no description (kubectl explain)"
        for sub in node.get("anyOf", []):
            assert set(sub) == {"type"}, f"{path}: anyOf may only carry types"
        if node.get("type") == "object" and not node.get("x-kubernetes-preserve-unknown-fields"):
            assert "properties" in node or "additionalProperties" in node or path in (".metadata",), \
                f"{path}: object without properties"


def test_cel_targets_are_bounded(version: dict[str, Any]) -> None:
    """Lists and strings that CEL rules iterate over or match carry maxItems/maxLength."""
    root = version["schema"]["openAPIV3Schema"]
    nodes = dict(_walk(root))
    for path in (".spec.elastic.topologies", ".spec.template.spec.containers", ".spec.template.spec.initContainers"):
        assert nodes[path]["maxItems"] <= 32
    for path in (".spec.slices.accelerator", ".spec.slices.topology", ".spec.elastic.topologies[]",
                 ".spec.template.spec.containers[].name"):
        assert nodes[path]["maxLength"] <= 63
    rules = [r for _, n in _walk(root) for r in n.get("x-kubernetes-validations", [])]
    assert len(rules) >= 7
    for r in rules:
        assert "\n" not in r["message"] and r["rule"].strip()


def test_cel_topology_table_matches_python(version: dict[str, Any]) -> None:
    root = version["schema"]["openAPIV3Schema"]
    slices_rule = root["properties"]["spec"]["properties"]["slices"]["x-kubernetes-validations"][0]["rule"]
    listed = "[" + ", ".join(f"'{t}'" for t in topology.TOPOLOGIES_2D) + "]"
    assert listed in slices_rule
    for accel in topology.TPU_ACCELERATORS:
        assert f"'{accel}'" in slices_rule
    accel_pattern = root["properties"]["spec"]["properties"]["slices"]["properties"]["accelerator"]["pattern"]
    for accel in topology.TPU_ACCELERATORS:
        assert accel in accel_pattern


def test_defaults_match_spec_module(version: dict[str, Any]) -> None:
    props = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    ck = props["checkpoint"]["properties"]
    rc = props["recovery"]["properties"]
    assert ck["finalSave"]["properties"]["timeoutSeconds"]["default"] == spec.DEFAULT_FINAL_SAVE_TIMEOUT_SECONDS
    assert ck["restore"]["properties"]["step"]["default"] == spec.RESTORE_LATEST
    assert rc["maxRestarts"]["default"] == spec.DEFAULT_MAX_RESTARTS
    assert rc["backoffSeconds"]["default"] == spec.DEFAULT_BACKOFF_SECONDS
    assert rc["nodeLossGraceSeconds"]["default"] == spec.DEFAULT_NODE_LOSS_GRACE_SECONDS


def test_status_enums_match_api(version: dict[str, Any]) -> None:
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert tuple(status["phase"]["enum"]) == api.PHASES
    # Every transition kind the operator records must be storable (a new kind missing here made every
    # status write of that transition fail with 422).
    assert tuple(status["transition"]["properties"]["kind"]["enum"]) == st.TRANSITION_KINDS
    conditions = status["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == ["type"]


def test_reference_doc_covers_every_field(version: dict[str, Any]) -> None:
    doc = (ROOT / "docs" / "jaxjob-reference.md").read_text()
    root = version["schema"]["openAPIV3Schema"]
    for section in ("spec", "status"):
        for path, _ in _walk(root["properties"][section]):
            if not path or path.startswith(".template.") or ".conditions[]." in path:
                continue
            leaf = path.rstrip("[]").split(".")[-1]
            assert f"`{leaf}" in doc or f"{leaf}`" in doc or f".{leaf}`" in doc, f"{section}{path} is not documented"
