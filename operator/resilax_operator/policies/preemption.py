"""Preemption: a notice on a node hosting a worker (the GKE impending-termination taint, or the
scheduled-maintenance label) replaces the generation while its workers can still save.

| node of a worker                                   | decision                                  |
|----------------------------------------------------|-------------------------------------------|
| taint cloud.google.com/impending-node-termination  | Preemption (final save if onPreemption)   |
| label cloud.google.com/scheduled-maintenance-time  | Preemption (final save if onPreemption)   |
| none                                               | nothing                                   |

The notice also keeps the node out of the next generation's plan (`ObservedNode.schedulable`). The
final save and the teardown are transition.py's and final_save.py's.
"""

from __future__ import annotations

from .. import api
from .. import status as st
from ..observed import Observed
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus
from . import Finding


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Finding | None:
    """The first worker (by pod name) whose node carries a notice."""
    for p in observed.pods_of(s.generation):
        node = observed.node(p.node_name)
        notice = node.notice() if node is not None else None
        if node is not None and notice is not None:
            return Finding(st.PREEMPTION, api.PREEMPTION_NOTICE.name, api.PREEMPTION_NOTICE.format(
                node=node.name, generation=s.generation, notice=notice))
    return None
