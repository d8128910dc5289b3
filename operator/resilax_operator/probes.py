"""Grow-back probe pods (pure): their names, manifests and parsed form (policies/grow_back_probe.py
decides when they exist).

A probe pod holds the place of one host of a slice the job lacks: the slice's device requests, node
selectors and tolerations (as a worker's), the template's own node selectors, tolerations and
affinity, all of a probe slice's pods on one node pool and no two probe slices on one pool (a waiting
slice's rules, builders._slice_placement), none on the pools the job's workers use, one per node. A
pause container, no service account token, grace 0. Labelled with the job (`resilax.dev/job`, so the
job's capacity planning counts the nodes they hold as its own: free for its grow-back) and role `probe`,
without a generation label: never a worker, never counted as one.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import api
from .builders import Manifest, build_owner_reference, geometry_of
from .generation import JobRef
from .ownership import owner_uid
from .podsecurity import RESTRICTED_POD, merge_security_context, restricted_context
from .settings import OperatorSettings
from .spec import JobSpec, Shape


@dataclass(frozen=True)
class ObservedProbe:
    """A probe pod of this job (owned by its uid)."""

    name: str
    #: `g<generation>r<round>` (`probe_set`).
    probe_set: str
    node_name: str | None = None
    deleting: bool = False
    uid: str = ""


def probe_set(generation: int, round_: int) -> str:
    return f"g{generation}r{round_}"


def probe_name(job: str, set_: str, slice_index: int, host: int) -> str:
    return f"{job}-probe-{set_}-s{slice_index}-h{host}"


def parse_probe(raw: Mapping[str, Any], job_uid: str) -> ObservedProbe | None:
    """A pod labelled with the job → its probe (None: not a probe, or not this job's uid's)."""
    meta = raw.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(api.LABEL_ROLE) != api.ROLE_PROBE or not job_uid or owner_uid(raw) != job_uid:
        return None
    return ObservedProbe(str(meta.get("name", "")), str(labels.get(api.LABEL_PROBE_SET, "")),
                         (raw.get("spec") or {}).get("nodeName") or None, bool(meta.get("deletionTimestamp")),
                         str(meta.get("uid") or ""))


def build_probe_pods(job: JobRef, spec: JobSpec, shape: Shape, set_: str, avoid_pools: tuple[str, ...],
                     settings: OperatorSettings) -> list[Manifest]:
    """Every probe pod of `shape` (the missing slices: `shape.count` of them, of `shape.topology`)."""
    geometry = geometry_of(spec, shape.topology)
    template = copy.deepcopy(dict(spec.template.get("spec") or {}))
    same = {api.LABEL_JOB: job.name, api.LABEL_ROLE: api.ROLE_PROBE, api.LABEL_PROBE_SET: set_}
    out = []
    for i in range(shape.count):
        affinity: dict[str, Any] = copy.deepcopy(dict(template.get("affinity") or {}))
        affinity.setdefault("podAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
            {"labelSelector": {"matchLabels": {**same, api.LABEL_PROBE_SLICE: str(i)}},
             "topologyKey": api.NODE_POOL_LABEL})
        anti = affinity.setdefault("podAntiAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
        anti.append({"labelSelector": {"matchLabels": same, "matchExpressions": [
            {"key": api.LABEL_PROBE_SLICE, "operator": "NotIn", "values": [str(i)]}]}, "topologyKey": api.NODE_POOL_LABEL})
        anti.append({"labelSelector": {"matchLabels": same}, "topologyKey": api.HOSTNAME_LABEL})
        if avoid_pools:
            terms = affinity.setdefault("nodeAffinity", {}).setdefault(
                "requiredDuringSchedulingIgnoredDuringExecution", {}).setdefault("nodeSelectorTerms", [])
            if not terms:
                terms.append({})
            for term in terms:  # ORed: each gets the exclusion
                term.setdefault("matchExpressions", []).append(
                    {"key": api.NODE_POOL_LABEL, "operator": "NotIn", "values": sorted(avoid_pools)})
        devices = geometry.resource_requests()
        pod: dict[str, Any] = {
            "containers": [{"name": "probe", "image": settings.probe_image,
                            "resources": {"requests": {"cpu": "1m", "memory": "8Mi", **devices},
                                          "limits": {"memory": "16Mi", **devices}},
                            "securityContext": restricted_context({})}],
            "nodeSelector": {**(template.get("nodeSelector") or {}), **dict(geometry.node_selector)},
            "tolerations": [*(template.get("tolerations") or []),
                            *({"key": k, "operator": "Exists", "effect": "NoSchedule"} for k in geometry.toleration_keys)],
            "affinity": affinity, "restartPolicy": "Always", "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False, "enableServiceLinks": False,
            "securityContext": merge_security_context(RESTRICTED_POD, {}),
        }
        if settings.probe_priority_class:
            pod["priorityClassName"] = settings.probe_priority_class
        labels: dict[str, str] = {**same, api.LABEL_PROBE_SLICE: str(i)}
        for h in range(geometry.hosts):
            out.append({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": probe_name(job.name, set_, i, h), "namespace": job.namespace,
                                     "labels": dict(labels),
                                     "annotations": {api.ANNOTATION_SHAPE: str(shape)},
                                     "ownerReferences": [build_owner_reference(job)]},
                        "spec": copy.deepcopy(pod)})
    return out
