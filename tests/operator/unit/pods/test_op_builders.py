"""Spec + generation plan → Service and Pods: labels, scheduling, environment, sidecar, security."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from op_samples import good_spec
from resilax_operator import api
from resilax_operator.builders import (
    GenerationPlan,
    JobRef,
    build_pod,
    build_pods,
    build_service,
    build_token_secret,
    geometry_of,
    in_place_unavailable,
)
from resilax_operator.errors import InvalidSpecError
from resilax_operator.pods.worker_env import build_generation_env, build_generation_overlay, storage_dir
from resilax_operator.settings import OperatorSettings
from resilax_operator.spec import JobSpec, Shape
from resilax_operator.validation import validate_spec

JOB = JobRef("llama", "ml", "uid-1")
SETTINGS = OperatorSettings(sidecar_image="resilax:test")


def _spec(**slices: Any) -> JobSpec:
    raw = good_spec()
    raw["slices"].update(slices)
    if "elastic" in slices:
        raw["elastic"] = slices.pop("elastic")
    return validate_spec(raw)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _trainer(pod: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = pod["spec"]["containers"][0]
    return c


PLAN = GenerationPlan(3, Shape("4x4", 2), ("pool-a", "pool-b"), "latest")


def test_pod_zero_alone_until_coordinator_ip_known() -> None:
    pods = build_pods(JOB, _spec(), PLAN, SETTINGS, coordinator_ip=None)
    assert [p["metadata"]["name"] for p in pods] == ["llama-g3-s0-h0"]
    env = _env(_trainer(pods[0]))
    assert env["JAX_COORDINATOR_ADDRESS"] == "$(RESILAX_POD_IP):8482"
    assert env["JAX_COORDINATOR_BIND_ADDRESS"] == "$(RESILAX_POD_IP):8482"
    assert env["RESILAX_SIDECAR_HOST"] == "$(RESILAX_POD_IP)"
    assert env["RESILAX_POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    names = [e["name"] for e in _trainer(pods[0])["env"]]
    assert names.index("RESILAX_POD_IP") < names.index("JAX_COORDINATOR_ADDRESS")


def test_all_pods_once_coordinator_known() -> None:
    pods = build_pods(JOB, _spec(), PLAN, SETTINGS, coordinator_ip="10.0.0.5")
    assert len(pods) == 8  # 2 slices x 4 hosts (4x4 v5e, 4 chips per host)
    ids = [int(_env(_trainer(p))["JAX_PROCESS_ID"]) for p in pods]
    assert ids == list(range(8))
    for p in pods:
        env = _env(_trainer(p))
        assert env["JAX_COORDINATOR_ADDRESS"] == "10.0.0.5:8482"
        assert env["JAX_NUM_PROCESSES"] == "8"
        assert env["MEGASCALE_COORDINATOR_ADDRESS"] == "10.0.0.5:8080" and env["MEGASCALE_PORT"] == "8080"
        assert env["MEGASCALE_NUM_SLICES"] == "2"
        assert env["MEGASCALE_SLICE_ID"] == p["metadata"]["labels"][api.LABEL_SLICE]
        assert env["TPU_WORKER_ID"] == p["metadata"]["labels"][api.LABEL_HOST]


def test_ipv6_coordinator_in_brackets() -> None:
    pod = build_pod(JOB, _spec(), PLAN, 0, 1, SETTINGS, coordinator_ip="fd00::5")
    assert _env(_trainer(pod))["JAX_COORDINATOR_ADDRESS"] == "[fd00::5]:8482"


def test_non_zero_process_needs_coordinator_ip() -> None:
    with pytest.raises(ValueError, match="process 0"):
        build_pod(JOB, _spec(), PLAN, 1, 0, SETTINGS, coordinator_ip=None)


def test_labels_owner_and_names() -> None:
    pod = build_pod(JOB, _spec(), PLAN, 1, 2, SETTINGS, coordinator_ip="10.0.0.5")
    meta = pod["metadata"]
    assert meta["name"] == "llama-g3-s1-h2" and meta["namespace"] == "ml"
    assert meta["labels"].items() >= {api.LABEL_JOB: "llama", api.LABEL_GENERATION: "3", api.LABEL_SLICE: "1",
                                   api.LABEL_HOST: "2", api.LABEL_PROCESS: "6", api.LABEL_NODE_POOL: "pool-b"}.items()
    (owner,) = meta["ownerReferences"]
    assert owner == {"apiVersion": "resilax.dev/v1alpha1", "kind": "JAXJob", "name": "llama", "uid": "uid-1",
                     "controller": True, "blockOwnerDeletion": True}
    assert pod["spec"]["hostname"] == "llama-g3-s1-h2" and pod["spec"]["subdomain"] == "llama-workers"
    assert pod["spec"]["restartPolicy"] == "Never"


def test_tpu_scheduling() -> None:
    pod = build_pod(JOB, _spec(), PLAN, 1, 0, SETTINGS, coordinator_ip="10.0.0.5")
    spec = pod["spec"]
    assert spec["nodeSelector"] == {api.TPU_ACCELERATOR_LABEL: "tpu-v5-lite-podslice", api.TPU_TOPOLOGY_LABEL: "4x4",
                                    api.NODE_POOL_LABEL: "pool-b"}
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    res = _trainer(pod)["resources"]
    assert res["requests"]["google.com/tpu"] == "4" and res["limits"]["google.com/tpu"] == "4"
    term = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    env = _env(_trainer(pod))
    assert env["TPU_WORKER_HOSTNAMES"] == ",".join(f"llama-g3-s1-h{h}.llama-workers" for h in range(4))


def test_single_slice_has_no_megascale() -> None:
    plan = GenerationPlan(1, Shape("4x4", 1), ("p",))
    raw = good_spec()
    del raw["elastic"]
    raw["slices"]["count"] = 1
    env = _env(_trainer(build_pod(JOB, validate_spec(raw), plan, 0, 0, SETTINGS, coordinator_ip="1.2.3.4")))
    assert not any(k.startswith("MEGASCALE_") for k in env)


def test_cpu_pods() -> None:
    raw = good_spec()
    raw["slices"] = {"accelerator": "cpu", "topology": "2x4", "count": 2, "chipsPerHost": 4}
    raw["elastic"] = {"minCount": 1, "maxCount": 2}
    spec = validate_spec(raw)
    plan = GenerationPlan(1, Shape("2x4", 2), ("cpu-a", "cpu-b"))
    pods = build_pods(JOB, spec, plan, SETTINGS, coordinator_ip="127.0.1.1")
    assert len(pods) == 4
    pod = pods[3]
    assert pod["spec"]["nodeSelector"] == {api.NODE_POOL_LABEL: "cpu-b"}
    assert pod["spec"]["tolerations"] == []
    env = _env(_trainer(pod))
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
    assert "TPU_WORKER_ID" not in env and "google.com/tpu" not in str(_trainer(pod)["resources"])


def test_gpu_request() -> None:
    raw = good_spec()
    raw["slices"] = {"accelerator": "nvidia-l4", "topology": "1x2", "count": 1}
    del raw["elastic"]
    pod = build_pod(JOB, validate_spec(raw), GenerationPlan(1, Shape("1x2", 1), ("g",)), 0, 0, SETTINGS,
                    coordinator_ip=None)
    assert _trainer(pod)["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert pod["spec"]["nodeSelector"][api.GPU_ACCELERATOR_LABEL] == "nvidia-l4"


def test_resilax_env_matches_architecture_doc() -> None:
    env = _env(_trainer(build_pod(JOB, _spec(), PLAN, 0, 0, SETTINGS, coordinator_ip=None)))
    assert env["RESILAX_JOB_NAME"] == "llama" and env["RESILAX_NAMESPACE"] == "ml"
    assert env["RESILAX_GENERATION"] == "3"
    assert env["RESILAX_JOB_UID"] == JOB.uid and JOB.uid
    assert env["RESILAX_CHECKPOINT_DIR"] == "gs://bucket/runs/llama"
    assert env["RESILAX_LOCAL_DIR"] == api.LOCAL_DIR and env["RESILAX_CONTROL_DIR"] == api.CONTROL_DIR
    assert env["RESILAX_SAVE_EVERY_STEPS"] == "1000" and env["RESILAX_SAVE_EVERY_SECONDS"] == "1800"
    assert env["RESILAX_KEEP_LAST"] == "3" and env["RESILAX_KEEP_EVERY_STEPS"] == "10000"
    assert env["RESILAX_RESTORE_STEP"] == "latest" and env["RESILAX_SIDECAR_PORT"] == "8490"
    assert env["RESILAX_SIDECAR_TOKEN_FILE"] == f"{api.TOKEN_DIR}/token"
    assert env["RESILAX_SIDECAR_GRACE_SECONDS"] == "300"
    doc = (__import__("pathlib").Path(__file__).resolve().parents[4] / "docs" / "architecture.md").read_text()
    for name in env:
        if name in ("RESILAX_SIDECAR_GRACE_SECONDS", "RESILAX_SIDECAR_HOST",
                    "RESILAX_SIDECAR_LOG_FORMAT"):  # resilax_sidecar.config settings (docs/sidecar.md)
            continue
        if name.startswith(("RESILAX_SAVE", "RESILAX_KEEP", "RESILAX_RESTORE", "RESILAX_SIDECAR", "JAX_",
                            "RESILAX_CHECKPOINT", "RESILAX_LOCAL", "RESILAX_CONTROL", "RESILAX_GENERATION",
                            "RESILAX_NUM_SLICES", "RESILAX_SLICE_ID", "RESILAX_HOSTS_PER_SLICE",
                            "RESILAX_DEVICES_PER_HOST", "RESILAX_POD_IP", "TPU_", "MEGASCALE_")):
            assert f"`{name}`" in doc, f"{name} is not in docs/architecture.md"


def test_keep_best_and_every_minutes_reach_the_trainer_and_the_sidecar() -> None:
    raw = good_spec()
    raw["checkpoint"]["keep"] = {"last": 2, "everyMinutes": 90, "best": 3, "metric": "loss", "mode": "min"}
    pod = build_pod(JOB, validate_spec(raw), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    for container in (_trainer(pod), pod["spec"]["initContainers"][0]):
        env = _env(container)
        assert (env["RESILAX_KEEP_LAST"], env["RESILAX_KEEP_EVERY_SECONDS"], env["RESILAX_KEEP_BEST"],
                env["RESILAX_KEEP_BEST_METRIC"], env["RESILAX_KEEP_BEST_MODE"]) == ("2", "5400", "3", "loss", "min")
    env = _env(_trainer(build_pod(JOB, _spec(), PLAN, 0, 0, SETTINGS, coordinator_ip=None)))
    assert env["RESILAX_KEEP_BEST"] == env["RESILAX_KEEP_BEST_METRIC"] == env["RESILAX_KEEP_EVERY_SECONDS"] == ""


def test_policy_off_is_empty() -> None:
    raw = good_spec()
    raw["checkpoint"] = {"storage": "/ckpt"}
    env = _env(_trainer(build_pod(JOB, validate_spec(raw), PLAN, 0, 0, SETTINGS, coordinator_ip=None)))
    assert env["RESILAX_SAVE_EVERY_STEPS"] == "" and env["RESILAX_KEEP_LAST"] == "" and env["RESILAX_LOCAL_DIR"] == ""


def test_containers_share_no_objects() -> None:
    """Each container gets its own env objects (a YAML dump shows no anchors, edits stay local)."""
    import yaml

    pod = build_pod(JOB, _spec(), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    assert "&id" not in yaml.safe_dump(pod)


def test_sidecar_is_native_and_restricted() -> None:
    pod = build_pod(JOB, _spec(), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    sidecar = pod["spec"]["initContainers"][0]
    assert sidecar["name"] == api.SIDECAR_CONTAINER and sidecar["restartPolicy"] == "Always"
    assert sidecar["image"] == "resilax:test" and sidecar["command"] == ["resilax", "sidecar"]
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 8490}
    sc = sidecar["securityContext"]
    assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {m["mountPath"] for m in sidecar["volumeMounts"]} >= {api.CONTROL_DIR, api.LOCAL_DIR}


def test_volumes_and_local_tier() -> None:
    pod = build_pod(JOB, _spec(), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[api.LOCAL_VOLUME]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes[api.CONTROL_VOLUME]["emptyDir"] == {}
    assert volumes[api.TOKEN_VOLUME]["secret"]["secretName"] == "llama-resilax-token"
    mounts = {m["mountPath"] for m in _trainer(pod)["volumeMounts"]}
    assert {api.CONTROL_DIR, api.LOCAL_DIR, api.TOKEN_DIR} <= mounts


def test_user_settings_are_kept() -> None:
    raw = good_spec()
    raw["template"] = {"metadata": {"labels": {"team": "x"}}, "spec": {
        "terminationGracePeriodSeconds": 1000,
        "securityContext": {"runAsUser": 1000},
        "nodeSelector": {"disk": "ssd"},
        "containers": [{"name": "trainer", "image": "t", "env": [{"name": "JAX_PROCESS_ID", "value": "9"},
                                                                    {"name": "MINE", "value": "$(RESILAX_GENERATION)"}],
                        "securityContext": {"allowPrivilegeEscalation": True},
                        "resources": {"requests": {"cpu": "2"}}}]}}
    pod = build_pod(JOB, validate_spec(raw), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    spec = pod["spec"]
    assert pod["metadata"]["labels"]["team"] == "x"
    assert spec["terminationGracePeriodSeconds"] == 1000
    assert spec["securityContext"]["runAsUser"] == 1000 and spec["securityContext"]["runAsNonRoot"] is True
    assert spec["nodeSelector"]["disk"] == "ssd"
    trainer = _trainer(pod)
    env = [e for e in trainer["env"] if e["name"] == "JAX_PROCESS_ID"]
    assert env == [{"name": "JAX_PROCESS_ID", "value": "0"}]  # the operator's value wins
    assert trainer["env"][-1] == {"name": "MINE", "value": "$(RESILAX_GENERATION)"}
    assert trainer["securityContext"]["allowPrivilegeEscalation"] is True  # the user said so
    assert trainer["resources"]["requests"] == {"cpu": "2", "google.com/tpu": "4"}


def test_termination_grace_covers_final_save() -> None:
    pod = build_pod(JOB, _spec(), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    assert pod["spec"]["terminationGracePeriodSeconds"] == 300 + SETTINGS.termination_margin_seconds


def test_trainer_found_by_name() -> None:
    raw = good_spec()
    raw["template"]["spec"]["containers"] = [{"name": "logs", "image": "l"}, {"name": "trainer", "image": "t"}]
    pod = build_pod(JOB, validate_spec(raw), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    assert "env" not in pod["spec"]["containers"][0] and "env" in pod["spec"]["containers"][1]


def test_service_is_headless_and_job_wide() -> None:
    svc = build_service(JOB, SETTINGS)
    assert svc["metadata"]["name"] == "llama-workers"
    assert api.LABEL_GENERATION not in svc["metadata"]["labels"]  # it serves every generation
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"] == {api.LABEL_JOB: "llama", api.LABEL_ROLE: api.ROLE_WORKER}


def _in_place_spec(trainer: dict[str, Any] | None = None, in_place: str = "Auto", **template: Any) -> JobSpec:
    raw = good_spec()
    raw.setdefault("recovery", {})["inPlace"] = in_place
    raw["template"]["spec"]["containers"][0].update(trainer or {})
    raw["template"].update(template)
    return validate_spec(raw)


def test_never_leaves_the_trainer_as_the_template_has_it() -> None:
    raw = good_spec()
    pod = build_pod(JOB, validate_spec(raw), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    trainer = _trainer(pod)
    assert trainer["command"] == raw["template"]["spec"]["containers"][0]["command"]
    assert "readinessProbe" not in trainer and api.ANNOTATION_SUPERVISED not in pod["metadata"]["annotations"]


def test_auto_runs_the_trainer_under_the_supervisor_with_the_doorbell() -> None:
    spec = _in_place_spec({"command": ["python", "-m", "train"], "args": ["--steps", "10"]})
    pod = build_pod(JOB, spec, PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    trainer = _trainer(pod)
    assert trainer["command"] == ["resilax", "run", "--", "python", "-m", "train", "--steps", "10"]
    assert "args" not in trainer
    assert trainer["readinessProbe"] == {"httpGet": {"path": "/v1/trainer/ready", "port": SETTINGS.sidecar_port},
                                         "periodSeconds": 1, "failureThreshold": 1}
    assert pod["metadata"]["annotations"][api.ANNOTATION_SUPERVISED] == "1"
    assert in_place_unavailable(JOB, spec) == ""


def _without_command() -> JobSpec:
    raw = good_spec()
    raw["recovery"]["inPlace"] = "Auto"
    del raw["template"]["spec"]["containers"][0]["command"]
    return validate_spec(raw)


@pytest.mark.parametrize(("spec", "job", "why"), [
    pytest.param(_without_command(), JOB, "has no command", id="no-command"),
    pytest.param(_in_place_spec({"readinessProbe": {"exec": {"command": ["true"]}}}), JOB, "its own readinessProbe",
                 id="own-probe"),
    pytest.param(_in_place_spec(), JobRef("llama", "ml", "uid-1", queue="team-a"), "Kueue queue", id="kueue"),
])
def test_auto_falls_back_when_the_trainer_cannot_be_supervised(spec: JobSpec, job: JobRef, why: str) -> None:
    assert why in in_place_unavailable(job, spec)
    pod = build_pod(job, spec, PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    assert api.ANNOTATION_SUPERVISED not in pod["metadata"]["annotations"]
    trainer = _trainer(pod)
    assert (trainer.get("command") or [""])[0] != "resilax"
    assert (trainer.get("readinessProbe") or {}).get("httpGet") is None  # no doorbell: nothing supervises


def test_generation_env_is_the_pods_and_the_overlay_has_literal_values() -> None:
    spec = _spec(accelerator="tpu-v5-lite-podslice", topology="4x4", count=2)
    geometry = geometry_of(spec, "4x4")
    pod = build_pod(JOB, spec, PLAN, 1, 2, SETTINGS, coordinator_ip="10.0.0.5")
    env = _env(_trainer(pod))
    generation = build_generation_env(JOB, spec, PLAN, geometry, 1, 2, SETTINGS, coordinator_ip="10.0.0.5")
    assert {k: env[k] for k in generation} == generation
    assert set(generation) == {"JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "RESILAX_NUM_SLICES",
                               "RESILAX_SLICE_ID", "RESILAX_HOSTS_PER_SLICE", "RESILAX_GENERATION",
                               "RESILAX_RESTORE_STEP", "RESILAX_LIVE_JOB_UIDS", "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES",
                               "MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_PORT", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID"}
    overlay = build_generation_overlay(JOB, spec, PLAN, geometry, 6, SETTINGS, coordinator_ip="10.0.0.5")
    assert overlay == generation and not any("$(" in v for v in overlay.values())
    # the sidecar's start call accepts exactly these names (issue 40, item 5: an allowlist)
    from resilax_sidecar.trainer_control import START_ENV_NAMES

    assert set(overlay) == START_ENV_NAMES


def test_a_kept_pod_keeps_its_name_and_its_slice_names_it() -> None:
    spec = _spec(accelerator="tpu-v5-lite-podslice", topology="4x4", count=2)
    kept = tuple(f"llama-g2-s{p // 4}-h{p % 4}" if p != 5 else "llama-g3-s1-h1" for p in range(8))
    plan = GenerationPlan(3, Shape("4x4", 2), ("pool-a", "pool-b"), worker_pods=kept)
    pod = build_pod(JOB, spec, plan, 1, 2, SETTINGS, coordinator_ip="10.0.0.5")
    assert pod["metadata"]["name"] == "llama-g2-s1-h2" and pod["metadata"]["labels"][api.LABEL_GENERATION] == "3"
    assert _env(_trainer(pod))["TPU_WORKER_HOSTNAMES"] == (
        "llama-g2-s1-h0.llama-workers,llama-g3-s1-h1.llama-workers,llama-g2-s1-h2.llama-workers,"
        "llama-g2-s1-h3.llama-workers")


def test_pvc_storage_is_mounted() -> None:
    raw = good_spec()
    raw["checkpoint"]["storage"] = "pvc://ckpt-claim/runs/llama"
    pod = build_pod(JOB, validate_spec(raw), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["resilax-storage"]["persistentVolumeClaim"] == {"claimName": "ckpt-claim"}
    assert _env(_trainer(pod))["RESILAX_CHECKPOINT_DIR"] == "/var/run/resilax/storage/runs/llama"


@pytest.mark.parametrize(("storage", "expected"), [("gs://b/p", "gs://b/p"), ("/mnt/c", "/mnt/c"),
                                                   ("pvc://c", "/var/run/resilax/storage")],
                         ids=["gcs", "path", "pvc-root"])
def test_storage_dir(storage: str, expected: str) -> None:
    assert storage_dir(storage) == expected


def test_token_secret() -> None:
    secret = build_token_secret(JOB, "s3cret")
    assert secret["metadata"]["name"] == "llama-resilax-token" and secret["stringData"] == {"token": "s3cret"}


def test_plan_pools_must_match_count() -> None:
    with pytest.raises(ValueError, match="1 pools for 2 slices"):
        GenerationPlan(1, Shape("4x4", 2), ("a",))


def _variant(name: str) -> JobSpec:
    raw = good_spec()
    if name == "cpu":
        raw["slices"] = {"accelerator": "cpu", "topology": "2x4", "count": 2, "chipsPerHost": 4}
        raw["elastic"] = {"minCount": 1, "maxCount": 2}
    elif name == "gpu":
        raw["slices"] = {"accelerator": "nvidia-l4", "topology": "1x2", "count": 2}
        raw["elastic"] = {"minCount": 1, "maxCount": 2}
    elif name == "pvc":
        raw["checkpoint"]["storage"] = "pvc://claim/x"
    return validate_spec(raw)


@pytest.mark.parametrize("variant", ["tpu", "cpu", "gpu", "pvc"])
def test_manifests_use_only_known_kubernetes_fields(variant: str) -> None:
    """Round trip through the kubernetes client's models: a misspelt field would be dropped."""
    import json

    from kubernetes.client import ApiClient

    client = ApiClient()
    spec = _variant(variant)
    topology = spec.slices.topology
    plan = GenerationPlan(2, Shape(topology, 2), ("a", "b"))
    objects = [(p, "V1Pod") for p in build_pods(JOB, spec, plan, SETTINGS, coordinator_ip="10.0.0.1")]
    objects += [(build_service(JOB, SETTINGS), "V1Service"), (build_token_secret(JOB, "t"), "V1Secret")]
    for obj, kind in objects:
        model = client._ApiClient__deserialize(obj, kind)  # type: ignore[attr-defined]
        back = client.sanitize_for_serialization(model)
        assert json.dumps(back, sort_keys=True) == json.dumps(obj, sort_keys=True), kind


# ---------------------------------------------------------------- the local tier: scope Node and Pod


def _local_spec(local: dict[str, Any], template_spec: dict[str, Any] | None = None) -> JobSpec:
    raw = good_spec()
    raw["checkpoint"]["local"] = local
    if template_spec is not None:
        raw["template"]["spec"].update(template_spec)
    return validate_spec(raw)


JOB_UID = JobRef("llama", "ml", "0b6c-uid")


@pytest.mark.parametrize(("local", "path"), [
    ({}, "/var/lib/resilax/local/ml_llama_0b6c-uid"),
    ({"scope": "Node"}, "/var/lib/resilax/local/ml_llama_0b6c-uid"),
    ({"medium": "Memory"}, "/dev/shm/resilax/ml_llama_0b6c-uid"),
], ids=["default-scope", "node-disk", "node-memory"])
def test_node_scope_is_a_host_path_per_job_with_an_init_container(local: dict[str, Any], path: str) -> None:
    pod = build_pod(JOB_UID, _local_spec(local), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[api.LOCAL_VOLUME] == {"name": api.LOCAL_VOLUME,
                                         "hostPath": {"path": path, "type": "DirectoryOrCreate"}}
    inits = pod["spec"]["initContainers"]
    assert [c["name"] for c in inits] == [api.LOCAL_INIT_CONTAINER, api.SIDECAR_CONTAINER]
    init = inits[0]
    assert init["command"] == ["sh", "-c", f"chown -R 65532:65532 {api.LOCAL_DIR} && chmod 0700 {api.LOCAL_DIR}"]
    assert init["volumeMounts"] == [{"name": api.LOCAL_VOLUME, "mountPath": api.LOCAL_DIR}]
    sc = init["securityContext"]
    assert sc["runAsUser"] == 0 and sc["runAsNonRoot"] is False and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert "restartPolicy" not in init  # a plain init container: done before the sidecar starts
    assert inits[1]["securityContext"]["runAsUser"] == 65532
    assert _env(_trainer(pod))["RESILAX_LOCAL_KEEP_LAST"] == "2"
    assert _env(_trainer(pod))["RESILAX_PERSIST_EVERY_STEPS"] == ""
    assert _env(_trainer(pod))["RESILAX_LOCAL_DIR"] == api.LOCAL_DIR
    assert _env(inits[1])["RESILAX_PEER_REPLICAS"] == "true"  # the sidecar keeps peer replicas by default


@pytest.mark.parametrize(("local", "want"), [({}, "true"), ({"peerReplicas": True}, "true"),
                                             ({"peerReplicas": False}, "false"), (None, "")],
                         ids=["default", "on", "off", "no-local-tier"])
def test_peer_replicas_switch_reaches_the_sidecar(local: dict | None, want: str) -> None:
    raw = good_spec()
    raw["checkpoint"].pop("local", None)
    if local is not None:
        raw["checkpoint"]["local"] = local
    pod = build_pod(JOB_UID, validate_spec(raw), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == "resilax-sidecar")
    assert _env(sidecar)["RESILAX_PEER_REPLICAS"] == want


def test_peer_replicas_must_be_a_boolean() -> None:
    raw = good_spec()
    raw["checkpoint"]["local"] = {"peerReplicas": "yes"}
    with pytest.raises(InvalidSpecError, match=r"spec.checkpoint.local.peerReplicas: must be true or false"):
        validate_spec(raw)


def test_node_scope_folder_goes_to_the_workers_user_and_group() -> None:
    spec = _local_spec({"keepLast": 5, "persistEverySteps": 10},
                       {"securityContext": {"runAsUser": 1000, "fsGroup": 2000}})
    pod = build_pod(JOB_UID, spec, PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    init, sidecar = pod["spec"]["initContainers"][:2]
    assert "chown -R 1000:2000 " in init["command"][2]
    assert (sidecar["securityContext"]["runAsUser"], sidecar["securityContext"]["runAsGroup"]) == (1000, 2000)
    assert _env(_trainer(pod))["RESILAX_LOCAL_KEEP_LAST"] == "5"
    assert _env(_trainer(pod))["RESILAX_PERSIST_EVERY_STEPS"] == "10"
    assert _env(sidecar)["RESILAX_PERSIST_EVERY_STEPS"] == "10"
    raw = good_spec()
    raw["checkpoint"]["local"] = {}
    raw["template"]["spec"]["containers"][0]["securityContext"] = {"runAsUser": 7, "runAsGroup": 8}
    pod = build_pod(JOB_UID, validate_spec(raw), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    assert "chown -R 7:8 " in pod["spec"]["initContainers"][0]["command"][2]


def test_node_scope_roots_come_from_the_operator_settings() -> None:
    settings = OperatorSettings(sidecar_image="resilax:test", local_tier_root="/mnt/ssd/resilax/",
                                local_tier_memory_root="/run/shm")
    for local, path in (({}, "/mnt/ssd/resilax/ml_llama_0b6c-uid"), ({"medium": "Memory"}, "/run/shm/ml_llama_0b6c-uid")):
        pod = build_pod(JOB_UID, _local_spec(local), PLAN, 0, 0, settings, coordinator_ip=None)
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == api.LOCAL_VOLUME)
        assert volume["hostPath"]["path"] == path


def test_pod_scope_is_an_empty_dir_without_init_container() -> None:
    pod = build_pod(JOB_UID, _local_spec({"scope": "Pod", "sizeLimit": "8Gi", "keepLast": 1}), PLAN, 0, 0,
                    SETTINGS, coordinator_ip=None)
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == api.LOCAL_VOLUME)
    assert volume == {"name": api.LOCAL_VOLUME, "emptyDir": {"sizeLimit": "8Gi"}}
    assert [c["name"] for c in pod["spec"]["initContainers"]] == [api.SIDECAR_CONTAINER]
    assert "runAsUser" not in pod["spec"]["initContainers"][0]["securityContext"]
    assert _env(_trainer(pod))["RESILAX_LOCAL_KEEP_LAST"] == "1"


def test_no_local_tier_no_local_volume() -> None:
    raw = good_spec()
    del raw["checkpoint"]["local"]
    pod = build_pod(JOB_UID, validate_spec(raw), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    assert api.LOCAL_VOLUME not in {v["name"] for v in pod["spec"]["volumes"]}
    assert _env(_trainer(pod))["RESILAX_LOCAL_KEEP_LAST"] == ""


def test_each_worker_prefers_the_node_its_index_last_ran_on() -> None:
    plan = GenerationPlan(4, Shape("4x4", 2), ("pool-a", "pool-b"), "latest", ((0, "node-a0"), (5, "node-b1")))
    pods = build_pods(JOB_UID, _spec(), plan, SETTINGS, coordinator_ip="10.0.0.1")
    by_process = {int(p["metadata"]["labels"][api.LABEL_PROCESS]): p for p in pods}
    for index, node in ((0, "node-a0"), (5, "node-b1")):
        affinity = by_process[index]["spec"]["affinity"]
        assert affinity["nodeAffinity"] == {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "preference": {"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}}]}
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in affinity["nodeAffinity"]  # the node may be gone
        assert affinity["podAntiAffinity"]  # still one worker per node
    assert "nodeAffinity" not in by_process[1]["spec"]["affinity"]


def test_no_worker_goes_to_a_node_held_down_nor_prefers_it() -> None:
    """A node proven down by a witnessed Lease is still Ready for the scheduler: every pod of the
    generation is kept off it (in each of the user's ORed terms), and its last worker does not prefer it."""
    plan = GenerationPlan(4, Shape("4x4", 2), ("pool-a", "pool-b"), "latest", ((0, "node-a0"), (5, "node-b1")),
                          avoid_nodes=("node-b1",))
    raw = good_spec()
    raw["template"]["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                              {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}}
    pods = build_pods(JOB_UID, validate_spec(raw), plan, SETTINGS, coordinator_ip="10.0.0.1")
    avoid = {"key": "metadata.name", "operator": "NotIn", "values": ["node-b1"]}
    for pod in pods:
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        assert len(terms) == 2 and all(t["matchFields"] == [avoid] for t in terms), terms
        assert [t["matchExpressions"][0]["values"] for t in terms] == [["a"], ["b"]]
    by_process = {int(p["metadata"]["labels"][api.LABEL_PROCESS]): p for p in pods}
    preferred = by_process[5]["spec"]["affinity"]["nodeAffinity"].get("preferredDuringSchedulingIgnoredDuringExecution")
    assert not preferred  # its last node is the one held down
    assert by_process[0]["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]


def test_sidecar_resources_come_from_the_settings() -> None:
    from resilax_operator.builders import SIDECAR_RESOURCES, build_sidecar
    from resilax_operator.errors import InvalidSettingError

    assert build_sidecar(_spec(), SETTINGS, [])["resources"] == SIDECAR_RESOURCES
    wanted = {"requests": {"cpu": "1"}, "limits": {"memory": "2Gi"}}
    settings = OperatorSettings.from_env({"RESILAX_OPERATOR_SIDECAR_RESOURCES": json.dumps(wanted)})
    assert build_sidecar(_spec(), settings, [])["resources"] == wanted
    for bad in ("{", '{"request": {}}', '{"limits": {"memory": ["1Gi"]}}', "[]"):
        with pytest.raises(InvalidSettingError, match=r"RESILAX_OPERATOR_SIDECAR_RESOURCES.*allowed"):
            OperatorSettings.from_env({"RESILAX_OPERATOR_SIDECAR_RESOURCES": bad})


@pytest.mark.parametrize(("change", "expected"), [
    pytest.param({}, None, id="gs-storage-no-path-none"),
    pytest.param({"checkpoint.storage": "/ckpt/llama"}, "/ckpt/llama/_jax_cache", id="folder-storage"),
    pytest.param({"checkpoint.storage": "pvc://claim/runs"}, "/var/run/resilax/storage/runs/_jax_cache", id="pvc"),
    pytest.param({"checkpoint.local": {"scope": "Node"}}, f"{api.LOCAL_DIR}/_jax_cache", id="node-local-tier"),
    pytest.param({"compilationCache": {"path": "gs://b/cache"}}, "gs://b/cache", id="explicit-path"),
    pytest.param({"checkpoint.storage": "/ckpt", "compilationCache": {"enabled": False}}, None, id="disabled"),
])
def test_compilation_cache_folder(change: dict[str, Any], expected: str | None) -> None:
    raw = good_spec()
    for key, value in change.items():
        where, _, leaf = key.rpartition(".")
        (raw[where] if where else raw)[leaf] = value
    pod = build_pod(JOB, validate_spec(raw), PLAN, 0, 0, SETTINGS, coordinator_ip=None)
    env = _env(_trainer(pod))
    assert env.get("JAX_COMPILATION_CACHE_DIR") == expected
    assert env.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS") == (None if expected is None else "0")
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == api.SIDECAR_CONTAINER)
    assert "JAX_COMPILATION_CACHE_DIR" not in _env(sidecar)  # the trainer's only


def test_the_templates_own_compilation_cache_setting_wins() -> None:
    raw = good_spec()
    raw["checkpoint"]["storage"] = "/ckpt"
    raw["template"]["spec"]["containers"][0]["env"] = [{"name": "JAX_COMPILATION_CACHE_DIR", "value": "/mine"}]
    env = [e for e in _trainer(build_pod(JOB, validate_spec(raw), PLAN, 0, 0, SETTINGS, coordinator_ip=None))["env"]
           if e["name"] == "JAX_COMPILATION_CACHE_DIR"]
    assert env == [{"name": "JAX_COMPILATION_CACHE_DIR", "value": "/mine"}]


def test_the_storage_claim_settings_reach_the_workers() -> None:
    """RESILAX_LIVE_JOB_UIDS (the other live jobs on the storage) and RESILAX_TAKE_OVER
    (spec.checkpoint.takeOver), read by resilax_ckpt's ManagerOptions.from_env (issue 25, item 9)."""
    from dataclasses import replace

    raw = good_spec()
    env = _env(_trainer(build_pod(JOB, validate_spec(raw), PLAN, 0, 0, SETTINGS, coordinator_ip=None)))
    assert env["RESILAX_LIVE_JOB_UIDS"] == "" and env["RESILAX_TAKE_OVER"] == ""
    raw["checkpoint"]["takeOver"] = True
    plan = replace(PLAN, live_job_uids=("uid-b", "uid-c"))
    env = _env(_trainer(build_pod(JOB, validate_spec(raw), plan, 0, 0, SETTINGS, coordinator_ip=None)))
    assert env["RESILAX_LIVE_JOB_UIDS"] == "uid-b,uid-c" and env["RESILAX_TAKE_OVER"] == "true"
    import resilax_ckpt as rc

    opts = rc.ManagerOptions.from_env({k: v for k, v in env.items() if isinstance(v, str)})
    assert opts.live_job_uids == ("uid-b", "uid-c") and opts.take_over and opts.job_name == "ml/llama"


def _kubelet_refuses(pod: dict[str, Any]) -> list[str]:
    """The containers the kubelet refuses for `runAsNonRoot: true` with `runAsUser: 0` (each field the
    container's own, else the pod's)."""
    spec = pod["spec"]
    pod_ctx = spec.get("securityContext") or {}
    refused = []
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        ctx = c.get("securityContext") or {}
        user = ctx.get("runAsUser", pod_ctx.get("runAsUser"))
        non_root = ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot"))
        if non_root and user == 0:
            refused.append(c["name"])
    return refused


@pytest.mark.parametrize("local", [{"scope": "Node"}, {"scope": "Pod"}, None], ids=["node-scope", "pod-scope", "no-local"])
@pytest.mark.parametrize("trainer_user", [0, 1000, None], ids=["root-trainer", "user-trainer", "image-user"])
@pytest.mark.parametrize("pod_user", [0, None], ids=["root-pod", "no-pod-user"])
def test_every_container_runs_in_a_security_context_the_kubelet_accepts(
        local: dict[str, Any] | None, trainer_user: int | None, pod_user: int | None) -> None:
    """Issue 40, item 7: with host access allowed (the only way to a root trainer), a root trainer and
    `scope: Node` gave the sidecar `runAsUser: 0` beside the injected `runAsNonRoot: true`, and the
    kubelet refused the pod. Every combination now builds a pod whose every container it accepts."""
    raw = good_spec()
    if local is None:
        raw["checkpoint"].pop("local", None)
    else:
        raw["checkpoint"]["local"] = local
    if pod_user is not None:
        raw["template"]["spec"]["securityContext"] = {"runAsUser": pod_user}
    if trainer_user is not None:
        raw["template"]["spec"]["containers"][0]["securityContext"] = {"runAsUser": trainer_user}
    settings = replace(SETTINGS, allow_host_access=True)
    pod = build_pod(JOB_UID, validate_spec(raw, settings=settings), PLAN, 0, 0, settings, coordinator_ip=None)
    assert _kubelet_refuses(pod) == []
    # what the template says itself is kept: an explicit runAsNonRoot stays as written
    raw["template"]["spec"]["containers"][0]["securityContext"] = {"runAsUser": 1000, "runAsNonRoot": True}
    pod = build_pod(JOB_UID, validate_spec(raw, settings=settings), PLAN, 0, 0, settings, coordinator_ip=None)
    assert pod["spec"]["containers"][0]["securityContext"]["runAsNonRoot"] is True
