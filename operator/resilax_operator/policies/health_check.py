"""Health-checked starts (issue 39): a new worker pod runs `resilax health-check` (an init container,
spec.recovery.healthCheck) before its trainer; its result is the container's termination message, which
the watch cache keeps parsed (`ObservedPod.health`). Kept survivors of an in-place restart are not
checked again: only new pods get the init container, and a kept pod is never rebuilt.

| the current generation's pods                              | decision                                        |
|------------------------------------------------------------|-------------------------------------------------|
| a pod's check failed on its own part (devices, matmul)     | its node goes to status.unhealthyNodes (failures counted once per pod) and the UnhealthyNodes condition; PodLost HealthCheckFailed naming the node (not a worker failure): the next generation avoids it |
| only parts that need the others failed (rendezvous, collective), a check still running (within its bound + CHECK_SLACK_SECONDS of the generation's start) | wait: the host at fault leaves first and reports its own part |
| only such parts failed, no check running                   | PodLost HealthCheckSliceFailed: no host blamed   |
| otherwise                                                  | nothing (the next check runs)                   |

A node in status.unhealthyNodes stays out of this and later generations: `mark_kept_out` marks it in the
snapshot every decision reads (not schedulable for the planner, `ObservedNode.kept_out`), and the avoid
list (`Observed.avoid_list`: with the nodes a witnessed Lease holds down) puts it in each new pod's
required node anti-affinity. When too few nodes remain the job waits with InsufficientCapacity, whose
message names the nodes kept out (`describe_kept_out`).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Final

from .. import api
from .. import status as st
from ..actions import POLL_SECONDS, EmitEvent, RequeueAfter
from ..observed.snapshot import Observed, ObservedPod
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus, UnhealthyNode
from . import Finding, Verdict

#: How long past `healthCheck.timeoutSeconds` (counted from the generation's start) a slice failure waits
#: for checks still running to report a host fault: the last pods start after pod 0 has its IP.
CHECK_SLACK_SECONDS: Final = 120


def kept_out_reason(n: UnhealthyNode) -> str:
    """Why a node is kept out, for the avoid list and messages."""
    return f"HealthCheckFailed: {n.part}: {n.reason} ({n.failures} failure(s), last in generation {n.generation})"


def mark_kept_out(observed: Observed, s: JobStatus) -> Observed:
    """`observed` with the nodes of status.unhealthyNodes marked kept out (`ObservedNode.kept_out`)."""
    if not s.unhealthy_nodes:
        return observed
    why = {n.node: kept_out_reason(n) for n in s.unhealthy_nodes}
    if not any(n.name in why for n in observed.nodes):
        return observed
    return replace(observed, nodes=tuple(replace(n, kept_out=why[n.name]) if n.name in why else n
                                         for n in observed.nodes))


def describe_kept_out(observed: Observed) -> str:
    """" (kept out after a failed health check: a (...), b (...))" for the InsufficientCapacity message;
    "" when no node is kept out."""
    kept = [f"{n.name} ({n.kept_out})" for n in observed.nodes if n.kept_out]
    return f"; kept out after a failed health check: {', '.join(kept)}" if kept else ""


def blamed(pods: list[ObservedPod]) -> list[ObservedPod]:
    """Pods whose check failed on the host's own part, on a known node, by name."""
    return [p for p in pods if p.health is not None and p.health.host_fault and p.node_name]


def record(observed: Observed, s: JobStatus) -> JobStatus:
    """The current generation's pods whose check failed on their host's own part: their nodes recorded
    in status.unhealthyNodes (a pod counted once, however often this runs) and the UnhealthyNodes
    condition naming every node kept out."""
    by_node = {n.node: n for n in s.unhealthy_nodes}
    now = st.truncate(observed.now)
    for p in blamed(observed.pods_of(s.generation)):
        assert p.node_name is not None and p.health is not None
        old = by_node.get(p.node_name)
        if old is not None and (old.generation, old.pod) == (s.generation, p.name):
            continue
        by_node[p.node_name] = UnhealthyNode(p.node_name, p.health.failed_part or "", p.health.reason,
                                             (old.failures if old is not None else 0) + 1, now, s.generation, p.name)
    if not by_node:
        return s
    nodes = tuple(sorted(by_node.values(), key=lambda n: n.node))
    if nodes == s.unhealthy_nodes and s.condition(api.COND_UNHEALTHY_NODES) is not None:
        return s
    message = api.NODES_KEPT_OUT.format(nodes="; ".join(f"{n.node} ({n.part}: {n.reason})" for n in nodes))
    new = replace(s, unhealthy_nodes=nodes)
    return st.set_condition(new, api.COND_UNHEALTHY_NODES, True, api.NODES_KEPT_OUT.name, message, observed.now)


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Verdict:
    """A failed health check among the current generation's pods (table above). `record` has run."""
    pods = observed.pods_of(s.generation)
    failed = [p for p in pods if p.health is not None and p.health.exit_code != 0]
    if not failed:
        return None
    g = s.generation
    at_fault = blamed(failed)
    if at_fault:
        entries = {n.node: n for n in s.unhealthy_nodes}
        messages = []
        for p in at_fault:
            assert p.node_name is not None and p.health is not None
            entry = entries.get(p.node_name)
            messages.append(api.HEALTH_CHECK_FAILED.format(
                node=p.node_name, generation=g, pod=p.name, part=p.health.failed_part, detail=p.health.reason,
                failures=entry.failures if entry is not None else 1))
        return Finding(st.POD_LOST, api.HEALTH_CHECK_FAILED.name, messages[0],
                       events=tuple(EmitEvent("Warning", api.HEALTH_CHECK_FAILED.name, m) for m in messages[1:]))
    still_checking = [p for p in pods if p.health is None and p.phase == "Pending" and p.node_name
                      and p.deletion_timestamp is None and not p.waiting]
    bound = timedelta(seconds=spec.recovery.health_check.timeout_seconds + CHECK_SLACK_SECONDS)
    if still_checking and observed.now - (s.workers_since or observed.now) < bound:
        return [RequeueAfter(POLL_SECONDS)]
    first = failed[0]
    assert first.health is not None
    return Finding(st.POD_LOST, api.HEALTH_CHECK_SLICE_FAILED.name, api.HEALTH_CHECK_SLICE_FAILED.format(
        pod=first.name, generation=g, part=first.health.failed_part or "unknown", detail=first.health.reason))
