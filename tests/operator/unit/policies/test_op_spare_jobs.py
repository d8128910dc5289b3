"""policies/spare_jobs.py and spare_jobs.py (issue 39): a lower-priority JAXJob annotated
`resilax.dev/spare-for: <job>` is suspended (its own final save first) when that job would otherwise
wait for capacity, and resumed once the job runs at its declared shape again."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from op_world import World, fixed_spec, tpu_pool
from resilax_operator import api
from resilax_operator.actions import EmitEvent, SuspendSpareJob
from resilax_operator.observed.spare_jobs import (
    ANNOTATION_SPARE_FOR,
    ANNOTATION_SUSPENDED_FOR,
    SpareJob,
    parse_spare_jobs,
    suspended_for_gone,
)
from resilax_operator.policies import spare_jobs
from resilax_operator.validation import validate_spec

RUNNING_DONOR = SpareJob("low", "uid-low", suspended=False, lent=False, phase=api.PHASE_RUNNING)


def waiting_world() -> World:
    """A fixed 1-slice job whose only pool lost a node: it waits with InsufficientCapacity."""
    w = World.make(fixed_spec(1), tpu_pool("pool-a", 4))
    w.settle()
    w.set_node("pool-a-n0", ready="False", ready_since=w.now)
    w.advance(31)
    w.settle()
    assert spare_jobs.waiting_for_capacity(w.status), w.status
    return w


def decide(w: World, *donors: SpareJob, gone: str = "") -> list[Any]:
    observed = replace(w.observed(), spare_jobs=donors, lent_to_gone=gone)
    first = spare_jobs.decide(validate_spec(w.spec), observed, w.status)
    assert first == spare_jobs.decide(validate_spec(w.spec), observed, w.status)
    return first


def test_a_waiting_job_suspends_its_running_spare_job_once() -> None:
    w = waiting_world()
    other = replace(RUNNING_DONOR, name="low-b", uid="uid-b")
    suspend, event = decide(w, RUNNING_DONOR, other)
    assert suspend == SuspendSpareJob("low", "uid-low", True, "llama")  # the first by name, one at a time
    assert isinstance(event, EmitEvent) and event.reason == api.SPARE_JOB_SUSPENDED.name and "low" in event.message
    lent = replace(RUNNING_DONOR, suspended=True, lent=True, phase=api.PHASE_SAVING)
    assert decide(w, lent, other) == []  # its final save and its pods' end free the nodes


@pytest.mark.parametrize("donor", [
    replace(RUNNING_DONOR, suspended=True),  # the user suspended it
    replace(RUNNING_DONOR, phase=api.PHASE_PENDING),  # it holds no workers
], ids=["suspended-by-its-user", "not-running"])
def test_a_job_that_holds_nothing_or_that_its_user_suspended_is_not_taken(donor: SpareJob) -> None:
    assert decide(waiting_world(), donor) == []


def test_a_job_at_its_declared_shape_resumes_what_was_lent_to_it_and_nothing_else() -> None:
    w = World.make(fixed_spec(1), tpu_pool("pool-a", 4))
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING
    lent = SpareJob("low", "uid-low", suspended=True, lent=True, phase=api.PHASE_SUSPENDED)
    theirs = SpareJob("other", "uid-o", suspended=True, lent=False, phase=api.PHASE_SUSPENDED)
    resume, event = decide(w, lent, theirs)
    assert resume == SuspendSpareJob("low", "uid-low", False, "")
    assert event.reason == api.SPARE_JOB_RESUMED.name and "declared shape" in event.message
    assert decide(w, RUNNING_DONOR) == []  # a running spare job is left alone


def test_a_job_lent_to_a_job_that_is_gone_resumes_itself() -> None:
    w = World.make(fixed_spec(1), tpu_pool("pool-a", 4))
    resume, event = decide(w, gone="high")
    assert resume == SuspendSpareJob("llama", "uid-1", False, "") and "high it was lent to is gone" in event.message


def _job(name: str, uid: str, notes: dict[str, str] | None = None, *, namespace: str = "ml", suspend: bool = False,
         phase: str = "Running", deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid, "annotations": notes or {}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"suspend": suspend}, "status": {"phase": phase}}


def test_parse_spare_jobs_keeps_the_live_annotated_jobs_of_the_namespace() -> None:
    me = _job("high", "uid-h")
    jobs = [me,
            _job("b", "uid-b", {ANNOTATION_SPARE_FOR: "high", ANNOTATION_SUSPENDED_FOR: "high"}, suspend=True),
            _job("a", "uid-a", {ANNOTATION_SPARE_FOR: "high"}),
            _job("c", "uid-c", {ANNOTATION_SPARE_FOR: "high"}, namespace="other"),
            _job("d", "uid-d", {ANNOTATION_SPARE_FOR: "someone"}),
            _job("e", "uid-e", {ANNOTATION_SPARE_FOR: "high"}, phase="Succeeded"),
            _job("f", "uid-f", {ANNOTATION_SPARE_FOR: "high"}, deleting=True)]
    assert parse_spare_jobs(me, jobs) == (SpareJob("a", "uid-a", False, False, "Running"),
                                          SpareJob("b", "uid-b", True, True, "Running"))
    lent = _job("b", "uid-b", {ANNOTATION_SUSPENDED_FOR: "high"}, suspend=True)
    assert suspended_for_gone(lent, jobs) == "" and suspended_for_gone(lent, [lent]) == "high"
    assert suspended_for_gone(_job("x", "uid-x"), []) == ""
