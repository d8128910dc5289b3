"""queue_eviction.py (issue 27): Kueue preempting or evicting a generation's pod group is the queue's
decision, not the job's failure: neither `failures` nor `podLosses` counts it, no backoff, no final
save request (the workers save on SIGTERM), and the next generation queues again and runs once
admitted; a generation change (a resize, a grow-back) leaves the job waiting for admission only until
the queue admits the new group.

Driven through the in-memory world (op_world: deciding twice gives the same actions, never two
generations at once); the real Kueue flow is tests/operator/cluster/test_op_e2e_kueue.py."""

from __future__ import annotations

from typing import Any

import pytest
from op_world import SETTINGS, World, fixed_spec, tpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import EmitEvent, RequestFinalSave
from resilax_operator.builders import GenerationPlan, JobRef, build_pods
from resilax_operator.observed.snapshot import parse_pod
from resilax_operator.policies import queue_eviction
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec

GATE = "kueue.x-k8s.io/admission"
PREEMPTED = ("WorkloadEvicted: Preempted to accommodate a workload (UID: 7f3c, JobUID: 91ab) due to "
             "prioritization in the ClusterQueue")


def _pod(conditions: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"name": "llama-g1-s0-h0", "labels": {api.LABEL_GENERATION: "1", api.LABEL_SLICE: "0",
                                                              api.LABEL_HOST: "0"}},
            "spec": {"containers": [{"name": "trainer"}]},
            "status": {"phase": "Running", "conditions": conditions}}


@pytest.mark.parametrize(("conditions", "expected"), [
    ([{"type": "TerminationTarget", "status": "True", "reason": "WorkloadEvicted",
       "message": "Preempted to accommodate a workload"}], "WorkloadEvicted: Preempted to accommodate a workload"),
    ([{"type": "TerminationTarget", "status": "True", "reason": "NotAdmitted"}], "NotAdmitted"),
    ([{"type": "TerminationTarget", "status": "False", "reason": "WorkloadEvicted"}], None),
    ([{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}], None),
    ([], None),
], ids=["kueue-preempted", "kueue-no-message", "condition-false", "scheduler-disruption", "none"])
def test_parse_pod_reads_kueues_stop_condition(conditions: list[dict[str, Any]], expected: str | None) -> None:
    pod = parse_pod(_pod(conditions))
    assert pod is not None and pod.queue_stop == expected


def queued(spec: dict[str, Any], *pools: list[Any]) -> World:
    """A job with a Kueue queue, admitted and running (its pods are created gated, then admitted)."""
    w = World.make(spec, *pools)
    w.job = JobRef("llama", "ml", "uid-1", queue="team-a")
    w.gates = (GATE,)
    w.settle()
    assert api.WAITING_FOR_ADMISSION.name == w.status.condition(api.COND_READY).reason  # type: ignore[union-attr]
    w.admit()
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING, w.status
    return w


def test_a_preempted_pod_group_is_not_a_failure_and_the_next_generation_queues_again() -> None:
    w = queued(fixed_spec(2), tpu_pool("pool-a", 4), tpu_pool("pool-b", 4))
    before = w.status
    w.queue_evict(PREEMPTED)
    w.exit_workers(75)  # the workers' SIGTERM save: they agree on a step, commit it and exit 75
    actions = w.step()
    t = w.status.transition
    assert t is not None and t.kind == st.QUEUE_EVICTION and t.not_before is None and t.save_request_id is None
    assert not any(isinstance(a, RequestFinalSave) for a in actions)  # Kueue's SIGTERM already asks for it
    assert w.status.failures == before.failures == 0 and w.status.pod_losses == before.pod_losses == 0
    event = next(a for a in actions if isinstance(a, EmitEvent) and a.reason == api.QUEUE_EVICTED.name)
    assert event.type == "Normal" and event.message == (
        "the queue (Kueue) stopped generation 1, pod group llama-g1 (" + PREEMPTED + "): not a failure; the "
        "workers save on SIGTERM and the next generation queues again")
    # The next generation at once (no backoff), held by Kueue's gates while the preemptor runs.
    w.settle()
    assert w.status.generation == 2 and w.status.transition is None
    reason = w.status.condition(api.COND_READY)
    assert reason is not None and reason.reason == api.WAITING_FOR_ADMISSION.name, reason
    w.advance(SETTINGS.schedule_timeout_seconds * 10)  # however long the queue holds it: no timeout, no replan
    w.settle()
    assert w.status.generation == 2 and w.status.failures == 0 and w.status.pod_losses == 0
    w.admit()
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.created == [1, 2]


def test_preempted_again_and_again_never_backs_off_nor_fails() -> None:
    """More evictions in a row than max_pod_losses (the limit of pod-level losses): still no count."""
    w = queued(fixed_spec(1), tpu_pool("pool-a", 4))
    for _ in range(SETTINGS.max_pod_losses + 2):
        w.queue_evict(PREEMPTED)
        w.exit_workers(75)
        w.settle()
        ready = w.status.condition(api.COND_READY)
        assert w.status.transition is None and ready is not None and ready.reason == api.WAITING_FOR_ADMISSION.name
        w.admit()
        w.settle()
        assert w.status.phase == api.PHASE_RUNNING
    assert w.status.failures == 0 and w.status.pod_losses == 0
    assert w.status.generation == SETTINGS.max_pod_losses + 3
    assert api.POD_LOSS_BACKOFF.name not in w.reasons() and api.BACKOFF.name not in w.reasons()


def test_a_pod_deleted_without_the_queues_condition_is_still_a_pod_loss() -> None:
    """Only Kueue's own mark makes a deletion the queue's decision."""
    w = queued(fixed_spec(1), tpu_pool("pool-a", 4))
    w.exit_workers(75)
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.WORKER_STOPPED
    assert w.status.pod_losses == 1


def test_the_check_names_the_first_stopped_worker() -> None:
    w = queued(fixed_spec(1), tpu_pool("pool-a", 4))
    assert queue_eviction.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS) is None
    w.queue_evict("WorkloadEvicted: Preempted")
    finding = queue_eviction.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    assert finding is not None and finding.kind == st.QUEUE_EVICTION and not finding.failure


@pytest.mark.parametrize("change", ["grow-back", "resize"])
def test_a_new_generation_waits_for_admission_only_until_the_queue_admits_it(change: str) -> None:
    """Each generation is its own pod group (Kueue's Workload per generation: a group's pod count and
    pod sets are fixed, so a generation change cannot be expressed in one group). After a grow-back or a
    resize the new group is held by the gates (WaitingForAdmission) and, once Kueue admits it, the very
    next reconcile records the admission and moves on: the job is not left queued."""
    pools = [tpu_pool("pool-a", 4), tpu_pool("pool-b", 4)]
    spec = fixed_spec(2) if change == "resize" else {**fixed_spec(2), "elastic": {
        "minCount": 1, "maxCount": 3, "topologies": ["4x4"], "growBack": True}}
    w = queued(spec, *pools)
    if change == "resize":
        w.spec["slices"]["count"] = 1
    else:
        w.nodes.update({n.name: n for n in tpu_pool("pool-c", 4)})
        w.advance(SETTINGS.grow_back_settle_seconds + 1)
    w.step()
    assert w.status.transition is not None and w.status.transition.kind in (st.GROW_BACK, st.RESIZE)
    w.exit_workers(75)
    w.settle()
    assert w.status.generation == 2 and w.status.shape == Shape("4x4", 1 if change == "resize" else 3)
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.WAITING_FOR_ADMISSION.name and "llama-g2" in ready.message
    assert w.status.admitted_time is None
    w.admit()
    w.step()  # one reconcile after the gates went
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason != api.WAITING_FOR_ADMISSION.name, ready
    assert w.status.admitted_time == st.truncate(w.now)
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING and w.status.failures == 0 and w.status.pod_losses == 0


def test_every_worker_of_a_queued_generation_marks_its_group_not_retriable() -> None:
    """So Kueue finishes a generation's Workload (and frees its quota) once its pods ended, instead of
    waiting for replacement pods that the operator never creates in that group."""
    spec = validate_spec(fixed_spec(2))
    pods = build_pods(JobRef("llama", "ml", "u", queue="team-a"), spec,
                      GenerationPlan(3, Shape("4x4", 2), ("pool-a", "pool-b")), SETTINGS, coordinator_ip=None)
    assert len(pods) == 8
    for m in pods:
        assert m["metadata"]["annotations"][api.KUEUE_RETRIABLE_ANNOTATION] == "false"
        assert m["metadata"]["labels"][api.KUEUE_POD_GROUP_LABEL] == "llama-g3"
    plain = build_pods(JobRef("llama", "ml", "u"), spec, GenerationPlan(3, Shape("4x4", 2), ("pool-a", "pool-b")),
                       SETTINGS, coordinator_ip="10.0.0.1")
    assert all(api.KUEUE_RETRIABLE_ANNOTATION not in m["metadata"].get("annotations", {}) for m in plain)
