"""kueue_manifests.py (pure): upstream's CRDs and webhooks pointed at a Kueue manager on 127.0.0.1, its
configuration and the queues. The real manifests and the real manager are exercised by
tests/operator/cluster/test_op_e2e_kueue.py; these tables pin what is kept and rewritten."""

from __future__ import annotations

from typing import Any

import pytest
from resilax_local import binaries
from resilax_local.controlplane import kueue_manifests as km
from resilax_local.errors import BinaryError

BASE = "https://127.0.0.1:9443"
CA = "Q0E="


def _hook(name: str, group: str, resource: str, path: str) -> dict[str, Any]:
    return {"name": name, "admissionReviewVersions": ["v1"], "sideEffects": "None", "failurePolicy": "Fail",
            "clientConfig": {"service": {"name": "webhook-service", "namespace": "system", "path": path}},
            "rules": [{"apiGroups": [group], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": [resource]}]}


UPSTREAM = [
    {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
     "metadata": {"name": "mutating-webhook-configuration"},
     "webhooks": [_hook("mjob.kb.io", "batch", "jobs", "/mutate-batch-v1-job"),
                  _hook("mpod.kb.io", "", "pods", "/mutate--v1-pod"),
                  _hook("mclusterqueue.kb.io", "kueue.x-k8s.io", "clusterqueues",
                        "/mutate-kueue-x-k8s-io-v1beta2-clusterqueue")]},
    {"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
     "metadata": {"name": "validating-webhook-configuration"},
     "webhooks": [_hook("vpod.kb.io", "", "pods", "/validate--v1-pod"),
                  _hook("vrayjob.kb.io", "ray.io", "rayjobs", "/validate-ray-io-v1-rayjob")]},
]


def test_webhooks_keep_the_pod_integration_and_kueues_kinds_called_on_127_0_0_1() -> None:
    mutating, validating = km.build_webhook_configurations(UPSTREAM, BASE, CA)
    assert (mutating["metadata"]["name"], validating["metadata"]["name"]) == (km.MUTATING_NAME, km.VALIDATING_NAME)
    assert [h["name"] for h in mutating["webhooks"]] == ["mpod.kb.io", "mclusterqueue.kb.io"]
    assert [h["name"] for h in validating["webhooks"]] == ["vpod.kb.io"]
    pod = mutating["webhooks"][0]
    assert pod["clientConfig"] == {"url": f"{BASE}/mutate--v1-pod", "caBundle": CA}
    # Pods without a queue label never reach Kueue; kube-system and kueue-system are left out (upstream's).
    assert pod["objectSelector"] == {"matchExpressions": [{"key": km.QUEUE_NAME_LABEL, "operator": "Exists"}]}
    assert pod["namespaceSelector"]["matchExpressions"][0]["values"] == ["kube-system", "kueue-system"]
    queue = mutating["webhooks"][1]
    assert queue["clientConfig"]["url"] == f"{BASE}/mutate-kueue-x-k8s-io-v1beta2-clusterqueue"
    assert "objectSelector" not in queue and "namespaceSelector" not in queue
    assert UPSTREAM[0]["webhooks"][1]["clientConfig"]["service"]["path"] == "/mutate--v1-pod"  # input untouched


def test_conversion_webhook_only_where_upstreams_kustomization_enables_it() -> None:
    kustomization = {"resources": ["bases/kueue.x-k8s.io_workloads.yaml"], "patches": [
        {"path": "patches/webhook_in_workloads.yaml"}, {"path": "patches/webhook_in_clusterqueues.yaml"},
        {"path": "patches/cainjection_in_workloads.yaml"}]}
    converted = km.conversion_crds(kustomization)
    assert converted == {"workloads.kueue.x-k8s.io", "clusterqueues.kueue.x-k8s.io"}
    crds = [{"metadata": {"name": n}, "spec": {"group": km.GROUP}}
            for n in ("workloads.kueue.x-k8s.io", "resourceflavors.kueue.x-k8s.io")]
    workloads, flavors = km.build_crds(crds, converted, BASE, CA)
    assert workloads["spec"]["conversion"] == {"strategy": "Webhook", "webhook": {
        "clientConfig": {"url": f"{BASE}/convert", "caBundle": CA}, "conversionReviewVersions": ["v1"]}}
    assert "conversion" not in flavors["spec"] and "conversion" not in crds[0]["spec"]


def test_config_runs_the_pod_integration_on_loopback_without_cert_management_nor_leader_election() -> None:
    config = km.build_config(health_port=8081, webhook_port=9443, cert_dir="/run/certs")
    assert config["webhook"] == {"host": "127.0.0.1", "port": 9443, "certDir": "/run/certs"}
    assert config["health"]["healthProbeBindAddress"] == "127.0.0.1:8081"
    assert config["internalCertManagement"] == {"enable": False} and config["leaderElection"] == {"leaderElect": False}
    assert config["integrations"] == {"frameworks": ["pod"]} and config["manageJobsWithoutQueueName"] is False
    assert config["featureGates"] == {"VisibilityOnDemand": False} and config["metrics"] == {"bindAddress": "0"}


@pytest.mark.parametrize(("doc", "path"), [
    (km.build_cluster_queue("cq", {"cpu": "4"}), "/apis/kueue.x-k8s.io/v1beta2/clusterqueues"),
    (km.build_local_queue("ml", "team", "cq"), "/apis/kueue.x-k8s.io/v1beta2/namespaces/ml/localqueues"),
    (km.build_resource_flavor(), "/apis/kueue.x-k8s.io/v1beta2/resourceflavors"),
    (km.build_priority_class("high", 1000), "/apis/kueue.x-k8s.io/v1beta2/workloadpriorityclasses"),
], ids=["cluster-queue", "local-queue", "flavor", "priority-class"])
def test_object_paths(doc: dict[str, Any], path: str) -> None:
    assert km.object_path(doc) == path


def test_cluster_queue_covers_each_quota_resource_and_preempts_lower_priorities() -> None:
    cq = km.build_cluster_queue("cq", {"google.com/tpu": "8", "cpu": "100"},
                                namespace_selector={"matchLabels": {"kubernetes.io/metadata.name": "ml"}})
    group = cq["spec"]["resourceGroups"][0]
    assert group["coveredResources"] == ["cpu", "google.com/tpu"]
    assert group["flavors"] == [{"name": km.DEFAULT_FLAVOR, "resources": [
        {"name": "cpu", "nominalQuota": "100"}, {"name": "google.com/tpu", "nominalQuota": "8"}]}]
    assert cq["spec"]["preemption"]["withinClusterQueue"] == "LowerPriority"
    assert cq["spec"]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "ml"}}
    assert km.build_cluster_queue()["spec"]["namespaceSelector"] == {}  # the default queue: every namespace


def test_kueue_is_cached_by_version_with_its_manifests(tmp_path, monkeypatch) -> None:
    """`ensure_kueue(build=False)` finds a complete cache folder (the binary and every manifest it copies)
    and otherwise says how to build it."""
    monkeypatch.setenv("RESILAX_CACHE", str(tmp_path))
    with pytest.raises(BinaryError, match="resilax local binaries"):
        binaries.ensure_kueue("v9.9.9", build=False)
    folder = binaries.kueue_dir("v9.9.9")
    (folder / "manifests" / "config/components/crd/bases").mkdir(parents=True)
    for item in binaries.KUEUE_MANIFESTS[1:]:
        (folder / "manifests" / item).parent.mkdir(parents=True, exist_ok=True)
        (folder / "manifests" / item).write_text("{}\n")
    with pytest.raises(BinaryError):
        binaries.ensure_kueue("v9.9.9", build=False)  # manifests without the manager
    (folder / "kueue").write_text("")
    found = binaries.ensure_kueue("v9.9.9", build=False)
    assert found.manager == folder / "kueue" and found.version == "v9.9.9"
