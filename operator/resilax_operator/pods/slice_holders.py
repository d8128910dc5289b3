"""The pod spec of a pod that holds one host of a slice without training (pure): grow-back probes
(probes.py) and spare slices' placeholders (pods/spares.py).

Such a pod asks for the slice's devices, node selectors and tolerations (as a worker's) beside the
template's own node selectors, tolerations and affinity. All pods of one held slice land on one node
pool and no two held slices of the same kind on one pool (a waiting slice's rules,
builders._slice_placement), none on the pools in `avoid_pools` (the job's workers'), one per node. No
service account token, no service links, grace 0, the restricted Pod Security profile.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from .. import api
from ..topology import SliceGeometry
from .podsecurity import RESTRICTED_POD, merge_security_context, restricted_context


def holder_pod_spec(template: Mapping[str, Any], geometry: SliceGeometry, same: Mapping[str, str],
                    slice_label: str, slice_value: str, avoid_pools: tuple[str, ...],
                    container: Mapping[str, Any], priority_class: str, pool: str = "") -> dict[str, Any]:
    """The spec of every pod of the held slice `slice_value` (label `slice_label`) among the pods
    labelled `same`; `container` gives the container's name, image and command; `pool` pins the
    slice to one node pool."""
    affinity: dict[str, Any] = copy.deepcopy(dict(template.get("affinity") or {}))
    affinity.setdefault("podAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(
        {"labelSelector": {"matchLabels": {**same, slice_label: slice_value}}, "topologyKey": api.NODE_POOL_LABEL})
    anti = affinity.setdefault("podAntiAffinity", {}).setdefault("requiredDuringSchedulingIgnoredDuringExecution", [])
    anti.append({"labelSelector": {"matchLabels": dict(same), "matchExpressions": [
        {"key": slice_label, "operator": "NotIn", "values": [slice_value]}]}, "topologyKey": api.NODE_POOL_LABEL})
    anti.append({"labelSelector": {"matchLabels": dict(same)}, "topologyKey": api.HOSTNAME_LABEL})
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
        "containers": [{**container, "resources": {"requests": {"cpu": "1m", "memory": "8Mi", **devices},
                                                   "limits": {"memory": "16Mi", **devices}},
                        "securityContext": restricted_context({})}],
        "nodeSelector": {**(template.get("nodeSelector") or {}), **dict(geometry.node_selector),
                         **({api.NODE_POOL_LABEL: pool} if pool else {})},
        "tolerations": [*(template.get("tolerations") or []),
                        *({"key": k, "operator": "Exists", "effect": "NoSchedule"} for k in geometry.toleration_keys)],
        "affinity": affinity, "restartPolicy": "Always", "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False, "enableServiceLinks": False,
        "securityContext": merge_security_context(RESTRICTED_POD, {}),
    }
    if priority_class:
        pod["priorityClassName"] = priority_class
    return pod
