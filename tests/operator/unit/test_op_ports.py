"""TPU-safe ports (issue 25, item 2): every port of every pod and Service the builders make, TPU and
CPU/GPU, one and several slices, avoids the TPU runtime's (pods/ports.py: 8471, 8080-8081, 8431, 8476-8479)
except Megascale's own; multislice TPU workers get MEGASCALE_PORT; a reserved port in the operator's
settings, the sidecar's config or a clash in the template is refused with a clear message."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from op_samples import good_spec
from resilax_operator.builders import GenerationPlan, JobRef, build_pods, build_service
from resilax_operator.errors import InvalidSettingError, InvalidSpecError
from resilax_operator.pods.ports import (
    DEFAULT_COORDINATOR_PORT,
    DEFAULT_SIDECAR_PORT,
    MEGASCALE_PORTS,
    TPU_RESERVED_PORTS,
)
from resilax_operator.settings import OperatorSettings
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec

SETTINGS = OperatorSettings(sidecar_image="resilax:test")
#: The environment that names Megascale's port on purpose.
MEGASCALE_ENV = ("MEGASCALE_PORT", "MEGASCALE_COORDINATOR_ADDRESS")

#: id, slices, elastic, extra spec changes, the job's Kueue queue.
CASES: list[tuple[str, dict[str, Any], dict[str, Any] | None, dict[str, Any], str]] = [
    ("v5e-one-slice", {"accelerator": "tpu-v5-lite-podslice", "topology": "4x4", "count": 1}, None, {}, ""),
    ("v5e-two-slices", {"accelerator": "tpu-v5-lite-podslice", "topology": "4x4", "count": 2},
     {"minCount": 1, "maxCount": 2}, {}, ""),
    ("v5p-three-slices", {"accelerator": "tpu-v5p-slice", "topology": "2x2x2", "count": 3}, None, {}, ""),
    ("v6e-single-host", {"accelerator": "tpu-v6e-slice", "topology": "2x4", "count": 1}, None, {}, ""),
    ("v4-two-slices-kueue", {"accelerator": "tpu-v4-podslice", "topology": "2x2x4", "count": 2}, None, {}, "team-a"),
    ("v5e-node-local-tier", {"accelerator": "tpu-v5-lite-podslice", "topology": "2x4", "count": 2}, None,
     {"local": {"scope": "Node"}}, ""),
    ("cpu-two-slices", {"accelerator": "cpu", "topology": "2x4", "count": 2, "chipsPerHost": 4}, None, {}, ""),
    ("gpu-one-slice", {"accelerator": "nvidia-l4", "topology": "1x2", "count": 1}, None,
     {"storage": "pvc://ckpt/run"}, ""),
]


def _build(slices: dict[str, Any], elastic: dict[str, Any] | None, checkpoint: dict[str, Any],
           queue: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    raw = good_spec()
    raw["slices"] = slices
    raw.pop("elastic")
    if elastic:
        raw["elastic"] = elastic
    raw["checkpoint"].update(checkpoint)
    spec = validate_spec(raw, settings=SETTINGS)
    job = JobRef("llama", "ml", "uid-1", queue)
    plan = GenerationPlan(2, Shape(slices["topology"], slices["count"]), ("pool",) * slices["count"])
    pods = [*build_pods(job, spec, plan, SETTINGS, coordinator_ip=None),
            *build_pods(job, spec, plan, SETTINGS, coordinator_ip="10.0.0.9")]
    return pods, build_service(job, SETTINGS)


def _ports(pods: list[dict[str, Any]], service: dict[str, Any]) -> Iterator[tuple[str, str, int]]:
    """(where, name, port) of every port a pod or the Service names: Service ports, container ports,
    probe ports, and every environment value that is a port or ends in `:<port>`."""
    for p in service["spec"]["ports"]:
        yield "service", p["name"], int(p["port"])
    for pod in pods:
        name = pod["metadata"]["name"]
        for c in [*pod["spec"]["containers"], *pod["spec"]["initContainers"]]:
            where = f"{name}/{c['name']}"
            for p in c.get("ports") or []:
                yield where, f"containerPort {p.get('name', '')}", int(p["containerPort"])
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                for kind in ("httpGet", "tcpSocket"):
                    port = ((c.get(probe) or {}).get(kind) or {}).get("port")
                    if isinstance(port, int):
                        yield where, f"{probe}.{kind}", port
            for e in c.get("env") or []:
                value = str(e.get("value", ""))
                found = re.fullmatch(r"\d+", value) if e["name"].endswith("_PORT") else re.search(r":(\d+)$", value)
                if found:
                    yield where, f"env {e['name']}", int(found.group(1) if found.groups() else found.group(0))


@pytest.mark.parametrize(("slices", "elastic", "checkpoint", "queue"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_no_built_pod_uses_a_tpu_runtime_port(slices: dict[str, Any], elastic: dict[str, Any] | None,
                                              checkpoint: dict[str, Any], queue: str) -> None:
    pods, service = _build(slices, elastic, checkpoint, queue)
    found = list(_ports(pods, service))
    clashes = [f for f in found if f[2] in TPU_RESERVED_PORTS
               and not (f[1].removeprefix("env ") in MEGASCALE_ENV and f[2] in MEGASCALE_PORTS)]
    assert not clashes, clashes
    numbers = {f[2] for f in found}
    assert {DEFAULT_SIDECAR_PORT, DEFAULT_COORDINATOR_PORT} <= numbers, sorted(numbers)
    tpu = slices["accelerator"].startswith("tpu-")
    for pod in pods:
        trainer = next(c for c in pod["spec"]["containers"] if c["name"] == "trainer")
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        if tpu and slices["count"] > 1:  # Megascale told its port explicitly, the coordinator's the same
            assert env["MEGASCALE_PORT"] == str(SETTINGS.megascale_port)
            assert env["MEGASCALE_COORDINATOR_ADDRESS"].endswith(f":{SETTINGS.megascale_port}")
        else:
            assert not any(k.startswith("MEGASCALE_") for k in env)


def test_the_defaults_are_outside_the_reserved_ports() -> None:
    settings = OperatorSettings()
    assert settings.sidecar_port == DEFAULT_SIDECAR_PORT == 8490
    assert settings.coordinator_port == DEFAULT_COORDINATOR_PORT == 8482
    assert settings.megascale_port in MEGASCALE_PORTS
    assert not {settings.sidecar_port, settings.coordinator_port} & set(TPU_RESERVED_PORTS)
    assert {8471, 8080, 8081, 8431, 8476} <= set(TPU_RESERVED_PORTS)


@pytest.mark.parametrize("port", sorted(TPU_RESERVED_PORTS))
@pytest.mark.parametrize("field", ["sidecar_port", "coordinator_port"])
def test_a_reserved_port_in_the_settings_is_refused_at_start(field: str, port: int) -> None:
    variable = f"RESILAX_OPERATOR_{field.upper()}"
    with pytest.raises(InvalidSettingError) as info:
        OperatorSettings.from_env({variable: str(port)})
    message = str(info.value)
    assert f"{variable}={port} is the TPU runtime's port" in message and "8471" in message, message


@pytest.mark.parametrize(("values", "expected"), [
    ({"megascale_port": 8471}, "RESILAX_OPERATOR_MEGASCALE_PORT=8471 is the TPU runtime's port"),
    ({"sidecar_port": 9000, "coordinator_port": 9000}, "must differ"),
    ({"sidecar_port": 8080, "megascale_port": 8080}, "RESILAX_OPERATOR_SIDECAR_PORT=8080"),
    ({"coordinator_port": 0}, "RESILAX_OPERATOR_COORDINATOR_PORT=0 is not a port number"),
])
def test_bad_port_settings_are_refused(values: dict[str, int], expected: str) -> None:
    with pytest.raises(InvalidSettingError, match=re.escape(expected)):
        OperatorSettings(**values)  # type: ignore[arg-type]


def test_other_ports_are_accepted() -> None:
    OperatorSettings(sidecar_port=9471, coordinator_port=1234, megascale_port=8081)


@pytest.mark.parametrize(("change", "path", "expected"), [
    (lambda c: c[0].update(ports=[{"containerPort": DEFAULT_SIDECAR_PORT}]),
     "spec.template.spec.containers[0].ports[0].containerPort", "the Resilax sidecar's port"),
    (lambda c: c.append({"name": "helper", "image": "x", "ports": [{"containerPort": DEFAULT_COORDINATOR_PORT}]}),
     "spec.template.spec.containers[1].ports[0].containerPort", "JAX's coordination service's port"),
], ids=["sidecar-port", "coordinator-port-on-a-helper"])
def test_a_template_port_clashing_with_the_operators_is_refused(change: Any, path: str, expected: str) -> None:
    raw = good_spec()
    change(raw["template"]["spec"]["containers"])
    with pytest.raises(InvalidSpecError) as info:
        validate_spec(raw, settings=SETTINGS)
    problems = {p.path: p.message for p in info.value.problems}
    assert expected in problems[path], problems


def test_the_trainer_may_declare_the_ports_it_binds() -> None:
    """The trainer runs JAX's coordinator and libtpu/Megascale: declaring those ports (as xpk does) is fine."""
    raw = good_spec()
    raw["template"]["spec"]["containers"][0]["ports"] = [
        {"containerPort": p} for p in (DEFAULT_COORDINATOR_PORT, 8471, 8080)]
    validate_spec(raw, settings=SETTINGS)
