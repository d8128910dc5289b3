"""Grow-back probe pods (pure): their names, manifests and parsed form (policies/grow_back_probe.py
decides when they exist).

A probe pod holds the place of one host of a slice the job lacks (slice_holders.holder_pod_spec: the
slice's devices and placement, none on the pools the job's workers use, one per node), in a pause
container. Labelled with the job (`resilax.dev/job`, so the
job's capacity planning counts the nodes they hold as its own: free for its grow-back) and role `probe`,
without a generation label: never a worker, never counted as one.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import api
from ..builders import Manifest, build_owner_reference, geometry_of
from ..generation import JobRef
from ..ownership import owner_uid
from ..settings import OperatorSettings
from ..spec import JobSpec, Shape
from .slice_holders import holder_pod_spec


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
        pod = holder_pod_spec(template, geometry, same, api.LABEL_PROBE_SLICE, str(i), avoid_pools,
                              {"name": "probe", "image": settings.probe_image}, settings.probe_priority_class)
        labels: dict[str, str] = {**same, api.LABEL_PROBE_SLICE: str(i)}
        for h in range(geometry.hosts):
            out.append({"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": probe_name(job.name, set_, i, h), "namespace": job.namespace,
                                     "labels": dict(labels),
                                     "annotations": {api.ANNOTATION_SHAPE: str(shape)},
                                     "ownerReferences": [build_owner_reference(job)]},
                        "spec": copy.deepcopy(pod)})
    return out
