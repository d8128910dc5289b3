"""final_save.py: the final save before a planned teardown, and when it counts as done.

Driven through the in-memory world (op_world), which checks at every decision that deciding twice
gives the same actions and that no generation is created while another one's pods exist; the
tables call the policy's functions directly."""

from __future__ import annotations

from datetime import timedelta

import pytest
from op_samples import good_spec
from op_world import SETTINGS, World, running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import (
    DeleteGeneration,
    RequestFinalSave,
)
from resilax_operator.observed.snapshot import SaveOutcome, Taint
from resilax_operator.policies import final_save
from resilax_operator.validation import validate_spec


def test_final_save_timeout_stops_the_generation_anyway() -> None:
    w = running_world()
    node = w.gen_pods()[0].node_name or ""
    w.set_node(node, taints=(Taint(api.IMPENDING_TERMINATION_TAINT),))
    w.step()
    w.advance(299)
    assert not any(isinstance(a, DeleteGeneration) for a in w.step())
    w.advance(1)
    actions = w.step()
    assert any(isinstance(a, DeleteGeneration) for a in actions)
    assert api.FINAL_SAVE_TIMEOUT.name in w.reasons()


# ---------------------------------------------------------------- the rule, as a table

WANTED_CASES = {
    # id: (kind, onPreemption, onResize, wanted?)
    "preemption-on": (st.PREEMPTION, True, False, True),
    "preemption-off": (st.PREEMPTION, False, True, False),
    "resize-on": (st.RESIZE, False, True, True),
    "grow-back-on": (st.GROW_BACK, False, True, True),
    "resize-off": (st.RESIZE, True, False, False),
    "node-loss-never": (st.NODE_LOSS, True, True, False),
    "worker-failure-never": (st.WORKER_FAILURE, True, True, False),
    "worker-stopped-never": (st.WORKER_STOPPED, True, True, False),
    "pod-lost-never": (st.POD_LOST, True, True, False),
}


@pytest.mark.parametrize(("kind", "on_preemption", "on_resize", "wanted"), list(WANTED_CASES.values()),
                         ids=list(WANTED_CASES))
def test_final_save_wanted_table(kind: str, on_preemption: bool, on_resize: bool, wanted: bool) -> None:
    raw = good_spec()
    raw["checkpoint"]["finalSave"].update(onPreemption=on_preemption, onResize=on_resize)
    assert final_save.wanted(validate_spec(raw), kind) == wanted


def _saving_world() -> tuple[World, str]:
    w = running_world()
    node = w.gen_pods()[0].node_name or ""
    w.set_node(node, taints=(Taint(api.IMPENDING_TERMINATION_TAINT),))
    w.step()
    t = w.status.transition
    assert t is not None and t.saving and t.save_request_id is not None
    return w, t.save_request_id


PROGRESS_CASES = {
    # id: (what happens, done?, event reason, event type, detail in the message)
    "no-answer-yet": ("nothing", False, None, None, None),
    "committed": ("committed", True, api.FINAL_SAVE_DONE.name, "Normal", "step 4200 committed"),
    "failed": ("failed", True, api.FINAL_SAVE_DONE.name, "Warning", "error: disk full"),
    "one-failed-another-committed": ("both", True, api.FINAL_SAVE_DONE.name, "Normal", "step 4200 committed"),
    "another-job-request-ignored": ("other-request", False, None, None, None),
    "deadline-passed": ("timeout", True, api.FINAL_SAVE_TIMEOUT.name, "Warning", "300s"),
    "workers-exited": ("exited", True, api.FINAL_SAVE_DONE.name, "Normal", "the workers exited"),
    "a-node-was-lost": ("node-lost", True, api.FINAL_SAVE_DONE.name, "Normal", "a node was lost"),
}


@pytest.mark.parametrize(("happens", "done", "reason", "event_type", "detail"), list(PROGRESS_CASES.values()),
                         ids=list(PROGRESS_CASES))
def test_final_save_progress_table(happens: str, done: bool, reason: str | None, event_type: str | None,
                                   detail: str | None) -> None:
    w, request = _saving_world()
    if happens == "committed":
        w.outcomes.append(SaveOutcome(request, step=4200, committed=True))
    elif happens == "failed":
        w.outcomes.append(SaveOutcome(request, error="disk full"))
    elif happens == "both":
        w.outcomes += [SaveOutcome(request, error="peer gone"), SaveOutcome(request, step=4200, committed=True)]
    elif happens == "other-request":
        w.outcomes.append(SaveOutcome("older-request", step=1, committed=True))
    elif happens == "timeout":
        w.advance(300)
    elif happens == "exited":
        w.exit_workers(75)
    elif happens == "node-lost":
        w.set_node(w.gen_pods()[3].node_name or "", ready="Unknown", ready_since=w.now)
    w.advance(1)
    step = final_save.progress(validate_spec(w.spec), w.observed(), w.status, SETTINGS, w.status)
    if not done:
        assert isinstance(step, list)
        save = next(a for a in step if isinstance(a, RequestFinalSave))
        assert save.request_id == request and save.reason == "preemption" and len(save.pods) == 16
        return
    assert isinstance(step, tuple)
    status, event = step
    t = status.transition
    assert t is not None and t.save_done and not t.saving and t.teardown_since == w.now
    assert (event.reason, event.type) == (reason, event_type) and detail in event.message
    saving = status.condition(api.COND_SAVING)
    assert saving is not None and saving.status == "False"
    if happens in ("committed", "both"):
        assert status.checkpoint is not None and status.checkpoint.step == 4200


def test_a_committed_final_save_lets_running_trainers_stop_by_themselves_first() -> None:
    """After the save, a worker whose trainer still runs is deleted no earlier than teardownSince + the
    wait (it is stopping by itself); one whose trainer exited goes at once."""
    w, request = _saving_world()
    w.outcomes.append(SaveOutcome(request, step=4200, committed=True))
    w.exit_workers(75, names=[p.name for p in w.gen_pods()[:8]])
    w.advance(1)
    delete = next(a for a in w.step() if isinstance(a, DeleteGeneration))
    waits = {d.name: d.not_before for d in delete.pods}
    assert all(waits[p.name] is None for p in w.gen_pods()[:8])
    assert all(waits[p.name] == w.now + timedelta(seconds=15) for p in w.gen_pods()[8:])
    w.kubelets()
    assert [p.name for p in w.gen_pods()] == sorted(waits)[8:]  # the exited ones went; the others stop by themselves
    assert all(p.deletion_timestamp is None for p in w.gen_pods())
    w.settle()
    assert w.status.generation == 1 and len(w.gen_pods()) == 8  # still waiting, also over many decisions
    w.advance(15)
    w.settle()
    assert w.status.generation == 2 and w.status.phase == api.PHASE_RUNNING
