"""preemption.py: a notice on a worker's node replaces the generation after a final save.

Driven through the in-memory world (op_world), which checks at every decision that deciding twice
gives the same actions and that no generation is created while another one's pods exist; the
tables call the policy's functions directly."""

from __future__ import annotations

from datetime import timedelta

import pytest
from op_restart import KEEP, Driver, assert_survives_restarts
from op_samples import good_spec
from op_world import SETTINGS, T0, four_pools, running_world, tpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import (
    DeleteGeneration,
    RequestFinalSave,
)
from resilax_operator.observed import SaveOutcome, Taint
from resilax_operator.policies import preemption
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec


def test_preemption_notice_final_save_then_new_generation_without_the_doomed_node() -> None:
    w = running_world()
    doomed = w.gen_pods()[5].node_name
    assert doomed is not None
    w.set_node(doomed, taints=(*w.nodes[doomed].taints, Taint(api.IMPENDING_TERMINATION_TAINT, "", "NoSchedule")))
    actions = w.step()
    save = next(a for a in actions if isinstance(a, RequestFinalSave))
    assert save.reason == "preemption" and save.generation == 1 and len(save.pods) == 16
    assert save.deadline == T0 + timedelta(seconds=300)
    assert not any(isinstance(a, DeleteGeneration) for a in actions)
    assert w.status.phase == api.PHASE_SAVING and w.status.transition is not None
    saving = w.status.condition(api.COND_SAVING)
    assert saving is not None and saving.status == "True"
    # still saving: the request is repeated (idempotent by id), nothing is deleted
    w.advance(5)
    again = w.step()
    assert any(isinstance(a, RequestFinalSave) and a.request_id == save.request_id for a in again)
    # the workers commit and exit 75
    w.outcomes.append(SaveOutcome(save.request_id, step=4200, committed=True))
    w.exit_workers(75)
    actions = w.step()
    assert any(isinstance(a, DeleteGeneration) and a.generation == 1 for a in actions)
    assert w.status.checkpoint is not None and w.status.checkpoint.step == 4200
    assert w.status.phase == api.PHASE_RECOVERING
    w.settle()
    assert w.status.generation == 2 and w.status.phase == api.PHASE_RUNNING
    assert w.status.shape == Shape("4x4", 3) and w.status.restarts == 1 and w.status.failures == 0
    doomed_pool = w.nodes[doomed].pool
    assert doomed_pool not in w.status.pools
    assert all(p.node_name != doomed for p in w.pods.values())
    assert api.FINAL_SAVE_DONE.name in w.reasons()


def test_maintenance_label_is_a_notice_too() -> None:
    w = running_world()
    node = w.gen_pods()[0].node_name or ""
    w.set_node(node, labels={**w.nodes[node].labels, api.SCHEDULED_MAINTENANCE_LABEL: "1767225600"})
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.PREEMPTION


def test_no_final_save_when_on_preemption_is_off() -> None:
    spec = good_spec()
    spec["checkpoint"]["finalSave"]["onPreemption"] = False
    w = running_world(spec)
    node = w.gen_pods()[0].node_name or ""
    w.set_node(node, taints=(Taint(api.IMPENDING_TERMINATION_TAINT),))
    actions = w.step()
    assert not any(isinstance(a, RequestFinalSave) for a in actions)
    delete = next(a for a in actions if isinstance(a, DeleteGeneration))
    assert delete.force_pods == ()  # graceful: SIGTERM makes the workers save anyway


# ---------------------------------------------------------------- the rule, as a table

NOTICE_CASES = {
    # id: (taints added to the first worker's node, labels added, finding?)
    "impending-termination-taint": ((Taint(api.IMPENDING_TERMINATION_TAINT, "", "NoSchedule"),), {}, "taint"),
    "scheduled-maintenance-label": ((), {api.SCHEDULED_MAINTENANCE_LABEL: "1767225600"}, "label"),
    "an-unrelated-taint": ((Taint("example.com/other", "", "NoSchedule"),), {}, None),
    "an-unrelated-label": ((), {"example.com/other": "x"}, None),
}


@pytest.mark.parametrize(("taints", "labels", "notice"), list(NOTICE_CASES.values()), ids=list(NOTICE_CASES))
def test_preemption_table(taints: tuple[Taint, ...], labels: dict[str, str], notice: str | None) -> None:
    w = running_world()
    node = w.gen_pods()[0].node_name or ""
    w.set_node(node, taints=(*w.nodes[node].taints, *taints), labels={**w.nodes[node].labels, **labels})
    finding = preemption.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    if notice is None:
        assert finding is None
    else:
        assert finding is not None and finding.kind == st.PREEMPTION and finding.reason == api.PREEMPTION_NOTICE.name
        assert node in finding.message and notice in finding.message and not finding.failure


def test_a_notice_on_a_node_without_workers_changes_nothing() -> None:
    w = running_world(pools=[*four_pools(), tpu_pool("spare", 4)])
    w.set_node("spare-n0", taints=(Taint(api.IMPENDING_TERMINATION_TAINT),))
    assert preemption.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS) is None
    assert w.step() == []


# ---------------------------------------------------------------- operator restarts


def preemption_flow(d: Driver) -> None:
    d.tick(6)
    node = d.w.gen_pods()[0].node_name or ""
    d.w.set_node(node, taints=(Taint(api.IMPENDING_TERMINATION_TAINT),))
    d.tick(3)
    d.w.exit_workers(75, generation=d.w.status.generation)
    d.tick(10)


@pytest.mark.parametrize("keep", list(KEEP.values()), ids=list(KEEP))
def test_operator_dies_at_every_step_of_a_preemption(keep: int) -> None:
    assert_survives_restarts(preemption_flow, keep)
