"""Final save: before a planned teardown the workers write one last checkpoint and stop.

Wanted for a preemption and a suspend (`spec.suspend`: a preemption the user or a queue asks for) when
`checkpoint.finalSave.onPreemption`, for a resize or grow-back when `onResize`, and only while a worker
runs. The request id and the deadline
(`finalSave.timeoutSeconds`) are in the status (`transition.saveRequestId`, `saveDeadline`), so an
operator restart resumes the wait. While it runs:

| observed                                                | decision                                    |
|---------------------------------------------------------|---------------------------------------------|
| no answer, before the deadline, workers alive           | Saving=True; RequestFinalSave (idempotent)  |
| a sidecar's answer: one committed, else a failure      | done: FinalSaveDone (the step joins status) |
| the deadline passed                                     | done: FinalSaveTimeout                      |
| every worker ended or is being deleted                  | done: "the workers exited"                  |
| a worker's node is down or gone                         | done: "a node was lost"                     |

Done sets `transition.saveDone` and `teardownSince` (and, for a committed save, how long it took in
`status.timings.finalSaveSeconds`, which sizes the default maintenance lead); transition.py tears the
generation down.
"""

from __future__ import annotations

import math
from dataclasses import replace

from .. import api
from .. import status as st
from ..actions import POLL_SECONDS, Action, EmitEvent, RequestFinalSave, RequeueAfter, status_change
from ..observed.snapshot import Observed
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import CheckpointInfo, JobStatus
from . import node_loss


def wanted(spec: JobSpec, kind: str) -> bool:
    """Whether a transition of `kind` asks the workers for a final save (if any runs)."""
    on = spec.checkpoint.final_save
    return (kind in (st.PREEMPTION, st.SUSPEND) and on.on_preemption) or (kind in st.RESIZE_KINDS and on.on_resize) \
        or kind == st.ROLLBACK  # always: the current step is kept on its own branch (policies/rollback.py)


def progress(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings,
             base: JobStatus) -> list[Action] | tuple[JobStatus, EmitEvent]:
    """While the save runs: the actions that keep it going (status changes compared with `base`).
    Once it is done: the status that records it, and the Event that announces it."""
    now, t = observed.now, s.transition
    assert t is not None and t.saving
    g = t.generation
    pods = observed.pods_of(g)
    answers = [o for o in observed.save_outcomes if o.request_id == t.save_request_id]
    # All processes agree on one step, so any sidecar's commit is the save's; else the first failure.
    outcome = next((o for o in answers if o.committed and o.error is None), answers[0] if answers else None)
    lost = node_loss.pods_to_force(observed, pods, settings)
    timed_out = t.save_deadline is not None and now >= t.save_deadline
    all_ended = all(p.terminated or p.deletion_timestamp is not None for p in pods)
    if outcome is None and not timed_out and not all_ended and not lost:
        new = st.set_condition(s, api.COND_SAVING, True, api.SAVING.name, api.SAVING.format(
            reason=t.kind, generation=g, deadline=st.format_time(t.save_deadline)), now)
        new = replace(new, phase=api.PHASE_SAVING)
        running = tuple(p.name for p in pods if p.phase == "Running")
        wait = max(1.0, min(POLL_SECONDS, ((t.save_deadline or now) - now).total_seconds()))
        return [*status_change(base, new),
                RequestFinalSave(g, t.save_request_id or "", _reason(t.kind), t.save_deadline or now, running),
                RequeueAfter(wait)]
    if outcome is not None:
        detail = (f"step {outcome.step} committed" if outcome.committed and outcome.error is None
                  else f"error: {outcome.error or 'not committed'}")
        event = EmitEvent("Normal" if outcome.committed else "Warning", api.FINAL_SAVE_DONE.name,
                          api.FINAL_SAVE_DONE.format(generation=g, detail=detail))
    elif timed_out:
        event = EmitEvent("Warning", api.FINAL_SAVE_TIMEOUT.name, api.FINAL_SAVE_TIMEOUT.format(
            generation=g, seconds=spec.checkpoint.final_save.timeout_seconds))
    else:
        event = EmitEvent("Normal", api.FINAL_SAVE_DONE.name, api.FINAL_SAVE_DONE.format(
            generation=g, detail="the workers exited" if all_ended else "a node was lost"))
    checkpoint, took = s.checkpoint, s.final_save_seconds
    if outcome is not None and outcome.committed and outcome.step is not None:
        # the current generation's own step: on the branch the status knows (status_fields/checkpoint.py)
        checkpoint = st.newer_checkpoint(checkpoint, CheckpointInfo(
            outcome.step, st.truncate(now), True, branch=checkpoint.branch if checkpoint else None))
        took = math.ceil((now - t.since).total_seconds())
    done = replace(t, save_done=True, teardown_since=st.truncate(now))
    new = replace(s, transition=done, checkpoint=checkpoint, phase=st.phase_for(done, first=False),
                  final_save_seconds=took)
    new = st.set_condition(new, api.COND_SAVING, False, api.NOT_SAVING.name, api.NOT_SAVING.message, now)
    return new, event


def _reason(kind: str) -> str:
    """The `reason` the sidecar's /v1/save takes."""
    return "preemption" if kind in (st.PREEMPTION, st.SUSPEND) else "resize"
