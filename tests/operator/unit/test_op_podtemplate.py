"""The worker template against Kubernetes' PodTemplateSpec schema and the restricted Pod Security profile
(issue 18, item 6; issue 25, item 5): malformed templates become InvalidSpec naming the field, never an
exception in a reconcile; every field the restricted profile refuses (and nodeName, hostPort,
shareProcessNamespace, tolerations of every taint) is refused unless the operator allows host access;
nulls anywhere are absent; a user's securityContext is merged deeply, `drop: [ALL]` always kept."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_samples import (
    ALWAYS_REFUSED_TEMPLATES,
    HOST_ACCESS_TEMPLATES,
    MALFORMED_TEMPLATES,
    RESTRICTED_ALLOWED_TEMPLATES,
    RESTRICTED_TEMPLATES,
    TEMPLATE_TYPOS,
    good_spec,
)
from op_world import SETTINGS, World, tpu_pool
from resilax_operator import api
from resilax_operator.actions import CreateGeneration
from resilax_operator.builders import GenerationPlan, JobRef, build_pods
from resilax_operator.errors import InvalidSettingError, InvalidSpecError
from resilax_operator.pods.podtemplate import MAX_PROBLEMS, check_template_schema, template_schema
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


# ---- the restricted Pod Security profile (issue 25, item 5) -------------------------------------------

def _pods(raw: dict[str, Any], settings: OperatorSettings = SETTINGS, *, count: int = 2) -> list[dict[str, Any]]:
    """Every pod of a generation the builders make from a validated spec (pod 0 alone, then all)."""
    spec = validate_spec(raw, settings=settings)
    plan = GenerationPlan(1, Shape("4x4", count), tuple("ab"[:count]), "latest")
    job = JobRef("llama", "ml", "uid-1")
    return [*build_pods(job, spec, plan, settings, coordinator_ip=None),
            *build_pods(job, spec, plan, settings, coordinator_ip="10.0.0.1")]


@pytest.mark.parametrize(("change", "path"), [r[1:3] for r in RESTRICTED_TEMPLATES], ids=[r[0] for r in RESTRICTED_TEMPLATES])
def test_restricted_profile_refuses_the_field_naming_it(change: Any, path: str) -> None:
    """Each refusal is InvalidSpec naming the field path, the value found, what is allowed and the
    setting that lifts it; the same template is valid when the operator allows host access."""
    raw = _spec_with(change)
    with pytest.raises(InvalidSpecError) as info:
        validate_spec(raw, settings=SETTINGS)
    problems = {p.path: p.message for p in info.value.problems}
    assert path in problems, info.value
    message = problems[path]
    assert " is refused; allowed: " in message and "operator.allowHostAccess" in message, message
    assert "pod-security-standards" in message, message
    validate_spec(raw, settings=ALLOW)
    world = World.make(raw, tpu_pool("a", 4), tpu_pool("b", 4))
    world.step()
    invalid = world.status.condition(api.COND_INVALID_SPEC)
    assert invalid is not None and invalid.status == "True" and path in invalid.message


@pytest.mark.parametrize(("change", "path"), [r[1:] for r in ALWAYS_REFUSED_TEMPLATES],
                         ids=[r[0] for r in ALWAYS_REFUSED_TEMPLATES])
def test_node_name_and_ephemeral_containers_are_refused_whatever_the_setting(change: Any, path: str) -> None:
    for settings in (SETTINGS, ALLOW, None):
        with pytest.raises(InvalidSpecError) as info:
            validate_spec(_spec_with(change), settings=settings)
        assert path in {p.path for p in info.value.problems}, info.value


def test_every_restricted_refusal_is_reported_at_once() -> None:
    """All the rows in one template (those that set the same list or field as another row are left out
    and added together at the end): one InvalidSpec names every field."""
    shared = ("host-path", "nfs-volume", "init-privileged", "cap-add-sys-ptrace-init",
              "init-allow-privilege-escalation", "cap-add-net-admin-beside-allowed")
    raw = good_spec()
    expected = set()
    for name, change, path, _ in RESTRICTED_TEMPLATES:
        if name not in shared:
            change(raw["template"])
            expected.add(path)
    raw["template"]["spec"]["volumes"] = [{"name": "h", "hostPath": {"path": "/x"}},
                                          {"name": "n", "nfs": {"server": "s", "path": "/x"}}]
    raw["template"]["spec"]["initContainers"] = [{"name": "prepare", "image": "x", "securityContext": {
        "privileged": True, "allowPrivilegeEscalation": True, "capabilities": {"add": ["SYS_PTRACE", "CHOWN"]}}}]
    init = "spec.template.spec.initContainers[0].securityContext"
    expected |= {"spec.template.spec.volumes[0].hostPath", "spec.template.spec.volumes[1].nfs", f"{init}.privileged",
                 f"{init}.allowPrivilegeEscalation", f"{init}.capabilities.add[0]", f"{init}.capabilities.add[1]"}
    with pytest.raises(InvalidSpecError) as info:
        validate_spec(raw, settings=SETTINGS)
    paths = {p.path for p in info.value.problems}
    assert expected <= paths, (expected - paths, sorted(paths))


@pytest.mark.parametrize("change", [r[1] for r in RESTRICTED_ALLOWED_TEMPLATES], ids=[r[0] for r in RESTRICTED_ALLOWED_TEMPLATES])
def test_what_the_restricted_profile_allows_is_valid(change: Any) -> None:
    _pods(_spec_with(change))


@pytest.mark.parametrize("user", [
    {"capabilities": {"add": ["NET_BIND_SERVICE"]}},
    {"capabilities": {"drop": ["NET_RAW"], "add": ["NET_BIND_SERVICE"]}},
    {"capabilities": {"drop": []}},
    {"capabilities": {"drop": ["ALL"]}},
    {"capabilities": {}, "runAsUser": 1000},
], ids=["add-only", "drop-and-add", "empty-drop", "drop-all", "empty"])
def test_a_users_capabilities_merge_deeply_keeping_drop_all(user: dict[str, Any]) -> None:
    """Merged, not replaced: every container and init container of every pod keeps `drop: [ALL]` (once,
    first), the user's own drops and adds, and the user's other fields."""
    def change(t: dict[str, Any]) -> None:
        t["spec"]["containers"][0]["securityContext"] = copy.deepcopy(user)
        t["spec"]["containers"].append({"name": "helper", "image": "x", "securityContext": copy.deepcopy(user)})
        t["spec"]["initContainers"] = [{"name": "prepare", "image": "x", "securityContext": copy.deepcopy(user)}]

    for pod in _pods(_spec_with(change)):
        spec = pod["spec"]
        for c in [*spec["containers"], *spec["initContainers"]]:
            ctx = c["securityContext"]
            assert ctx["capabilities"]["drop"][0] == "ALL" and ctx["capabilities"]["drop"].count("ALL") == 1, c
            if c["name"] in ("trainer", "helper", "prepare"):
                assert set(user["capabilities"].get("drop", [])) <= set(ctx["capabilities"]["drop"])
                assert ctx["capabilities"].get("add") == user["capabilities"].get("add")
                assert ctx.get("runAsUser") == user.get("runAsUser")
                assert ctx["allowPrivilegeEscalation"] is False and ctx["runAsNonRoot"] is True
                assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}


def test_a_users_security_context_fields_win_inside_objects() -> None:
    def change(t: dict[str, Any]) -> None:
        t["spec"]["containers"][0]["securityContext"] = {
            "seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}, "readOnlyRootFilesystem": True}
        t["spec"]["securityContext"] = {"fsGroup": 2000, "seccompProfile": {"type": "Localhost", "localhostProfile": "q"}}

    pod = _pods(_spec_with(change))[0]["spec"]
    trainer = pod["containers"][0]["securityContext"]
    assert trainer["seccompProfile"] == {"type": "Localhost", "localhostProfile": "p.json"}
    assert trainer["readOnlyRootFilesystem"] is True and trainer["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"] == {"runAsNonRoot": True, "fsGroup": 2000,
                                      "seccompProfile": {"type": "Localhost", "localhostProfile": "q"}}


#: Nulls the issue found crashing the builder, and their neighbours: id, change to `spec.template`.
NULL_TEMPLATES: list[tuple[str, Any]] = [
    ("anti-affinity-required-null", lambda t: t["spec"].update(affinity={"podAntiAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": None}})),
    ("affinity-null", lambda t: t["spec"].update(affinity=None)),
    ("node-affinity-required-null", lambda t: t["spec"].update(affinity={"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": None, "preferredDuringSchedulingIgnoredDuringExecution": None}})),
    ("security-context-null", lambda t: (t["spec"].update(securityContext=None),
                                         t["spec"]["containers"][0].update(securityContext=None))),
    ("capabilities-null", lambda t: t["spec"]["containers"][0].update(securityContext={"capabilities": None,
                                                                                       "runAsUser": None})),
    ("drop-null", lambda t: t["spec"]["containers"][0].update(securityContext={"capabilities": {"drop": None}})),
    ("lists-null", lambda t: (t["spec"].update(tolerations=None, volumes=None, initContainers=None, nodeSelector=None),
                              t["spec"]["containers"][0].update(env=None, volumeMounts=None, resources=None, ports=None))),
    ("list-items-null", lambda t: (t["spec"].update(tolerations=[None], volumes=[None], initContainers=[None]),
                                   t["spec"]["containers"][0].update(env=[None], volumeMounts=[None]))),
    ("resources-limits-null", lambda t: t["spec"]["containers"][0].update(resources={"limits": None, "requests": None})),
    ("metadata-null", lambda t: t.update(metadata={"labels": None, "annotations": None})),
    ("grace-null", lambda t: t["spec"].update(terminationGracePeriodSeconds=None, restartPolicy=None)),
]


@pytest.mark.parametrize("change", [n[1] for n in NULL_TEMPLATES], ids=[n[0] for n in NULL_TEMPLATES])
def test_nulls_are_absent_and_never_crash_the_builder(change: Any) -> None:
    """The job validates, the builders make every pod (with the operator's anti-affinity and drop ALL),
    and the decisions create the generation."""
    raw = _spec_with(change)
    for pod in _pods(raw):
        terms = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms and terms[-1]["topologyKey"] == api.HOSTNAME_LABEL
        assert pod["spec"]["containers"][0]["securityContext"]["capabilities"]["drop"] == ["ALL"]
    world = World.make(raw, tpu_pool("a", 4), tpu_pool("b", 4))
    assert any(isinstance(a, CreateGeneration) for a in world.step())


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at] if at else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*at, i))
    return out


def _rich_spec() -> dict[str, Any]:
    raw = good_spec()
    raw["template"] = {"metadata": {"labels": {"team": "a"}, "annotations": {"x": "y"}}, "spec": {
        "nodeSelector": {"pool": "a"}, "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
        "securityContext": {"runAsUser": 1000, "fsGroup": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
        "affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "zone"}]},
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "k", "operator": "In", "values": ["v"]}]}]}}},
        "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "d"}}],
        "initContainers": [{"name": "prep", "image": "x", "securityContext": {"capabilities": {"drop": ["NET_RAW"]}}}],
        "containers": [{"name": "trainer", "image": "x:1", "command": ["python"], "env": [{"name": "A", "value": "1"}],
                        "resources": {"requests": {"cpu": "1"}, "limits": {"memory": "1Gi"}},
                        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                        "securityContext": {"runAsNonRoot": True, "capabilities": {"add": ["NET_BIND_SERVICE"]}}}]}}
    raw["slices"]["machineType"] = None
    raw["capacity"] = {"provisioning": "Ready"}
    return raw


def test_a_null_anywhere_in_the_spec_never_crashes_validation_building_or_deciding() -> None:
    """Every field of a rich spec set to null, one at a time: validation answers (valid, or InvalidSpec),
    and a valid one is built and decided on without an exception."""
    tried = built = 0
    for path in _paths(_rich_spec()):
        raw = _rich_spec()
        node: Any = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = None
        tried += 1
        try:
            validate_spec(raw, settings=SETTINGS)
        except InvalidSpecError:
            continue
        _pods(raw)
        world = World.make(raw, tpu_pool("a", 4), tpu_pool("b", 4))
        for _ in range(2):
            world.step()
        built += 1
    assert tried > 60 and built > 40, (tried, built)
