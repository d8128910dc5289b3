"""`kubectl resilax rollback NAME --step N`: roll a running job back to step N.

It makes the edit a user could make by hand, `spec.checkpoint.restore.step: N` (a JSON merge patch);
the operator then saves the current step, and a new generation restores N (policies/rollback.py). The
plugin refuses at once what the operator would refuse, naming the steps there are: a job with no
generation, or a step above the newest committed step (`status.checkpoint.step`); a step the job's
history never saw committed on its current timeline is sent with a warning (retention may have deleted
it, the history keeps the newest 20 per generation: the library's restore is the judge and names the
committed steps if it is not there).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from ..status_fields.history import parse_history
from .client import JobAPI, PluginError


def build_rollback_patch(step: int) -> dict[str, Any]:
    """The JSON merge patch of a rollback to `step`."""
    return {"spec": {"checkpoint": {"restore": {"step": step}}}}


def known_steps(status: Mapping[str, Any]) -> list[int]:
    """The committed steps the job's history saw on its current timeline (pure): each generation's
    checkpoints, less those above a later generation's restored step (a rollback supersedes them)."""
    steps: set[int] = set()
    for entry in parse_history(status.get("history")):
        if entry.restored_step is not None:
            steps = {s for s in steps if s <= entry.restored_step}
        steps.update(entry.checkpoints)
    return sorted(steps)


def plan_rollback(job_name: str, status: Mapping[str, Any], step: int) -> str | None:
    """Whether a rollback of the job with `status` to `step` may be asked (pure): raises PluginError
    naming what there is when it may not; returns a warning to print, or None."""
    if step < 0:
        raise PluginError(f"jaxjob {job_name}: --step must be >= 0, found {step}")
    newest = (status.get("checkpoint") or {}).get("step")
    if not int(status.get("generation") or 0) or newest is None:
        raise PluginError(f"jaxjob {job_name}: no committed step known yet (status.checkpoint is empty): "
                          "nothing to roll back to")
    known = known_steps(status)
    if step > int(newest):
        raise PluginError(f"jaxjob {job_name}: step {step} is above the newest committed step {newest}; "
                          f"committed steps seen on this timeline: {known or [newest]}")
    if step not in known and step != int(newest):
        return (f"warning: jaxjob {job_name}: step {step} is not among the committed steps its history saw on "
                f"this timeline ({known}); if it is not a committed step, the restore refuses it and names them")
    return None


def run_rollback(kube: JobAPI, namespace: str, name: str, step: int) -> str:
    job = kube.get_job(namespace, name)
    warning = plan_rollback(f"{namespace}/{name}", job.get("status") or {}, step)
    if warning:
        print(warning, file=sys.stderr)
    kube.patch_job(namespace, name, build_rollback_patch(step))
    return (f"jaxjob {namespace}/{name}: spec.checkpoint.restore.step={step}; the operator saves the current step "
            f"(kept on its own branch), then a new generation restores step {step} "
            f"(`kubectl resilax timeline {name}` shows it)")
