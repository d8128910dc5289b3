"""Resize and grow-back: the running generation moves to another shape.

`status.plannedFrom` fingerprints what the generation was planned from (`capacity.fingerprint`:
`<hardware>/<shape bounds>`), so a spec edit is noticed once, also across operator restarts.

| observed                                                             | decision                   |
|----------------------------------------------------------------------|----------------------------|
| spec's hardware changed, or its bounds no longer allow the shape     | Resize (`check_incompatible`, before anything reads the pods with the new spec) |
| spec's bounds changed and capacity fits a larger shape (with capacity Autoscaled: or the declared shape is larger) | Resize |
| spec's bounds changed, no larger shape fits                          | keep the generation        |
| elastic.growBack, settled (growBackSettleSeconds), all Running, a larger shape fits | GrowBack    |

Both ask for a final save when `checkpoint.finalSave.onResize` (final_save.py).
"""

from __future__ import annotations

from datetime import timedelta

from .. import api
from .. import status as st
from ..capacity import fingerprint, plan_shape, plan_target, shape_chips
from ..observed.snapshot import Observed
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus
from . import Finding, preemption


def check_incompatible(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Finding | None:
    """The accelerator or the shape bounds changed so that the running shape is no longer allowed:
    nothing after this check may interpret the running generation with the new spec's geometry."""
    if s.shape is None or s.planned_from == fingerprint(spec):
        return None
    if not _hardware_changed(spec, s) and spec.allows(s.shape):
        return None
    target = plan_shape(spec, observed.nodes, observed.now, preemption.maintenance_lead(spec, s))
    return _finding(st.RESIZE, s, target.shape if target else spec.spec_shape)


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Finding | None:
    """A spec edit or returned capacity allows a larger shape than the running one."""
    now, current = observed.now, s.shape
    if current is None:
        return None
    if s.planned_from != fingerprint(spec):  # with capacity Autoscaled, a larger declared shape even without nodes
        planned = plan_target(spec, observed.nodes, now, preemption.maintenance_lead(spec, s))
        if planned is not None and shape_chips(spec, planned.shape) > shape_chips(spec, current):
            return _finding(st.RESIZE, s, planned.shape)
        return None
    if spec.elastic is None or not spec.elastic.grow_back:
        return None
    started = s.generation_start_time or now
    if now - started < timedelta(seconds=settings.grow_back_settle_seconds):
        return None
    pods = observed.pods_of(s.generation)
    if not (pods and len(pods) == s.hosts and all(p.phase == "Running" for p in pods)):
        return None
    planned = plan_shape(spec, observed.nodes, now, preemption.maintenance_lead(spec, s))
    if planned is not None and shape_chips(spec, planned.shape) > shape_chips(spec, current):
        return _finding(st.GROW_BACK, s, planned.shape)
    return None


def _finding(kind: str, s: JobStatus, new: object) -> Finding:
    reason = api.SPEC_RESIZED if kind == st.RESIZE else api.GROW_BACK
    return Finding(kind, reason.name, reason.format(old=s.shape, new=new), event_type="Normal")


def _hardware_changed(spec: JobSpec, s: JobStatus) -> bool:
    return s.planned_from.split("/")[0] != fingerprint(spec).split("/")[0]
