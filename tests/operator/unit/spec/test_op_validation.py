"""Spec parsing and validation: every problem at once, each with its field path and what is allowed."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from op_samples import good_spec
from resilax_operator.errors import InvalidSpecError, ResilaxOperatorError
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec

Raw = dict[str, Any]


def _set(path: str, value: Any) -> Callable[[Raw], None]:
    keys = path.split(".")

    def mutate(raw: Raw) -> None:
        node = raw
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if value is _DELETE:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return mutate


_DELETE = object()
CONTAINER = {"name": "trainer", "image": "x"}

# id, mutation, expected field path, expected message fragment
BAD = [
    ("unknown-accelerator", _set("slices.accelerator", "tpu-v9"), "spec.slices.accelerator", "unknown accelerator 'tpu-v9'"),
    ("topology-invalid-for-v5e", _set("slices.topology", "4x3"), "spec.slices.topology",
     "'4x3' is not a valid tpu-v5-lite-podslice topology; valid: 1x1, 2x2, 2x4, 4x4"),
    ("3d-topology-on-v5e", _set("slices.topology", "2x2x2"), "spec.slices.topology", "valid: 1x1"),
    ("2d-topology-on-v4", lambda r: r["slices"].update(accelerator="tpu-v4-podslice", topology="4x4"),
     "spec.slices.topology", "not a valid tpu-v4-podslice topology"),
    ("count-above-elastic-max", _set("slices.count", 5), "spec.slices.count", "outside the elastic bounds [2, 4]"),
    ("count-below-elastic-min", _set("slices.count", 1), "spec.slices.count", "outside the elastic bounds"),
    ("count-zero", _set("slices.count", 0), "spec.slices.count", "must be >= 1"),
    ("min-above-max", _set("elastic.minCount", 5), "spec.elastic.minCount", "greater than maxCount 4"),
    ("elastic-topology-invalid", _set("elastic.topologies", ["4x4", "3x3"]), "spec.elastic.topologies",
     "'3x3' is not a valid tpu-v5-lite-podslice topology"),
    ("elastic-topologies-not-a-list", _set("elastic.topologies", "2x4"), "spec.elastic.topologies", "list of strings"),
    ("missing-template", _set("template", _DELETE), "spec.template", "is required"),
    ("template-without-spec", _set("template", {"metadata": {}}), "spec.template.spec", "is required"),
    ("template-without-containers", _set("template", {"spec": {"containers": []}}), "spec.template.spec.containers",
     "at least one container"),
    ("container-named-like-sidecar", _set("template", {"spec": {"containers": [{"name": "resilax-sidecar", "image": "x"}]}}),
     "spec.template.spec.containers[0].name", "reserved for the operator's sidecar"),
    ("init-container-named-like-sidecar",
     _set("template", {"spec": {"containers": [CONTAINER], "initContainers": [{"name": "resilax-sidecar"}]}}),
     "spec.template.spec.initContainers[0].name", "reserved"),
    ("duplicate-container-names", _set("template", {"spec": {"containers": [CONTAINER, CONTAINER]}}),
     "spec.template.spec.containers[1].name", "duplicate"),
    ("container-without-image", _set("template", {"spec": {"containers": [{"name": "trainer"}]}}),
     "spec.template.spec.containers[0].image", "is required"),
    ("reserved-volume-name", _set("template", {"spec": {"containers": [CONTAINER], "volumes": [{"name": "resilax-control"}]}}),
     "spec.template.spec.volumes[0].name", "reserved"),
    ("restart-policy-always", _set("template", {"spec": {"containers": [CONTAINER], "restartPolicy": "Always"}}),
     "spec.template.spec.restartPolicy", "leave it unset"),
    ("negative-backoff", _set("recovery.backoffSeconds", -1), "spec.recovery.backoffSeconds", "must be >= 0"),
    ("negative-grace", _set("recovery.nodeLossGraceSeconds", -5), "spec.recovery.nodeLossGraceSeconds", ">= 0"),
    ("negative-max-restarts", _set("recovery.maxRestarts", -1), "spec.recovery.maxRestarts", ">= 0"),
    ("zero-every-steps", _set("checkpoint.every.steps", 0), "spec.checkpoint.every.steps", ">= 1"),
    ("negative-every-minutes", _set("checkpoint.every.minutes", -3), "spec.checkpoint.every.minutes", "must be > 0"),
    ("zero-keep-last", _set("checkpoint.keep.last", 0), "spec.checkpoint.keep.last", ">= 1"),
    ("zero-final-save-timeout", _set("checkpoint.finalSave.timeoutSeconds", 0),
     "spec.checkpoint.finalSave.timeoutSeconds", ">= 1"),
    ("bad-restore-step", _set("checkpoint.restore.step", "yesterday"), "spec.checkpoint.restore.step",
     "'latest', 'none' or a step number"),
    ("negative-restore-step", _set("checkpoint.restore.step", -3), "spec.checkpoint.restore.step", "step number"),
    ("storage-s3", _set("checkpoint.storage", "s3://bucket/x"), "spec.checkpoint.storage", "must be gs://bucket/prefix"),
    ("storage-relative-path", _set("checkpoint.storage", "runs/x"), "spec.checkpoint.storage", "absolute path"),
    ("storage-bad-bucket", _set("checkpoint.storage", "gs://B!"), "spec.checkpoint.storage", "not a valid gs://"),
    ("storage-missing", _set("checkpoint.storage", _DELETE), "spec.checkpoint.storage", "is required"),
    ("missing-checkpoint", _set("checkpoint", _DELETE), "spec.checkpoint", "is required"),
    ("size-limit-unparsable", _set("checkpoint.local.sizeLimit", "lots"), "spec.checkpoint.local.sizeLimit",
     "not a storage quantity"),
    ("bad-medium", _set("checkpoint.local.medium", "SSD"), "spec.checkpoint.local.medium", "valid: '' (node disk), Memory"),
    ("bad-scope", _set("checkpoint.local.scope", "Cluster"), "spec.checkpoint.local.scope",
     "'Cluster' is not a local tier scope; valid: Node"),
    ("size-limit-with-node-scope", _set("checkpoint.local.scope", "Node"), "spec.checkpoint.local.sizeLimit",
     "'64Gi' with scope Node: sizeLimit applies to scope: Pod only"),
    ("zero-local-keep-last", _set("checkpoint.local.keepLast", 0), "spec.checkpoint.local.keepLast", ">= 1"),
    ("machine-type-wrong-family", _set("slices.machineType", "ct4p-hightpu-4t"), "spec.slices.machineType",
     "not a tpu-v5-lite-podslice machine type"),
    ("machine-type-on-cpu", lambda r: r["slices"].update(accelerator="cpu", topology="1x4", machineType="n2"),
     "spec.slices.machineType", "TPU accelerators only"),
    ("chips-per-host-wrong", _set("slices.chipsPerHost", 8), "spec.slices.chipsPerHost", "does not fit"),
    ("count-not-integer", _set("slices.count", "four"), "spec.slices.count", "must be an integer"),
    ("grow-back-not-bool", _set("elastic.growBack", "yes"), "spec.elastic.growBack", "true or false"),
    ("missing-slices", _set("slices", _DELETE), "spec.slices", "is required"),
    ("provisioning-unknown", _set("capacity", {"provisioning": "Eventually"}), "spec.capacity.provisioning",
     "'Eventually' is not a provisioning mode; valid: Ready (plan only over Ready nodes"),
    ("provisioning-not-string", _set("capacity", {"provisioning": 3}), "spec.capacity.provisioning",
     "must be a string, found 3"),
    ("shrink-negative", _set("capacity", {"provisioning": "Autoscaled", "shrinkAfterSeconds": -1}),
     "spec.capacity.shrinkAfterSeconds", "must be >= 0, found -1"),
    ("shrink-not-integer", _set("capacity", {"provisioning": "Autoscaled", "shrinkAfterSeconds": "10m"}),
     "spec.capacity.shrinkAfterSeconds", "must be an integer, found '10m'"),
    ("shrink-without-autoscaled", _set("capacity", {"shrinkAfterSeconds": 60}), "spec.capacity.shrinkAfterSeconds",
     "60 with provisioning Ready: shrinkAfterSeconds applies to provisioning: Autoscaled only"),
    ("in-place-unknown", _set("recovery.inPlace", "Always"), "spec.recovery.inPlace",
     "'Always' is not an in-place mode; valid: Auto (keep the surviving pods"),
    ("in-place-stop-timeout-zero", _set("recovery.inPlaceStopTimeoutSeconds", 0),
     "spec.recovery.inPlaceStopTimeoutSeconds", "must be >= 1, found 0"),
    ("hang-timeout-negative", _set("recovery.hangTimeoutSeconds", -1),
     "spec.recovery.hangTimeoutSeconds", "must be >= 0, found -1"),
    ("hang-timeout-too-short", _set("recovery.hangTimeoutSeconds", 5),
     "spec.recovery.hangTimeoutSeconds", "5 is not allowed; allowed: 10-86400 seconds, 0 (no hang detection)"),
    ("hang-timeout-too-long", _set("recovery.hangTimeoutSeconds", 86401),
     "spec.recovery.hangTimeoutSeconds", "86401 is not allowed"),
    ("compilation-cache-relative", _set("compilationCache", {"path": "cache"}), "spec.compilationCache.path",
     "'cache' is not allowed; allowed: an absolute path"),
    ("compilation-cache-not-bool", _set("compilationCache", {"enabled": "yes"}), "spec.compilationCache.enabled",
     "must be true or false"),
    ("capacity-not-object", _set("capacity", "Autoscaled"), "spec.capacity", "must be an object, found str"),
    ("suspend-not-bool", _set("suspend", "yes"), "spec.suspend", "must be true or false, found 'yes'"),
    ("keep-best-zero", _set("checkpoint.keep.best", 0), "spec.checkpoint.keep.best", "must be >= 1, found 0"),
    ("keep-best-not-integer", _set("checkpoint.keep.best", "3"), "spec.checkpoint.keep.best",
     "must be an integer, found '3'"),
    ("keep-best-without-metric", _set("checkpoint.keep", {"best": 3, "mode": "min"}), "spec.checkpoint.keep.metric",
     "is required with spec.checkpoint.keep.best: the name of a metric the training script passes to "
     "save(..., metrics={...}), e.g. loss"),
    ("keep-best-without-mode", _set("checkpoint.keep", {"best": 3, "metric": "loss"}), "spec.checkpoint.keep.mode",
     "is required with spec.checkpoint.keep.best; valid: max (keep the highest values, e.g. accuracy), min (keep "
     "the lowest, e.g. loss)"),
    ("keep-mode-unknown", _set("checkpoint.keep", {"best": 3, "metric": "loss", "mode": "lowest"}),
     "spec.checkpoint.keep.mode", "'lowest' is not a mode with spec.checkpoint.keep.best; valid: max"),
    ("keep-metric-without-best", _set("checkpoint.keep", {"last": 2, "metric": "loss"}), "spec.checkpoint.keep.metric",
     "'loss' needs spec.checkpoint.keep.best (how many of the best steps to keep)"),
    ("keep-mode-without-best", _set("checkpoint.keep", {"mode": "min"}), "spec.checkpoint.keep.mode",
     "'min' needs spec.checkpoint.keep.best"),
    ("keep-metric-not-string", _set("checkpoint.keep", {"best": 1, "metric": 5, "mode": "max"}),
     "spec.checkpoint.keep.metric", "must be a string, found 5"),
    ("keep-every-minutes-zero", _set("checkpoint.keep.everyMinutes", 0), "spec.checkpoint.keep.everyMinutes",
     "must be > 0, found 0"),
]


@pytest.mark.parametrize(("mutate", "path", "fragment"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec_is_rejected_with_field_path(mutate: Callable[[Raw], None], path: str, fragment: str) -> None:
    raw = good_spec()
    mutate(raw)
    with pytest.raises(InvalidSpecError) as info:
        validate_spec(raw)
    paths = [p.path for p in info.value.problems]
    assert path in paths, info.value
    message = next(p.message for p in info.value.problems if p.path == path)
    assert fragment in message
    assert isinstance(info.value, ResilaxOperatorError) and isinstance(info.value, ValueError)
    assert f"{path}: " in str(info.value)


def test_keep_best_and_every_minutes_parse() -> None:
    from resilax_operator.spec import KeepSpec
    raw = good_spec()
    raw["checkpoint"]["keep"] = {"last": 2, "everySteps": 1000, "everyMinutes": 90, "best": 3, "metric": "loss",
                                 "mode": "min"}
    assert validate_spec(raw).checkpoint.keep == KeepSpec(last=2, every_steps=1000, every_minutes=90.0, best=3,
                                                          metric="loss", mode="min")


def test_all_problems_reported_at_once() -> None:
    raw = good_spec()
    raw["slices"]["topology"] = "4x3"
    raw["recovery"]["backoffSeconds"] = -1
    raw["checkpoint"]["storage"] = "s3://x"
    raw["template"] = {"spec": {"containers": []}}
    with pytest.raises(InvalidSpecError) as info:
        validate_spec(raw)
    assert [p.path for p in info.value.problems] == [
        "spec.recovery.backoffSeconds", "spec.slices.topology", "spec.checkpoint.storage",
        "spec.template.spec.containers"]


@pytest.mark.parametrize("name", ["x" * 41, "1job", "Job", "job-"], ids=["too-long", "digit-first", "upper", "dash-last"])
def test_bad_job_name(name: str) -> None:
    with pytest.raises(InvalidSpecError, match=r"metadata.name: .* at most 40 characters"):
        validate_spec(good_spec(), name=name)


def test_good_spec_parses_to_dataclasses() -> None:
    spec = validate_spec(good_spec(), name="llama")
    assert spec.slices.count == 4 and spec.spec_shape == Shape("4x4", 4)
    assert spec.elastic is not None and spec.elastic.topologies == ("4x4", "2x4")
    assert spec.count_bounds == (2, 4)
    assert spec.checkpoint.every.minutes == 30.0 and spec.checkpoint.keep.every_steps == 10000
    assert spec.checkpoint.local is not None and spec.checkpoint.local.size_limit == "64Gi"
    assert spec.checkpoint.local.scope == "Pod" and spec.checkpoint.local.keep_last == 2
    assert spec.recovery.node_loss_grace_seconds == 30
    assert spec.allows(Shape("2x4", 2)) and not spec.allows(Shape("2x4", 1))


def test_defaults_for_a_minimal_spec() -> None:
    raw = {"slices": {"accelerator": "cpu", "topology": "1x4"}, "checkpoint": {"storage": "/ckpt"},
           "template": {"spec": {"containers": [CONTAINER]}}}
    spec = validate_spec(copy.deepcopy(raw))
    assert spec.slices.count == 1 and spec.elastic is None
    assert spec.checkpoint.restore_step == "latest" and spec.checkpoint.final_save.timeout_seconds == 300
    assert spec.recovery.max_restarts == 20 and spec.recovery.backoff_seconds == 10
    assert spec.allowed_topologies == ("1x4",) and spec.count_bounds == (1, 1)
    assert spec.capacity.provisioning == "Ready" and not spec.capacity.autoscaled and not spec.suspend
    assert spec.capacity.shrink_after == 600


def test_capacity_and_suspend_parse() -> None:
    raw = good_spec()
    raw["capacity"] = {"provisioning": "Autoscaled", "shrinkAfterSeconds": 45}
    raw["suspend"] = True
    spec = validate_spec(raw)
    assert spec.capacity.autoscaled and spec.capacity.shrink_after == 45 and spec.suspend


def test_elastic_topologies_start_with_the_spec_topology() -> None:
    raw = good_spec()
    raw["elastic"]["topologies"] = ["2x4"]
    spec = validate_spec(raw)
    assert spec.allowed_topologies == ("4x4", "2x4")


@pytest.mark.parametrize(("value", "expected"), [("latest", "latest"), ("none", "none"), ("1200", "1200"), (1200, "1200")],
                         ids=["latest", "none", "string-step", "int-step"])
def test_restore_step_forms(value: Any, expected: str) -> None:
    raw = good_spec()
    raw["checkpoint"]["restore"]["step"] = value
    assert validate_spec(raw).checkpoint.restore_step == expected


def test_local_tier_defaults_to_a_node_folder_keeping_two_steps() -> None:
    raw = good_spec()
    raw["checkpoint"]["local"] = {}
    local = validate_spec(raw).checkpoint.local
    assert local is not None and (local.scope, local.medium, local.keep_last, local.size_limit) == ("Node", "", 2, None)
