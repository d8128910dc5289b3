"""Exact accounting (issue 26, item 5): the sidecars' last words (their termination messages, kept in
the pods' status and, once a pod is gone, in the operator's watch cache) tell the final save and the
trainers' last step the operator could no longer ask for (observed/sidecar.py, indexes.LastWordsIndex,
observe.observe_save_outcomes), and the history's lostSteps follows them."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from op_samples import good_spec
from op_world import running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.observed.indexes import LastWordsIndex
from resilax_operator.observed.observe import observe_save_outcomes
from resilax_operator.observed.sidecar import LastWords, newest_trainer_report, parse_last_words
from resilax_operator.observed.snapshot import RestoreReport, SaveOutcome, TrainerReport
from resilax_operator.settings import OperatorSettings
from resilax_operator.status import CheckpointInfo

OWNER = {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": "llama", "uid": "u1", "controller": True}
FIGURES = {"generation": 1, "step": 44, "step_time": 1044.0, "first_step": 1, "first_step_time": 1000.0}
FINAL = {"id": "resize-abc", "status": "committed", "step": 12, "committed": True, "error": None}


def pod(name: str = "llama-g1-s0-h0", generation: int = 1, words: Any = None, *, where: str = "state",
        container: str = api.SIDECAR_CONTAINER, annotation: str = "op-1=resize-abc", owner: dict | None = None,
        phase: str = "Failed") -> dict[str, Any]:
    """A worker pod whose sidecar ended with `words` as its termination message (a dict: as JSON)."""
    message = words if isinstance(words, str) or words is None else json.dumps(words)
    terminated = {"exitCode": 0, **({"message": message} if message is not None else {})}
    status = {"name": container, "state": {"terminated": terminated}} if where == "state" else {
        "name": container, "state": {"running": {}}, "lastState": {"terminated": terminated}}
    return {"metadata": {"name": name, "namespace": "ml", "ownerReferences": [owner or OWNER],
                         "labels": {api.LABEL_JOB: "llama", api.LABEL_GENERATION: str(generation)},
                         "annotations": {api.ANNOTATION_SAVE_REQUEST: annotation}},
            "status": {"phase": phase, "podIP": "10.0.0.1", "initContainerStatuses": [status],
                       "containerStatuses": [{"name": "trainer", "state": {"terminated": {"exitCode": 75}}}]}}


WORDS = {"generation": 1, "newest_persisted_step": 12, "trainer": FIGURES, "final_save": FINAL}


@pytest.mark.parametrize(("body", "expected"), [
    (pod(words=WORDS), LastWords("llama-g1-s0-h0", 1, WORDS, "op-1=resize-abc", "u1")),
    (pod(words=WORDS, where="lastState"), LastWords("llama-g1-s0-h0", 1, WORDS, "op-1=resize-abc", "u1")),
    (pod(words=None), None),
    (pod(words="not json {"), None),
    (pod(words=[1, 2]), None),
    (pod(words=WORDS, container="trainer"), None),
    (pod(words=WORDS, generation=0), None),
], ids=["terminated-state", "restarted-sidecar-last-state", "no-message", "not-json", "not-an-object",
        "only-another-containers", "not-a-worker"])
def test_parse_last_words(body: dict[str, Any], expected: LastWords | None) -> None:
    assert parse_last_words(body) == expected


@pytest.mark.parametrize(("annotation", "request_id", "save", "expected"), [
    ("op-1=resize-abc", "op-1", FINAL, SaveOutcome("op-1", 12, True, None)),
    ("op-1=resize-abc", "op-1", {**FINAL, "status": "failed", "committed": False, "step": None, "error": "disk full"},
     SaveOutcome("op-1", None, False, "disk full")),
    ("op-1=resize-abc", "op-1", {**FINAL, "status": "pending", "committed": False, "step": None}, None),
    ("op-1=resize-abc", "op-2", FINAL, None),  # an older request of the operator's
    ("op-1=other", "op-1", FINAL, None),  # the sidecar's final save was its own request, not the operator's
    ("", "op-1", FINAL, None),
], ids=["committed", "failed", "pending", "another-request", "another-sidecar-request", "no-annotation"])
def test_a_sidecars_last_words_answer_the_final_save_it_was_asked_for(
        annotation: str, request_id: str, save: dict[str, Any], expected: SaveOutcome | None) -> None:
    words = LastWords("p", 1, {"final_save": save}, annotation, "u1")
    assert words.save_outcome(request_id) == expected


def report(step: int, at: float, generation: int = 1) -> TrainerReport:
    return TrainerReport(generation, step=step, step_time=at, first_step=1, first_step_time=1000.0,
                         save_blocking_seconds=0.5)


def said(step: int, at: float, generation: int = 1, label: int | None = None, pod_name: str = "p") -> LastWords:
    return LastWords(pod_name, label or generation, {"trainer": {**FIGURES, "generation": generation, "step": step,
                                                                 "step_time": at, "save_blocking_seconds": 0.75}})


@pytest.mark.parametrize(("kept", "words", "expected"), [
    # the operator last saw step 40; pod 0's sidecar left 44: the last step is 44, the rest kept
    (report(40, 1040.0), [said(44, 1044.0)], replace(report(44, 1044.0), save_blocking_seconds=0.75)),
    # pod 0 died with its node (no words); another host's sidecar tells the step they all reached
    (report(40, 1040.0), [said(43, 1043.0, pod_name="h1"), said(44, 1044.0, pod_name="h2")],
     replace(report(44, 1044.0), save_blocking_seconds=0.75)),
    # words no newer than what the operator saw change nothing
    (report(44, 1044.0), [said(44, 1044.0)], report(44, 1044.0)),
    # nothing kept (an operator restart): the words are the report
    (None, [said(44, 1044.0)], TrainerReport(1, 44, 1044.0, 1, 1000.0, 0.75)),
    # another generation's words (an older one's, or a kept pod whose label is older than its trainer)
    (report(40, 1040.0), [said(90, 1090.0, generation=2)], report(40, 1040.0)),
    (report(40, 1040.0, generation=2), [said(44, 1044.0, generation=2, label=1)],
     replace(report(44, 1044.0, generation=2), save_blocking_seconds=0.75)),
    (report(40, 1040.0, generation=1), [], report(40, 1040.0)),
    (report(40, 1040.0, generation=1), [said(44, 1044.0)], None),  # asked of generation 2: nothing of it yet
], ids=["pod-0s-words", "another-hosts-words", "not-newer", "nothing-kept", "another-generation",
        "kept-pod-label-older", "no-words", "new-generation-nothing-known"])
def test_the_last_step_is_the_furthest_any_sidecar_of_the_generation_left(
        kept: TrainerReport | None, words: list[LastWords], expected: TrainerReport | None) -> None:
    generation = 2 if expected is None or expected.generation == 2 else 1
    assert newest_trainer_report(kept, words, generation) == expected


def test_the_cache_keeps_the_words_of_deleted_pods_for_the_two_newest_generations() -> None:
    index = LastWordsIndex()
    key = "ml/llama-g1-s0-h0"
    index.update(key, None, pod(words=WORDS, phase="Running"))
    gone = pod(words=WORDS)
    index.update(key, gone, None)  # deleted: the watch's last state still speaks
    assert [w.pod for w in index.of("ml", "llama")] == ["llama-g1-s0-h0"]
    index.update("ml/x", None, pod("llama-g1-s0-h1", words=None))  # a sidecar still running: nothing
    index.update("ml/g2", None, pod("llama-g2-s0-h0", 2, words=WORDS))
    index.update("ml/g3", None, pod("llama-g3-s0-h0", 3, words=WORDS))
    assert [w.pod for w in index.of("ml", "llama")] == ["llama-g2-s0-h0", "llama-g3-s0-h0"]
    # a job re-created under the same name: its words are kept apart by owner (observed/observe.py filters by uid)
    other = {**OWNER, "uid": "u2"}
    index.update("ml/new", None, pod("llama-g1-s0-h0", 1, words=WORDS, owner=other))
    assert sorted((w.owner_uid, w.generation) for w in index.of("ml", "llama")) == [("u1", 2), ("u1", 3), ("u2", 1)]
    index.forget("ml", "llama")
    assert index.of("ml", "llama") == ()


def test_a_final_save_committed_as_the_workers_exited_is_read_from_the_last_words() -> None:
    """Every pod ended (its sidecar gone, not asked): the outcome comes from the words alone."""
    t = st.Transition(st.RESIZE, 1, datetime(2026, 1, 1, tzinfo=UTC), save_request_id="op-1")
    status = st.JobStatus(phase=api.PHASE_SAVING, generation=1, transition=t)
    pods = [pod(words=WORDS), pod("llama-g1-s0-h1", words={"generation": 1})]
    words = tuple(w for p in pods if (w := parse_last_words(p)) is not None)
    kube: Any = None  # a pod whose phase ended is never asked: no request at all
    found = observe_save_outcomes(kube, status, pods, OperatorSettings(), logging.getLogger("t"), words)
    assert found == (SaveOutcome("op-1", 12, True, None),)


def test_lost_steps_count_the_steps_the_operator_saw_only_in_the_last_words() -> None:
    """Generation 1 was last seen at step 40 by the operator, but its trainers reached 44 before the node
    died (pod 0's sidecar said so as it ended); generation 2 restored 30: 14 steps lost, not 10."""
    w = running_world(good_spec())
    t0 = w.now.timestamp()
    w.trainer = TrainerReport(1, step=40, step_time=t0 + 40, first_step=1, first_step_time=t0 + 5)
    w.checkpoint = CheckpointInfo(30, w.now)
    w.advance(45)
    w.step()
    victim = w.gen_pods()[-1].node_name
    assert victim is not None
    w.set_node(victim, ready="Unknown", ready_since=w.now)
    w.trainer = newest_trainer_report(w.trainer, [said(44, t0 + 44.5, pod_name="llama-g1-s0-h0")], 1)
    w.advance(31)
    w.settle(3)
    w.kubelets()
    w.settle(4)
    assert w.status.generation == 2, w.status
    w.restore = RestoreReport(30, (), generation=2, source="persistent")
    w.trainer = TrainerReport(2, step=35, step_time=w.now.timestamp() + 9, first_step=31,
                              first_step_time=w.now.timestamp() + 5, restores=1, restored_time=w.now.timestamp() + 3,
                              last_restore_seconds=1.0)
    w.advance(10)
    w.step()
    e1, _e2 = w.status.history
    assert (e1.last_step, e1.lost_steps) == (44, 14)
    assert w.status.goodput is not None and w.status.goodput.summary().lost_steps == 14
