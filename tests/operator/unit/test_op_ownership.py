"""Ownership (issue 25, item 8): the job's pods, Services and token Secret are its own by owner uid,
never by name or label. A 409 on an object of another owner is NameConflict (condition and event),
never adoption; the token Secret is checked for its owner and re-created when deleted.

The pure side (policies/name_conflict.py) in tables; the I/O side (execute.py, k8s.py) against the
recording in-memory API of test_op_cache (the real API server runs in the cluster tests)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from op_world import SETTINGS as WORLD_SETTINGS
from op_world import running_world
from resilax_operator import api, execute
from resilax_operator import status as st
from resilax_operator.actions import EmitEvent, RequeueAfter, SetStatus
from resilax_operator.errors import NameConflictError
from resilax_operator.policies import name_conflict
from test_op_cache import LOG, NS, SETTINGS, FakeAPI
from test_op_execute import _fake

JOB = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/llama"
SECRET = f"/api/v1/namespaces/{NS}/secrets/llama-resilax-token"
STRANGER = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "other", "uid": "uid-other", "controller": True}
OLD_SELF = {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": "llama", "uid": "uid-0", "controller": True}


# ---------------------------------------------------------------- the pure side

def test_a_conflict_is_reported_once_and_tried_again() -> None:
    w = running_world()
    conflict = NameConflictError("Pod", "llama-g1-s0-h0", "owned by Deployment other (uid uid-other)")
    actions = name_conflict.decide(w.observed(), conflict, WORLD_SETTINGS)
    assert [type(a) for a in actions] == [SetStatus, EmitEvent, RequeueAfter]
    status = next(a.status for a in actions if isinstance(a, SetStatus))
    cond, ready = status.condition(api.COND_NAME_CONFLICT), status.condition(api.COND_READY)
    assert cond is not None and cond.status == "True" and ready is not None and ready.reason == api.NAME_CONFLICT.name
    assert "Pod llama-g1-s0-h0 exists and is not this job's (owned by Deployment other" in cond.message
    w.status = status
    assert [type(a) for a in name_conflict.decide(w.observed(), conflict, WORLD_SETTINGS)] == [RequeueAfter]
    other = NameConflictError("Service", "llama-g1", "no owner")
    assert EmitEvent in [type(a) for a in name_conflict.decide(w.observed(), other, WORLD_SETTINGS)]


SETTLE_CASES = {
    # id: (what the generation's workers are, whether NameConflict clears)
    "all-running": ("running", True),
    "one-missing": ("missing", False),
    "one-pending": ("pending", False),
    "workers-not-all-created": ("uncreated", False),
}


@pytest.mark.parametrize(("workers", "clears"), list(SETTLE_CASES.values()), ids=list(SETTLE_CASES))
def test_the_conflict_clears_once_every_worker_is_the_jobs_and_runs(workers: str, clears: bool) -> None:
    w = running_world()
    s = st.set_condition(w.status, api.COND_NAME_CONFLICT, True, api.NAME_CONFLICT.name, "m", w.now)
    name = w.gen_pods()[3].name
    if workers == "missing":
        del w.pods[name]
    elif workers == "pending":
        w.pods[name] = w.pods[name].__class__(name, 1, w.pods[name].slice_index, w.pods[name].host)
    elif workers == "uncreated":
        s = st.JobStatus(**{**s.__dict__, "workers_created": False})
    settled = name_conflict.settle(s, w.observed(), w.now).condition(api.COND_NAME_CONFLICT)
    assert settled is not None and (settled.status == "False") is clears


# ---------------------------------------------------------------- the I/O side: never adopted

def _reconcile(fake: FakeAPI, times: int = 1) -> None:
    for _ in range(times):
        execute.reconcile_job(fake, fake.cache, NS, "llama", SETTINGS, LOG)  # type: ignore[arg-type]


def _status(fake: FakeAPI) -> dict[str, Any]:
    return dict((fake.cache.job(NS, "llama") or {}).get("status") or {})  # type: ignore[union-attr]


def _condition(fake: FakeAPI, kind: str) -> dict[str, Any]:
    return next((c for c in _status(fake).get("conditions") or [] if c["type"] == kind), {})


def _events(fake: FakeAPI, reason: str) -> list[str]:
    return [o["message"] for p, o in fake.objects.items() if "/events/" in p and o["reason"] == reason]


def _foreign_pod(labelled: bool, owner: dict[str, Any] | None) -> dict[str, Any]:
    labels = {api.LABEL_JOB: "llama", api.LABEL_GENERATION: "1", api.LABEL_SLICE: "0", api.LABEL_HOST: "0"}
    return {"kind": "Pod", "metadata": {"name": "llama-g1-s0-h0", "namespace": NS, "labels": labels if labelled else {},
                                        "ownerReferences": [owner] if owner else []},
            "spec": {"nodeName": "node-0", "containers": [{"name": "trainer", "image": "evil"}]},
            "status": {"phase": "Running", "podIP": "10.9.9.9"}}


FOREIGN_PODS = {
    # id: (labelled resilax.dev/job=llama, its owner)
    "labelled-owned-by-another-kind": (True, STRANGER),
    "labelled-left-by-a-deleted-jaxjob-of-the-same-name": (True, OLD_SELF),
    "unlabelled-no-owner": (False, None),
}


@pytest.mark.parametrize("hosts", [2, 1], ids=["two-hosts", "one-host"])
@pytest.mark.parametrize(("labelled", "owner"), list(FOREIGN_PODS.values()), ids=list(FOREIGN_PODS))
def test_a_pod_with_a_workers_name_is_not_adopted(labelled: bool, owner: dict[str, Any] | None, hosts: int) -> None:
    """The job waits for the name, in the same generation (with one host too, whose status says its
    workers are created before the pod is: the conflict says they are not, so no PodLost moves it on)."""
    fake = _fake()
    if hosts == 1:
        job = dict(fake.objects[JOB])
        job["spec"] = {**job["spec"], "slices": {"accelerator": "cpu", "topology": "1x2", "count": 1}}
        fake.put(JOB, job)
        fake.put("/api/v1/nodes/cpu-0", {"kind": "Node", "metadata": {"name": "cpu-0", "labels": {
            api.NODE_POOL_LABEL: "cpu"}}, "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    path = f"/api/v1/namespaces/{NS}/pods/llama-g1-s0-h0"
    fake.put(path, _foreign_pod(labelled, owner))
    _reconcile(fake, 3)
    assert _status(fake)["generation"] == 1 and _status(fake)["shape"]["hosts"] == hosts
    cond = _condition(fake, api.COND_NAME_CONFLICT)
    assert cond.get("status") == "True" and "Pod llama-g1-s0-h0" in cond["message"], _status(fake)
    assert len(_events(fake, api.NAME_CONFLICT.name)) == 1
    assert fake.objects[path]["spec"]["containers"][0]["image"] == "evil"  # untouched, not replaced
    assert not (fake.objects[path]["metadata"].get("annotations") or {})
    assert not any(m == "DELETE" and p == path for m, p in fake.requests)
    assert _status(fake).get("phase") != api.PHASE_RUNNING
    # the squatter goes: the job creates its own worker and runs
    fake.request("DELETE", path)
    for _ in range(8):
        _reconcile(fake)
        fake.run_pods()
    assert _status(fake)["phase"] == api.PHASE_RUNNING and _status(fake)["generation"] == 1
    assert _condition(fake, api.COND_NAME_CONFLICT)["status"] == "False"
    assert fake.objects[path]["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


@pytest.mark.parametrize("labelled", [True, False], ids=["labelled", "unlabelled"])
def test_a_service_of_another_owner_is_not_adopted(labelled: bool) -> None:
    fake = _fake()
    path = f"/api/v1/namespaces/{NS}/services/llama-workers"
    fake.put(path, {"kind": "Service", "metadata": {"name": "llama-workers", "namespace": NS,
                                                    "labels": {api.LABEL_JOB: "llama"} if labelled else {},
                                                    "ownerReferences": [STRANGER]}})
    _reconcile(fake, 3)
    assert "Service llama-workers" in _condition(fake, api.COND_NAME_CONFLICT)["message"]
    assert not [p for p in fake.objects if "/pods/" in p]  # no worker without its Service
    assert path in fake.objects


@pytest.mark.parametrize(("owner", "deleted"), [(None, True), (STRANGER, False)], ids=["the-jobs", "another-owners"])
def test_a_per_generation_service_goes_with_its_generation_only_if_the_jobs(owner: dict[str, Any] | None,
                                                                            deleted: bool) -> None:
    """Operators before the job-wide Service made one per generation (`<job>-g<N>`): deleted with its
    generation as a leftover, but only when the job owns it."""
    fake = _fake()
    for _ in range(6):
        _reconcile(fake)
        fake.run_pods()
    refs = [{**OLD_SELF, "uid": "uid-1"}] if owner is None else [owner]
    path = f"/api/v1/namespaces/{NS}/services/llama-g1"
    fake.put(path, {"kind": "Service", "metadata": {"name": "llama-g1", "namespace": NS, "ownerReferences": refs,
                                                    "labels": {api.LABEL_JOB: "llama", api.LABEL_GENERATION: "1"}}})
    fake.request("DELETE", f"/api/v1/namespaces/{NS}/pods/llama-g1-s0-h0")  # generation 1 goes
    for _ in range(6):
        _reconcile(fake)
        fake.run_pods()
    assert _status(fake)["generation"] == 2
    assert (path not in fake.objects) is deleted


def test_a_token_secret_the_job_does_not_own_is_never_used() -> None:
    fake = _fake()
    fake.put(SECRET, {"kind": "Secret", "metadata": {"name": "llama-resilax-token", "namespace": NS,
                                                     "ownerReferences": [STRANGER]},
                      "data": {api.TOKEN_KEY: base64.b64encode(b"known-to-someone").decode()}})
    _reconcile(fake, 3)
    assert "Secret llama-resilax-token" in _condition(fake, api.COND_NAME_CONFLICT)["message"]
    assert not [p for p in fake.objects if "/pods/" in p] and not fake._tokens
    execute.cleanup_job(fake, fake.cache, fake.cache.job(NS, "llama") or {}, SETTINGS, LOG)  # type: ignore[arg-type]
    assert SECRET in fake.objects  # not the job's: not deleted with it either


def test_a_deleted_token_secret_is_recreated_with_a_new_token() -> None:
    """Deleting the Secret rotates the token (issue 40, item 5): the operator never writes back the copy
    it had. The real API server and a sidecar: tests/sidecar/test_token_rotation.py."""
    fake = _fake()
    for _ in range(6):
        _reconcile(fake)
        fake.run_pods()
    assert _status(fake)["phase"] == api.PHASE_RUNNING
    token = fake.objects[SECRET]["data"][api.TOKEN_KEY]
    fake.request("DELETE", SECRET)
    fake.request("DELETE", f"/api/v1/namespaces/{NS}/pods/llama-g1-s0-h0")  # a new generation is needed
    for _ in range(8):
        _reconcile(fake)
        fake.run_pods()
    assert _status(fake)["phase"] == api.PHASE_RUNNING and _status(fake)["generation"] == 2
    assert fake.objects[SECRET]["data"][api.TOKEN_KEY] != token
    assert fake.objects[SECRET]["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    execute.cleanup_job(fake, fake.cache, fake.cache.job(NS, "llama") or {}, SETTINGS, LOG)  # type: ignore[arg-type]
    assert SECRET not in fake.objects  # the job's own: deleted with it


def test_pods_stuck_starting_get_their_token_secret_back() -> None:
    """A Secret deleted after the generation's pods were created (they then never start, as a kubelet
    keeps them in PodInitializing): the stuck report re-creates it."""
    fake = _fake()
    for _ in range(6):
        _reconcile(fake)
        fake.run_pods()
    fake.request("DELETE", SECRET)
    for path in [p for p in fake.objects if "/pods/" in p]:
        pod = dict(fake.objects[path])
        pod["status"] = {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2020-01-01T00:00:00Z"}],
            "initContainerStatuses": [{"name": api.SIDECAR_CONTAINER, "state": {"waiting": {"reason": "PodInitializing"}}}]}
        fake.put(path, pod)
    job = dict(fake.objects[JOB])
    job["status"] = {**job["status"], "generationStartTime": "2020-01-01T00:00:00Z"}
    fake.put(JOB, job)
    _reconcile(fake)
    assert SECRET in fake.objects
    ready = _condition(fake, api.COND_READY)
    assert ready["reason"] == api.CONTAINER_WAITING.name and "PodInitializing" in ready["message"], ready


def test_a_pod_recreated_under_a_workers_name_since_it_was_observed_is_not_deleted() -> None:
    """Deletes carry the observed pod's uid as a precondition: a pod of another owner created under the
    name between the observation and the delete stays."""
    from resilax_operator.actions import DeleteGeneration, PodDeletion
    from resilax_operator.observed.observe import observe

    fake = _fake()
    for _ in range(6):
        _reconcile(fake)
        fake.run_pods()
    world = observe(fake, fake.cache, fake.cache.job(NS, "llama") or {}, SETTINGS, LOG)  # type: ignore[arg-type]
    path = f"/api/v1/namespaces/{NS}/pods/llama-g1-s0-h0"
    assert world.observed.pods[0].uid == fake.objects[path]["metadata"]["uid"]
    fake.objects[path] = {**_foreign_pod(True, STRANGER), "metadata": {  # behind the cache's back
        **_foreign_pod(True, STRANGER)["metadata"], "uid": "uid-squatter"}}
    action = DeleteGeneration(1, "Preemption", (PodDeletion("llama-g1-s0-h0", force=True), PodDeletion("other")))
    execute.execute(fake, fake.cache, world, [action], SETTINGS, LOG)  # type: ignore[arg-type]
    assert fake.objects[path]["metadata"]["uid"] == "uid-squatter"
    assert ("DELETE", f"/api/v1/namespaces/{NS}/pods/other") not in fake.requests  # not a pod of the job's


def test_token_rechecks_of_jobs_started_together_spread_over_the_period() -> None:
    """Each job reads its token Secret again once per period at its own phase (k8s.token_recheck_due):
    a first read is always due, a job is due exactly once per period, and twenty jobs read at the same
    moment come due at different times, never all in one 30 s window (issue 27's request budget)."""
    from resilax_operator.k8s import token_recheck_due

    period = 600.0
    assert token_recheck_due("uid-a", None, 5.0, period)
    uids = [f"00000000-0000-0000-0000-{n:012d}" for n in range(20)]
    due_at = {}
    for uid in uids:
        times = [t for t in range(1, 1201) if token_recheck_due(uid, 0.0, float(t), period)]
        assert times and times[0] <= period, (uid, times[:3])
        due_at[uid] = times[0]
        assert not token_recheck_due(uid, float(times[0]), float(times[0]) + period - 1, period)
        assert token_recheck_due(uid, float(times[0]), float(times[0]) + period, period)
    window_counts = [sum(1 for t in due_at.values() if start <= t < start + 30) for start in range(0, 600)]
    assert len(set(due_at.values())) > 10 and max(window_counts) <= 10, sorted(due_at.values())
