"""Bad JAXJob specs are rejected with a field-path message: by the API server (CRD schema and CEL) when
it can tell, otherwise by the operator (condition InvalidSpec, phase Failed, no workers)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from op_cluster import Jobs, OperatorProcess, job_manifest
from resilax_local.errors import KubeAPIError
from resilax_local.testing import wait_for


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = m
        for key in parents:
            node = node.setdefault(key, {})
        if value is _DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return edit


_DELETE = object()


def _both(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        for e in edits:
            e(m)
    return edit

# (id, edit of a good manifest, the field path the message must name)
CASES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("unknown-accelerator", _set("spec.slices.accelerator", "tpu-v9-megapod"), "spec.slices.accelerator"),
    ("topology-invalid-for-v5e", _set("spec.slices.topology", "3x3"), "spec.slices.topology"),
    ("3d-topology-on-2d-accelerator", _set("spec.slices.topology", "2x2x2"), "spec.slices.topology"),
    ("topology-garbage", _set("spec.slices.topology", "big"), "spec.slices.topology"),
    ("count-zero", _set("spec.slices.count", 0), "spec.slices.count"),
    ("count-negative", _set("spec.slices.count", -2), "spec.slices.count"),
    ("count-above-elastic-max", _both(_set("spec.elastic", {"minCount": 1, "maxCount": 2}),
                                      _set("spec.slices.count", 3)), "spec"),
    ("elastic-min-above-max", _set("spec.elastic", {"minCount": 3, "maxCount": 2}), "spec.elastic"),
    ("elastic-topology-invalid", _set("spec.elastic", {"minCount": 1, "maxCount": 4, "topologies": ["2x4", "5x5"]}),
     "spec.elastic.topologies"),
    ("chips-per-host-invalid", _set("spec.slices.chipsPerHost", 3), "spec.slices"),
    ("missing-slices", _set("spec.slices", _DELETE), "spec.slices"),
    ("missing-template", _set("spec.template", _DELETE), "spec.template"),
    ("template-without-containers", _set("spec.template", {"spec": {"containers": []}}), "spec.template"),
    ("reserved-container-name", _set("spec.template", {"spec": {"containers": [
        {"name": "trainer", "image": "x", "command": ["true"]},
        {"name": "resilax-sidecar", "image": "x", "command": ["true"]}]}}), "spec.template.spec.containers"),
    ("reserved-volume-name", _set("spec.template", {"spec": {
        "containers": [{"name": "trainer", "image": "x", "command": ["true"]}],
        "volumes": [{"name": "resilax-control", "emptyDir": {}}]}}), "spec.template.spec.volumes"),
    ("missing-storage", _set("spec.checkpoint.storage", _DELETE), "spec.checkpoint"),
    ("relative-storage-path", _set("spec.checkpoint.storage", "runs/llama"), "spec.checkpoint.storage"),
    ("unsupported-storage-scheme", _set("spec.checkpoint.storage", "s3://bucket/run"), "spec.checkpoint.storage"),
    ("gcs-without-bucket", _set("spec.checkpoint.storage", "gs://"), "spec.checkpoint.storage"),
    ("negative-save-interval", _set("spec.checkpoint.every", {"steps": -5}), "spec.checkpoint.every.steps"),
    ("zero-minutes-interval", _set("spec.checkpoint.every", {"minutes": 0}), "spec.checkpoint.every.minutes"),
    ("keep-last-zero", _set("spec.checkpoint.keep", {"last": 0}), "spec.checkpoint.keep.last"),
    ("negative-final-save-timeout", _set("spec.checkpoint.finalSave", {"timeoutSeconds": -1}),
     "spec.checkpoint.finalSave.timeoutSeconds"),
    ("restore-step-garbage", _set("spec.checkpoint.restore", {"step": "yesterday"}), "spec.checkpoint.restore.step"),
    ("local-medium-unknown", _set("spec.checkpoint.local", {"medium": "Floppy"}), "spec.checkpoint.local.medium"),
    ("negative-max-restarts", _set("spec.recovery.maxRestarts", -1), "spec.recovery.maxRestarts"),
    ("negative-backoff", _set("spec.recovery.backoffSeconds", -3), "spec.recovery.backoffSeconds"),
    ("negative-node-loss-grace", _set("spec.recovery.nodeLossGraceSeconds", -10),
     "spec.recovery.nodeLossGraceSeconds"),
    ("name-too-long", _set("metadata.name", "a" * 50), "metadata.name"),
    # Kubernetes' own PodTemplateSpec schema in the CRD (issue 18): refused at apply, naming the field
    ("template-env-as-map", _set("spec.template", {"spec": {"containers": [
        {"name": "trainer", "image": "x", "command": ["true"], "env": {"A": "1"}}]}}),
     "spec.template.spec.containers[0].env"),
    ("template-labels-as-list", _set("spec.template", {"metadata": {"labels": ["a"]}, "spec": {"containers": [
        {"name": "trainer", "image": "x", "command": ["true"]}]}}), "spec.template.metadata.labels"),
    # host access: valid pods, refused by the operator's policy (operator.allowHostAccess is off)
    ("template-privileged", _set("spec.template", {"spec": {"containers": [
        {"name": "trainer", "image": "x", "command": ["true"], "securityContext": {"privileged": True}}]}}),
     "spec.template.spec.containers[0].securityContext.privileged"),
    ("template-host-network", _set("spec.template", {"spec": {"hostNetwork": True, "containers": [
        {"name": "trainer", "image": "x", "command": ["true"]}]}}), "spec.template.spec.hostNetwork"),
    ("template-host-path", _set("spec.template", {"spec": {
        "containers": [{"name": "trainer", "image": "x", "command": ["true"]}],
        "volumes": [{"name": "h", "hostPath": {"path": "/var/run"}}]}}), "spec.template.spec.volumes[0].hostPath"),
]


def test_bad_specs_are_rejected_with_a_field_path(operator: OperatorProcess, jobs: Jobs, tmp_path: Path) -> None:
    good = job_manifest("x", tmp_path / "ckpt", count=2, steps=5,
                        template={"spec": {"containers": [{"name": "trainer", "image": "x", "command": ["true"]}]}})
    by_api: dict[str, str] = {}
    accepted: dict[str, tuple[str, str]] = {}  # case -> (job name, path)
    for i, (case, edit, path) in enumerate(CASES):
        manifest = copy.deepcopy(good)
        manifest["metadata"]["name"] = f"bad-{i}"
        edit(manifest)
        try:
            jobs.create(manifest)
        except KubeAPIError as e:
            assert e.status == 422, (case, e)
            assert path in str(e), f"{case}: the API's message does not name {path}: {e}"
            by_api[case] = str(e)
            continue
        accepted[case] = (manifest["metadata"]["name"], path)

    problems = []
    for case, (name, path) in accepted.items():
        def invalid(name: str = name) -> dict[str, Any] | None:
            status = jobs.status(name)
            cond = next((c for c in status.get("conditions") or [] if c["type"] == "InvalidSpec"), None)
            return status if cond and cond["status"] == "True" else None

        try:
            status = wait_for(invalid, timeout=120, message=f"{case}: InvalidSpec")
        except TimeoutError as e:
            problems.append(f"{case}: accepted by the API and not flagged by the operator ({e})")
            continue
        message = next(c["message"] for c in status["conditions"] if c["type"] == "InvalidSpec")
        if path not in message:
            problems.append(f"{case}: the operator's message does not name {path}: {message}")
        if status.get("phase") != "Failed" or status.get("generation", 0) != 0 or jobs.pods(name):
            problems.append(f"{case}: expected phase Failed and no workers, got {status.get('phase')}")
    print(f"\nrejected by the API server ({len(by_api)}): {', '.join(sorted(by_api))}")
    print(f"rejected by the operator ({len(accepted)}): {', '.join(sorted(accepted))}")
    assert not problems, "\n".join(problems)
    assert len(CASES) >= 20
