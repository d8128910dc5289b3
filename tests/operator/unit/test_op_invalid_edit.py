"""policies/invalid_edit.py: an invalid edit of a job that has run leaves it running under the last
valid spec (status.lastValidSpec) — node loss, preemption, worker exits and backoff still handled —
with InvalidSpec naming every problem until the spec is fixed; a fixed spec applies as any edit.

Driven through the in-memory world (op_world), which checks at every decision that deciding twice
gives the same actions, that no generation is created while another one's pods exist, and that every
status write is a merge patch of what changed that the API server turns into the decided status."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from op_restart import KEEP, Driver, assert_survives_restarts
from op_samples import good_spec
from op_world import SETTINGS, World, running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import Action, CreateGeneration, SetStatus
from resilax_operator.observed.snapshot import SaveOutcome, Taint
from resilax_operator.spec import Shape


def _edit_invalid(w: World) -> None:
    """An edit with two problems and one valid change (which must not apply while the spec is invalid)."""
    w.spec["slices"]["topology"] = "4x3"
    w.spec["checkpoint"]["storage"] = "s3://bucket/x"
    w.spec["checkpoint"]["every"]["steps"] = 500
    w.spec_generation += 1


def _env(manifest: dict[str, Any], name: str) -> str:
    trainer = manifest["spec"]["containers"][0]
    return str(next(e["value"] for e in trainer["env"] if e["name"] == name))


def _settle(w: World, steps: int = 10) -> list[Action]:
    """`World.settle`, keeping every action decided."""
    out: list[Action] = []
    for _ in range(steps):
        out += w.step()
        w.schedule()
        w.kubelets()
    return out


def _kept(w: World) -> st.Condition:
    cond = w.status.condition(api.COND_INVALID_SPEC)
    assert cond is not None and cond.status == "True" and cond.reason == api.SPEC_INVALID_KEPT.name, cond
    return cond


# ---------------------------------------------------------------- recording the last valid spec

def test_the_last_valid_spec_is_recorded_with_the_write_of_its_generation() -> None:
    w = running_world()
    record = w.status.last_valid_spec
    assert record is not None and record.generation == 1 and record.spec == good_spec()
    assert w.step_besides_goodput() == []  # steady: nothing written
    # a valid edit: one write records its generation and the spec together
    w.spec["checkpoint"]["every"]["steps"] = 2000
    w.spec_generation = 2
    writes = [a for a in w.step() if isinstance(a, SetStatus)]
    assert len(writes) == 1
    assert w.status.observed_generation == 2 and w.status.last_valid_spec == st.SpecRecord(2, w.spec)


def test_a_status_write_carries_the_spec_only_when_it_changed() -> None:
    w = running_world()
    before = w.status
    stored = st.merge_patch({}, st.build_status(before))  # as the API server keeps it: no nulls
    other = st.set_condition(before, api.COND_DEGRADED, True, api.SHRUNK.name, "m", w.now)
    assert "lastValidSpec" not in st.build_status_patch(stored, other)
    edited = replace(before, last_valid_spec=st.SpecRecord(2, {**good_spec(), "suspend": True}))
    assert st.build_status_patch(stored, edited) == {"lastValidSpec": {"generation": 2, "spec": {"suspend": True}}}
    # a member removed from the spec goes from the status's copy too (null in the patch)
    trimmed = {k: v for k, v in good_spec().items() if k != "elastic"}
    patch = st.build_status_patch(stored, replace(before, last_valid_spec=st.SpecRecord(1, trimmed)))
    assert patch == {"lastValidSpec": {"spec": {"elastic": None}}}


def test_nulls_in_the_spec_are_not_kept_so_the_copy_reads_back_equal() -> None:
    spec = good_spec()
    spec["checkpoint"]["local"]["sizeLimit"] = None
    spec["template"]["spec"]["containers"][0]["workingDir"] = None
    w = running_world(spec)
    record = w.status.last_valid_spec
    assert record is not None and "sizeLimit" not in record.spec["checkpoint"]["local"]
    assert "workingDir" not in record.spec["template"]["spec"]["containers"][0]
    assert w.step_besides_goodput() == []  # what was written reads back equal: not written again


# ---------------------------------------------------------------- running on under it

def _node_loss(w: World) -> None:
    w.set_node(w.gen_pods()[0].node_name or "", ready="Unknown", ready_since=w.now - timedelta(seconds=60),
               taints=(Taint(api.UNREACHABLE_TAINT),))


def _preemption(w: World) -> None:
    node = w.gen_pods()[5].node_name or ""
    w.set_node(node, taints=(*w.nodes[node].taints, Taint(api.IMPENDING_TERMINATION_TAINT)))
    w.step()
    save = w.save_requests[-1]
    w.outcomes.append(SaveOutcome(save.request_id, step=4200, committed=True))
    w.exit_workers(75)


def _worker_failure(w: World) -> None:
    w.exit_workers(1, names=[w.gen_pods()[3].name])
    w.step()
    w.advance(11)  # recovery.backoffSeconds: 10


def _worker_stopped(w: World) -> None:
    w.exit_workers(75)  # stopped for rescheduling (a SIGTERM: all agree and exit 75)


FAULTS: dict[str, tuple[Callable[[World], None], str, int]] = {
    # id: (the fault, the transition kind it starts, failures counted)
    "node-loss": (_node_loss, st.NODE_LOSS, 0),
    "preemption": (_preemption, st.PREEMPTION, 0),
    "worker-failure-after-its-backoff": (_worker_failure, st.WORKER_FAILURE, 1),
    "worker-stopped": (_worker_stopped, st.WORKER_STOPPED, 0),
}


@pytest.mark.parametrize(("fault", "kind", "failures"), list(FAULTS.values()), ids=list(FAULTS))
def test_an_invalid_edit_still_recovers_under_the_last_valid_spec(
        fault: Callable[[World], None], kind: str, failures: int) -> None:
    w = running_world()
    _edit_invalid(w)
    w.step()
    message = _kept(w).message
    assert "spec.slices.topology: '4x3'" in message and "spec.checkpoint.storage" in message
    assert "metadata.generation 1" in message
    assert w.status.phase == api.PHASE_RUNNING and w.status.observed_generation == 2
    fault(w)
    actions = w.step()
    assert w.status.transition is not None and w.status.transition.kind == kind
    actions += _settle(w)
    assert w.status.generation == 2 and w.status.phase == api.PHASE_RUNNING, w.status
    assert w.status.restarts == 1 and w.status.failures == failures
    created = [m for a in actions if isinstance(a, CreateGeneration) for m in a.pods]
    assert created and all(m["metadata"]["labels"][api.LABEL_GENERATION] == "2" for m in created)
    # the new generation is the last valid spec's: its checkpoint policy, its topology
    assert {_env(m, "RESILAX_SAVE_EVERY_STEPS") for m in created} == {"1000"}
    assert {_env(m, "RESILAX_CHECKPOINT_DIR") for m in created} == {"gs://bucket/runs/llama"}
    assert w.status.shape is not None and w.status.shape.topology == "4x4"
    # still reported, with one event for the whole time
    assert _kept(w).message == message
    assert w.reasons().count(api.SPEC_INVALID_KEPT.name) == 1
    assert w.status.last_valid_spec == st.SpecRecord(1, good_spec())


def test_all_workers_done_under_an_invalid_edit_succeeds() -> None:
    w = running_world()
    _edit_invalid(w)
    w.exit_workers(0)
    w.step()
    assert w.status.phase == api.PHASE_SUCCEEDED
    _kept(w)


def test_new_problems_are_announced_again_the_same_are_not() -> None:
    w = running_world()
    _edit_invalid(w)
    w.step()
    w.spec_generation += 1  # an edit that keeps the same problems
    w.step()
    assert w.reasons().count(api.SPEC_INVALID_KEPT.name) == 1
    w.spec["recovery"]["maxRestarts"] = -1
    w.spec_generation += 1
    w.step()
    assert w.reasons().count(api.SPEC_INVALID_KEPT.name) == 2
    assert "spec.recovery.maxRestarts" in _kept(w).message
    assert w.events[-1].message == _kept(w).message


def test_a_fixed_spec_applies_as_an_ordinary_edit_would() -> None:
    w = running_world()
    _edit_invalid(w)
    w.step()
    # fixed, and smaller: the running 4 slices no longer fit the bounds: a resize
    w.spec = good_spec()
    w.spec["slices"]["count"] = 2
    w.spec["elastic"]["maxCount"] = 2
    w.spec_generation += 1
    w.step()
    cond = w.status.condition(api.COND_INVALID_SPEC)
    assert cond is not None and cond.status == "False" and cond.reason == api.SPEC_VALID.name
    assert w.status.transition is not None and w.status.transition.kind == st.RESIZE
    assert w.status.last_valid_spec == st.SpecRecord(w.spec_generation, w.spec)
    w.outcomes.append(SaveOutcome(w.save_requests[-1].request_id, step=4200, committed=True))
    w.exit_workers(75)
    w.settle()
    assert w.status.generation == 2 and w.status.shape == Shape("4x4", 2) and w.status.phase == api.PHASE_RUNNING


# ---------------------------------------------------------------- without a usable last valid spec

def test_a_job_that_never_ran_still_fails_until_fixed() -> None:
    w = World.make(good_spec(), *[])
    w.spec["slices"]["topology"] = "4x3"
    w.step()
    assert w.status.phase == api.PHASE_FAILED and w.status.last_valid_spec is None
    cond = w.status.condition(api.COND_INVALID_SPEC)
    assert cond is not None and cond.reason == api.SPEC_INVALID.name


def test_without_a_record_the_running_generation_is_left_alone() -> None:
    """A status written by an operator before lastValidSpec: as before, nothing but InvalidSpec."""
    w = running_world()
    w.status = replace(w.status, last_valid_spec=None)
    _edit_invalid(w)
    w.step()
    _node_loss(w)
    w.advance(600)
    assert [type(a) for a in w.step()] == []
    cond = w.status.condition(api.COND_INVALID_SPEC)
    assert cond is not None and cond.reason == api.SPEC_INVALID.name and w.status.transition is None


def test_a_record_the_operators_settings_now_refuse_is_not_used() -> None:
    spec = good_spec()
    spec["template"]["spec"]["hostNetwork"] = True
    w = running_world()
    w.status = replace(w.status, last_valid_spec=st.SpecRecord(1, spec))  # valid under allowHostAccess only
    _edit_invalid(w)
    w.step()
    cond = w.status.condition(api.COND_INVALID_SPEC)
    assert cond is not None and cond.reason == api.SPEC_INVALID.name
    assert SETTINGS.allow_host_access is False


# ---------------------------------------------------------------- operator restarts

def _invalid_edit_then_node_loss(d: Driver) -> None:
    d.tick(4)
    d.w.spec["checkpoint"]["storage"] = "s3://nope"
    d.w.spec_generation += 1
    d.tick()
    d.w.set_node(d.w.gen_pods()[0].node_name or "", ready="Unknown", ready_since=d.w.now - timedelta(seconds=60))
    d.tick(8)


@pytest.mark.parametrize("keep", list(KEEP.values()), ids=list(KEEP))
def test_invalid_edit_and_node_loss_survive_operator_restarts(keep: int) -> None:
    assert_survives_restarts(_invalid_edit_then_node_loss, keep)
