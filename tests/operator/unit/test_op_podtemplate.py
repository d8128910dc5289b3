"""The worker template against Kubernetes' PodTemplateSpec schema and the host-access policy (issue 18,
item 6): malformed templates become InvalidSpec naming the field, never an exception in a reconcile;
privileged, hostNetwork, hostPID and hostPath are refused unless the operator allows host access."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_samples import HOST_ACCESS_TEMPLATES, MALFORMED_TEMPLATES, TEMPLATE_TYPOS, good_spec
from op_world import SETTINGS, World, tpu_pool
from resilax_operator import api
from resilax_operator.actions import CreateGeneration
from resilax_operator.builders import GenerationPlan, JobRef, build_pods
from resilax_operator.errors import InvalidSettingError, InvalidSpecError
from resilax_operator.podtemplate import MAX_PROBLEMS, check_template_schema, template_schema
from resilax_operator.settings import OperatorSettings
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec

ROOT = Path(__file__).resolve().parents[3]
ALLOW = OperatorSettings(sidecar_image="resilax:test", allow_host_access=True)


def _spec_with(change: Any) -> dict[str, Any]:
    raw = good_spec()
    change(raw["template"])
    return raw


@pytest.mark.parametrize(("change", "path"), [m[1:] for m in MALFORMED_TEMPLATES + TEMPLATE_TYPOS],
                         ids=[m[0] for m in MALFORMED_TEMPLATES + TEMPLATE_TYPOS])
def test_malformed_template_is_an_invalid_spec_naming_the_field(change: Any, path: str) -> None:
    with pytest.raises(InvalidSpecError) as info:
        validate_spec(_spec_with(change), settings=SETTINGS)
    problems = {p.path: p.message for p in info.value.problems}
    assert path in problems, info.value
    assert "required" in problems[path] or "unknown field" in problems[path], problems[path]


@pytest.mark.parametrize(("change", "path"), [m[1:] for m in MALFORMED_TEMPLATES + TEMPLATE_TYPOS],
                         ids=[m[0] for m in MALFORMED_TEMPLATES + TEMPLATE_TYPOS])
def test_malformed_template_never_crashes_a_reconcile(change: Any, path: str) -> None:
    """A job stored before the CRD carried the schema: every reconcile sets InvalidSpec (and fails the
    job that never started) with the field in the message and the event; no exception, no pods."""
    world = World.make(_spec_with(change), tpu_pool("a", 4), tpu_pool("b", 4))
    for _ in range(3):
        actions = world.step()
        assert not any(isinstance(a, CreateGeneration) for a in actions)
    invalid = world.status.condition(api.COND_INVALID_SPEC)
    assert invalid is not None and invalid.status == "True" and path in invalid.message
    assert world.status.phase == api.PHASE_FAILED
    assert any(e.reason == api.SPEC_INVALID.name and path in e.message for e in world.events)


def test_the_builder_would_have_crashed_on_them() -> None:
    """Why the check matters: the pure builder trips over most of them (the bug issue 18 reports)."""
    crashed = 0
    for _, change, _ in MALFORMED_TEMPLATES:
        raw = _spec_with(change)
        spec = validate_spec(good_spec())
        spec = type(spec)(**{**spec.__dict__, "template": raw["template"]})
        plan = GenerationPlan(1, Shape("4x4", 4), ("a", "a", "a", "a"), "latest")
        try:
            build_pods(JobRef("llama", "ml", "uid-1"), spec, plan, SETTINGS, coordinator_ip="10.0.0.1")
        except (TypeError, ValueError, AttributeError, KeyError):
            crashed += 1
    assert crashed >= 4, crashed


def test_all_problems_of_a_template_at_once_and_bounded() -> None:
    raw = good_spec()
    container = raw["template"]["spec"]["containers"][0]
    container.update(env={"A": "1"}, ports={"containerPort": 1}, command="x")
    raw["template"]["metadata"] = {"labels": ["a"]}
    with pytest.raises(InvalidSpecError) as info:
        validate_spec(raw)
    paths = {p.path for p in info.value.problems}
    assert {"spec.template.spec.containers[0].env", "spec.template.spec.containers[0].ports",
            "spec.template.spec.containers[0].command", "spec.template.metadata.labels"} <= paths
    many = {"spec": {"containers": [{"name": f"c{i}", "image": 1} for i in range(30)]}}
    assert len(check_template_schema(many)) == MAX_PROBLEMS


def test_messages_say_what_was_found_and_what_is_allowed() -> None:
    raw = _spec_with(MALFORMED_TEMPLATES[0][1])
    with pytest.raises(InvalidSpecError) as info:
        validate_spec(raw)
    assert ("spec.template.spec.containers[0].env: found an object (a map) {\"LR\": \"0.1\"}; a list is required"
            in str(info.value))
    problems = check_template_schema({"spec": {"containers": [{"name": "t", "image": "x",
                                                               "resources": {"limits": {"cpu": 0.5}}}]}})
    assert [p.path for p in problems] == ["spec.template.spec.containers[0].resources.limits.cpu"]
    assert "an integer or a string is required" in problems[0].message and "\"500m\"" in problems[0].message


@pytest.mark.parametrize(("change", "path"), [h[1:] for h in HOST_ACCESS_TEMPLATES],
                         ids=[h[0] for h in HOST_ACCESS_TEMPLATES])
def test_host_access_is_refused_unless_the_operator_allows_it(change: Any, path: str) -> None:
    raw = _spec_with(change)
    with pytest.raises(InvalidSpecError) as info:
        validate_spec(raw, settings=SETTINGS)
    problems = {p.path: p.message for p in info.value.problems}
    assert path in problems and "operator.allowHostAccess" in problems[path], info.value
    validate_spec(raw, settings=ALLOW)  # allowed: valid
    validate_spec(raw)  # no settings: parsing only (no policy)
    world = World.make(raw, tpu_pool("a", 4), tpu_pool("b", 4))
    world.step()
    assert world.status.condition(api.COND_INVALID_SPEC).status == "True"


def test_host_access_allowed_reaches_the_pods() -> None:
    raw = _spec_with(lambda t: t["spec"].update(hostNetwork=True))
    spec = validate_spec(raw, settings=ALLOW)
    plan = GenerationPlan(1, Shape("4x4", 4), ("a", "a", "a", "a"), "latest")
    pods = build_pods(JobRef("llama", "ml", "uid-1"), spec, plan, ALLOW, coordinator_ip="10.0.0.1")
    assert all(p["spec"]["hostNetwork"] is True for p in pods)


@pytest.mark.parametrize(("raw", "value"), [("true", True), ("false", False), ("1", True), ("", False)])
def test_allow_host_access_setting_from_env(raw: str, value: bool) -> None:
    assert OperatorSettings.from_env({"RESILAX_OPERATOR_ALLOW_HOST_ACCESS": raw}).allow_host_access is value


def test_allow_host_access_setting_refuses_a_non_boolean() -> None:
    with pytest.raises(InvalidSettingError, match="RESILAX_OPERATOR_ALLOW_HOST_ACCESS='maybe' is not a boolean"):
        OperatorSettings.from_env({"RESILAX_OPERATOR_ALLOW_HOST_ACCESS": "maybe"})


def _strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [_strip(v) for v in node]
    return node


def test_the_operator_checks_the_schema_the_crd_carries() -> None:
    """One source (scripts/gen-template-schema): the packaged schema is the CRD's without descriptions."""
    crd = yaml.safe_load((ROOT / api.CRD_FILE).read_text())
    (version,) = crd["spec"]["versions"]
    in_crd = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["template"]
    assert json.loads(json.dumps(_strip(in_crd))) == template_schema()
    spec = template_schema()["properties"]["spec"]
    assert {"containers", "volumes", "securityContext", "affinity", "tolerations"} <= set(spec["properties"])
    assert spec["properties"]["containers"]["items"]["required"] == ["name", "image"]


def test_real_templates_pass() -> None:
    """The demo's job and a template using most of what users write pass the schema check."""
    demo = yaml.safe_load((ROOT / "examples" / "jaxjob-demo.yaml").read_text())
    assert check_template_schema(demo["spec"]["template"]) == []
    rich = {"metadata": {"labels": {"team": "a"}, "annotations": {"x": "y"}}, "spec": {
        "serviceAccountName": "train", "priorityClassName": "high", "terminationGracePeriodSeconds": 60,
        "nodeSelector": {"pool": "a"}, "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
        "securityContext": {"runAsUser": 1000, "fsGroup": 1000},
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}},
                    {"name": "cfg", "configMap": {"name": "c", "defaultMode": 420}}, {"name": "tmp", "emptyDir": {}}],
        "containers": [{
            "name": "trainer", "image": "x:1", "command": ["python"], "args": ["train.py", "--lr", "0.1"],
            "env": [{"name": "A", "value": "1"}, {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
            "envFrom": [{"configMapRef": {"name": "c"}}], "ports": [{"containerPort": 8080, "name": "http"}],
            "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": 2, "nvidia.com/gpu": 1}},
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
            "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 5},
            "securityContext": {"runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}},
            "lifecycle": {"preStop": {"sleep": {"seconds": 5}}}}]}}
    assert check_template_schema(copy.deepcopy(rich)) == []
    validate_spec({**good_spec(), "template": rich}, settings=SETTINGS)
