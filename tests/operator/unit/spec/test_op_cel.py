"""The CRD's CEL rules, evaluated with cel-python on good and bad JAXJobs.

The API server is the final judge (the cluster tests apply the CRD); this catches a rule that does not
compile or does not say what it means without one. Defaults are written out in the samples, as the
API server applies them before the rules run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from op_samples import good_spec
from resilax_operator import api

ROOT = Path(__file__).resolve().parents[4]
Raw = dict[str, Any]


def _rules(schema: Raw, path: str = "") -> Iterator[tuple[str, Raw]]:
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, rule
    for name, child in (schema.get("properties") or {}).items():
        yield from _rules(child, f"{path}.{name}")
    if "items" in schema:
        yield from _rules(schema["items"], f"{path}[]")


def _values(obj: Any, path: str) -> list[Any]:
    values = [obj]
    for part in [p for p in path.split(".") if p]:
        key, many = (part[:-2], True) if part.endswith("[]") else (part, False)
        nxt: list[Any] = []
        for v in values:
            if isinstance(v, dict) and key in v:
                nxt.extend(v[key]) if many else nxt.append(v[key])
        values = nxt
    return values


@pytest.fixture(scope="module")
def programs() -> list[tuple[str, str, Any]]:
    crd = yaml.safe_load((ROOT / api.CRD_FILE).read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    env = celpy.Environment()
    return [(path, rule["message"], env.program(env.compile(rule["rule"]))) for path, rule in _rules(root)]


def _violations(programs: list[tuple[str, str, Any]], job: Raw) -> list[str]:
    out = []
    for path, message, program in programs:
        for value in _values(job, path):
            result = program.evaluate({"self": celpy.json_to_cel(value)})
            if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
                out.append(message)
    return out


def _job(mutate: Callable[[Raw], Any] | None = None, name: str = "llama") -> Raw:
    spec = good_spec()
    if mutate is not None:
        mutate(spec)
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name}, "spec": spec}


def test_good_job_passes(programs: list[tuple[str, str, Any]]) -> None:
    assert _violations(programs, _job()) == []


GOOD = [
    ("v4-3d", lambda s: (s["slices"].update(accelerator="tpu-v4-podslice", topology="2x2x4"),
                         s["elastic"].update(topologies=["2x2x2"]))),
    ("tpu7x-3d-machine-type", lambda s: (s["slices"].update(accelerator="tpu7x", topology="4x4x8",
                                                            machineType="tpu7x-standard-4t"),
                                         s["elastic"].update(topologies=["2x2x1", "1x1x1"]))),
    ("restore-int", lambda s: s["checkpoint"]["restore"].update(step=12)),
    ("cpu-grid", lambda s: (s["slices"].update(accelerator="cpu", topology="2x4"), s["elastic"].update(topologies=["1x4"]))),
    ("no-elastic", lambda s: s.pop("elastic")),
    ("local-node-scope", lambda s: s["checkpoint"].update(local={"scope": "Node", "medium": "Memory", "keepLast": 3})),
    ("autoscaled-with-shrink", lambda s: s.update(capacity={"provisioning": "Autoscaled", "shrinkAfterSeconds": 30})),
    ("autoscaled", lambda s: s.update(capacity={"provisioning": "Autoscaled"}, suspend=True)),
    ("failure-rules", lambda s: s["recovery"].update(failureRules=[
        {"action": "FailJob", "exitCodes": [42], "containerName": "trainer"},
        {"action": "RestartWithoutCounting", "podReasons": ["Evicted"]}])),
    ("keep-best", lambda s: s["checkpoint"]["keep"].update(best=3, metric="loss", mode="min", everyMinutes=60)),
    ("spare-slices-tpu", lambda s: s["recovery"].update(spareSlices=2)),
    ("spare-slices-0-cpu", lambda s: (s["slices"].update(accelerator="cpu", topology="2x4"), s.pop("elastic"),
                                      s["recovery"].update(spareSlices=0))),
]


@pytest.mark.parametrize("mutate", [g[1] for g in GOOD], ids=[g[0] for g in GOOD])
def test_good_variants_pass(programs: list[tuple[str, str, Any]], mutate: Callable[[Raw], Any]) -> None:
    assert _violations(programs, _job(mutate)) == []


BAD = [
    ("count-above-max", lambda s: s["slices"].update(count=5), "slices.count must be <= elastic.maxCount"),
    ("count-below-min", lambda s: s["slices"].update(count=1), "slices.count must be >= elastic.minCount"),
    ("min-above-max", lambda s: s["elastic"].update(minCount=5), "minCount must be <= maxCount"),
    ("v5e-4x3", lambda s: s["slices"].update(topology="4x3"), "topology is not valid for the accelerator"),
    ("v4-2d", lambda s: (s["slices"].update(accelerator="tpu-v4-podslice", topology="4x4"), s.pop("elastic")),
     "topology is not valid for the accelerator"),
    ("v6e-3d", lambda s: (s["slices"].update(accelerator="tpu-v6e-slice", topology="2x2x2"), s.pop("elastic")),
     "topology is not valid for the accelerator"),
    ("elastic-topology-invalid", lambda s: s["elastic"].update(topologies=["3x3"]), "every elastic.topologies entry"),
    ("sidecar-container-name", lambda s: s["template"]["spec"]["containers"][0].update(name="resilax-sidecar"),
     "reserved for the operator's sidecar"),
    ("sidecar-init-container-name", lambda s: s["template"]["spec"].update(initContainers=[{"name": "resilax-sidecar"}]),
     "reserved for the operator's sidecar"),
    ("machine-type-on-cpu", lambda s: (s["slices"].update(accelerator="cpu", topology="2x4", machineType="n2"),
                                       s["elastic"].update(topologies=[])), "machineType applies to TPU"),
    ("negative-restore-step", lambda s: s["checkpoint"]["restore"].update(step=-1), "a step number must be >= 0"),
    ("size-limit-with-node-scope", lambda s: s["checkpoint"]["local"].update(scope="Node"), "sizeLimit needs scope: Pod"),
    ("size-limit-default-scope", lambda s: s["checkpoint"]["local"].pop("scope"), "sizeLimit needs scope: Pod"),
    ("local-init-container-name", lambda s: s["template"]["spec"].update(initContainers=[{"name": "resilax-local-init"}]),
     "reserved for the operator's local tier init container"),
    ("shrink-without-autoscaled", lambda s: s.update(capacity={"shrinkAfterSeconds": 30}),
     "shrinkAfterSeconds applies to provisioning: Autoscaled only"),
    ("shrink-with-ready", lambda s: s.update(capacity={"provisioning": "Ready", "shrinkAfterSeconds": 30}),
     "shrinkAfterSeconds applies to provisioning: Autoscaled only"),
    ("rule-matches-nothing", lambda s: s["recovery"].update(failureRules=[{"action": "FailJob"}]),
     "a rule sets exitCodes, podReasons or both"),
    ("rule-protocol-code", lambda s: s["recovery"].update(failureRules=[{"action": "FailJob", "exitCodes": [3, 76]}]),
     "the worker protocol's exit codes"),
    ("rule-container-without-codes", lambda s: s["recovery"].update(
        failureRules=[{"action": "FailJob", "podReasons": ["Evicted"], "containerName": "trainer"}]),
     "containerName says whose exit code"),
    ("keep-best-without-metric", lambda s: s["checkpoint"]["keep"].update(best=2, mode="min"),
     "keep.best needs keep.metric"),
    ("keep-best-without-mode", lambda s: s["checkpoint"]["keep"].update(best=2, metric="loss"),
     "keep.best needs keep.metric (a metric the script passes to save(..., metrics=)) and keep.mode (max or min)"),
    ("keep-metric-without-best", lambda s: s["checkpoint"]["keep"].update(metric="loss"),
     "keep.metric and keep.mode need keep.best"),
    ("spare-slices-cpu", lambda s: (s["slices"].update(accelerator="cpu", topology="2x4"), s.pop("elastic"),
                                    s["recovery"].update(spareSlices=1)),
     "recovery.spareSlices must be 0 with accelerator cpu: a spare's placeholders hold a slice's TPUs or GPUs"),
]


@pytest.mark.parametrize(("mutate", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_jobs_fail_their_rule(programs: list[tuple[str, str, Any]], mutate: Callable[[Raw], Any], message: str) -> None:
    violations = _violations(programs, _job(mutate))
    assert any(message in v for v in violations), violations


def _cel_format(template: Any, args: Any) -> Any:
    """Kubernetes' CEL `string.format(list)` for `%d` (cel-python lacks the strings extension)."""
    return celpy.celtypes.StringType(str(template).replace("%d", "{}").format(*(int(a) for a in args)))


@pytest.mark.parametrize(("count", "expected"), [
    (5, "slices.count 5 is above elastic.maxCount 4; allowed: 2..4"),
    (1, "slices.count 1 is below elastic.minCount 2; allowed: 2..4"),
], ids=["above-max", "below-min"])
def test_count_outside_the_elastic_bounds_names_the_bound(count: int, expected: str) -> None:
    """What `kubectl scale jj/NAME --replicas N` answers outside the bounds (the /scale subresource writes
    spec.slices.count, which these rules check): the value, the bound it crosses and the allowed range."""
    crd = yaml.safe_load((ROOT / api.CRD_FILE).read_text())
    spec_schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    job = _job(lambda s: s["slices"].update(count=count))
    env = celpy.Environment()
    messages = []
    for rule in spec_schema["x-kubernetes-validations"]:
        if "messageExpression" not in rule:
            continue
        activation = {"self": celpy.json_to_cel(job["spec"])}
        if not bool(env.program(env.compile(rule["rule"])).evaluate(activation)):
            message = env.program(env.compile(rule["messageExpression"]), functions={"format": _cel_format})
            messages.append(str(message.evaluate(activation)))
    assert messages == [expected]


def test_long_name(programs: list[tuple[str, str, Any]]) -> None:
    assert any("at most 40" in v for v in _violations(programs, _job(name="x" * 41)))


def test_name_starting_with_a_digit(programs: list[tuple[str, str, Any]]) -> None:
    assert any("start with a letter" in v for v in _violations(programs, _job(name="1job")))
