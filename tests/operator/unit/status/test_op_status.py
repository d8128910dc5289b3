"""The status: wire format round trip, conditions, phases."""

from __future__ import annotations

from datetime import timedelta

from op_world import T0, running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import SetStatus
from resilax_operator.spec import Shape
from resilax_operator.status import CheckpointInfo, InPlace, JobStatus, KeptPod, Transition


def test_round_trip_through_the_wire_format() -> None:
    s = JobStatus(phase=api.PHASE_SAVING, generation=3, shape=Shape("4x4", 2), hosts=8, pools=("a", "b"),
                  restore_step="latest", generation_start_time=T0, workers_created=True, restarts=2, failures=1,
                  planned_from="x/y", observed_generation=4,
                  transition=Transition(st.PREEMPTION, 3, T0, "m", "llama-g3-preemption", T0 + timedelta(seconds=300)),
                  checkpoint=CheckpointInfo(1200, T0, True, "persistent"),
                  worker_pods=("llama-g2-s0-h0", "llama-g3-s0-h1"), in_place_restarts=2,
                  in_place=InPlace(3, 2, st.IN_PLACE_STOPPING, T0, T0 + timedelta(seconds=30),
                                   (KeptPod("llama-g2-s0-h0", "u1", 0, stopped=True),)))
    s = st.set_condition(s, api.COND_SAVING, True, "R", "m", T0)
    assert st.parse_status(st.build_status(s)) == s


def test_pod_names_from_the_status_else_built_for_an_older_status() -> None:
    kept = JobStatus(generation=3, shape=Shape("2x4", 2), hosts=4, worker_pods=("j-g2-s0-h0", "j-g3-s0-h1", "a", "b"))
    assert kept.pod_names("j") == ["j-g2-s0-h0", "j-g3-s0-h1", "a", "b"]
    older = JobStatus(generation=3, shape=Shape("2x4", 2), hosts=4)
    assert older.pod_names("j") == ["j-g3-s0-h0", "j-g3-s0-h1", "j-g3-s1-h0", "j-g3-s1-h1"]


def test_empty_status_parses_to_defaults() -> None:
    assert st.parse_status(None) == JobStatus()
    assert st.parse_status({}) == JobStatus()


def test_merge_patch_removes_a_finished_transition() -> None:
    body = st.build_status(JobStatus(generation=1))
    assert body["transition"] is None and body["checkpoint"] is None


def test_condition_time_changes_only_with_its_status() -> None:
    s = st.set_condition(JobStatus(), api.COND_READY, False, "A", "a", T0)
    later = T0 + timedelta(seconds=10)
    s2 = st.set_condition(s, api.COND_READY, False, "B", "b", later)
    ready = s2.condition(api.COND_READY)
    assert ready is not None and ready.last_transition_time == T0 and ready.reason == "B"
    s3 = st.set_condition(s2, api.COND_READY, True, "C", "c", later)
    ready = s3.condition(api.COND_READY)
    assert ready is not None and ready.last_transition_time == later


def test_conditions_in_a_stable_order() -> None:
    s = st.set_condition(JobStatus(), api.COND_INVALID_SPEC, False, "x", "x", T0)
    s = st.set_condition(s, api.COND_READY, True, "x", "x", T0)
    s = st.set_condition(s, api.COND_DEGRADED, False, "x", "x", T0)
    assert [c.type for c in s.conditions] == [api.COND_READY, api.COND_DEGRADED, api.COND_INVALID_SPEC]


def test_phase_for_transition() -> None:
    saving = Transition(st.RESIZE, 1, T0, save_request_id="r")
    assert st.phase_for(saving, first=False) == api.PHASE_SAVING
    assert st.phase_for(Transition(st.GROW_BACK, 1, T0), first=False) == api.PHASE_RESIZING
    assert st.phase_for(Transition(st.NODE_LOSS, 1, T0), first=False) == api.PHASE_RECOVERING
    assert st.phase_for(None, first=True) == api.PHASE_PENDING


def test_newer_checkpoint() -> None:
    old = CheckpointInfo(100, T0)
    assert st.newer_checkpoint(old, CheckpointInfo(200, T0)) == CheckpointInfo(200, T0)
    assert st.newer_checkpoint(old, CheckpointInfo(50, T0)) == old
    assert st.newer_checkpoint(None, None) is None
    local = CheckpointInfo(100, T0, True, "local")
    assert st.newer_checkpoint(local, old) == old


def test_every_reason_has_a_message() -> None:
    reasons = [v for v in vars(api).values() if isinstance(v, api.Reason)]
    assert len(reasons) >= 20
    for r in reasons:
        assert r.name[0].isupper() and " " not in r.name and r.message


def test_reason_names_are_unique() -> None:
    names = [v.name for v in vars(api).values() if isinstance(v, api.Reason)]
    assert len(names) == len(set(names))


def test_every_condition_carries_the_observed_generation() -> None:
    s = st.set_condition(JobStatus(observed_generation=7), api.COND_READY, True, "R", "m", T0)
    s = st.set_condition(s, api.COND_SAVING, False, "S", "m", T0)
    assert [c["observedGeneration"] for c in st.build_status(s)["conditions"]] == [7, 7]


def test_an_edit_stamps_every_condition_with_its_generation_in_one_write() -> None:
    w = running_world()
    assert {c["observedGeneration"] for c in w.stored["conditions"]} == {1}
    w.spec["checkpoint"]["every"]["steps"] = 2000
    w.spec_generation = 2
    assert len([a for a in w.step() if isinstance(a, SetStatus)]) == 1
    assert w.stored["conditions"] and {c["observedGeneration"] for c in w.stored["conditions"]} == {2}


def test_an_invalid_spec_condition_names_the_generation_it_judged() -> None:
    w = running_world()
    w.spec["slices"]["topology"] = "4x3"
    w.spec_generation = 3
    w.step()
    invalid = next(c for c in w.stored["conditions"] if c["type"] == api.COND_INVALID_SPEC)
    assert invalid["status"] == "True" and invalid["observedGeneration"] == 3, invalid
