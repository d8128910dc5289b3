"""Autoscaled grow-back probe: pending demand for the slices a shrunk job lacks, so that a cluster
autoscaler (or GKE node auto-provisioning) adds the nodes its grow-back needs.

`resize.check` grows a job back only onto Ready nodes. On node pools that scale from zero no node comes
without a pending pod asking for it, so after a `Shrink` (capacity.shrinkAfterSeconds) a job would stay
small for ever. While it runs settled below its declared shape, the job keeps probe pods of the
missing slices (pods/probes.py: their devices, node selectors, one node pool per slice); when the autoscaler
gives them nodes, those nodes count as the job's own in its capacity planning, `resize.check` finds the
larger shape and the grow-back's transition removes the probes (the nodes, now empty, take the next
generation's workers).

| observed (the status the decision leaves)                                           | decision |
|--------------------------------------------------------------------------------------|----------|
| not eligible: settings.grow_back_probe_seconds 0, not `capacity.provisioning: Autoscaled`, no `elastic.growBack`, a Kueue queue (the queue decides capacity), not Running, a transition or in-place restart, a slice still waiting for nodes, workers not all Running, generation younger than grow_back_settle_seconds, or at its declared shape | delete every probe |
| eligible, a probe set of this generation with a pod bound to a node                    | keep that set (capacity is coming), delete the others |
| eligible, none bound                                                                   | the set of the current round (`g<generation>r<k>`, k = whole periods since the generation settled) exists; older sets are deleted |

Write budget: one set created and one deleted per `grow_back_probe_seconds` at most, while eligible;
nothing otherwise. The probes carry an owner reference (the garbage collector removes them with the job).
"""

from __future__ import annotations

from datetime import timedelta

from .. import api
from ..actions import Action, CreateProbes, DeleteProbes, SetStatus
from ..capacity import shape_chips
from ..generation import kueue_queue
from ..observed.snapshot import Observed
from ..pods.probes import build_probe_pods, probe_set
from ..settings import OperatorSettings
from ..spec import JobSpec, Shape
from ..status import JobStatus


def missing_shape(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Shape | None:
    """The slices to probe for (None: no probe)."""
    if (settings.grow_back_probe_seconds <= 0 or not spec.capacity.autoscaled or spec.elastic is None
            or not spec.elastic.grow_back or kueue_queue(observed.job, spec)):
        return None
    if (s.phase != api.PHASE_RUNNING or s.transition is not None or s.in_place is not None or s.shape is None
            or not all(s.pools) or s.generation_start_time is None):
        return None
    if observed.now < s.generation_start_time + timedelta(seconds=settings.grow_back_settle_seconds):
        return None
    pods = observed.pods_of(s.generation)
    if not (pods and len(pods) == s.hosts and all(p.phase == "Running" for p in pods)):
        return None
    declared = spec.spec_shape
    if shape_chips(spec, declared) <= shape_chips(spec, s.shape):
        return None
    missing = declared.count - (s.shape.count if s.shape.topology == declared.topology else 0)
    return Shape(declared.topology, missing) if missing > 0 else None


def current_set(observed: Observed, s: JobStatus, settings: OperatorSettings) -> str:
    """The probe set that should exist: one of this generation with a pod bound (the newest), else the
    current round's."""
    prefix = f"g{s.generation}r"
    bound = sorted({p.probe_set for p in observed.probes
                    if p.node_name and not p.deleting and p.probe_set.startswith(prefix)},
                   key=lambda name: int(name[len(prefix):]) if name[len(prefix):].isdigit() else -1)
    if bound:
        return bound[-1]
    since = (s.generation_start_time or observed.now) + timedelta(seconds=settings.grow_back_settle_seconds)
    return probe_set(s.generation, int((observed.now - since).total_seconds() // settings.grow_back_probe_seconds))


def decide(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> list[Action]:
    """The probe pods to create and delete for status `s` (the status this decision leaves)."""
    shape = missing_shape(spec, observed, s, settings)
    wanted = [] if shape is None else build_probe_pods(
        observed.job, spec, shape, current_set(observed, s, settings), tuple(p for p in s.pools if p), settings)
    names = {m["metadata"]["name"] for m in wanted}
    out: list[Action] = []
    stale = tuple(sorted(p.name for p in observed.probes if p.name not in names and not p.deleting))
    if stale:
        out.append(DeleteProbes(stale))
    have = {p.name for p in observed.probes}
    missing = tuple(m for m in wanted if m["metadata"]["name"] not in have)
    if missing:
        out.append(CreateProbes(missing))
    return out


def with_probes(actions: list[Action], spec: JobSpec, observed: Observed, settings: OperatorSettings) -> list[Action]:
    """`actions` and, last, the probe pods' creations and deletions the status they leave calls for."""
    s = next((a.status for a in reversed(actions) if isinstance(a, SetStatus)), observed.status)
    return [*actions, *decide(spec, observed, s, settings)]
