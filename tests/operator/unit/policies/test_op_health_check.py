"""policies/health_check.py (issue 39, health-checked starts): the avoid list with reasons, the record of
failed hosts, starting on healthy nodes or waiting with a clear reason, no check for kept survivors.

Driven through the in-memory world (op_world: deciding twice gives the same actions); the pure pieces
(avoid list, result parsing, the metric's count) in tables."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from op_samples import good_spec
from op_world import T0, World, cpu_pool, fixed_spec, four_pools, tpu_pool
from resilax_ckpt.trainer import health_check as hc
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import CreateGeneration, RequeueAfter
from resilax_operator.builders import JobRef
from resilax_operator.errors import InvalidSpecError
from resilax_operator.metrics import count_new_health_failures
from resilax_operator.observed.snapshot import (
    HealthResult,
    Observed,
    ObservedNode,
    parse_health_result,
    parse_pod,
)
from resilax_operator.policies import health_check
from resilax_operator.validation import validate_spec

MATMUL = HealthResult(api.EXIT_CODE_UNHEALTHY, "matmul", "wrong checksum on local device 0 (2045, expected 2051)", True)
COLLECTIVE = HealthResult(api.EXIT_CODE_UNHEALTHY, "collective", "the collective failed: gloo: closed", False)


def _checked(spec: dict[str, Any]) -> dict[str, Any]:
    spec["recovery"]["healthCheck"] = {"enabled": True, "timeoutSeconds": 60}
    return spec


def _started(w: World) -> None:
    """Generation created and every pod bound: their init containers (the check) run, trainers not yet."""
    for _ in range(4):
        w.step()
        w.schedule()
    for name, p in w.pods.items():
        w.pods[name] = replace(p, phase="Pending", ready=False, trainer_running=False, trainer_ready=False)


def _check_fails(w: World, pod: str, result: HealthResult) -> str:
    p = w.pods[pod]
    w.pods[pod] = replace(p, phase="Failed", health=result)
    assert p.node_name is not None
    return p.node_name


def _anti_affinity(manifest: dict[str, Any]) -> list[str]:
    terms = manifest["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [v for t in terms["nodeSelectorTerms"] for e in t.get("matchFields") or []
            if e["key"] == "metadata.name" and e["operator"] == "NotIn" for v in e["values"]]


def test_the_api_exit_code_is_the_checks() -> None:
    assert api.EXIT_CODE_UNHEALTHY == hc.EXIT_UNHEALTHY


def test_a_host_that_fails_is_kept_out_of_this_and_later_generations() -> None:
    w = World.make(_checked(good_spec()), *four_pools())
    _started(w)
    assert w.status.generation == 1 and len(w.gen_pods()) == 16
    bad = _check_fails(w, "llama-g1-s0-h1", MATMUL)
    w.step()
    # recorded, named by the condition and the Event, the generation replaced as a pod-level loss
    [entry] = w.status.unhealthy_nodes
    assert (entry.node, entry.part, entry.failures, entry.generation, entry.pod) == (
        bad, "matmul", 1, 1, "llama-g1-s0-h1")
    cond = w.status.condition(api.COND_UNHEALTHY_NODES)
    assert cond is not None and cond.status == "True" and cond.reason == api.NODES_KEPT_OUT.name and bad in cond.message
    event = next(e for e in w.events if e.reason == api.HEALTH_CHECK_FAILED.name)
    assert event.type == "Warning" and f"node {bad} failed the health check of generation 1" in event.message
    assert "(worker llama-g1-s0-h1, matmul: wrong checksum" in event.message
    assert w.status.transition is not None and w.status.transition.kind == st.POD_LOST
    assert w.status.failures == 0  # the node's fault, not the worker's
    # the next generation: the planner does not count the node (its pool no longer hosts a slice of 4)
    # and every new pod has it in its required anti-affinity
    created: list[CreateGeneration] = []
    for _ in range(12):
        created += [a for a in w.step() if isinstance(a, CreateGeneration) and a.generation == 2]
        w.schedule()
        w.kubelets()
    assert w.status.generation == 2 and "pool-a" not in w.status.pools and len(w.status.pools) == 3
    manifests = [m for a in created for m in a.pods]
    assert manifests and all(_anti_affinity(m) == [bad] for m in manifests)
    assert all(p.node_name != bad for p in w.gen_pods())
    assert [n.node for n in w.status.unhealthy_nodes] == [bad]  # kept for later generations


def test_too_few_healthy_nodes_left_waits_naming_the_nodes_kept_out() -> None:
    w = World.make(_checked(fixed_spec(count=2)), tpu_pool("pool-a", 4), tpu_pool("pool-b", 4))
    _started(w)
    bad = _check_fails(w, "llama-g1-s1-h2", MATMUL)
    for _ in range(12):
        w.step()
        w.schedule()
        w.kubelets()
    assert w.status.generation == 1 and not w.pods  # torn down, no generation 2: one pool of 4 is short
    ready = w.status.condition(api.COND_READY)
    assert ready is not None and ready.reason == api.INSUFFICIENT_CAPACITY.name
    assert f"kept out after a failed health check: {bad} (HealthCheckFailed: matmul: wrong checksum" in ready.message
    # a new node in that pool: the job starts again, on healthy nodes only
    w.nodes["pool-b-n9"] = replace(w.nodes["pool-b-n0"], name="pool-b-n9")
    created = [m for a in w.step() if isinstance(a, CreateGeneration) for m in a.pods]
    assert w.status.generation == 2 and w.status.pools == ("pool-a", "pool-b")
    assert created and all(_anti_affinity(m) == [bad] for m in created)  # the scheduler keeps it off


def test_a_failed_collective_blames_no_host_and_waits_for_the_checks_still_running() -> None:
    w = World.make(_checked(fixed_spec(count=2)), tpu_pool("pool-a", 4), tpu_pool("pool-b", 4))
    _started(w)
    _check_fails(w, "llama-g1-s0-h0", COLLECTIVE)
    assert [type(a) for a in w.step()] == [RequeueAfter]  # the host at fault leaves first and reports itself
    for p in w.gen_pods():
        _check_fails(w, p.name, COLLECTIVE)
    w.step()
    assert w.status.unhealthy_nodes == () and w.status.condition(api.COND_UNHEALTHY_NODES) is None
    assert w.status.transition is not None and w.status.transition.reason == api.HEALTH_CHECK_SLICE_FAILED.name
    assert "no host is blamed" in w.status.transition.message


def test_a_check_that_never_reports_does_not_hold_a_slice_failure_past_its_bound() -> None:
    w = World.make(_checked(fixed_spec(count=2)), tpu_pool("pool-a", 4), tpu_pool("pool-b", 4))
    _started(w)
    _check_fails(w, "llama-g1-s0-h0", COLLECTIVE)
    assert [type(a) for a in w.step()] == [RequeueAfter]
    w.advance(60 + health_check.CHECK_SLACK_SECONDS)  # timeoutSeconds 60: no check runs that long
    w.step()
    assert w.status.transition is not None and w.status.transition.reason == api.HEALTH_CHECK_SLICE_FAILED.name


def test_a_pod_counts_once_and_a_later_failure_of_the_node_adds_one() -> None:
    w = World.make(_checked(fixed_spec(count=2)), tpu_pool("pool-a", 4), tpu_pool("pool-b", 4))
    _started(w)
    bad = _check_fails(w, "llama-g1-s0-h0", MATMUL)
    observed = w.observed()
    once = health_check.record(observed, w.status)
    assert health_check.record(replace(observed, status=once), once) == once
    later = replace(once, generation=2)
    pod = replace(w.pods["llama-g1-s0-h0"], name="llama-g2-s0-h0", generation=2)
    twice = health_check.record(replace(observed, pods=(pod,), status=later), later)
    assert [(n.node, n.failures, n.generation) for n in twice.unhealthy_nodes] == [(bad, 2, 2)]
    assert count_new_health_failures(w.status, once) == [(bad, 1)]
    assert count_new_health_failures(once, twice) == [(bad, 1)]
    assert count_new_health_failures(twice, twice) == []


def _node(name: str, **kw: Any) -> ObservedNode:
    return ObservedNode(name, {api.NODE_POOL_LABEL: "p"}, ready_since=T0, **kw)


LEASE_GONE = {"lease_live_until": T0, "lease_seconds": 40.0}  # read, and expired: held down


@pytest.mark.parametrize(("nodes", "want"), [
    ([_node("a"), _node("b")], []),
    ([_node("a", **LEASE_GONE)], [("a", "NodeDown: its Lease proves the kubelet gone since 2026-01-01T11:59:40Z")]),
    ([_node("b", kept_out="HealthCheckFailed: matmul: x")], [("b", "HealthCheckFailed: matmul: x")]),
    ([_node("c", kept_out="HealthCheckFailed: devices: y"), _node("a", **LEASE_GONE),
      _node("b", kept_out="HealthCheckFailed: matmul: x", **LEASE_GONE)],
     [("a", "NodeDown: its Lease proves the kubelet gone since 2026-01-01T11:59:40Z"),
      ("b", "NodeDown: its Lease proves the kubelet gone since 2026-01-01T11:59:40Z; HealthCheckFailed: matmul: x"),
      ("c", "HealthCheckFailed: devices: y")]),
    ([_node("a", ready="Unknown")], []),  # not Ready: the scheduler keeps away by itself
], ids=["none", "lease-proven-down", "health-failed", "merged-by-name", "not-ready"])
def test_avoid_list_merges_lease_proven_down_and_health_failed(nodes: list[ObservedNode],
                                                               want: list[tuple[str, str]]) -> None:
    observed = Observed(now=T0 + timedelta(seconds=60), job=JobRef("j", "ns", "u"), status=st.JobStatus(),
                        nodes=tuple(nodes))
    assert list(observed.avoid_list()) == want
    assert observed.nodes_to_avoid() == tuple(n for n, _ in want)


def test_mark_kept_out_makes_the_nodes_unschedulable() -> None:
    entry = st.UnhealthyNode("b", "matmul", "wrong checksum", 2, T0, 3, "j-g3-s0-h1")
    observed = Observed(now=T0, job=JobRef("j", "ns", "u"), status=st.JobStatus(), nodes=(_node("a"), _node("b")))
    marked = health_check.mark_kept_out(observed, st.JobStatus(unhealthy_nodes=(entry,)))
    assert [(n.name, n.schedulable(T0)) for n in marked.nodes] == [("a", True), ("b", False)]
    assert marked.avoid_list() == (("b", "HealthCheckFailed: matmul: wrong checksum (2 failure(s), last in "
                                         "generation 3)"),)
    assert health_check.mark_kept_out(observed, st.JobStatus()) is observed


def test_kept_survivors_are_not_checked_again() -> None:
    """In place: the lost host's replacement is a new pod with the check; the kept pods are never
    rebuilt (their trainers restart through the supervisor), so their hosts are not checked again."""
    spec = _checked(good_spec())
    spec["slices"] = {"accelerator": "cpu", "topology": "2x4", "chipsPerHost": 4, "count": 2}
    spec["elastic"] = {"minCount": 1, "maxCount": 2}
    spec["recovery"]["inPlace"] = "Auto"
    w = World.make(spec, cpu_pool("pool-a", 3), cpu_pool("pool-b", 3))
    first: list[CreateGeneration] = []
    for _ in range(12):
        first += [a for a in w.step() if isinstance(a, CreateGeneration)]
        w.schedule()
        w.kubelets()
    assert w.status.phase == api.PHASE_RUNNING
    assert all(_inits(m)[-1] == api.HEALTH_CHECK_CONTAINER for a in first for m in a.pods)
    lost = w.pods["llama-g1-s0-h1"].node_name
    assert lost is not None
    w.set_node(lost, ready="Unknown", ready_since=w.now)
    w.advance(31)
    later: list[CreateGeneration] = []
    for _ in range(12):
        later += [a for a in w.step() if isinstance(a, CreateGeneration)]
        w.schedule()
        w.kubelets()
    assert w.status.generation == 2 and w.status.in_place_restarts == 1
    new = [m["metadata"]["name"] for a in later for m in a.pods]
    assert new == ["llama-g2-s0-h1"]  # the kept pods (generation 1 names) are never created again
    assert all(_inits(m)[-1] == api.HEALTH_CHECK_CONTAINER for a in later for m in a.pods)


def _inits(manifest: dict[str, Any]) -> list[str]:
    return [c["name"] for c in manifest["spec"]["initContainers"]]


def test_the_init_container_runs_the_check_with_the_trainers_image_environment_and_devices() -> None:
    w = World.make(_checked(fixed_spec(count=1)), tpu_pool("pool-a", 4))
    created = next(a for a in w.step() if isinstance(a, CreateGeneration))
    pod = created.pods[0]["spec"]
    assert _inits(created.pods[0]) == [api.SIDECAR_CONTAINER, api.HEALTH_CHECK_CONTAINER]
    check = pod["initContainers"][1]
    trainer = pod["containers"][0]
    assert check["command"] == ["resilax", "health-check", "--timeout", "60", "--result", "/dev/termination-log"]
    assert check["image"] == trainer["image"] and check["resources"] == trainer["resources"]
    assert check["resources"]["limits"][api.TPU_RESOURCE] == "4"
    assert check["securityContext"] == trainer["securityContext"]
    env = {e["name"]: e.get("value") for e in check["env"]}
    assert env["RESILAX_HEALTH_PLATFORM"] == "tpu" and env["RESILAX_DEVICES_PER_HOST"] == "4"
    assert env["JAX_NUM_PROCESSES"] == "4" and env["JAX_PROCESS_ID"] == "0"
    assert "restartPolicy" not in check  # a plain init container: its failure fails the pod
    local = _checked(fixed_spec(count=1))
    local["template"]["spec"]["containers"][0]["env"] = [{"name": "JAX_PLATFORMS", "value": "cpu"}]
    fake = next(a for a in World.make(local, tpu_pool("pool-a", 4)).step() if isinstance(a, CreateGeneration))
    env = {e["name"]: e.get("value") for e in fake.pods[0]["spec"]["initContainers"][1]["env"]}
    assert env["RESILAX_HEALTH_PLATFORM"] == "cpu"  # the trainer's JAX_PLATFORMS: the local cluster's fake TPUs
    off = World.make(fixed_spec(count=1), tpu_pool("pool-a", 4))
    plain = next(a for a in off.step() if isinstance(a, CreateGeneration))
    assert api.HEALTH_CHECK_CONTAINER not in _inits(plain.pods[0])


def _node_scope(spec: dict[str, Any]) -> dict[str, Any]:
    spec["checkpoint"]["local"] = {"scope": "Node"}
    return spec


def _no_local_tier(spec: dict[str, Any]) -> dict[str, Any]:
    del spec["checkpoint"]["local"]
    return spec


def _own_user(spec: dict[str, Any]) -> dict[str, Any]:
    spec["template"]["spec"]["containers"][0]["securityContext"] = {"runAsUser": 1234}
    return spec


@pytest.mark.parametrize(("shape", "inits"), [
    (lambda s: s, [api.SIDECAR_CONTAINER, api.HEALTH_CHECK_CONTAINER]),
    (_node_scope, [api.LOCAL_INIT_CONTAINER, api.SIDECAR_CONTAINER, api.HEALTH_CHECK_CONTAINER]),
    (_no_local_tier, [api.SIDECAR_CONTAINER, api.HEALTH_CHECK_CONTAINER]),
    (_own_user, [api.SIDECAR_CONTAINER, api.HEALTH_CHECK_CONTAINER]),
], ids=["pod-local-tier", "node-local-tier", "no-local-tier", "trainer-user"])
def test_the_check_writes_its_verdict_into_the_control_folder_the_sidecar_reads(shape: Any, inits: list[str]) -> None:
    """The check mounts the pod's control folder read-write where the sidecar and the trainer have it and
    is told its path: its health.json lets the sidecar of a failed pod exit without a final save."""
    w = World.make(shape(_checked(fixed_spec(count=1))), tpu_pool("pool-a", 4))
    pod = next(a for a in w.step() if isinstance(a, CreateGeneration)).pods[0]["spec"]
    assert _inits({"spec": pod}) == inits
    by_name = {c["name"]: c for c in [*pod["initContainers"], *pod["containers"]]}
    check, sidecar, trainer = (by_name[n] for n in (api.HEALTH_CHECK_CONTAINER, api.SIDECAR_CONTAINER,
                                                    api.TRAINER_CONTAINER))
    control = {"name": api.CONTROL_VOLUME, "mountPath": api.CONTROL_DIR}
    assert check["volumeMounts"] == [control]  # read-write; nothing else of the pod's
    assert control in sidecar["volumeMounts"] and control in trainer["volumeMounts"]
    assert {"name": api.CONTROL_VOLUME, "emptyDir": {}} in pod["volumes"]
    assert {e["name"]: e.get("value") for e in check["env"]}["RESILAX_CONTROL_DIR"] == api.CONTROL_DIR
    assert check["securityContext"] == trainer["securityContext"]  # the restricted one, the trainer's user
    assert check["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize(("code", "message", "want"), [
    (0, json.dumps({"healthy": True, "failed_part": None, "host_fault": False}), HealthResult(0, None, "", False)),
    (79, json.dumps({"failed_part": "devices", "reason": "3 devices visible, 4 expected", "host_fault": True}),
     HealthResult(79, "devices", "3 devices visible, 4 expected", True)),
    (79, json.dumps({"failed_part": "collective", "reason": "psum gave 12", "host_fault": False}),
     HealthResult(79, "collective", "psum gave 12", False)),
    (79, '{"failed_part": "matmul", "rea', HealthResult(79, None, "exit code 79, no readable result", False)),
    (2, "", HealthResult(2, None, "exit code 2, no readable result", False)),
    (79, "[1]", HealthResult(79, None, "exit code 79, no readable result", False)),
], ids=["healthy", "host-fault", "slice-fault", "cut-json", "no-message", "not-an-object"])
def test_parse_health_result(code: int, message: str, want: HealthResult) -> None:
    assert parse_health_result(code, message) == want


def test_parse_pod_reads_the_checks_termination_message() -> None:
    result = {"failed_part": "matmul", "reason": "wrong checksum", "host_fault": True}
    raw = {"metadata": {"name": "j-g1-s0-h0", "labels": {api.LABEL_GENERATION: "1", api.LABEL_SLICE: "0",
                                                         api.LABEL_HOST: "0"}},
           "spec": {"containers": [{"name": "trainer"}], "nodeName": "n1"},
           "status": {"phase": "Failed", "initContainerStatuses": [
               {"name": api.SIDECAR_CONTAINER, "state": {"running": {}}},
               {"name": api.HEALTH_CHECK_CONTAINER, "state": {"terminated": {
                   "exitCode": 79, "message": json.dumps(result)}}}]}}
    pod = parse_pod(raw)
    assert pod is not None and pod.health == HealthResult(79, "matmul", "wrong checksum", True)
    raw["status"]["initContainerStatuses"][1]["state"] = {"running": {}}
    pod = parse_pod(raw)
    assert pod is not None and pod.health is None


@pytest.mark.parametrize(("health", "problem"), [
    ({"enabled": "yes"}, "spec.recovery.healthCheck.enabled"),
    ({"timeoutSeconds": 0}, "spec.recovery.healthCheck.timeoutSeconds"),
    ({"timeoutSeconds": 5000}, "spec.recovery.healthCheck.timeoutSeconds: 5000 is not allowed; allowed: 1-3600"),
    ("on", "spec.recovery.healthCheck"),
], ids=["enabled-not-bool", "timeout-zero", "timeout-too-long", "not-an-object"])
def test_bad_health_check_spec_names_the_field(health: Any, problem: str) -> None:
    spec = good_spec()
    spec["recovery"]["healthCheck"] = health
    with pytest.raises(InvalidSpecError, match=problem.replace(".", r"\.")):
        validate_spec(spec)


def test_health_check_spec_defaults_off() -> None:
    assert validate_spec(good_spec()).recovery.health_check == validate_spec(good_spec()).recovery.health_check
    parsed = validate_spec(good_spec()).recovery.health_check
    assert (parsed.enabled, parsed.timeout_seconds) == (False, 120)


def test_unhealthy_nodes_round_trip_through_the_status() -> None:
    entry = st.UnhealthyNode("n1", "matmul", "wrong checksum", 2, T0, 3, "j-g3-s0-h1")
    s = st.JobStatus(unhealthy_nodes=(entry,))
    raw = st.build_status(s)
    assert raw["unhealthyNodes"] == [{"node": "n1", "part": "matmul", "reason": "wrong checksum", "failures": 2,
                                      "lastFailureTime": "2026-01-01T12:00:00Z", "generation": 3, "pod": "j-g3-s0-h1"}]
    assert st.parse_status(raw).unhealthy_nodes == (entry,)
    assert st.build_status(st.JobStatus())["unhealthyNodes"] is None
