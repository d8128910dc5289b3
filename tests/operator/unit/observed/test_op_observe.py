"""Raw API bodies → the Observed types (pure parsing for the I/O side)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from resilax_operator import api
from resilax_operator.observed.devices import count_devices_in_use
from resilax_operator.observed.snapshot import (
    SaveOutcome,
    Taint,
    nodes_needing_lease,
    parse_lease,
    parse_maintenance_time,
    parse_node,
    parse_pod,
    parse_save_outcome,
)

OWNER = {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": "llama", "uid": "u1", "controller": True,
         "blockOwnerDeletion": True}
POD = {
    "metadata": {"name": "llama-g2-s1-h0", "labels": {api.LABEL_JOB: "llama", api.LABEL_GENERATION: "2",
                                                     api.LABEL_SLICE: "1", api.LABEL_HOST: "0"},
                 "ownerReferences": [OWNER],
                 "deletionTimestamp": "2026-01-01T12:00:00Z", "deletionGracePeriodSeconds": 330},
    "spec": {"nodeName": "n1", "containers": [{"name": "logs"}, {"name": "trainer"}]},
    "status": {"phase": "Failed", "podIP": "10.0.0.7", "reason": "Evicted",
               "conditions": [{"type": "Ready", "status": "False"}],
               "containerStatuses": [{"name": "logs", "state": {"terminated": {"exitCode": 0}}},
                                     {"name": "trainer", "state": {"terminated": {"exitCode": 75, "reason": "Error"}}}]},
}


def test_parse_pod() -> None:
    p = parse_pod(POD)
    assert p is not None
    assert (p.name, p.generation, p.slice_index, p.host) == ("llama-g2-s1-h0", 2, 1, 0)
    assert (p.phase, p.node_name, p.pod_ip, p.ready) == ("Failed", "n1", "10.0.0.7", False)
    assert p.deletion_timestamp == datetime(2026, 1, 1, 12, tzinfo=UTC) and p.deletion_grace_seconds == 330
    assert (p.exit_code, p.exit_reason, p.pod_reason) == (75, "Error", "Evicted")


def test_parse_pod_without_worker_labels() -> None:
    assert parse_pod({"metadata": {"name": "x", "labels": {}}}) is None


def test_parse_fresh_pod() -> None:
    raw = {"metadata": {"name": "a", "labels": {api.LABEL_GENERATION: "1", api.LABEL_SLICE: "0", api.LABEL_HOST: "0"}}}
    p = parse_pod(raw)
    assert p is not None and p.phase == "Pending" and p.node_name is None and p.exit_code is None


def test_parse_node() -> None:
    raw = {"metadata": {"name": "n1", "labels": {api.NODE_POOL_LABEL: "pool-a"}},
           "spec": {"taints": [{"key": api.UNREACHABLE_TAINT, "effect": "NoExecute"}], "unschedulable": True},
           "status": {"allocatable": {"google.com/tpu": "4", "cpu": "8"},
                      "conditions": [{"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-01-01T12:00:00Z"}]}}
    n = parse_node(raw, {"google.com/tpu": 4})
    assert n.pool == "pool-a" and n.ready == "Unknown" and n.unschedulable
    assert n.taints == (Taint(api.UNREACHABLE_TAINT, "", "NoExecute"),)
    assert n.allocatable == {"google.com/tpu": 4} and n.in_use_by_others == {"google.com/tpu": 4}
    assert n.ready_since == datetime(2026, 1, 1, 12, tzinfo=UTC)


def test_count_devices_in_use_skips_this_job_and_finished_pods() -> None:
    def pod(job: str, node: str, tpus: int, phase: str = "Running") -> dict[str, object]:
        return {"metadata": {"labels": {api.LABEL_JOB: job}}, "status": {"phase": phase},
                "spec": {"nodeName": node, "containers": [{"resources": {"limits": {"google.com/tpu": str(tpus)}}}]}}
    pods = [pod("llama", "n1", 4), pod("other", "n1", 4), pod("other", "n2", 2), pod("other", "n2", 2, "Succeeded")]
    assert count_devices_in_use(pods, "llama") == {"n1": {"google.com/tpu": 4}, "n2": {"google.com/tpu": 2}}


def test_parse_save_outcome() -> None:
    assert parse_save_outcome("r", {"status": "pending"}) is None
    assert parse_save_outcome("r", {"status": "committed", "step": 12, "committed": True}) == SaveOutcome("r", 12, True, None)
    failed = parse_save_outcome("r", {"status": "failed", "error": "disk full"})
    assert failed == SaveOutcome("r", None, False, "disk full")


def test_parse_sidecar_state() -> None:
    from resilax_operator.observed.snapshot import parse_sidecar_state
    from resilax_operator.status import CheckpointInfo

    now = datetime(2026, 1, 1, 12, 0, 0, 500, tzinfo=UTC)
    at = now.replace(microsecond=0)
    assert parse_sidecar_state({"newest_persisted_step": 10, "newest_local_step": 12}, now) == CheckpointInfo(10, at)
    assert parse_sidecar_state({"newest_persisted_step": None, "newest_local_step": 12}, now) == \
        CheckpointInfo(12, at, True, "local")
    assert parse_sidecar_state({}, now) is None


def test_build_observed_from_raw_bodies() -> None:
    from resilax_operator.observed.snapshot import build_observed

    now = datetime(2026, 1, 1, 12, tzinfo=UTC)
    job = {"metadata": {"name": "llama", "namespace": "ml", "uid": "u1", "generation": 3},
           "status": {"phase": "Running", "generation": 2}}
    svc = {"metadata": {"labels": {api.LABEL_JOB: "llama", api.LABEL_GENERATION: "2"}, "ownerReferences": [OWNER]}}
    node = {"metadata": {"name": "n1", "labels": {api.NODE_POOL_LABEL: "a"}},
            "status": {"allocatable": {"google.com/tpu": "4"}, "conditions": [{"type": "Ready", "status": "True"}]}}
    other = {"metadata": {"labels": {}}, "status": {"phase": "Running"},
             "spec": {"nodeName": "n1", "containers": [{"resources": {"requests": {"google.com/tpu": "4"}}}]}}
    observed = build_observed(job, now=now, pods=[POD, {"metadata": {"name": "not-a-worker"}}], services=[svc],
                              nodes=[node], other_pods=[POD, other])
    assert observed.job.name == "llama" and observed.job.uid == "u1" and observed.spec_generation == 3
    assert observed.status.phase == "Running" and observed.status.generation == 2
    assert [p.name for p in observed.pods] == ["llama-g2-s1-h0"] and observed.services == (2,)
    assert observed.nodes[0].in_use_by_others == {"google.com/tpu": 4}


LEASE_CASES = {
    # id: (the Lease's spec, live until)
    "renewed": ({"renewTime": "2026-01-01T12:00:00.123456Z", "leaseDurationSeconds": 40},
                datetime(2026, 1, 1, 12, 0, 40, 123456, tzinfo=UTC)),
    "no-duration-40s": ({"renewTime": "2026-01-01T12:00:00Z"}, datetime(2026, 1, 1, 12, 0, 40, tzinfo=UTC)),
    "never-renewed": ({"leaseDurationSeconds": 40}, None),
    "garbage-time": ({"renewTime": "yesterday"}, None),
}


@pytest.mark.parametrize(("spec", "until"), list(LEASE_CASES.values()), ids=list(LEASE_CASES))
def test_parse_lease(spec: dict[str, Any], until: datetime | None) -> None:
    assert parse_lease({"spec": spec}) == until


def test_leases_are_read_only_for_notready_nodes_hosting_a_worker() -> None:
    from resilax_operator.observed.snapshot import build_observed

    def node(name: str, ready: str) -> dict[str, Any]:
        return {"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": ready}]}}

    def pod(host: int, node: str) -> dict[str, Any]:
        return {"metadata": {"name": f"w{host}", "labels": {api.LABEL_GENERATION: "1", api.LABEL_SLICE: "0",
                                                             api.LABEL_HOST: str(host)}, "ownerReferences": [OWNER]},
                "spec": {"nodeName": node}}

    nodes = [node("a", "False"), node("b", "False"), node("c", "Unknown"), node("d", "True")]
    observed = build_observed({"metadata": {"name": "j", "uid": "u1"}}, now=datetime(2026, 1, 1, tzinfo=UTC),
                              pods=[pod(0, "a"), pod(1, "c"), pod(2, "d"), pod(3, "a")], services=[], nodes=nodes)
    assert nodes_needing_lease(observed) == ["a"]
    # A worker exited 76 (a peer process is gone): the Ready nodes of the others are asked too.
    exited = {**pod(0, "a"), "status": {"containerStatuses": [
        {"name": "trainer", "state": {"terminated": {"exitCode": 76}}}]}, "spec": {"nodeName": "a",
                                                                                 "containers": [{"name": "trainer"}]}}
    observed = build_observed({"metadata": {"name": "j", "uid": "u1"}, "status": {"generation": 1}},
                              now=datetime(2026, 1, 1, tzinfo=UTC),
                              pods=[exited, pod(1, "c"), pod(2, "d"), pod(3, "b")], services=[], nodes=nodes)
    assert nodes_needing_lease(observed) == ["a", "b", "d"]


MAINTENANCE_TIMES = {
    "epoch-seconds": ("1767268800", datetime(2026, 1, 1, 12, 0, tzinfo=UTC)),
    "rfc3339": ("2026-01-01T12:00:00Z", datetime(2026, 1, 1, 12, 0, tzinfo=UTC)),
    "naive-iso-is-utc": ("2026-01-01T12:00:00", datetime(2026, 1, 1, 12, 0, tzinfo=UTC)),
    "empty": ("", None),
    "words": ("next tuesday", None),
}


@pytest.mark.parametrize(("raw", "when"), list(MAINTENANCE_TIMES.values()), ids=list(MAINTENANCE_TIMES))
def test_parse_maintenance_time(raw: str, when: datetime | None) -> None:
    assert parse_maintenance_time(raw) == when


# ---------------------------------------------------------------- ownership (issue 25, item 8)

def _ref(**changes: Any) -> dict[str, Any]:
    return {**OWNER, **changes}


OWNERSHIP_CASES = {
    # id: (the object's ownerReferences, whether it is the job's own)
    "controlled-by-the-job": ([OWNER], True),
    "among-other-references": ([{"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "uid": "c1"}, OWNER], True),
    "another-jaxjob-of-the-same-name": ([_ref(uid="u0")], False),
    "no-owner": ([], False),
    "the-job-but-not-as-controller": ([_ref(controller=False)], False),
    "the-jobs-uid-another-kind": ([_ref(kind="Deployment", apiVersion="apps/v1")], False),
    "the-jobs-uid-another-group": ([_ref(apiVersion="example.com/v1alpha1")], False),
}


@pytest.mark.parametrize(("refs", "own"), list(OWNERSHIP_CASES.values()), ids=list(OWNERSHIP_CASES))
def test_only_what_the_job_owns_is_its_own(refs: list[dict[str, Any]], own: bool) -> None:
    """A pod or Service carrying the job's label (and a worker's name) is the job's only when the job's
    uid controls it: anything else is never a worker, never deleted, never asked anything."""
    from resilax_operator.observed.snapshot import build_observed
    from resilax_operator.ownership import owner_uid

    pod = {**POD, "metadata": {**POD["metadata"], "ownerReferences": refs}}  # type: ignore[dict-item]
    svc = {"metadata": {"labels": {api.LABEL_JOB: "llama", api.LABEL_GENERATION: "2"}, "ownerReferences": refs}}
    job = {"metadata": {"name": "llama", "namespace": "ml", "uid": "u1"}, "status": {"generation": 2}}
    observed = build_observed(job, now=datetime(2026, 1, 1, tzinfo=UTC), pods=[pod], services=[svc], nodes=[])
    assert (owner_uid(pod) == "u1") is own
    assert [p.name for p in observed.pods] == (["llama-g2-s1-h0"] if own else [])
    assert observed.services == ((2,) if own else ())


def test_a_job_without_a_uid_owns_nothing() -> None:
    from resilax_operator.observed.snapshot import build_observed

    orphan = {**POD, "metadata": {**POD["metadata"], "ownerReferences": []}}  # type: ignore[dict-item]
    observed = build_observed({"metadata": {"name": "llama"}}, now=datetime(2026, 1, 1, tzinfo=UTC),
                              pods=[orphan], services=[], nodes=[])
    assert observed.pods == ()


def test_parse_pod_start_up_states_and_scheduling_time() -> None:
    raw = {"metadata": {"name": "a", "labels": {api.LABEL_GENERATION: "1", api.LABEL_SLICE: "0", api.LABEL_HOST: "0"}},
           "spec": {"nodeName": "n1"},
           "status": {"phase": "Pending",
                      "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-01-01T12:00:00Z"}],
                      "initContainerStatuses": [{"name": "resilax-sidecar", "state": {"waiting": {"reason": "PodInitializing"}}}],
                      "containerStatuses": [{"name": "trainer", "state": {"waiting": {"reason": "PodInitializing"}}}]}}
    p = parse_pod(raw)
    assert p is not None and p.waiting == ()
    assert p.starting == (("resilax-sidecar", "PodInitializing"), ("trainer", "PodInitializing"))
    assert p.scheduled_at == datetime(2026, 1, 1, 12, tzinfo=UTC)


def _job(name: str, uid: str, storage: str, phase: str | None = None, deleting: bool = False) -> dict:
    meta: dict = {"name": name, "namespace": "ml", "uid": uid}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"checkpoint": {"storage": storage}}, "status": {"phase": phase} if phase else {}}


def test_decide_storage_sharers_lists_the_other_live_jobs_on_the_same_storage() -> None:
    from resilax_operator.observed.snapshot import decide_storage_sharers

    me = _job("a", "uid-a", "gs://b/run")
    jobs = [me, _job("b", "uid-b", "gs://b/run/", "Running"), _job("c", "uid-c", "gs://b/other", "Running"),
            _job("d", "uid-d", "gs://b/run", "Failed"), _job("e", "uid-e", "gs://b/run", "Succeeded"),
            _job("f", "uid-f", "gs://b/run", "Running", deleting=True), _job("g", "uid-g", "gs://b/run")]
    assert decide_storage_sharers(me, jobs) == (("uid-b", "ml/b"), ("uid-g", "ml/g"))
    assert decide_storage_sharers(_job("x", "uid-x", ""), jobs) == ()


@pytest.mark.parametrize(("mine", "theirs", "shared"), [
    ("/data/ckpt", "/data/./ckpt", True),
    ("/data/ckpt", "/data/ckpt/", True),
    ("/data/ckpt", "/data//x/../ckpt", True),
    ("/data/ckpt", "/data/ckpt2", False),
    ("gs://b/run", "gs://b//run/./", True),
    ("gs://b/run", "gs://c/run", False),
    ("pvc://claim/runs/a", "/var/run/resilax/storage/runs/a", True),
    ("/var/run/resilax/storage/runs/./a/", "pvc://claim/runs/a", True),
    ("pvc://claim/runs/a", "pvc://claim/runs//a", True),
    ("pvc://claim/runs/a", "pvc://other/runs/a", False),  # two claims at the same mount: two storages
    ("pvc://claim/runs/a", "/var/run/resilax/storage/runs/b", False),
], ids=["dot", "trailing-slash", "dot-dot", "other-folder", "gs-normalised", "other-bucket", "pvc-and-its-mount",
        "mount-and-pvc", "pvc-normalised", "other-claim", "other-mount-folder"])
def test_storage_roots_are_compared_after_normalisation(mine: str, theirs: str, shared: bool) -> None:
    """Issue 40, item 7: two jobs share a root when their storages are one place, not only one string."""
    from resilax_operator.observed.snapshot import decide_storage_sharers

    jobs = [_job("a", "uid-a", mine), _job("b", "uid-b", theirs, "Running")]
    assert decide_storage_sharers(jobs[0], jobs) == ((("uid-b", "ml/b"),) if shared else ())


def test_the_lease_of_a_missing_pods_last_node_is_read_while_it_has_no_pod() -> None:
    """A process of the current generation with no pod yet (its pod was lost): the Lease of the Ready node
    it last ran on is read, so the new pod is kept off it while that Lease is stale (nodes_held_down)."""
    from resilax_operator.observed.snapshot import build_observed

    def node(name: str) -> dict[str, Any]:
        return {"metadata": {"name": name}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}

    def pod(host: int, node: str) -> dict[str, Any]:
        return {"metadata": {"name": f"j-g2-s0-h{host}", "labels": {
                    api.LABEL_GENERATION: "2", api.LABEL_SLICE: "0", api.LABEL_HOST: str(host)},
                    "ownerReferences": [OWNER]}, "spec": {"nodeName": node}}

    status = {"generation": 2, "shape": {"topology": "2x4", "count": 1, "hosts": 2},
              "workerNodes": {"0": "a", "1": "b"}}
    both = build_observed({"metadata": {"name": "j", "uid": "u1"}, "status": status},
                          now=datetime(2026, 1, 1, tzinfo=UTC), pods=[pod(0, "a"), pod(1, "c")], services=[],
                          nodes=[node("a"), node("b"), node("c")])
    assert nodes_needing_lease(both) == []  # every process has its pod: nothing read
    one = build_observed({"metadata": {"name": "j", "uid": "u1"}, "status": status},
                         now=datetime(2026, 1, 1, tzinfo=UTC), pods=[pod(0, "a")], services=[],
                         nodes=[node("a"), node("b"), node("c")])
    assert nodes_needing_lease(one) == ["b"]  # process 1 has no pod; it last ran on b
