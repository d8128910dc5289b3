"""Node loss: a node hosting a worker stopped being Ready (or was deleted).

Within `recovery.nodeLossGraceSeconds` of the node going down the job waits (Degraded=True,
NodeNotReady): a node that comes back costs nothing, and the workers' failures meanwhile are the
node's doing, not theirs. Past the grace (at once for a deleted node) the generation is replaced
(transition NodeLoss, no final save: it would be a collective with a dead peer). Pods on a down or
gone node are force-deleted, as no kubelet will ever confirm them; the surviving workers get a short
grace (`SURVIVOR_GRACE_SECONDS`) instead of their full one.

A node whose kubelet reports NotReady (Ready=False) while its Lease is live is not down: the kubelet
runs and still manages its pods (`ObservedNode.down_since`). When at least
`settings.node_loss_guard_percent` of the cluster's nodes (and `node_loss_guard_min_nodes`) are down at once, a
control-plane or network blip is likelier than that many node losses: the disruption guard waits
(`check_guard`, Degraded=True NodeLossGuard) and nothing is force-deleted (`pods_to_force`), whatever
the grace; when the nodes come back the generation runs on.

| node of a worker                   | decision                                             |
|------------------------------------|------------------------------------------------------|
| down while the guard holds         | Degraded NodeLossGuard (event once), wait            |
| NotReady (Ready=False), Lease live | not down: nothing                                    |
| deleted                            | NodeLoss now                                         |
| NotReady/Unknown ≥ grace           | NodeLoss                                             |
| NotReady/Unknown, a worker exited 76 (its peer is gone) or 134 (aborted) | NodeLoss at once: the generation is broken already |
| still Ready, a worker exited 76 or 134, the node's Lease missed two renewals (renewTime + leaseDurationSeconds × 0.5; read only then) | down since then: NodeLoss at once, before the node lifecycle controller marks it (the exit is the witness: docs/architecture.md, item 6) |
| NotReady/Unknown < grace           | Degraded NodeNotReady, look again in POLL_SECONDS    |
| Ready with the unreachable taint   | counts as down since its Ready transition            |
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Final

from .. import api
from .. import status as st
from ..actions import POLL_SECONDS, Action, EmitEvent, RequeueAfter, status_change
from ..observed.snapshot import Observed, ObservedPod
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus
from . import Finding

#: Grace period of the surviving workers of a generation that lost a node. Their final save is a
#: collective with a dead peer and cannot finish, so the pod's full grace (finalSave.timeoutSeconds
#: + margin) only delays the next generation; they still get SIGTERM and a few seconds.
SURVIVOR_GRACE_SECONDS: Final = 5


def guard_active(observed: Observed, settings: OperatorSettings) -> tuple[int, int] | None:
    """(nodes down, nodes in all) when the disruption guard holds: at least `node_loss_guard_percent` of
    the cluster's nodes and `node_loss_guard_min_nodes` are down at once; None otherwise."""
    percent = settings.node_loss_guard_percent
    if percent <= 0 or not observed.nodes:
        return None
    down = sum(1 for n in observed.nodes if n.down_since(observed.now) is not None)
    total = len(observed.nodes)
    if down >= max(1, settings.node_loss_guard_min_nodes) and down * 100 >= percent * total:
        return down, total
    return None


def check_guard(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> list[Action] | None:
    """A worker's node is down while the disruption guard holds: wait (Degraded=True NodeLossGuard, an
    event when it starts), whatever the grace; nothing is torn down or force-deleted."""
    for p in observed.pods_of(s.generation):
        node = observed.node(p.node_name)
        if node is not None and node.down_since(observed.now) is not None:
            guard = guard_active(observed, settings)  # counts every node: only when a worker's is down
            if guard is None:
                return None
            message = api.NODE_LOSS_GUARD.format(down=guard[0], total=guard[1], percent=settings.node_loss_guard_percent,
                                                 min_nodes=settings.node_loss_guard_min_nodes, node=node.name,
                                                 generation=s.generation)
            old = s.condition(api.COND_DEGRADED)
            new = st.set_condition(s, api.COND_DEGRADED, True, api.NODE_LOSS_GUARD.name, message, observed.now)
            events = [] if old is not None and old.reason == api.NODE_LOSS_GUARD.name \
                else [EmitEvent("Warning", api.NODE_LOSS_GUARD.name, message)]
            return [*status_change(observed.status, new, *events), RequeueAfter(POLL_SECONDS)]
    return None


def check_lost(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Finding | None:
    """A node hosting a worker of the current generation is gone, or down for longer than the grace."""
    now, g = observed.now, s.generation
    grace = timedelta(seconds=spec.recovery.node_loss_grace_seconds)
    # Workers that exited 76 (a peer process is gone) or 134 (aborted, as JAX's coordination service
    # aborts the survivors): the generation is broken already, so a down node hosting one of its workers
    # is not waited for (the grace spares a generation a node's blip).
    witnesses = sorted((p.name, p.exit_code) for p in observed.pods_of(g) if p.exit_code in api.PEER_LOSS_WITNESS_CODES)
    for p in observed.pods_of(g):
        node = observed.node(p.node_name)
        if p.node_name and node is None:
            return Finding(st.NODE_LOSS, api.NODE_LOST.name, f"node {p.node_name} hosting generation {g} is gone")
        since = node.down_since(now) if node is not None else None
        if node is not None and since is not None and now - since >= grace:
            return Finding(st.NODE_LOSS, api.NODE_LOST.name, api.NODE_LOST.format(
                node=node.name, generation=g, seconds=int((now - since).total_seconds()),
                grace=spec.recovery.node_loss_grace_seconds))
        if node is not None and since is not None and witnesses:
            name, code = witnesses[0]
            why = "stopped because a peer process is gone" if code == api.EXIT_CODE_PEER_LOST else \
                "was aborted (exit 134) as JAX's coordination service aborts a peer of a lost process"
            return Finding(st.NODE_LOSS, api.NODE_LOST.name, api.NODE_LOST.format(
                node=node.name, generation=g, seconds=int((now - since).total_seconds()),
                grace=spec.recovery.node_loss_grace_seconds) + f"; not waiting for the grace: worker {name} {why}")
    return None


def check_not_ready(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> list[Action] | None:
    """A node hosting a worker is down but within its grace: Degraded, and wait for it."""
    for p in observed.pods_of(s.generation):
        node = observed.node(p.node_name)
        if node is not None and node.down_since(observed.now) is not None:
            new = st.set_condition(s, api.COND_DEGRADED, True, api.NODE_NOT_READY.name, api.NODE_NOT_READY.format(
                node=node.name, generation=s.generation, grace=spec.recovery.node_loss_grace_seconds), observed.now)
            return [*status_change(observed.status, new), RequeueAfter(POLL_SECONDS)]
    return None


def pods_on_lost_nodes(observed: Observed, pods: Iterable[ObservedPod], settings: OperatorSettings) -> tuple[str, ...]:
    """Pods on a node that is gone, or down (unless the disruption guard holds: then the node is likelier
    to come back): their processes are lost, sidecars included (a pod merely stuck Terminating is not)."""
    out = []
    for p in pods:
        node = observed.node(p.node_name)
        if p.node_name and (node is None or (node.down_since(observed.now) is not None
                                             and guard_active(observed, settings) is None)):
            out.append(p.name)
    return tuple(sorted(out))


def pods_to_force(observed: Observed, pods: Iterable[ObservedPod], settings: OperatorSettings) -> tuple[str, ...]:
    """Pods no kubelet will confirm: on a lost node (`pods_on_lost_nodes`), or Terminating far past their
    grace (`stuckTerminatingSeconds`)."""
    pods = tuple(pods)
    lost = set(pods_on_lost_nodes(observed, pods, settings))
    out = []
    for p in pods:
        if p.name in lost:
            out.append(p.name)
        elif p.deletion_timestamp is not None:
            grace = p.deletion_grace_seconds or 0
            if observed.now >= p.deletion_timestamp + timedelta(seconds=grace + settings.stuck_terminating_seconds):
                out.append(p.name)
    return tuple(sorted(out))
