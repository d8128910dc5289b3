"""The accelerators pods hold (pure): what capacity accounting counts per node.

A live pod that is not this job's worker holds its device requests on its node once bound; a pending
pod pinned to a node pool (another job's new generation) holds them on one node of that pool, so two
jobs starting at once never plan the same free pool. `count_devices_in_use` is the full parse from raw
pods; the watch cache keeps the same figures per event (`indexes.FleetIndex`) with the parts below.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from .. import api

#: Extended resources the planner counts per node.
DEVICE_RESOURCES: Final = (api.TPU_RESOURCE, api.GPU_RESOURCE)


@dataclass(frozen=True)
class DeviceUse:
    """What one live pod holds of the accelerators (capacity accounting): on its node once bound; while
    pending but pinned to a node pool (a new generation's pod), on one node of that pool."""

    namespace: str
    name: str
    #: The `resilax.dev/job` label (None for a pod that is not a Resilax worker).
    job: str | None
    #: Device resource → amount requested (limits or requests of every container), never empty.
    asked: Mapping[str, int]
    node: str | None = None
    #: The node pool a pending pod is pinned to; None once bound, or when it holds nothing (going away).
    pool: str | None = None


def parse_device_use(raw: Mapping[str, Any]) -> DeviceUse | None:
    """A pod (full or `cache.trim_live_pod`'s form) → what it holds of the devices; None when it asks for
    none, has finished (Succeeded/Failed), or is pending, unpinned or being deleted."""
    meta, spec = raw.get("metadata") or {}, raw.get("spec") or {}
    if (raw.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None
    asked = _devices_asked(spec)
    if not asked:
        return None
    node = spec.get("nodeName") or None
    pool = None if node else (spec.get("nodeSelector") or {}).get(api.NODE_POOL_LABEL)
    if node is None and (not pool or meta.get("deletionTimestamp")):
        return None
    job = (meta.get("labels") or {}).get(api.LABEL_JOB)
    return DeviceUse(str(meta.get("namespace") or ""), str(meta.get("name", "")), None if job is None else str(job),
                     asked, node, None if pool is None else str(pool))


def count_devices_in_use(raw_pods: Iterable[Mapping[str, Any]], job: str,
                         raw_nodes: Iterable[Mapping[str, Any]] = (), namespace: str = "") -> dict[str, dict[str, int]]:
    """node name → device resource → amount requested by live pods that are not this job's workers
    (the job `job` of `namespace`).

    A pod not yet bound to a node but pinned to a node pool (another job's new generation, still
    pending) holds its devices too: it is counted on the node of its pool with the most free devices
    (`raw_nodes`), so that two jobs starting at once never plan the same free pool. The full parse;
    cache.py keeps the same figures per watch event (`indexes.FleetIndex`)."""
    out: dict[str, dict[str, int]] = {}
    pending: list[DeviceUse] = []
    for pod in raw_pods:
        use = parse_device_use(pod)
        if use is None or (use.namespace == namespace and use.job == job):
            continue
        if use.node is not None:
            add_devices(out, use.node, use.asked)
        else:
            pending.append(use)
    if pending:
        by_pool: dict[str, list[tuple[str, Mapping[str, int]]]] = {}
        for n in raw_nodes:
            meta, status = n.get("metadata") or {}, n.get("status") or {}
            pool = (meta.get("labels") or {}).get(api.NODE_POOL_LABEL)
            if pool:
                allocatable = {r: int(str(v)) for r, v in (status.get("allocatable") or {}).items()
                               if r in DEVICE_RESOURCES}
                by_pool.setdefault(str(pool), []).append((str(meta.get("name", "")), allocatable))
        place_pending(out, pending, by_pool)
    return out


def place_pending(in_use: dict[str, dict[str, int]], pending: Iterable[DeviceUse],
                  by_pool: Mapping[str, Sequence[tuple[str, Mapping[str, int]]]]) -> list[str]:
    """Count each pending pod (by name) on the node of its pool with the most free devices, in `in_use`
    (node → resource → amount, updated). `by_pool`: pool → (node, allocatable) of its nodes. Returns
    the nodes whose count changed."""
    touched = []
    for use in sorted(pending, key=lambda u: (u.name, u.pool or "", u.namespace)):
        candidates = by_pool.get(use.pool or "") or []
        if not candidates:
            continue
        r = next(iter(use.asked))
        name = min(candidates, key=lambda c: (in_use.get(c[0], {}).get(r, 0) - c[1].get(r, 0), c[0]))[0]
        add_devices(in_use, name, use.asked)
        touched.append(name)
    return touched


def add_devices(in_use: dict[str, dict[str, int]], node: str, asked: Mapping[str, int], sign: int = 1) -> None:
    """Add (or with `sign=-1` take away) `asked` to `node`'s counts; a count that reaches 0 goes."""
    counts = in_use.setdefault(node, {})
    for r, amount in asked.items():
        value = counts.get(r, 0) + sign * amount
        if value:
            counts[r] = value
        else:
            counts.pop(r, None)
    if not counts:
        del in_use[node]


def _devices_asked(spec: Mapping[str, Any]) -> dict[str, int]:
    asked: dict[str, int] = {}
    for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        resources = c.get("resources") or {}
        wanted = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        for r in DEVICE_RESOURCES:
            if r in wanted:
                asked[r] = asked.get(r, 0) + int(str(wanted[r]))
    return {r: amount for r, amount in asked.items() if amount}
