"""Shape and pool planning (pure): which shape the spec allows that schedulable node pools can host now,
why none fits, and what a generation was planned from. With `capacity.provisioning: Autoscaled`
(`plan_target`), a generation may also be planned at the declared shape where no node exists yet: its
slices go on the free pools while they last, the others get pool "" and wait for the nodes a cluster
autoscaler adds for their pending pods.

A slice goes on one node pool (`cloud.google.com/gke-nodepool`); a pool hosts a slice when enough of its
nodes are schedulable, carry the slice's labels and have free devices for one worker each (devices held
by others' pods are subtracted, `ObservedNode.in_use_by_others`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from . import api
from .builders import geometry_of
from .observed.snapshot import ObservedNode, ObservedPod
from .spec import JobSpec, Shape
from .status import JobStatus
from .topology import SliceGeometry


@dataclass(frozen=True)
class ShapePlan:
    """A shape to run, the node pools its slices go on (one each), and its host count."""

    shape: Shape
    pools: tuple[str, ...]
    hosts: int

    @property
    def waiting_slices(self) -> tuple[int, ...]:
        """Slices no Ready pool hosts (pool ""): they wait for nodes that do not exist yet."""
        return tuple(i for i, p in enumerate(self.pools) if not p)


def plan_pools(geometry: SliceGeometry, nodes: Iterable[ObservedNode], now: datetime,
               lead: timedelta = timedelta(0)) -> tuple[str, ...]:
    """Node pools that can host one slice of `geometry` now: enough schedulable nodes carrying the
    slice's labels, each with free devices for one worker. Sorted by name, the pools the job's own
    spare slices hold last (`ObservedNode.spare`: taken only when the others do not suffice). A node
    whose scheduled host maintenance is within `lead` is not schedulable (`ObservedNode.schedulable`)."""
    nodes = tuple(nodes)
    by_pool: dict[str, int] = {}
    for n in nodes:
        if n.pool is None or not n.schedulable(now, lead):
            continue
        if any(n.labels.get(k) != v for k, v in geometry.node_selector):
            continue
        if geometry.resource is None:
            if api.TPU_ACCELERATOR_LABEL in n.labels or api.GPU_ACCELERATOR_LABEL in n.labels:
                continue  # keep accelerator nodes for accelerator jobs
        else:
            free = n.allocatable.get(geometry.resource, 0) - n.in_use_by_others.get(geometry.resource, 0)
            if free < geometry.chips_per_host:
                continue
        by_pool[n.pool] = by_pool.get(n.pool, 0) + 1
    spare = {n.pool for n in nodes if n.spare}
    # The spare choice: pools no spare of the job holds first, then its spares' pools, each by name.
    return tuple(sorted((p for p, count in by_pool.items() if count >= geometry.hosts), key=lambda p: (p in spare, p)))


def plan_shape(spec: JobSpec, nodes: Iterable[ObservedNode], now: datetime,
               lead: timedelta = timedelta(0)) -> ShapePlan | None:
    """The largest shape (total chips) within the spec's bounds that schedulable node pools can host,
    one slice per pool; ties go to the preferred topology. Without `elastic`: the spec shape or None."""
    nodes = tuple(nodes)
    low, high = spec.count_bounds
    best: tuple[tuple[int, int], ShapePlan] | None = None
    for preference, topology in enumerate(spec.allowed_topologies):
        geometry = geometry_of(spec, topology)
        pools = plan_pools(geometry, nodes, now, lead)
        count = min(high, len(pools))
        if count < low:
            continue
        key = (geometry.chips * count, -preference)
        if best is None or key > best[0]:
            best = (key, ShapePlan(Shape(topology, count), pools[:count], geometry.hosts * count))
    return None if best is None else best[1]


def plan_target(spec: JobSpec, nodes: Iterable[ObservedNode], now: datetime,
                lead: timedelta = timedelta(0)) -> ShapePlan | None:
    """What a new generation runs at. `plan_shape` (Ready capacity); with `capacity.provisioning:
    Autoscaled`, when that finds less than the declared shape (`spec.slices`), the declared shape instead:
    its slices on the free pools `plan_pools` finds, in order, the rest with pool "" (`waiting_slices`)."""
    nodes = tuple(nodes)
    planned = plan_shape(spec, nodes, now, lead)
    declared = spec.spec_shape
    if not spec.capacity.autoscaled or (planned is not None and shape_chips(spec, planned.shape)
                                        >= shape_chips(spec, declared)):
        return planned
    geometry = geometry_of(spec, declared.topology)
    free = plan_pools(geometry, nodes, now, lead)[:declared.count]
    pools = (*free, *("",) * (declared.count - len(free)))
    return ShapePlan(declared, pools, geometry.hosts * declared.count)


@dataclass(frozen=True)
class LeaseWait:
    """`plan_lease_wait`'s answer: plan again at `until`; `nodes` are the Ready nodes whose Lease lags."""

    until: datetime
    nodes: tuple[str, ...]


def plan_lease_wait(spec: JobSpec, nodes: Iterable[ObservedNode], now: datetime,
                    lead: timedelta = timedelta(0)) -> LeaseWait | None:
    """Whether planning must wait rather than shrink: a Ready node held down by a witnessed Lease whose
    full duration has not passed (`ObservedNode.lease_lags`: its kubelet's renewals may merely lag) would
    give a larger shape if it renewed. Then wait until the earliest such Lease expires in full (or the
    node lifecycle controller marks the node, or a renewal is read); None: plan now, the node changes
    nothing (a spare host, or the shape is the same without it)."""
    nodes = tuple(nodes)
    lagging = [n for n in nodes if n.lease_lags(now)]
    if not lagging:
        return None
    renewed = tuple(replace(n, lease_live_until=None) if n.lease_lags(now) else n for n in nodes)
    planned, hoped = plan_target(spec, nodes, now, lead), plan_target(spec, renewed, now, lead)
    if hoped is None or (planned is not None and shape_chips(spec, planned.shape) >= shape_chips(spec, hoped.shape)
                         and not planned.waiting_slices):
        return None
    until = min(n.lease_live_until for n in lagging if n.lease_live_until is not None)
    return LeaseWait(until, tuple(sorted(n.name for n in lagging)))


def describe_slice_need(spec: JobSpec, topology: str) -> str:
    """What one slice of `topology` needs from a node pool, for messages: hosts, devices, node labels."""
    g = geometry_of(spec, topology)
    devices = f" with {g.chips_per_host} {g.resource} each" if g.resource else ""
    labels = ", ".join(f"{k}={v}" for k, v in g.node_selector)
    return f"{g.hosts} node(s){devices}" + (f" labelled {labels}" if labels else "")


def record_pools(s: JobStatus, pods: Iterable[ObservedPod], nodes: Iterable[ObservedNode]) -> JobStatus:
    """`s` with the node pool of each waiting slice (pool "") filled in, once every worker of the
    generation is created and bound to a node (the pools the cluster provided). Until then the empty
    pools mark the generation as waiting for capacity."""
    if all(s.pools) or not s.workers_created:
        return s
    mine = [p for p in pods if p.generation == s.generation]
    if len(mine) < s.hosts or any(p.node_name is None for p in mine):
        return s
    pool_of = {n.name: n.pool for n in nodes}
    found: dict[int, str] = {}
    for p in mine:
        pool = pool_of.get(p.node_name or "")
        if pool and p.slice_index < len(s.pools) and not s.pools[p.slice_index]:
            found.setdefault(p.slice_index, pool)
    if not found:
        return s
    return replace(s, pools=tuple(pool or found.get(i, "") for i, pool in enumerate(s.pools)))


def explain_shortfall(spec: JobSpec, nodes: Iterable[ObservedNode], now: datetime,
                      lead: timedelta = timedelta(0)) -> str:
    """Why `plan_shape` found nothing, for the InsufficientCapacity message: what each allowed
    topology needs and what the schedulable nodes carrying its labels offer. When such nodes exist
    but all have fewer free devices than one host of the slice needs, and the spec left the host
    size to its default, it says which field picks smaller hosts."""
    nodes = tuple(nodes)
    low, high = spec.count_bounds
    parts = []
    for topology in spec.allowed_topologies:
        g = geometry_of(spec, topology)
        matching = [n for n in nodes if n.pool is not None and n.schedulable(now, lead)
                    and all(n.labels.get(k) == v for k, v in g.node_selector)]
        need = f"{topology}: {low}..{high} node pools of {g.hosts} host(s)"
        if g.resource is None:
            parts.append(f"{need}; {len(matching)} schedulable nodes")
            continue
        need += f" with {g.chips_per_host} free {g.resource} each"
        most = max((n.allocatable.get(g.resource, 0) - n.in_use_by_others.get(g.resource, 0)
                    for n in matching), default=0)
        offer = f"{len(matching)} schedulable nodes with these labels, at most {most} free per node"
        hint = ""
        if (matching and most < g.chips_per_host and spec.slices.machine_type is None
                and spec.slices.chips_per_host is None):
            hint = (f" (the default is {g.chips_per_host} per host; set slices.machineType or "
                    f"slices.chipsPerHost for smaller hosts)")
        parts.append(f"{need}; {offer}{hint}")
    return f"{spec.slices.accelerator}: " + "; ".join(parts)


def shape_chips(spec: JobSpec, shape: Shape) -> int:
    return geometry_of(spec, shape.topology).chips * shape.count


def fingerprint(spec: JobSpec) -> str:
    """`<hardware>/<shape bounds>`: what the current generation was planned from."""
    s, e = spec.slices, spec.elastic
    hardware = json.dumps([s.accelerator, s.machine_type, s.chips_per_host])
    bounds = json.dumps([s.topology, s.count, None if e is None else [e.min_count, e.max_count, e.topologies]])
    return f"{_digest(hardware)}/{_digest(bounds)}"


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def plan_worker_nodes(s: JobStatus, pods: Iterable[ObservedPod]) -> dict[int, str]:
    """Worker process index → node, for the current generation's pods bound to a node."""
    count = s.shape.count if s.shape is not None else 1
    hosts = max(1, s.hosts // max(1, count))
    return {p.slice_index * hosts + p.host: p.node_name for p in pods
            if p.node_name and p.generation == s.generation}
