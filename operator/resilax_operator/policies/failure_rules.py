"""Failure rules: what a failed worker does, by the user's `spec.recovery.failureRules` (JobSet's
`failurePolicy.rules`, Kubernetes' `podFailurePolicy`).

`decide_rule` (pure) picks the first rule that matches a failed pod; `check` (in reconcile.WATCH just
before worker_exit.check) turns it into the generation's fate. Rules see only failed pods whose
trainer did not exit with a code of the worker protocol (75 stopped, 76 a peer lost, 78 storage in
use; validation refuses those codes in a rule), and none while a worker exited 75 or 78 (their rows
in worker_exit.py decide). No rule matching: worker_exit.py's own table decides.

| a rule matches when every criterion it sets holds         |                                              |
|-----------------------------------------------------------|----------------------------------------------|
| `exitCodes`                                               | the container (`containerName`, else the trainer) terminated with one of them |
| `podReasons`                                              | the pod's status.reason is one of them (Evicted, NodeShutdown, ...) |

| action                 | then                                                                    |
|------------------------|-------------------------------------------------------------------------|
| Restart                | a counted worker failure (backoff; Failed past maxRestarts), as without rules |
| RestartWithoutCounting | a new generation after recovery.backoffSeconds, counted nowhere (not in failures, not in podLosses) |
| FailJob                | Failed at once, reason FailedByRule, the workers deleted                |
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from .. import api
from .. import status as st
from ..actions import Action, EmitEvent, SetStatus
from ..observed.snapshot import Observed, ObservedPod
from ..settings import OperatorSettings
from ..spec import RULE_FAIL_JOB, RULE_RESTART_WITHOUT_COUNTING, FailureRule, JobSpec
from ..status import JobStatus
from . import Finding, Verdict
from .transition import plan_delete
from .worker_exit import counted_failure

#: Trainer exit codes whose own rows decide (worker_exit.py); never matched by a rule.
PROTOCOL_EXIT_CODES = frozenset({api.EXIT_CODE_STOPPED, api.EXIT_CODE_PEER_LOST, api.EXIT_CODE_STORAGE_IN_USE})


def exit_code_of(pod: ObservedPod, container: str | None) -> int | None:
    """The exit code `container` (None: the trainer) terminated with, None if it has not."""
    if container is None:
        return pod.exit_code
    code = dict(pod.container_exits).get(container)
    if code is None and container == api.TRAINER_CONTAINER:
        return pod.exit_code  # a supervised trainer's exit comes from its supervisor, not the kubelet
    return code


def matches(rule: FailureRule, pod: ObservedPod) -> bool:
    if rule.exit_codes and exit_code_of(pod, rule.container_name) not in rule.exit_codes:
        return False
    if rule.pod_reasons and pod.pod_reason not in rule.pod_reasons:
        return False
    return bool(rule.exit_codes or rule.pod_reasons)


def decide_rule(rules: tuple[FailureRule, ...], pods: list[ObservedPod]) -> tuple[int, FailureRule, ObservedPod] | None:
    """(index, rule, pod) of the first failed pod (by name) that a rule matches, with the first rule
    that matches it; None when no failed pod matches any."""
    for pod in sorted(pods, key=lambda p: p.name):
        if not pod.failed or pod.exit_code in PROTOCOL_EXIT_CODES:
            continue
        for i, rule in enumerate(rules):
            if matches(rule, pod):
                return i, rule, pod
    return None


def describe(pod: ObservedPod) -> str:
    """What is known of how the pod failed: the trainer's exit code, other containers', the pod's reason."""
    parts = [f"exit code {pod.exit_code}" if pod.exit_code is not None else "no exit code"]
    parts += [f"{name} exited {code}" for name, code in pod.container_exits
              if code and name != api.TRAINER_CONTAINER and pod.exit_code is not None]
    if pod.pod_reason:
        parts.append(f"pod reason {pod.pod_reason}")
    return ", ".join(parts)


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Verdict:
    """The fate the first matching rule gives the generation; None when no rule matches."""
    if not spec.recovery.failure_rules:
        return None
    pods = observed.pods_of(s.generation)
    if any(p.exit_code in (api.EXIT_CODE_STOPPED, api.EXIT_CODE_STORAGE_IN_USE) for p in pods):
        return None
    hit = decide_rule(spec.recovery.failure_rules, pods)
    if hit is None:
        return None
    index, rule, pod = hit
    g, detail = s.generation, describe(pod)
    if rule.action == RULE_FAIL_JOB:
        text = api.FAILED_BY_RULE.format(pod=pod.name, generation=g, detail=detail, index=index)
        new = replace(s, phase=api.PHASE_FAILED)
        new = st.set_condition(new, api.COND_READY, False, api.FAILED_BY_RULE.name, text, observed.now)
        actions: list[Action] = [SetStatus(new), EmitEvent("Warning", api.FAILED_BY_RULE.name, text),
                                 plan_delete(observed, spec, g, "job failed", settings)]
        return actions
    if rule.action == RULE_RESTART_WITHOUT_COUNTING:
        text = api.NOT_COUNTED_BY_RULE.format(pod=pod.name, generation=g, detail=detail, index=index)
        not_before = st.truncate(observed.now) + timedelta(seconds=spec.recovery.backoff_seconds)
        return Finding(st.WORKER_FAILURE, api.NOT_COUNTED_BY_RULE.name, text, not_before=not_before)
    message = api.WORKER_FAILED.format(pod=pod.name, generation=g, detail=f"{detail}; failureRules[{index}]: Restart")
    return counted_failure(spec, observed, s, settings, message)
