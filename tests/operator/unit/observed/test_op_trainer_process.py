"""observed/trainer_process.py: a supervised trainer's incarnation from its sidecar, which sidecars observed/observe.py
asks (the doorbell, pod 0, every pod while a fault is in view), and the exit codes it gives the pods."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from op_world import SETTINGS, T0, running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.observed.snapshot import parse_pod
from resilax_operator.observed.trainer_process import (
    EXITED,
    RUNNING,
    SIDECAR_START_SECONDS,
    SILENCE_SECONDS,
    TrainerProcess,
    parse_trainer_process,
    pods_to_poll,
    pods_to_poll_again,
    unreachable_workers,
    with_trainer_processes,
)
from resilax_operator.policies import Finding, worker_exit
from resilax_operator.status import InPlace
from resilax_operator.validation import validate_spec


@pytest.mark.parametrize(("state", "expected"), [
    pytest.param({}, None, id="no-supervisor"),
    pytest.param({"trainer_process": None}, None, id="null"),
    pytest.param({"trainer_process": {"incarnation": 1, "generation": 2, "state": "running", "pid": 7,
                                      "started_at": 1767268800.0}},
                 TrainerProcess(1, 2, RUNNING, started_at=datetime(2026, 1, 1, 12, tzinfo=UTC)), id="running"),
    pytest.param({"trainer_process": {"incarnation": 2, "generation": 3, "state": "exited", "exit_code": 1,
                                      "signal": None, "finished_at": 1767268801.5, "reason": "exit"},
                  "assignment": {"generation": 4}},
                 TrainerProcess(2, 3, EXITED, exit_code=1, finished_at=datetime(2026, 1, 1, 12, 0, 1, 500000, UTC),
                                reason="exit", assigned=4), id="exited-with-an-assignment"),
    pytest.param({"trainer_process": {"incarnation": 1, "generation": "2", "state": "running"}}, None,
                 id="generation-not-an-integer"),
    pytest.param({"trainer_process": {"incarnation": 1, "generation": 2, "state": "dancing"}}, None,
                 id="unknown-state"),
])
def test_parse_trainer_process(state: dict[str, Any], expected: TrainerProcess | None) -> None:
    assert parse_trainer_process(state) == expected


def test_proof_of_stop_table() -> None:
    assert TrainerProcess(1, 3, EXITED).proven_stopped_before(4)
    assert not TrainerProcess(1, 3, RUNNING).proven_stopped_before(4)
    assert not TrainerProcess(1, 3, "stopping").proven_stopped_before(4)
    assert TrainerProcess(2, 4, RUNNING).proven_stopped_before(4)  # started only once the old one was gone


def test_parse_pod_reads_the_supervised_annotation_the_trainers_readiness_and_the_uid() -> None:
    raw = {"metadata": {"name": "a", "uid": "u-1", "annotations": {api.ANNOTATION_SUPERVISED: "1"},
                        "labels": {api.LABEL_GENERATION: "1", api.LABEL_SLICE: "0", api.LABEL_HOST: "0"}},
           "spec": {"containers": [{"name": "trainer"}]},
           "status": {"phase": "Running", "containerStatuses": [
               {"name": "trainer", "ready": False, "state": {"running": {"startedAt": "2026-01-01T12:00:00Z"}}}]}}
    p = parse_pod(raw)
    assert p is not None and p.supervised and not p.trainer_ready and p.trainer_running and p.uid == "u-1"
    raw["status"]["containerStatuses"][0]["ready"] = True
    del raw["metadata"]["annotations"]
    p = parse_pod(raw)
    assert p is not None and not p.supervised and p.trainer_ready and not p.trainer_container_ended
    # the trainer container itself ended (its supervisor killed with it): the kubelet's word
    raw["status"]["containerStatuses"][0].update(ready=False, state={"terminated": {"exitCode": 137}})
    p = parse_pod(raw)
    assert p is not None and p.trainer_container_ended and p.exit_code == 137 and not p.trainer_running


def _supervised_world() -> Any:
    w = running_world()
    w.pods = {n: replace(p, supervised=True, trainer_ready=True) for n, p in w.pods.items()}
    return w


def test_a_steady_job_asks_pod_0_only() -> None:
    w = _supervised_world()
    assert pods_to_poll(w.observed()) == ["llama-g1-s0-h0"]


def test_the_doorbell_a_trainer_not_ready_is_asked_and_then_every_pod() -> None:
    w = _supervised_world()
    w.pods["llama-g1-s2-h0"] = replace(w.pods["llama-g1-s2-h0"], trainer_ready=False)
    # a fault is in view: every sidecar answers, so the decision knows which survivors qualify
    assert pods_to_poll(w.observed()) == sorted(w.pods)


def test_an_unsupervised_trainer_not_ready_rings_no_bell() -> None:
    w = running_world()
    w.pods["llama-g1-s2-h0"] = replace(w.pods["llama-g1-s2-h0"], trainer_ready=False)
    assert pods_to_poll(w.observed()) == ["llama-g1-s0-h0"]


def test_a_node_down_puts_the_others_in_view_and_its_own_pod_is_not_asked() -> None:
    w = _supervised_world()
    lost = w.pods["llama-g1-s1-h0"]
    w.nodes[str(lost.node_name)] = replace(w.nodes[str(lost.node_name)], ready="Unknown", ready_since=T0)
    assert pods_to_poll(w.observed()) == sorted(n for n in w.pods if n != lost.name)


def test_an_in_place_restart_asks_every_pod() -> None:
    w = _supervised_world()
    w.status = replace(w.status, in_place=InPlace(2, 1, st.IN_PLACE_STOPPING, T0, T0 + timedelta(seconds=30)))
    assert pods_to_poll(w.observed()) == sorted(w.pods)


def test_a_planned_move_asks_every_pod_even_while_every_trainer_looks_ready() -> None:
    # its in-place decision comes with the final save's outcome, before the kubelet's readiness probe has
    # seen the stopped trainers: asked only on the doorbell, a survivor would go unheard and be replaced
    w = _supervised_world()
    w.status = replace(w.status, transition=st.Transition(st.GROW_BACK, 1, T0, save_request_id="r-1"))
    assert pods_to_poll(w.observed()) == sorted(w.pods)


@pytest.mark.parametrize(("pod0", "again"), [
    pytest.param(TrainerProcess(1, 1, RUNNING), False, id="pod-0-runs"),
    pytest.param(TrainerProcess(1, 1, EXITED, exit_code=1), True, id="pod-0s-trainer-exited"),
    pytest.param(TrainerProcess(1, 1, EXITED, signal=9), True, id="pod-0s-trainer-killed"),
])
def test_an_answer_that_brings_a_fault_into_view_asks_the_others_in_a_second_round(
        pod0: TrainerProcess, again: bool) -> None:
    # the readiness probe has not run since the exit: only pod 0 was asked; its answer says what happened
    w = _supervised_world()
    first = pods_to_poll(w.observed())
    assert first == ["llama-g1-s0-h0"]
    answered = with_trainer_processes(w.observed(), {"llama-g1-s0-h0": pod0})
    assert pods_to_poll_again(answered, first) == (sorted(w.pods)[1:] if again else [])


def test_a_trainer_container_the_kubelet_says_ended_puts_every_pod_in_view() -> None:
    # the kubelet's exit code alone (its readiness not turned yet): every sidecar is asked at once
    w = _supervised_world()
    name = "llama-g1-s1-h1"
    w.pods[name] = replace(w.pods[name], exit_code=137, trainer_running=False, trainer_container_ended=True)
    assert pods_to_poll(w.observed()) == sorted(w.pods)


@pytest.mark.parametrize("gated", [False, True], ids=["waiting-for-a-node", "held-by-a-queue"])
def test_a_worker_no_node_takes_puts_the_bound_ones_in_view(gated: bool) -> None:
    # a capacity wait past shrinkAfterSeconds shrinks in place: the bound workers must have been heard
    w = _supervised_world()
    waiting = "llama-g1-s1-h0"
    w.pods[waiting] = replace(w.pods[waiting], node_name=None, phase="Pending", pod_ip=None, trainer_ready=False,
                              gates=("kueue.x-k8s.io/admission",) if gated else ())
    bound = sorted(n for n in w.pods if n != waiting)
    assert pods_to_poll(w.observed()) == (["llama-g1-s0-h0"] if gated else bound)


def test_exit_codes_come_from_the_incarnation_of_the_pods_own_generation() -> None:
    w = _supervised_world()
    spec = validate_spec(w.spec)
    name = "llama-g1-s3-h0"
    failed = with_trainer_processes(w.observed(), {name: TrainerProcess(1, 1, EXITED, exit_code=1, reason="exit")})
    pod = next(p for p in failed.pods if p.name == name)
    assert pod.exit_code == 1 and not pod.trainer_running
    verdict = worker_exit.check(spec, failed, w.status, SETTINGS)
    assert isinstance(verdict, Finding) and verdict.kind == st.WORKER_FAILURE and name in verdict.message
    assert worker_exit.check(spec, w.observed(), w.status, SETTINGS) is None  # the kubelet saw nothing
    killed = with_trainer_processes(w.observed(), {name: TrainerProcess(1, 1, EXITED, signal=9)})
    assert next(p for p in killed.pods if p.name == name).exit_code == 137
    # A kept pod (generation 2 by its labels) whose generation 1 trainer was stopped: not a failure.
    w.pods[name] = replace(w.pods[name], generation=2)
    old = with_trainer_processes(w.observed(), {name: TrainerProcess(1, 1, EXITED, exit_code=143)})
    assert next(p for p in old.pods if p.name == name).exit_code is None


def test_the_kubelets_code_stays_and_unsupervised_pods_are_untouched() -> None:
    w = running_world()
    name = "llama-g1-s3-h0"
    untouched = with_trainer_processes(w.observed(), {name: TrainerProcess(1, 1, EXITED, exit_code=1)})
    assert next(p for p in untouched.pods if p.name == name).exit_code is None
    w.pods = {n: replace(p, supervised=True) for n, p in w.pods.items()}
    w.pods[name] = replace(w.pods[name], exit_code=70, phase="Failed")  # the supervisor itself died
    kept = with_trainer_processes(w.observed(), {name: TrainerProcess(1, 1, EXITED, exit_code=1)})
    assert next(p for p in kept.pods if p.name == name).exit_code == 70


def test_parse_pod_says_since_when_the_trainer_is_not_ready() -> None:
    raw = {"metadata": {"name": "a", "annotations": {api.ANNOTATION_SUPERVISED: "1"},
                        "labels": {api.LABEL_GENERATION: "1", api.LABEL_SLICE: "0", api.LABEL_HOST: "0"}},
           "spec": {"containers": [{"name": "trainer"}]},
           "status": {"phase": "Running", "conditions": [
               {"type": "Ready", "status": "False", "lastTransitionTime": "2026-01-01T12:00:30Z"}],
               "containerStatuses": [{"name": "trainer", "ready": False,
                                      "state": {"running": {"startedAt": "2026-01-01T12:00:00Z"}}}]}}
    p = parse_pod(raw)
    assert p is not None and p.trainer_not_ready_since == T0 + timedelta(seconds=30)
    raw["status"]["containerStatuses"][0]["state"]["running"]["startedAt"] = "2026-01-01T12:01:00Z"
    p = parse_pod(raw)  # not ready since its start: it never was, this container
    assert p is not None and p.trainer_not_ready_since == T0 + timedelta(seconds=60)
    raw["status"]["containerStatuses"][0]["ready"] = True
    p = parse_pod(raw)
    assert p is not None and p.trainer_not_ready_since is None


def _not_ready(w: Any, names: list[str], since: datetime) -> None:
    for n in names:
        w.pods[n] = replace(w.pods[n], trainer_ready=False, trainer_not_ready_since=since)


EVERY = ["llama-g1-s0-h0", "llama-g1-s1-h0", "llama-g1-s2-h0", "llama-g1-s3-h0"]


@pytest.mark.parametrize(("case", "expected"), [
    # goodput seed 2 of 2026-12-07: every pod's address gone, every sidecar silent, every trainer not ready
    pytest.param("every-pod-silent", EVERY, id="every-pod-silent-past-the-silence"),
    pytest.param("pod-0-silent", ["llama-g1-s0-h0"], id="pod-0s-own"),
    pytest.param("within-the-silence", [], id="within-the-silence"),
    pytest.param("sidecar-starting", [], id="a-young-trainer-whose-sidecar-may-still-be-starting"),
    pytest.param("answered", [], id="its-sidecar-answered"),
    pytest.param("ready", [], id="ready-but-its-sidecar-slow"),
    pytest.param("node-not-ready", ["llama-g1-s0-h0", "llama-g1-s2-h0", "llama-g1-s3-h0"],
                 id="the-node-rules-decide-a-node-not-ready"),
    pytest.param("unsupervised", [], id="unsupervised-the-kubelet-sees-its-exit"),
    pytest.param("deleting", ["llama-g1-s0-h0", "llama-g1-s2-h0", "llama-g1-s3-h0"], id="being-deleted"),
])
def test_unreachable_workers_table(case: str, expected: list[str]) -> None:
    w = _supervised_world()  # its trainers started at T0
    now = T0 + timedelta(seconds=SIDECAR_START_SECONDS + SILENCE_SECONDS)
    since = now - timedelta(seconds=SILENCE_SECONDS)
    silent = list(EVERY)
    _not_ready(w, EVERY, since)
    if case == "pod-0-silent":
        silent = ["llama-g1-s0-h0"]
    elif case == "within-the-silence":
        _not_ready(w, EVERY, since + timedelta(seconds=1))
    elif case == "sidecar-starting":
        w.pods = {n: replace(p, trainer_started_at=since) for n, p in w.pods.items()}
    elif case == "answered":
        silent = []
    elif case == "ready":
        w.pods = {n: replace(p, trainer_ready=True, trainer_not_ready_since=None) for n, p in w.pods.items()}
    elif case == "node-not-ready":
        node = str(w.pods["llama-g1-s1-h0"].node_name)
        w.nodes[node] = replace(w.nodes[node], ready="Unknown", ready_since=T0)
    elif case == "unsupervised":
        w.pods = {n: replace(p, supervised=False) for n, p in w.pods.items()}
    elif case == "deleting":
        w.pods["llama-g1-s1-h0"] = replace(w.pods["llama-g1-s1-h0"], deletion_timestamp=T0)
    observed = replace(w.observed(), now=now, silent_sidecars=tuple(sorted(silent)))
    found = unreachable_workers(observed)
    assert [p.name for p, _ in found] == expected
    assert all(seconds >= SILENCE_SECONDS for _, seconds in found)
