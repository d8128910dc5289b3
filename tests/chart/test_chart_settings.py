"""The operator's settings as typed chart values (issue 41): `operator.settings` holds every
`OperatorSettings` field the chart does not derive from another value, with the operator's own default;
values.schema.json types and bounds each one as settings.INTEGER_BOUNDS does (helm refuses a bad value
at install); the rendered Deployment hands them to the operator as its `RESILAX_OPERATOR_*` variables,
which `OperatorSettings.from_env` reads back."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, RELEASE, one, write_values
from resilax_operator.settings import ENV_PREFIX, INTEGER_BOUNDS, OperatorSettings

#: Settings the chart sets from other values (the value named), not from `operator.settings`.
CHART_DERIVED = {
    "sidecar_image": "sidecar.image", "image_pull_policy": "sidecar.image.pullPolicy",
    "sidecar_resources": "sidecar.resources", "sidecar_log_format": "logFormat",
    "local_tier_root": "operator.localTier.root", "local_tier_memory_root": "operator.localTier.memoryRoot",
    "allow_host_access": "operator.allowHostAccess", "spare_priority_class": "spares.priorityClass",
}


def camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(word.capitalize() for word in rest)


def typed_settings() -> dict[str, Any]:
    """camelCase key -> the dataclass field, for every setting `operator.settings` must hold."""
    return {camel(f.name): f for f in fields(OperatorSettings) if f.name not in CHART_DERIVED}


def test_values_hold_every_setting_with_the_operators_default() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["operator"]["settings"]
    expected = typed_settings()
    assert sorted(values) == sorted(expected)
    for key, field in expected.items():
        assert values[key] == field.default, f"operator.settings.{key}: {values[key]!r}, the operator's {field.default!r}"


def test_schema_types_and_bounds_each_setting_as_the_operator_does() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["operator"]["properties"]["settings"]
    assert schema["additionalProperties"] is False
    assert sorted(schema["properties"]) == sorted(typed_settings())
    for key, field in typed_settings().items():
        prop = schema["properties"][key]
        if field.type in ("int", int):
            low, high = INTEGER_BOUNDS.get(field.name, (0, None))
            assert (prop["type"], prop["minimum"], prop.get("maximum")) == ("integer", low, high), key
        else:
            assert prop["type"] == "string", key
        assert ENV_PREFIX + field.name.upper() in prop["description"], key


def operator_env(objects: list[dict[str, Any]]) -> dict[str, str]:
    deployment = one(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_settings_reach_the_operator_as_its_variables(render) -> None:
    env = operator_env(render())
    # The chart's defaults read back as the operator's defaults (the derived ones aside).
    read = OperatorSettings.from_env(env)
    assert read == OperatorSettings(**{name: getattr(read, name) for name in CHART_DERIVED})
    for key, field in typed_settings().items():
        assert ENV_PREFIX + field.name.upper() in env, key
    changed = {"maxHostsPerJob": 1_000_000, "probePriorityClass": "resilax-probe", "nodeLossGuardPercent": 0,
               "sidecarPort": 8491}
    env = operator_env(render({"operator": {"settings": changed}}))
    assert env[ENV_PREFIX + "MAX_HOSTS_PER_JOB"] == "1000000"  # an integer, never 1e+06
    settings = OperatorSettings.from_env(env)
    assert (settings.max_hosts_per_job, settings.probe_priority_class, settings.node_loss_guard_percent,
            settings.sidecar_port) == (1_000_000, "resilax-probe", 0, 8491)
    # operator.env comes after the chart's variables: the one a user sets there wins.
    env = operator_env(render({"operator": {"env": [{"name": ENV_PREFIX + "RECONCILE_THREADS", "value": "8"}]}}))
    assert OperatorSettings.from_env(env).reconcile_threads == 8


@pytest.mark.parametrize(("settings", "expected"), [
    pytest.param({"reconcileThreads": 0}, ["/operator/settings/reconcileThreads", "minimum"], id="below-minimum"),
    pytest.param({"stuckTerminatingSeconds": "1m"}, ["/operator/settings/stuckTerminatingSeconds", "integer"],
                 id="not-an-integer"),
    pytest.param({"nodeLossGuardPercent": 150}, ["/operator/settings/nodeLossGuardPercent", "maximum"],
                 id="above-maximum"),
    pytest.param({"sidecarPort": 70000}, ["/operator/settings/sidecarPort"], id="port"),
    pytest.param({"maxHostPerJob": 10}, ["maxHostPerJob"], id="misspelt"),
])
def test_helm_refuses_a_bad_setting_naming_it(helm, tmp_path: Path, settings: dict[str, Any],
                                             expected: list[str]) -> None:
    values = write_values(tmp_path / "v.yaml", {"operator": {"settings": settings}})
    proc = helm("template", RELEASE, str(CHART), "-f", str(values))
    assert proc.returncode != 0, f"accepted {settings}"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    for fragment in expected:
        assert fragment in proc.stderr, f"{fragment!r} not in:\n{proc.stderr}"
