"""Node loss: a node hosting a worker stopped being Ready (or was deleted).

Within `recovery.nodeLossGraceSeconds` of the node going down the job waits (Degraded=True,
NodeNotReady): a node that comes back costs nothing, and the workers' failures meanwhile are the
node's doing, not theirs. Past the grace (at once for a deleted node) the generation is replaced
(transition NodeLoss, no final save: it would be a collective with a dead peer). Pods on a down or
gone node are force-deleted, as no kubelet will ever confirm them; the surviving workers get a short
grace (`SURVIVOR_GRACE_SECONDS`) instead of their full one.

| node of a worker                   | decision                                             |
|------------------------------------|------------------------------------------------------|
| deleted                            | NodeLoss now                                         |
| NotReady/Unknown ≥ grace           | NodeLoss                                             |
| NotReady/Unknown < grace           | Degraded NodeNotReady, look again in POLL_SECONDS    |
| Ready with the unreachable taint   | counts as down since its Ready transition            |
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Final

from .. import api
from .. import status as st
from ..actions import POLL_SECONDS, Action, RequeueAfter, status_change
from ..observed import Observed, ObservedPod
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus
from . import Finding

#: Grace period of the surviving workers of a generation that lost a node. Their final save is a
#: collective with a dead peer and cannot finish, so the pod's full grace (finalSave.timeoutSeconds
#: + margin) only delays the next generation; they still get SIGTERM and a few seconds.
SURVIVOR_GRACE_SECONDS: Final = 5


def check_lost(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Finding | None:
    """A node hosting a worker of the current generation is gone, or down for longer than the grace."""
    now, g = observed.now, s.generation
    grace = timedelta(seconds=spec.recovery.node_loss_grace_seconds)
    for p in observed.pods_of(g):
        node = observed.node(p.node_name)
        if p.node_name and node is None:
            return Finding(st.NODE_LOSS, api.NODE_LOST.name, f"node {p.node_name} hosting generation {g} is gone")
        since = node.down_since(now) if node is not None else None
        if node is not None and since is not None and now - since >= grace:
            return Finding(st.NODE_LOSS, api.NODE_LOST.name, api.NODE_LOST.format(
                node=node.name, generation=g, seconds=int((now - since).total_seconds()),
                grace=spec.recovery.node_loss_grace_seconds))
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


def pods_to_force(observed: Observed, pods: Iterable[ObservedPod], settings: OperatorSettings) -> tuple[str, ...]:
    """Pods no kubelet will confirm: on a node that is down or gone, or Terminating far past their grace
    (`stuckTerminatingSeconds`)."""
    out = []
    for p in pods:
        node = observed.node(p.node_name)
        if p.node_name and (node is None or node.down_since(observed.now) is not None):
            out.append(p.name)
        elif p.deletion_timestamp is not None:
            grace = p.deletion_grace_seconds or 0
            if observed.now >= p.deletion_timestamp + timedelta(seconds=grace + settings.stuck_terminating_seconds):
                out.append(p.name)
    return tuple(sorted(out))
