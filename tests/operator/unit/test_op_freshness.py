"""policies/freshness.py: the checkpoint freshness annotations on the JAXJob and its current workers.

A table of single decisions (the status, the trainer's report, what the job and its pods carry) with
what must be published; then flows through the in-memory world (op_world: deciding twice gives the
same actions at every step) that count the writes: one per object per newly committed step, none
from time or the trainer's progress alone."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest
from op_world import World, running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import PublishFreshness
from resilax_operator.builders import JobRef
from resilax_operator.observed.snapshot import Observed, ObservedPod, TrainerReport
from resilax_operator.policies import freshness
from resilax_operator.status import CheckpointInfo, JobStatus

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
TIME, STEP, TIER, RISK = (api.ANNOTATION_LAST_CHECKPOINT_TIME, api.ANNOTATION_LAST_CHECKPOINT_STEP,
                          api.ANNOTATION_LAST_CHECKPOINT_TIER, api.ANNOTATION_STEPS_AT_RISK)
CHECKPOINT_100 = CheckpointInfo(100, T0)
COMMIT_100 = {TIME: "2026-01-01T12:00:00Z", STEP: "100", TIER: "persistent"}


def observed(*, checkpoint: CheckpointInfo | None = CHECKPOINT_100, trainer_step: int | None = 130,
             trainer_generation: int = 1, job: dict[str, str] | None = None,
             pods: dict[str, dict[str, str]] | None = None, **pod_changes: object) -> tuple[Observed, JobStatus]:
    s = JobStatus(phase=api.PHASE_RUNNING, generation=1, checkpoint=checkpoint)
    names = ["llama-g1-s0-h0", "llama-g1-s0-h1"]
    made = tuple(replace(ObservedPod(n, 1, 0, i, phase="Running"),
                         freshness=tuple(sorted((pods or {}).get(n, {}).items())), **pod_changes)
                 for i, n in enumerate(names))
    trainer = None if trainer_step is None else TrainerReport(trainer_generation, step=trainer_step)
    return Observed(now=T0, job=JobRef("llama", "ml", "uid-1"), status=s, pods=made, trainer=trainer,
                    freshness=tuple(sorted((job or {}).items()))), s


def pods_of(action: PublishFreshness | None) -> dict[str, dict[str, str | None]]:
    return {} if action is None else {name: dict(notes) for name, notes in action.pods}


@pytest.mark.parametrize(("case", "kwargs", "job", "pod_notes"), [
    ("a new commit: the job and every worker get the four values, steps at risk = 130 - 100",
     {}, {**COMMIT_100, RISK: "30"}, {**COMMIT_100, RISK: "30"}),
    ("the trainer behind the commit (its report is older): steps at risk 0, never negative",
     {"trainer_step": 90}, {**COMMIT_100, RISK: "0"}, {**COMMIT_100, RISK: "0"}),
    ("the trainer's step unknown: steps at risk left out",
     {"trainer_step": None}, COMMIT_100, COMMIT_100),
    ("a report of the previous generation's trainer does not count",
     {"trainer_generation": 0}, COMMIT_100, COMMIT_100),
    ("the local tier's commit names its tier",
     {"checkpoint": CheckpointInfo(100, T0, True, "local")}, {**COMMIT_100, TIER: "local", RISK: "30"},
     {**COMMIT_100, TIER: "local", RISK: "30"}),
])
def test_a_new_commit_is_published_everywhere(case: str, kwargs: dict[str, object], job: dict[str, str],
                                              pod_notes: dict[str, str]) -> None:
    o, s = observed(**kwargs)  # type: ignore[arg-type]
    action = freshness.decide(o, s)
    assert action is not None, case
    assert {k: v for k, v in action.job if v is not None} == job, case
    assert pods_of(action) == {"llama-g1-s0-h0": pod_notes, "llama-g1-s0-h1": pod_notes}, case


def test_nothing_committed_publishes_nothing() -> None:
    assert freshness.decide(*observed(checkpoint=None)) is None
    assert freshness.decide(*observed(checkpoint=CheckpointInfo(100, T0, committed=False))) is None


def test_the_workers_copy_the_jobs_values_for_the_same_commit() -> None:
    """The trainer went on (step 170), but the job already names the commit: the new worker gets the
    job's steps at risk (30, fixed at the commit), the job is not written again."""
    job = {**COMMIT_100, RISK: "30"}
    o, s = observed(trainer_step=170, job=job, pods={"llama-g1-s0-h0": job})
    action = freshness.decide(o, s)
    assert action is not None and action.job == ()
    assert pods_of(action) == {"llama-g1-s0-h1": job}


def test_everything_up_to_date_writes_nothing_whatever_the_trainer_does() -> None:
    job = {**COMMIT_100, RISK: "30"}
    for step in (100, 130, 5000):
        o, s = observed(trainer_step=step, job=job, pods=dict.fromkeys(("llama-g1-s0-h0", "llama-g1-s0-h1"), job))
        assert freshness.decide(o, s) is None


def test_a_newer_commit_replaces_the_old_values_and_drops_a_stale_steps_at_risk() -> None:
    old = {**COMMIT_100, RISK: "30"}
    o, s = observed(checkpoint=CheckpointInfo(200, T0.replace(minute=5)), trainer_step=None, job=old,
                    pods=dict.fromkeys(("llama-g1-s0-h0", "llama-g1-s0-h1"), old))
    action = freshness.decide(o, s)
    assert action is not None
    assert dict(action.job) == {TIME: "2026-01-01T12:05:00Z", STEP: "200", RISK: None}  # only what differs
    assert pods_of(action)["llama-g1-s0-h0"] == dict(action.job)


def test_workers_being_deleted_are_left_alone_finished_ones_are_not() -> None:
    o, s = observed(deletion_timestamp=T0)
    action = freshness.decide(o, s)
    assert action is not None and action.pods == ()
    o, s = observed(phase="Succeeded")  # the final commit, seen as the workers finish: they stay until the job goes
    assert set(pods_of(freshness.decide(o, s))) == {"llama-g1-s0-h0", "llama-g1-s0-h1"}


# ---- flows through the in-memory world: the write budget


def publish_count(w: World) -> tuple[int, int]:
    """(job writes, pod writes) published so far."""
    return sum(1 for a in w.published if a.job), sum(len(a.pods) for a in w.published)


def test_one_write_per_object_per_commit_and_none_from_time_alone() -> None:
    w = running_world()
    hosts = len(w.gen_pods())
    assert w.published == []  # nothing committed yet
    w.checkpoint = CheckpointInfo(100, w.now)
    w.trainer = TrainerReport(w.status.generation, step=104)
    w.step()
    assert publish_count(w) == (1, hosts)
    assert w.freshness == {TIME: st.format_time(w.now), STEP: "100", TIER: "persistent", RISK: "4"}
    for p in w.gen_pods():
        assert dict(p.freshness) == w.freshness
    for step in range(105, 140, 5):  # the trainer goes on, time passes: no write
        w.trainer = TrainerReport(w.status.generation, step=step)
        w.advance(5)
        w.step()
    assert publish_count(w) == (1, hosts)
    w.checkpoint = CheckpointInfo(200, w.now)  # the next commit: one more write per object
    w.trainer = TrainerReport(w.status.generation, step=201)
    w.step()
    w.step()
    assert publish_count(w) == (2, 2 * hosts)
    assert w.freshness[STEP] == "200" and w.freshness[RISK] == "1"


def test_the_next_generations_workers_get_the_jobs_values() -> None:
    w = running_world()
    w.checkpoint = CheckpointInfo(100, w.now)
    w.trainer = TrainerReport(w.status.generation, step=110)
    w.step()
    published = dict(w.freshness)
    w.exit_workers(1)  # a worker failure: a new generation after the backoff, restored from step 100
    for _ in range(20):
        w.settle()
        w.advance(30)
    assert w.status.generation == 2 and w.gen_pods()
    for p in w.gen_pods():
        assert dict(p.freshness) == published  # the commit's values, not recomputed
    assert w.freshness == published
