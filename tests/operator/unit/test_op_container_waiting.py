"""container_waiting.py: a worker container stuck waiting (an unpullable image, a root image under
runAsNonRoot, a crash-looping sidecar) is named with its fix in the Ready condition and an event, then
fails the job or is replaced as a counted failure after the timeout.

Driven through the in-memory world (op_world), which checks at every decision that deciding twice
gives the same actions; the table calls the policy directly."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from op_world import SETTINGS, running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import DeleteGeneration, EmitEvent, SetStatus
from resilax_operator.observed.snapshot import parse_pod
from resilax_operator.policies import Finding, container_waiting
from resilax_operator.validation import validate_spec

TIMEOUT = SETTINGS.container_waiting_timeout_seconds

WAITING_CASES = {
    # id: (container, reason, seconds after the generation started, outcome, text in the message)
    "unpullable-image-early": ("trainer", "ImagePullBackOff", 30, "waiting", "imagePullSecrets"),
    "unpullable-image-past-timeout": ("trainer", "ImagePullBackOff", TIMEOUT, "failed", "ImagePullBackOff"),
    "err-image-pull-past-timeout": ("trainer", "ErrImagePull", TIMEOUT + 1, "failed", "ErrImagePull"),
    "root-image-early": ("trainer", "CreateContainerConfigError", 10, "waiting", "runAsUser"),
    "root-image-past-timeout": ("trainer", "CreateContainerConfigError", TIMEOUT, "failed", "runAsNonRoot"),
    "crash-looping-sidecar-early": (api.SIDECAR_CONTAINER, "CrashLoopBackOff", 59, "waiting", "--previous"),
    "crash-looping-sidecar-past-timeout": (api.SIDECAR_CONTAINER, "CrashLoopBackOff", TIMEOUT, "failure",
                                           api.SIDECAR_CONTAINER),
    "unknown-reason-past-timeout": ("trainer", "SomethingNew", TIMEOUT, "failure", "kubectl describe pod"),
}


@pytest.mark.parametrize(("container", "reason", "seconds", "outcome", "text"), list(WAITING_CASES.values()),
                         ids=list(WAITING_CASES))
def test_container_waiting_table(container: str, reason: str, seconds: int, outcome: str, text: str) -> None:
    w = running_world()
    pod = w.gen_pods()[3]
    w.pods[pod.name] = replace(pod, phase="Pending", waiting=((container, reason, "back-off pulling"),))
    assert w.status.generation_start_time is not None
    w.now = w.status.generation_start_time + timedelta(seconds=seconds)
    verdict = container_waiting.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    if outcome == "failure":
        assert isinstance(verdict, Finding) and verdict.kind == st.WORKER_FAILURE and verdict.failure
        assert pod.name in verdict.message and reason in verdict.message and text in verdict.message
        return
    assert isinstance(verdict, list)
    status = next(a for a in verdict if isinstance(a, SetStatus)).status
    ready = status.condition(api.COND_READY)
    assert ready is not None and ready.status == "False"
    assert pod.name in ready.message and container in ready.message and reason in ready.message
    assert text in ready.message
    if outcome == "waiting":
        assert ready.reason == api.CONTAINER_WAITING.name and status.phase == api.PHASE_RUNNING
        assert not any(isinstance(a, DeleteGeneration) for a in verdict)
    else:
        assert ready.reason == api.CONTAINER_WAITING_TIMEOUT.name and status.phase == api.PHASE_FAILED
        assert any(isinstance(a, DeleteGeneration) for a in verdict)
        assert any(isinstance(a, EmitEvent) and a.reason == api.CONTAINER_WAITING_TIMEOUT.name for a in verdict)


def test_nothing_waiting_says_nothing() -> None:
    w = running_world()
    assert container_waiting.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS) is None


def test_an_unpullable_image_is_named_once_then_fails_the_job() -> None:
    w = running_world()
    for p in w.gen_pods():
        w.pods[p.name] = replace(p, phase="Pending", waiting=(("trainer", "ImagePullBackOff", "no such image"),))
    w.step()
    w.advance(5)
    w.step()
    assert w.reasons().count(api.CONTAINER_WAITING.name) == 1  # the condition is the memory
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.CONTAINER_WAITING.name and "no such image" in ready.message
    w.advance(TIMEOUT)
    w.settle()
    assert w.status.phase == api.PHASE_FAILED and not w.gen_pods()
    assert api.CONTAINER_WAITING_TIMEOUT.name in w.reasons()


def test_one_event_per_stuck_container_while_the_kubelets_reason_and_message_change() -> None:
    """ErrImagePull and ImagePullBackOff take turns, a crash loop's delay grows: the condition follows
    the kubelet, the event is sent once per pod and container (and again for another container)."""
    w = running_world()
    pod = w.gen_pods()[0]
    for reason, message in (("ErrImagePull", "no such host"), ("ImagePullBackOff", 'Back-off pulling image "x"'),
                            ("ErrImagePull", "no such host")):
        w.pods[pod.name] = replace(pod, phase="Pending", waiting=(("trainer", reason, message),))
        w.step()
        ready = w.status.condition(api.COND_READY)
        assert ready is not None and reason in ready.message and message in ready.message
        w.advance(3)
    assert w.reasons().count(api.CONTAINER_WAITING.name) == 1
    w.pods[pod.name] = replace(pod, phase="Pending", waiting=((api.SIDECAR_CONTAINER, "CrashLoopBackOff", "back-off"),))
    w.step()
    assert w.reasons().count(api.CONTAINER_WAITING.name) == 2


def test_parse_pod_reads_waiting_containers_but_not_starting_ones() -> None:
    raw = {"metadata": {"name": "j-g1-s0-h0", "labels": {api.LABEL_GENERATION: "1", api.LABEL_SLICE: "0",
                                                         api.LABEL_HOST: "0"}},
           "spec": {"containers": [{"name": "trainer"}, {"name": api.SIDECAR_CONTAINER}]},
           "status": {"phase": "Pending",
                      "initContainerStatuses": [{"name": "init", "state": {"waiting": {"reason": "PodInitializing"}}}],
                      "containerStatuses": [
                          {"name": "trainer", "state": {"waiting": {"reason": "ContainerCreating"}}},
                          {"name": api.SIDECAR_CONTAINER, "state": {"waiting": {
                              "reason": "CrashLoopBackOff", "message": "back-off 10s restarting"}}}]}}
    pod = parse_pod(raw)
    assert pod is not None
    assert pod.waiting == ((api.SIDECAR_CONTAINER, "CrashLoopBackOff", "back-off 10s restarting"),)


STARTING_CASES = {
    # id: (reason, seconds since the pod was scheduled, since the generation started, on a node, reported)
    "pulling-or-mounting-within-the-timeout": ("PodInitializing", TIMEOUT - 1, TIMEOUT + 600, True, False),
    "stuck-past-the-timeout": ("PodInitializing", TIMEOUT, TIMEOUT, True, True),
    "container-creating-past-the-timeout": ("ContainerCreating", TIMEOUT + 5, TIMEOUT + 5, True, True),
    "scheduled-late-counts-from-its-scheduling": ("ContainerCreating", 10, TIMEOUT + 600, True, False),
    "not-scheduled-is-not-starting": ("PodInitializing", TIMEOUT + 60, TIMEOUT + 60, False, False),
}


@pytest.mark.parametrize(("reason", "scheduled", "started", "bound", "reported"), list(STARTING_CASES.values()),
                         ids=list(STARTING_CASES))
def test_start_up_states_past_the_timeout_are_reported(reason: str, scheduled: int, started: int, bound: bool,
                                                       reported: bool) -> None:
    """ContainerCreating/PodInitializing (no timeout of the kubelet's: a volume it cannot mount keeps a pod
    there for ever) past the timeout from the pod's scheduling: Ready=False ContainerWaiting naming it and
    the likely causes, the token Secret ensured; never a teardown (a large image may take that long)."""
    from resilax_operator.actions import EnsureTokenSecret

    w = running_world()
    pod = w.gen_pods()[3]
    assert w.status.generation_start_time is not None
    w.now = w.status.generation_start_time + timedelta(seconds=started)
    w.pods[pod.name] = replace(pod, phase="Pending", node_name=pod.node_name if bound else None,
                               starting=((api.SIDECAR_CONTAINER, reason), ("trainer", reason)),
                               scheduled_at=w.now - timedelta(seconds=scheduled))
    verdict = container_waiting.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    if not reported:
        assert verdict is None
        return
    assert isinstance(verdict, list) and isinstance(verdict[-1], EnsureTokenSecret)
    assert not any(isinstance(a, DeleteGeneration) for a in verdict)
    status = next(a for a in verdict if isinstance(a, SetStatus)).status
    ready = status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.CONTAINER_WAITING.name and status.phase == api.PHASE_RUNNING
    assert pod.name in ready.message and reason in ready.message and "FailedMount" in ready.message
    assert [a.reason for a in verdict if isinstance(a, EmitEvent)] == [api.CONTAINER_WAITING.name]
    # the message does not change while it waits (no status write per reconcile), nor is it announced again
    w.status = status
    w.now += timedelta(seconds=30)
    again = container_waiting.check(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    assert isinstance(again, list) and not any(isinstance(a, SetStatus | EmitEvent) for a in again)
