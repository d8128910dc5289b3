"""Kueue's objects for the local cluster (pure): its configuration, its CRDs and webhook configurations
pointed at a manager on 127.0.0.1, and the queue a cluster starts with.

Kueue normally runs in the cluster: the API server reaches its admission and CRD-conversion webhooks
through a Service, with certificates that Kueue's internal cert manager writes into a Secret the
kubelet mounts. The local cluster runs it as a process on 127.0.0.1 instead (kueue.py), so:

- internal cert management is off; the cluster's CA issues a serving certificate for 127.0.0.1, and
  every webhook (admission and conversion) is called by `url: https://127.0.0.1:<port><path>` with that
  CA as its `caBundle` (the API server calls a URL webhook directly; a Service would need kube-proxy);
- only the plain Pod integration is on (`integrations.frameworks: [pod]`): only its webhooks and those
  of Kueue's own kinds are registered, and the pod webhooks only see pods that carry a queue-name
  label (an objectSelector), outside kube-system and kueue-system (upstream's namespaceSelector), so
  the pods of other tests never wait on Kueue;
- leader election, the visibility API server (feature VisibilityOnDemand) and the metrics server are off.

Which CRDs get the conversion webhook is read from upstream's own kustomization (its
`patches/webhook_in_<plural>.yaml` entries), not listed here.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

GROUP: Final = "kueue.x-k8s.io"
API_VERSION: Final = f"{GROUP}/v1beta2"
#: Kueue's labels on the objects it queues (pkg/controller/constants).
QUEUE_NAME_LABEL: Final = "kueue.x-k8s.io/queue-name"
PRIORITY_CLASS_LABEL: Final = "kueue.x-k8s.io/priority-class"
#: The namespace Kueue's configuration names (events, the certificate Secret it does not write here).
NAMESPACE: Final = "kueue-system"
#: What `resilax local up --kueue` creates: a ResourceFlavor, a ClusterQueue of that flavor open to every
#: namespace, and a LocalQueue of that name in `default` (other namespaces add their own LocalQueue).
DEFAULT_FLAVOR: Final = "default-flavor"
DEFAULT_QUEUE: Final = "resilax-local"
#: The default ClusterQueue's quota: more than any local cluster has, so the nodes are the limit.
DEFAULT_QUOTA: Final = {"cpu": "1000", "memory": "4Ti", "google.com/tpu": "10000"}
MUTATING_NAME: Final = "kueue-mutating-webhook-configuration"
VALIDATING_NAME: Final = "kueue-validating-webhook-configuration"
#: Namespaces upstream's kustomization keeps away from the pod webhooks.
EXCLUDED_NAMESPACES: Final = ("kube-system", NAMESPACE)


def build_config(*, health_port: int, webhook_port: int, cert_dir: str) -> dict[str, Any]:
    """Kueue's `Configuration` (config.kueue.x-k8s.io/v1beta2) for a manager on 127.0.0.1."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": cert_dir},
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["pod"]},
        "featureGates": {"VisibilityOnDemand": False},
    }


def conversion_crds(kustomization: Mapping[str, Any]) -> frozenset[str]:
    """The CRDs upstream serves through its conversion webhook: `patches/webhook_in_<plural>.yaml` of
    config/components/crd/kustomization.yaml (commented-out entries are not in the parsed YAML)."""
    names = set()
    for patch in kustomization.get("patches") or []:
        found = re.fullmatch(r"patches/webhook_in_([a-z]+)\.yaml", str((patch or {}).get("path", "")))
        if found:
            names.add(f"{found.group(1)}.{GROUP}")
    return frozenset(names)


def build_crds(crds: Iterable[Mapping[str, Any]], converted: frozenset[str], base_url: str,
               ca_bundle: str) -> list[dict[str, Any]]:
    """Upstream's CRDs, those in `converted` with their conversion webhook at `<base_url>/convert`
    (`ca_bundle`: the CA, base64 PEM)."""
    out = []
    for crd in crds:
        doc = copy.deepcopy(dict(crd))
        if doc["metadata"]["name"] in converted:
            doc["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
                "clientConfig": {"url": f"{base_url}/convert", "caBundle": ca_bundle},
                "conversionReviewVersions": ["v1"]}}
        out.append(doc)
    return out


def _is_pod_webhook(hook: Mapping[str, Any]) -> bool:
    return any("" in (r.get("apiGroups") or []) and "pods" in (r.get("resources") or [])
               for r in hook.get("rules") or [])


def _is_kueue_webhook(hook: Mapping[str, Any]) -> bool:
    return any(GROUP in (r.get("apiGroups") or []) for r in hook.get("rules") or [])


def build_webhook_configurations(manifests: Iterable[Mapping[str, Any]], base_url: str,
                                 ca_bundle: str) -> list[dict[str, Any]]:
    """Upstream's Mutating/ValidatingWebhookConfiguration (config/components/webhook/manifests.yaml),
    kept to the pod webhooks and Kueue's own kinds, each called at `<base_url><path>`."""
    names = {"MutatingWebhookConfiguration": MUTATING_NAME, "ValidatingWebhookConfiguration": VALIDATING_NAME}
    out = []
    for doc in manifests:
        kind = doc.get("kind")
        if kind not in names:
            continue
        hooks = []
        for hook in doc.get("webhooks") or []:
            if not (_is_pod_webhook(hook) or _is_kueue_webhook(hook)):
                continue
            h = copy.deepcopy(dict(hook))
            path = h["clientConfig"]["service"]["path"]
            h["clientConfig"] = {"url": f"{base_url}{path}", "caBundle": ca_bundle}
            if _is_pod_webhook(h):
                h["objectSelector"] = {"matchExpressions": [{"key": QUEUE_NAME_LABEL, "operator": "Exists"}]}
                h["namespaceSelector"] = {"matchExpressions": [{
                    "key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": list(EXCLUDED_NAMESPACES)}]}
            hooks.append(h)
        out.append({"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind,
                    "metadata": {"name": names[str(kind)]}, "webhooks": hooks})
    return out


def build_resource_flavor(name: str = DEFAULT_FLAVOR) -> dict[str, Any]:
    """A ResourceFlavor with no node labels: it stands for every node."""
    return {"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": name}, "spec": {}}


def build_cluster_queue(name: str = DEFAULT_QUEUE, quota: Mapping[str, str] | None = None, *,
                        flavor: str = DEFAULT_FLAVOR,
                        namespace_selector: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A ClusterQueue with one flavor and `quota` (resource → nominal quota) that preempts lower
    priorities within itself; open to every namespace unless `namespace_selector` says otherwise."""
    quota = dict(quota or DEFAULT_QUOTA)
    return {"apiVersion": API_VERSION, "kind": "ClusterQueue", "metadata": {"name": name}, "spec": {
        "namespaceSelector": dict(namespace_selector or {}),
        "queueingStrategy": "BestEffortFIFO",
        "preemption": {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Never"},
        "resourceGroups": [{"coveredResources": sorted(quota), "flavors": [{
            "name": flavor, "resources": [{"name": r, "nominalQuota": quota[r]} for r in sorted(quota)]}]}],
    }}


def build_local_queue(namespace: str, name: str = DEFAULT_QUEUE, cluster_queue: str = DEFAULT_QUEUE) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "LocalQueue", "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterQueue": cluster_queue}}


def build_priority_class(name: str, value: int, description: str = "") -> dict[str, Any]:
    """A WorkloadPriorityClass (a workload names it with the `kueue.x-k8s.io/priority-class` label)."""
    return {"apiVersion": API_VERSION, "kind": "WorkloadPriorityClass", "metadata": {"name": name},
            "value": value, "description": description}


def object_path(doc: Mapping[str, Any]) -> str:
    """The REST path of the collection `doc` is created in (Kueue's kinds, CRDs, webhook configurations)."""
    api_version, kind = str(doc["apiVersion"]), str(doc["kind"])
    plural = {"CustomResourceDefinition": "customresourcedefinitions",
              "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
              "ValidatingWebhookConfiguration": "validatingwebhookconfigurations",
              "ResourceFlavor": "resourceflavors", "ClusterQueue": "clusterqueues", "LocalQueue": "localqueues",
              "WorkloadPriorityClass": "workloadpriorityclasses", "Workload": "workloads"}[kind]
    namespace = (doc.get("metadata") or {}).get("namespace")
    scope = f"/namespaces/{namespace}" if namespace else ""
    return f"/apis/{api_version}{scope}/{plural}"
