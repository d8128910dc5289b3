"""execute.py carries out what the decision says and decides nothing itself: each pod is deleted as its
PodDeletion says (not before its time), and a pod the API server refuses goes back to the pure side.
Against the recording in-memory API of test_op_cache (it counts requests; the real API server runs in
the cluster tests)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from resilax_operator import api, execute
from resilax_operator.actions import DeleteGeneration, PodDeletion
from resilax_operator.cache import WorldCache
from resilax_operator.k8s import KubeError
from resilax_operator.observe import observe
from test_op_cache import LOG, NS, SETTINGS, FakeAPI, _job, _node


def _fake(cls: type[FakeAPI] = FakeAPI) -> FakeAPI:
    fake = cls()
    fake.put(f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/llama", _job())
    for i in range(2):
        fake.put(f"/api/v1/nodes/node-{i}", _node(f"node-{i}"))
    fake.cache = WorldCache(fake, [NS])
    for informer in fake.cache.informers():
        informer._relist()
    return fake


class RefusingAPI(FakeAPI):
    """An API server whose admission refuses every worker pod (as Pod Security does)."""

    def create(self, manifest: Any) -> dict[str, Any] | None:
        if manifest["kind"] == "Pod":
            raise KubeError(403, "POST pods: 403", 'pods "x" is forbidden: violates PodSecurity "baseline:latest"')
        return super().create(manifest)


def test_a_refused_pod_is_reported_in_the_status_by_the_pure_side() -> None:
    fake = _fake(RefusingAPI)
    execute.reconcile_job(fake, fake.cache, NS, "llama", SETTINGS, LOG)  # type: ignore[arg-type]
    status = (fake.cache.job(NS, "llama") or {})["status"]  # type: ignore[union-attr]
    assert status["generation"] == 1  # the status naming the generation was written first
    ready = next(c for c in status["conditions"] if c["type"] == api.COND_READY)
    assert ready["reason"] == api.POD_CREATION_REFUSED.name and "violates PodSecurity" in ready["message"]
    events = [p for p in fake.objects if "/events/" in p]
    reasons = [fake.objects[p]["reason"] for p in events]
    assert reasons.count(api.POD_CREATION_REFUSED.name) == 1
    execute.reconcile_job(fake, fake.cache, NS, "llama", SETTINGS, LOG)  # type: ignore[arg-type]
    again = [fake.objects[p]["reason"] for p in fake.objects if "/events/" in p]
    assert again.count(api.POD_CREATION_REFUSED.name) == 1  # the same refusal: no second event


@pytest.mark.parametrize(("seconds", "deleted"), [(-1, True), (0, True), (1, False)],
                         ids=["not-before-passed", "not-before-now", "not-before-ahead"])
def test_a_pod_is_not_deleted_before_its_time(seconds: int, deleted: bool) -> None:
    fake = _fake()
    for _ in range(6):
        execute.reconcile_job(fake, fake.cache, NS, "llama", SETTINGS, LOG)  # type: ignore[arg-type]
        fake.run_pods()
    world = observe(fake, fake.cache, fake.cache.job(NS, "llama") or {}, SETTINGS, LOG)  # type: ignore[arg-type]
    pod = world.observed.pods[0].name
    fake.requests.clear()
    action = DeleteGeneration(1, "Preemption", (
        PodDeletion(pod, grace_seconds=2, not_before=world.observed.now + timedelta(seconds=seconds)),))
    execute.execute(fake, fake.cache, world, [action], SETTINGS, LOG)  # type: ignore[arg-type]
    pod_deletes = [r for r in fake.requests if r[0] == "DELETE" and "/pods/" in r[1]]
    assert pod_deletes == ([("DELETE", f"/api/v1/namespaces/{NS}/pods/{pod}")] if deleted else [])
    # no per-generation Service of the job's exists (the job-wide one serves every generation): none deleted
    assert not [p for m, p in fake.requests if m == "DELETE" and "/services/" in p]


class LockWatchingAPI(FakeAPI):
    """Records, for each worker pod created, whether the planning lock was held meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.created: list[tuple[str, bool]] = []

    def create(self, manifest: Any) -> dict[str, Any] | None:
        if manifest["kind"] == "Pod":
            assert self.cache is not None
            self.created.append((manifest["metadata"]["name"], self.cache.planning.locked()))
        return super().create(manifest)


def test_a_kueue_job_holds_the_planning_lock_only_while_creating_its_lead_pods() -> None:
    """Issue 25, item 6: a job with a Kueue queue creates all its pods at once, but under the planning
    lock (which every other job's new generation waits for) only the first pod of each slice; the rest
    come with the next reconcile, the lock free."""
    fake = LockWatchingAPI()
    job = _job()
    job["metadata"]["labels"] = {api.KUEUE_QUEUE_LABEL: "team-a"}
    job["spec"]["slices"]["count"] = 2
    fake.put(f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/llama", job)
    for i, pool in enumerate(["pool-a", "pool-a", "pool-b", "pool-b"]):
        node = _node(f"node-{i}")
        node["metadata"]["labels"][api.NODE_POOL_LABEL] = pool
        fake.put(f"/api/v1/nodes/node-{i}", node)
    fake.cache = WorldCache(fake, [NS])
    for informer in fake.cache.informers():
        informer._relist()
    execute.reconcile_job(fake, fake.cache, NS, "llama", SETTINGS, LOG)
    assert fake.created == [("llama-g1-s0-h0", True), ("llama-g1-s1-h0", True)]
    execute.reconcile_job(fake, fake.cache, NS, "llama", SETTINGS, LOG)
    assert fake.created[2:] == [("llama-g1-s0-h1", False), ("llama-g1-s1-h1", False)]
    assert not fake.cache.planning.locked()
