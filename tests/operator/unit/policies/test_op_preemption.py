"""preemption.py: a notice on a worker's node replaces the generation after a final save.

Driven through the in-memory world (op_world), which checks at every decision that deciding twice
gives the same actions and that no generation is created while another one's pods exist; the
tables call the policy's functions directly."""

from __future__ import annotations

from dataclasses import replace
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
from resilax_operator.capacity import plan_shape
from resilax_operator.observed.snapshot import SaveOutcome, Taint
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

def _epoch(seconds_from_t0: int) -> str:
    return str(int((T0 + timedelta(seconds=seconds_from_t0)).timestamp()))


NOTICE_CASES = {
    # id: (taints added to the first worker's node, labels added, finding?) -- the lead is 600 s here
    "impending-termination-taint": ((Taint(api.IMPENDING_TERMINATION_TAINT, "", "NoSchedule"),), {}, "taint"),
    "maintenance-window-started-taint": ((Taint(api.MAINTENANCE_WINDOW_STARTED_TAINT, "", "NoSchedule"),), {},
                                         "maintenance-window-started"),
    "active-maintenance-ongoing": ((), {api.ACTIVE_MAINTENANCE_LABEL: "ONGOING"}, "ONGOING"),
    "active-maintenance-true": ((), {api.ACTIVE_MAINTENANCE_LABEL: "true"}, "active-node-maintenance=true"),
    "active-maintenance-false": ((), {api.ACTIVE_MAINTENANCE_LABEL: "false"}, None),
    "maintenance-in-the-past": ((), {api.SCHEDULED_MAINTENANCE_LABEL: "1767225600"}, "label"),
    "maintenance-within-the-lead": ((), {api.SCHEDULED_MAINTENANCE_LABEL: _epoch(599)}, "within the lead of 600s"),
    "maintenance-exactly-at-the-lead": ((), {api.SCHEDULED_MAINTENANCE_LABEL: _epoch(600)}, "within the lead"),
    "maintenance-past-the-lead": ((), {api.SCHEDULED_MAINTENANCE_LABEL: _epoch(601)}, None),
    "maintenance-in-days": ((), {api.SCHEDULED_MAINTENANCE_LABEL: _epoch(3 * 86400)}, None),
    "maintenance-as-rfc3339": ((), {api.SCHEDULED_MAINTENANCE_LABEL: "2026-01-01T12:05:00Z"}, "within the lead"),
    "maintenance-not-a-time": ((), {api.SCHEDULED_MAINTENANCE_LABEL: "soon"}, "not a time"),
    "an-unrelated-taint": ((Taint("example.com/other", "", "NoSchedule"),), {}, None),
    "an-unrelated-label": ((), {"example.com/other": "x"}, None),
}


@pytest.mark.parametrize(("taints", "labels", "notice"), list(NOTICE_CASES.values()), ids=list(NOTICE_CASES))
def test_preemption_table(taints: tuple[Taint, ...], labels: dict[str, str], notice: str | None) -> None:
    spec = good_spec()
    spec["recovery"] = {"maintenanceLeadSeconds": 600}
    w = running_world(spec)
    w.now = T0
    node = w.gen_pods()[0].node_name or ""
    w.set_node(node, taints=(*w.nodes[node].taints, *taints), labels={**w.nodes[node].labels, **labels})
    finding = preemption.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    if notice is None:
        assert finding is None
    else:
        assert finding is not None and finding.kind == st.PREEMPTION and finding.reason == api.PREEMPTION_NOTICE.name
        assert node in finding.message and notice in finding.message and not finding.failure


LEAD_CASES = {
    # id: (maintenanceLeadSeconds, final save seconds measured, restart seconds measured, lead)
    "set-in-the-spec": (45, 10, 10, 45),
    "set-to-zero": (0, 10, 10, 0),
    "nothing-measured-yet": (None, None, None, 2 * (300 + preemption.DEFAULT_RESTART_SECONDS)),
    "both-measured": (None, 30, 90, 240),
    "only-the-save-measured": (None, 20, None, 2 * (20 + preemption.DEFAULT_RESTART_SECONDS)),
    "measured-fast-floor": (None, 2, 10, preemption.MIN_MAINTENANCE_LEAD_SECONDS),
}


@pytest.mark.parametrize(("spec_lead", "save", "restart", "lead"), list(LEAD_CASES.values()), ids=list(LEAD_CASES))
def test_maintenance_lead_table(spec_lead: int | None, save: int | None, restart: int | None, lead: int) -> None:
    spec = good_spec()
    if spec_lead is not None:
        spec["recovery"] = {"maintenanceLeadSeconds": spec_lead}
    s = st.JobStatus(final_save_seconds=save, restart_seconds=restart)
    assert preemption.maintenance_lead(validate_spec(spec), s) == timedelta(seconds=lead)


def test_scheduled_maintenance_waits_for_the_lead_then_saves_and_moves() -> None:
    """A node labelled with a maintenance 10 minutes ahead: no save now, a condition and one event that
    say when; the final save and the move start once the time is within the lead (180 s)."""
    spec = good_spec()
    spec["recovery"] = {"maintenanceLeadSeconds": 180}
    w = running_world(spec)
    node = w.gen_pods()[3].node_name or ""
    when = w.now + timedelta(seconds=600)
    w.set_node(node, labels={**w.nodes[node].labels, api.SCHEDULED_MAINTENANCE_LABEL: str(int(when.timestamp()))})
    actions = w.step()
    assert not any(isinstance(a, RequestFinalSave | DeleteGeneration) for a in actions)
    assert w.status.transition is None and w.status.phase == api.PHASE_RUNNING
    cond = w.status.condition(api.COND_MAINTENANCE)
    assert cond is not None and cond.status == "True" and cond.reason == api.MAINTENANCE_SCHEDULED.name
    assert node in cond.message and st.format_time(when - timedelta(seconds=180)) in (cond.message or "")
    assert w.reasons().count(api.MAINTENANCE_SCHEDULED.name) == 1
    w.advance(400)  # 200 s before the maintenance: not yet
    assert not any(isinstance(a, RequestFinalSave) for a in w.step())
    assert w.reasons().count(api.MAINTENANCE_SCHEDULED.name) == 1  # the condition is the memory: no repeat
    w.advance(20)  # 180 s before: the move starts
    save = next(a for a in w.step() if isinstance(a, RequestFinalSave))
    assert save.reason == "preemption" and w.status.transition is not None
    assert w.status.transition.kind == st.PREEMPTION and "within the lead of 180s" in w.status.transition.message
    w.outcomes.append(SaveOutcome(save.request_id, step=4200, committed=True))
    w.exit_workers(75)
    w.settle()
    assert w.status.generation == 2 and w.status.phase == api.PHASE_RUNNING
    assert all(p.node_name != node for p in w.pods.values())  # within its lead, the node is not planned on
    assert w.status.final_save_seconds == 0 and w.status.restart_seconds is not None
    cond = w.status.condition(api.COND_MAINTENANCE)
    assert cond is not None and cond.status == "False" and cond.reason == api.NO_MAINTENANCE.name


def test_a_maintenance_far_ahead_does_not_keep_the_node_out_of_the_plan() -> None:
    """Days ahead the node is planned on as usual (the old behaviour shunned it: a fixed-shape job
    could stall for days)."""
    days = str(int((T0 + timedelta(days=3)).timestamp()))
    pools = four_pools()
    nodes = [replace(n, labels={**n.labels, api.SCHEDULED_MAINTENANCE_LABEL: days}) for pool in pools for n in pool]
    spec = validate_spec(good_spec())
    assert plan_shape(spec, nodes, T0, timedelta(seconds=840)) == plan_shape(spec, [n for p in pools for n in p], T0)
    assert plan_shape(spec, nodes, T0, timedelta(days=4)) is None


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
