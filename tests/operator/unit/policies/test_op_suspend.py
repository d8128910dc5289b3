"""suspend.py: `spec.suspend: true` takes a final save and removes every worker (phase Suspended);
false again starts a generation that restores the newest step (issue 18, item 3).

Driven through the in-memory world (op_world: deciding twice gives the same actions, never two
generations at once) and the operator-restart driver (op_restart)."""

from __future__ import annotations

import pytest
from op_restart import KEEP, Driver
from op_samples import good_spec
from op_world import SETTINGS, World, four_pools, running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import CreateGeneration, DeleteGeneration, RequestFinalSave
from resilax_operator.observed.snapshot import SaveOutcome
from resilax_operator.policies import suspend
from resilax_operator.validation import validate_spec


def condition(w: World, type_: str) -> tuple[str, str, str]:
    c = w.status.condition(type_)
    assert c is not None, type_
    return c.status, c.reason, c.message


def test_suspend_saves_removes_the_workers_and_resume_restores_the_newest_step() -> None:
    w = running_world()
    w.spec["suspend"] = True
    actions = w.step()
    save = next(a for a in actions if isinstance(a, RequestFinalSave))
    assert save.reason == "preemption" and save.generation == 1 and len(save.pods) == 16
    assert not any(isinstance(a, DeleteGeneration) for a in actions)
    assert w.status.phase == api.PHASE_SAVING and w.status.transition is not None
    assert w.status.transition.kind == st.SUSPEND
    assert condition(w, api.COND_READY)[1] == api.SUSPENDING.name
    # The workers commit step 4200 and exit 75; the generation goes.
    w.outcomes.append(SaveOutcome(save.request_id, step=4200, committed=True))
    w.exit_workers(75)
    w.settle()
    assert not w.pods and w.services == set() and w.created == [1]
    assert w.status.phase == api.PHASE_SUSPENDED and w.status.generation == 1
    assert condition(w, api.COND_SUSPENDED) == (
        "True", api.SUSPENDED.name, "spec.suspend is true: no workers; false again starts a generation that "
        "restores the newest committed step (the last the operator saw: 4200)")
    assert condition(w, api.COND_READY)[:2] == ("False", api.SUSPENDED.name)
    assert w.reasons() == [api.GENERATION_CREATED.name, api.WORKERS_RUNNING.name, api.SUSPENDING.name,
                           api.FINAL_SAVE_DONE.name, api.SUSPENDED.name]
    # Suspended for as long as it takes: nothing is created, nothing more is said.
    w.advance(3600)
    w.settle()
    assert not w.pods and w.status.phase == api.PHASE_SUSPENDED and w.reasons()[-1] == api.SUSPENDED.name
    assert len(w.reasons()) == 5
    # Resume: a new generation restores the newest step (the final save), the job runs again.
    w.spec["suspend"] = False
    actions = w.step()
    assert any(isinstance(a, CreateGeneration) and a.generation == 2 for a in actions)
    assert w.status.restore_step == "latest" and w.status.transition is None
    assert condition(w, api.COND_SUSPENDED) == (
        "False", api.RESUMED.name, "spec.suspend is false: generation 2 restores the newest committed step")
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.status.generation == 2 and w.status.failures == 0
    assert w.reasons()[-3:] == [api.GENERATION_CREATED.name, api.RESUMED.name, api.WORKERS_RUNNING.name]


def test_suspended_from_the_start_creates_nothing_until_resumed() -> None:
    raw = good_spec()
    raw["suspend"] = True
    raw["checkpoint"]["restore"]["step"] = 1200
    w = World.make(raw, *four_pools())
    w.settle()
    assert not w.pods and w.status.generation == 0 and w.status.phase == api.PHASE_SUSPENDED
    assert condition(w, api.COND_SUSPENDED)[2].endswith("(the last the operator saw: none)")
    w.spec["suspend"] = False
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.status.generation == 1 and w.status.restarts == 0
    assert w.status.restore_step == "1200"  # the first generation restores what the spec says
    assert condition(w, api.COND_SUSPENDED) == ("False", api.RESUMED.name,
                                                "spec.suspend is false: generation 1 restores step 1200")


def test_without_final_save_on_preemption_suspend_stops_without_a_save() -> None:
    raw = good_spec()
    raw["checkpoint"]["finalSave"]["onPreemption"] = False
    w = running_world(raw)
    w.spec["suspend"] = True
    actions = w.step()
    assert not any(isinstance(a, RequestFinalSave) for a in actions)
    assert w.status.transition is not None and w.status.transition.save_request_id is None
    w.exit_workers(75)
    w.settle()
    assert not w.pods and w.status.phase == api.PHASE_SUSPENDED


def test_suspend_while_a_failure_backs_off_holds_and_resume_waits_out_nothing_more() -> None:
    w = running_world()
    w.exit_workers(1, names=[w.gen_pods()[0].name])
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.WORKER_FAILURE
    w.spec["suspend"] = True
    w.settle()
    assert not w.pods and w.status.phase == api.PHASE_SUSPENDED
    w.advance(60)
    w.spec["suspend"] = False
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.status.generation == 2


def test_check_table() -> None:
    w = running_world()
    spec = validate_spec(w.spec)
    assert suspend.check(spec, w.observed(), w.status, SETTINGS) is None
    w.spec["suspend"] = True
    finding = suspend.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    assert finding is not None and finding.kind == st.SUSPEND and finding.event_type == "Normal"
    assert finding.message == "spec.suspend is true: saving and stopping generation 1"


def suspend_flow(d: Driver) -> None:
    d.tick(6)
    d.w.spec["suspend"] = True
    d.tick(3)
    d.w.exit_workers(75, generation=d.w.status.generation)
    d.tick(6)
    d.w.spec["suspend"] = False
    d.tick(8)


@pytest.mark.parametrize("keep", list(KEEP.values()), ids=list(KEEP))
def test_operator_dies_at_every_step_of_a_suspend_and_resume(keep: int) -> None:
    clean = Driver(None, 0)
    suspend_flow(clean)
    end = (clean.w.status.phase, clean.w.status.generation, clean.w.status.failures, len(clean.w.gen_pods()))
    assert end == (api.PHASE_RUNNING, 2, 0, 8)
    for crash_at in range(clean.n):
        d = Driver(crash_at, keep)
        suspend_flow(d)
        got = (d.w.status.phase, d.w.status.generation, d.w.status.failures, len(d.w.gen_pods()))
        assert got == end, f"crash at decision {crash_at}"
