"""policies/failure_rules.py: spec.recovery.failureRules (JobSet's failurePolicy.rules).

A table of (rules, failed pod) → the rule that decides, the actions' table, validation's field-path
errors, and the whole flow through the in-memory world (op_world: every decision is made twice and
must agree)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from op_samples import good_spec
from op_world import running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.errors import InvalidSpecError
from resilax_operator.observed.snapshot import ObservedPod
from resilax_operator.policies.failure_rules import decide_rule, describe, exit_code_of
from resilax_operator.spec import FailureRule
from resilax_operator.validation import validate_spec

FAIL_42 = FailureRule("FailJob", exit_codes=(42,))
SKIP_43 = FailureRule("RestartWithoutCounting", exit_codes=(43, 44))
SIDECAR_1 = FailureRule("FailJob", exit_codes=(1,), container_name="resilax-sidecar")
EVICTED = FailureRule("RestartWithoutCounting", pod_reasons=("Evicted",))
OOM_REASON_AND_CODE = FailureRule("FailJob", exit_codes=(137,), pod_reasons=("OutOfmemory",))
RESTART_ANY_1 = FailureRule("Restart", exit_codes=(1,))


def pod(name: str = "llama-g1-s0-h0", **kw: Any) -> ObservedPod:
    fields: dict[str, Any] = {"phase": "Failed", **kw}
    return ObservedPod(name=name, generation=1, slice_index=0, host=0, **fields)


# (rules, pods) -> index of the deciding rule and the pod it matched, or None.
CASES: dict[str, tuple[tuple[FailureRule, ...], list[ObservedPod], tuple[int, str] | None]] = {
    "no-rules": ((), [pod(exit_code=42)], None),
    "exit-code-matches": ((FAIL_42,), [pod(exit_code=42)], (0, "llama-g1-s0-h0")),
    "exit-code-differs": ((FAIL_42,), [pod(exit_code=1)], None),
    "first-rule-wins": ((RESTART_ANY_1, FailureRule("FailJob", exit_codes=(1,))), [pod(exit_code=1)], (0, "llama-g1-s0-h0")),
    "second-rule-when-first-misses": ((FAIL_42, SKIP_43), [pod(exit_code=44)], (1, "llama-g1-s0-h0")),
    "running-pod-never": ((FAIL_42,), [pod(phase="Running", exit_code=None)], None),
    "succeeded-pod-never": ((FailureRule("FailJob", pod_reasons=("Completed",)),),
                            [pod(phase="Succeeded", exit_code=0, pod_reason="Completed")], None),
    "protocol-75-never": ((FailureRule("FailJob", pod_reasons=("Evicted",)),),
                          [pod(exit_code=75, pod_reason="Evicted")], None),
    "protocol-76-never": ((FailureRule("FailJob", pod_reasons=("Error",)),), [pod(exit_code=76, pod_reason="Error")],
                          None),
    "first-pod-by-name": ((FAIL_42, SKIP_43), [pod("llama-g1-s1-h0", exit_code=42), pod("llama-g1-s0-h1", exit_code=43)],
                          (1, "llama-g1-s0-h1")),
    "container-name-sidecar": ((SIDECAR_1,), [pod(exit_code=None, container_exits=(("resilax-sidecar", 1),))],
                               (0, "llama-g1-s0-h0")),
    "container-name-not-the-trainer": ((SIDECAR_1,), [pod(exit_code=1, container_exits=(("trainer", 1),))], None),
    "container-name-trainer-supervised": ((FailureRule("FailJob", exit_codes=(3,), container_name="trainer"),),
                                          [pod(phase="Running", supervised=True, exit_code=3)], (0, "llama-g1-s0-h0")),
    "pod-reason-matches": ((EVICTED,), [pod(pod_reason="Evicted")], (0, "llama-g1-s0-h0")),
    "pod-reason-differs": ((EVICTED,), [pod(pod_reason="NodeShutdown")], None),
    "both-criteria-both-hold": ((OOM_REASON_AND_CODE,), [pod(exit_code=137, pod_reason="OutOfmemory")],
                                (0, "llama-g1-s0-h0")),
    "both-criteria-one-holds": ((OOM_REASON_AND_CODE,), [pod(exit_code=137)], None),
}


@pytest.mark.parametrize("rules,pods,expected", CASES.values(), ids=CASES.keys())
def test_decide_rule(rules: tuple[FailureRule, ...], pods: list[ObservedPod], expected: tuple[int, str] | None) -> None:
    hit = decide_rule(rules, pods)
    assert (None if hit is None else (hit[0], hit[2].name)) == expected
    assert decide_rule(rules, pods) == hit  # pure: deciding twice gives the same answer


def test_exit_code_of_reads_the_named_container() -> None:
    p = pod(exit_code=2, container_exits=(("trainer", 2), ("logger", 9)))
    assert (exit_code_of(p, None), exit_code_of(p, "logger"), exit_code_of(p, "absent")) == (2, 9, None)
    assert describe(p) == "exit code 2, logger exited 9"


def spec_with(rules: list[dict[str, Any]], max_restarts: int = 1) -> dict[str, Any]:
    spec = good_spec()
    spec["recovery"] = {"maxRestarts": max_restarts, "backoffSeconds": 0, "failureRules": rules}
    return spec


# rules -> the field paths validation names (all at once).
INVALID: dict[str, tuple[list[Any], list[str]]] = {
    "unknown-action": ([{"action": "Ignore", "exitCodes": [3]}], ["spec.recovery.failureRules[0].action"]),
    "missing-action": ([{"exitCodes": [3]}], ["spec.recovery.failureRules[0].action"]),
    "matches-nothing": ([{"action": "FailJob"}], ["spec.recovery.failureRules[0]"]),
    "protocol-codes": ([{"action": "FailJob", "exitCodes": [75, 3, 78, 0, 300]}],
                       ["spec.recovery.failureRules[0].exitCodes[0]", "spec.recovery.failureRules[0].exitCodes[2]",
                        "spec.recovery.failureRules[0].exitCodes[3]", "spec.recovery.failureRules[0].exitCodes[4]"]),
    "codes-not-integers": ([{"action": "FailJob", "exitCodes": ["3"]}], ["spec.recovery.failureRules[0].exitCodes"]),
    "container-without-codes": ([{"action": "FailJob", "podReasons": ["Evicted"], "containerName": "trainer"}],
                                ["spec.recovery.failureRules[0].containerName"]),
    "second-rule-bad": ([{"action": "FailJob", "exitCodes": [3]}, {"action": "Nope", "podReasons": "Evicted"}],
                        ["spec.recovery.failureRules[1].action", "spec.recovery.failureRules[1].podReasons"]),
    "not-a-list": ({"action": "FailJob"}, ["spec.recovery.failureRules"]),
}


@pytest.mark.parametrize("rules,paths", INVALID.values(), ids=INVALID.keys())
def test_invalid_rules_name_their_fields(rules: list[Any], paths: list[str]) -> None:
    with pytest.raises(InvalidSpecError) as e:
        validate_spec(spec_with(rules), name="llama")
    assert sorted(p.path for p in e.value.problems) == sorted(paths)


def test_valid_rules_parse_in_order() -> None:
    spec = validate_spec(spec_with([{"action": "FailJob", "exitCodes": [42]},
                                    {"action": "RestartWithoutCounting", "podReasons": ["Evicted"]},
                                    {"action": "Restart", "exitCodes": [1], "containerName": "resilax-sidecar"}]),
                         name="llama")
    assert spec.recovery.failure_rules == (FAIL_42, EVICTED, FailureRule("Restart", (1,), "resilax-sidecar"))


def test_fail_job_fails_at_once() -> None:
    w = running_world(spec_with([{"action": "FailJob", "exitCodes": [42]}], max_restarts=5))
    w.exit_workers(42, names=["llama-g1-s1-h2"])
    w.settle()
    assert w.status.phase == api.PHASE_FAILED and w.status.failures == 0 and w.status.generation == 1
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.FAILED_BY_RULE.name
    assert "llama-g1-s1-h2" in ready.message and "failureRules[0]" in ready.message
    assert not w.pods and api.FAILED_BY_RULE.name in w.reasons()


def test_restart_without_counting_never_exhausts_max_restarts() -> None:
    w = running_world(spec_with([{"action": "RestartWithoutCounting", "exitCodes": [43]}], max_restarts=1))
    for generation in (1, 2, 3, 4):
        w.exit_workers(43, generation=generation, names=[f"llama-g{generation}-s0-h1"])
        w.settle()
        assert w.status.transition is None or w.status.transition.kind == st.WORKER_FAILURE
    assert w.status.phase == api.PHASE_RUNNING and w.status.generation == 5
    assert w.status.failures == 0 and w.status.pod_losses == 0 and w.status.restarts == 4


def test_restart_counts_and_unmatched_codes_keep_the_built_in_rows() -> None:
    w = running_world(spec_with([{"action": "RestartWithoutCounting", "exitCodes": [43]},
                                 {"action": "Restart", "podReasons": ["Evicted"]}], max_restarts=1))
    w.exit_workers(1, names=["llama-g1-s0-h0"])  # no rule: the built-in counted failure
    w.settle()
    assert w.status.failures == 1 and w.status.generation == 2
    name = "llama-g2-s0-h0"
    w.pods[name] = replace(w.pods[name], phase="Failed", pod_reason="Evicted", exit_code=None, trainer_running=False)
    w.settle()  # an eviction is not counted without rules; the Restart rule counts it: past maxRestarts=1
    assert w.status.phase == api.PHASE_FAILED and w.status.failures == 2
