"""Waiting for capacity or admission: workers of the current generation that no node takes because the
nodes do not exist yet (`capacity.provisioning: Autoscaled`), or that a queue holds back (Kueue's
scheduling gates).

A generation planned at the declared shape where Ready pools lacked (`capacity.plan_target`) has slices
with pool "" in the status; their pods are Pending with no node, which is what a cluster autoscaler,
node auto-provisioning or flex-start reacts to. When nodes come the pods schedule and the generation runs
at the declared shape (the status then names the pools they got, `capacity.record_pools`).

| the generation's workers                                          | decision                                 |
|-------------------------------------------------------------------|------------------------------------------|
| some held by scheduling gates (not yet admitted by the queue)     | Ready=False WaitingForAdmission (event once); no timeout: the queue decides (`waiting`) |
| a slice with pool "" not all bound, before capacity.shrinkAfterSeconds | Ready=False WaitingForCapacity naming the nodes missing (event once) (`waiting`) |
| the same past shrinkAfterSeconds, `elastic` allows a smaller shape the Ready nodes fit | Shrink: tear down (no final save: the workers never all ran) and start that shape (`check`); growBack later as usual |
| the same past it, no smaller shape fits (or no `elastic`)         | keep waiting; the message says so        |

The timeout counts from the generation's creation, or from its admission by a queue (`JobStatus.workers_since`:
status.generationStartTime, status.admittedTime): nothing waits in memory.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from .. import api
from .. import status as st
from ..capacity import describe_slice_need, plan_shape, shape_chips
from ..generation import build_pod_group_name
from ..observed.snapshot import Observed
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus
from . import Finding, preemption


def waiting_workers(observed: Observed, s: JobStatus) -> dict[int, int]:
    """Waiting slice (pool "") → its workers not bound to a node yet (pods not created count too)."""
    if s.shape is None or all(s.pools):
        return {}
    per_slice = max(1, s.hosts // max(1, s.shape.count))
    bound: dict[int, int] = {}
    for p in observed.pods_of(s.generation):
        if p.node_name is not None:
            bound[p.slice_index] = bound.get(p.slice_index, 0) + 1
    out = {i: per_slice - bound.get(i, 0) for i, pool in enumerate(s.pools) if not pool}
    return {i: n for i, n in out.items() if n > 0}


def gated(observed: Observed, s: JobStatus) -> tuple[int, tuple[str, ...]]:
    """(workers held by scheduling gates, the gates' names)."""
    pods = [p for p in observed.pods_of(s.generation) if p.gates and p.node_name is None]
    return len(pods), tuple(sorted({g for p in pods for g in p.gates}))


def record_admission(observed: Observed, s: JobStatus) -> JobStatus:
    """`s` with `admittedTime` set when the workers were held by a queue's gates (the Ready condition says
    WaitingForAdmission) and none is any more: the timeouts on their start count from now."""
    old = s.condition(api.COND_READY)
    if old is None or old.reason != api.WAITING_FOR_ADMISSION.name or gated(observed, s)[0]:
        return s
    return replace(s, admitted_time=st.truncate(observed.now))


def waiting(spec: JobSpec, observed: Observed, s: JobStatus) -> tuple[str, str] | None:
    """The Ready condition's (reason, message) while the generation waits for admission or capacity;
    None when it does not."""
    held, gates = gated(observed, s)
    if held:
        return api.WAITING_FOR_ADMISSION.name, api.WAITING_FOR_ADMISSION.format(
            generation=s.generation, waiting=held, hosts=s.hosts, gates=", ".join(gates),
            group=build_pod_group_name(observed.job.name, s.generation))
    missing = waiting_workers(observed, s)
    if not missing or s.shape is None:
        return None
    now = observed.now
    slices = ", ".join(str(i) for i in sorted(missing))
    need = (f"slice{'s' if len(missing) > 1 else ''} {slices} each need a node pool of "
            f"{describe_slice_need(spec, s.shape.topology)}")
    shrink_at = (s.workers_since or now) + timedelta(seconds=spec.capacity.shrink_after)
    if spec.elastic is None:
        then = "no spec.elastic: the job waits for exactly this shape"
    elif now < shrink_at:
        then = (f"if they do not come by {st.format_time(shrink_at)} (capacity.shrinkAfterSeconds="
                f"{spec.capacity.shrink_after}), the job shrinks to the largest allowed shape the Ready nodes fit")
    else:
        then = ("capacity.shrinkAfterSeconds has passed, but no smaller allowed shape fits the Ready nodes "
                "either: still waiting")
    return api.WAITING_FOR_CAPACITY.name, api.WAITING_FOR_CAPACITY.format(
        generation=s.generation, waiting=sum(missing.values()), hosts=s.hosts, missing=need, then=then)


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Finding | None:
    """Workers waited for capacity past `capacity.shrinkAfterSeconds` and `elastic` allows a smaller shape
    that the Ready nodes fit now: Shrink. Workers held by a queue's gates never shrink (the queue decides)."""
    if not spec.capacity.autoscaled or spec.elastic is None or s.shape is None:
        return None
    missing = waiting_workers(observed, s)
    if not missing or gated(observed, s)[0]:
        return None
    now = observed.now
    if now < (s.workers_since or now) + timedelta(seconds=spec.capacity.shrink_after):
        return None
    target = plan_shape(spec, observed.nodes, now, preemption.maintenance_lead(spec, s))
    if target is None or shape_chips(spec, target.shape) >= shape_chips(spec, s.shape):
        return None
    return Finding(st.SHRINK, api.CAPACITY_TIMEOUT.name, api.CAPACITY_TIMEOUT.format(
        generation=s.generation, waiting=sum(missing.values()), seconds=spec.capacity.shrink_after,
        old=s.shape, new=target.shape))
