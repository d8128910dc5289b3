"""Spare slices' placeholder pods (pure): their names, manifests, parsed form, and status.spares
(policies/spares.py decides when they exist and when the job takes one).

A spare slice of `spec.recovery.spareSlices` is held by one placeholder pod per host of the job's slice
(the GKE "balloon pod" pattern; slice_holders.holder_pod_spec: the slice's devices and placement, none
on the pools the job's workers use, one per node): `sleep infinity` in the sidecar's image (a pause
process: it only holds the place), the operator's `spare_priority_class` (below every job's: any pod
of a higher priority preempts it). Labelled with the job (`resilax.dev/job`: the job's capacity planning counts the nodes they
hold as its own, free for its next generation; other jobs see them taken) and role `spare`, without a
generation label: never a worker.
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
from ..spec import JobSpec
from .slice_holders import holder_pod_spec

#: What a placeholder runs: a process that only waits (the sidecar's image is a Python image).
PLACEHOLDER_COMMAND = ("sleep", "infinity")


@dataclass(frozen=True)
class ObservedSpare:
    """A placeholder pod of this job (owned by its uid)."""

    name: str
    #: The spare slot (0 .. spareSlices-1) and the host of the slice it holds.
    slot: int
    host: int
    node_name: str | None = None
    running: bool = False
    deleting: bool = False
    uid: str = ""
    #: The node pool its nodeSelector pins it to ("" for the scheduler's choice).
    pinned: str = ""
    #: The slice it holds (`spare_shape` when created; "" on one that predates the annotation).
    shape: str = ""


@dataclass(frozen=True)
class SpareStatus:
    """status.spares: what the job holds, and the last time it took a spare."""

    desired: int = 0
    #: Spare slices whose every placeholder runs on a node that is up.
    ready: int = 0
    #: The node pools of the ready spares, sorted.
    pools: tuple[str, ...] = ()
    #: Why no spare is held although some are asked for (a Kueue queue, a suspended job); "" otherwise.
    message: str = ""
    #: The generation that last took spares, and their pools (one event per take).
    taken_generation: int = 0
    taken_pools: tuple[str, ...] = ()
    #: How many spare slices the job has taken over its life.
    taken_total: int = 0


def spare_shape(spec: JobSpec) -> str:
    """`<accelerator>/<topology>/<devices per host>`: what a placeholder holds; one of another shape (a
    `slices` edit) is replaced."""
    geometry = geometry_of(spec, spec.slices.topology)
    return f"{spec.slices.accelerator}/{spec.slices.topology}/{geometry.chips_per_host}"


def spare_name(job: str, slot: int, host: int) -> str:
    return f"{job}-spare-s{slot}-h{host}"


def parse_spare(raw: Mapping[str, Any], job_uid: str) -> ObservedSpare | None:
    """A pod labelled with the job → its placeholder (None: not a spare, or not this job's uid's)."""
    meta = raw.get("metadata") or {}
    labels = meta.get("labels") or {}
    if labels.get(api.LABEL_ROLE) != api.ROLE_SPARE or not job_uid or owner_uid(raw) != job_uid:
        return None
    try:
        slot, host = int(labels.get(api.LABEL_SPARE_SLICE, "")), int(labels.get(api.LABEL_HOST, ""))
    except ValueError:
        return None
    spec = raw.get("spec") or {}
    return ObservedSpare(str(meta.get("name", "")), slot, host, spec.get("nodeName") or None,
                         (raw.get("status") or {}).get("phase") == "Running", bool(meta.get("deletionTimestamp")),
                         str(meta.get("uid") or ""), str((spec.get("nodeSelector") or {}).get(api.NODE_POOL_LABEL) or ""),
                         str((meta.get("annotations") or {}).get(api.ANNOTATION_SHAPE) or ""))


def build_spare_pods(job: JobRef, spec: JobSpec, slot: int, avoid_pools: tuple[str, ...],
                     settings: OperatorSettings, hosts: tuple[int, ...] | None = None, pool: str = "") -> list[Manifest]:
    """The placeholder pods of spare slot `slot` (its hosts `hosts`, default all) of the spec's shape,
    kept off the node pools `avoid_pools` (the job's workers'), pinned to node pool `pool` if given."""
    geometry = geometry_of(spec, spec.slices.topology)
    template = copy.deepcopy(dict(spec.template.get("spec") or {}))
    same: dict[str, str] = {api.LABEL_JOB: job.name, api.LABEL_ROLE: api.ROLE_SPARE}
    container = {"name": "placeholder", "image": settings.sidecar_image, "command": list(PLACEHOLDER_COMMAND),
                 "imagePullPolicy": settings.image_pull_policy}
    pod = holder_pod_spec(template, geometry, same, api.LABEL_SPARE_SLICE, str(slot), avoid_pools, container,
                          settings.spare_priority_class, pool)
    out: list[Manifest] = []
    for h in range(geometry.hosts) if hosts is None else hosts:
        out.append({"apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": spare_name(job.name, slot, h), "namespace": job.namespace,
                                 "labels": {**same, api.LABEL_SPARE_SLICE: str(slot), api.LABEL_HOST: str(h)},
                                 "annotations": {api.ANNOTATION_SHAPE: spare_shape(spec)},
                                 "ownerReferences": [build_owner_reference(job)]},
                    "spec": copy.deepcopy(pod)})
    return out


def parse_spare_status(raw: Any) -> SpareStatus | None:
    """status.spares → SpareStatus (None when absent or unreadable)."""
    if not isinstance(raw, Mapping):
        return None
    try:
        taken = raw.get("lastTaken") or {}
        return SpareStatus(int(raw.get("desired") or 0), int(raw.get("ready") or 0),
                           tuple(str(p) for p in raw.get("pools") or ()), str(raw.get("message") or ""),
                           int(taken.get("generation") or 0), tuple(str(p) for p in taken.get("pools") or ()),
                           int(raw.get("takenTotal") or 0))
    except (TypeError, ValueError, AttributeError):
        return None


def build_spare_status(spares: SpareStatus | None) -> dict[str, Any] | None:
    """SpareStatus → status.spares (None: a merge patch removes the member)."""
    if spares is None:
        return None
    out: dict[str, Any] = {"desired": spares.desired, "ready": spares.ready, "pools": list(spares.pools),
                           "takenTotal": spares.taken_total}
    if spares.message:
        out["message"] = spares.message
    if spares.taken_generation:
        out["lastTaken"] = {"generation": spares.taken_generation, "pools": list(spares.taken_pools)}
    return out
