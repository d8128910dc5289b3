"""execute.py carries out what the decision says and decides nothing itself: each pod is deleted as its
PodDeletion says (not before its time), and a pod the API server refuses goes back to the pure side.
Against the recording in-memory API of test_op_cache (it counts requests; the real API server runs in
the cluster tests)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pytest
from resilax_operator import api, execute
from resilax_operator.actions import DeleteGeneration, PodDeletion
from resilax_operator.k8s import KubeError, SidecarError
from resilax_operator.observed.cache import WorldCache
from resilax_operator.observed.observe import observe
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


class TellingAPI(FakeAPI):
    """Records the pod deletions and the sidecar calls in one order; a sidecar at `silent` errs."""

    def __init__(self, silent: str = "") -> None:
        super().__init__()
        self.order: list[tuple[Any, ...]] = []
        self.silent = silent

    def request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> dict[str, Any] | None:
        if method == "DELETE" and "/pods/" in path:
            self.order.append(("DELETE", path.rsplit("/", 1)[1], (body or {}).get("gracePeriodSeconds")))
        return super().request(method, path, body, **kwargs)

    def sidecar(self, method: str, ip: str, port: int, path: str, body: Mapping[str, Any] | None = None,
                token: str | None = None) -> dict[str, Any]:
        self.order.append((method, path, ip, dict(body or {}), token is not None))
        if ip == self.silent:
            raise SidecarError(f"{ip}: connection refused")
        return dict(body or {})


@pytest.mark.parametrize("silent", [False, True], ids=["told", "sidecar-gone"])
def test_the_pods_deleted_with_a_grace_are_told_the_lost_processes_after_their_deletion(silent: bool) -> None:
    """`DeleteGeneration.lost` (a node proven down): every pod is deleted first (a sidecar slow to answer
    never delays a deletion), then the sidecars of the pods deleted with a grace, not the forced one's,
    are told with the job's token; a sidecar that does not answer changes nothing."""
    fake = _fake(TellingAPI)
    assert isinstance(fake, TellingAPI)
    for _ in range(6):
        execute.reconcile_job(fake, fake.cache, NS, "llama", SETTINGS, LOG)  # type: ignore[arg-type]
        fake.run_pods()
    world = observe(fake, fake.cache, fake.cache.job(NS, "llama") or {}, SETTINGS, LOG)  # type: ignore[arg-type]
    survivor, dead = world.observed.pods[0], world.observed.pods[1]
    assert survivor.pod_ip and dead.process == 1
    fake.silent = survivor.pod_ip if silent else ""
    fake.order.clear()
    action = DeleteGeneration(1, "NodeLoss", (PodDeletion(survivor.name, grace_seconds=5),
                                              PodDeletion(dead.name, force=True)), lost=(1,))
    execute.execute(fake, fake.cache, world, [action], SETTINGS, LOG)  # type: ignore[arg-type]
    assert fake.order == [("DELETE", survivor.name, 5), ("DELETE", dead.name, 0),
                          ("POST", "/v1/peers/lost", survivor.pod_ip, {"generation": 1, "processes": [1]}, True)]
    fake.order.clear()
    execute.execute(fake, fake.cache, world, [DeleteGeneration(1, "NodeLoss", (PodDeletion(survivor.name, 5),))],
                    SETTINGS, LOG)  # type: ignore[arg-type]
    assert fake.order == [("DELETE", survivor.name, 5)]  # nothing lost: nobody told


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


def _two_pools(fake: FakeAPI) -> None:
    for i, pool in enumerate(["pool-a", "pool-a", "pool-b", "pool-b"]):
        node = _node(f"node-{i}")
        node["metadata"]["labels"][api.NODE_POOL_LABEL] = pool
        fake.put(f"/api/v1/nodes/node-{i}", node)


def test_a_kueue_job_creates_its_pods_with_the_planning_lock_free() -> None:
    """Issue 25 item 6, issue 27 (fleet start-up): a job with a Kueue queue creates all its pods at once;
    none under the planning lock (which every other job's new generation waits for): the plan reserves
    its pools in the cache and the writes run outside. The lead pods (the first of each slice) come with
    the planning reconcile, the rest with the next one."""
    fake = LockWatchingAPI()
    job = _job()
    job["metadata"]["labels"] = {api.KUEUE_QUEUE_LABEL: "team-a"}
    job["spec"]["slices"]["count"] = 2
    fake.put(f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/llama", job)
    _two_pools(fake)
    fake.cache = WorldCache(fake, [NS])
    for informer in fake.cache.informers():
        informer._relist()
    execute.reconcile_job(fake, fake.cache, NS, "llama", SETTINGS, LOG)
    assert fake.created == [("llama-g1-s0-h0", False), ("llama-g1-s1-h0", False)]
    execute.reconcile_job(fake, fake.cache, NS, "llama", SETTINGS, LOG)
    assert fake.created[2:] == [("llama-g1-s0-h1", False), ("llama-g1-s1-h1", False)]
    assert not fake.cache.planning.locked()
    assert not [k for k in fake.cache.fleet._uses if k.startswith("reserved:")]  # every reservation ended


class PlanningMeanwhileAPI(FakeAPI):
    """While the first job's first pod is being created (the API call in flight, the planning lock
    free), the second job plans: as two reconcile threads would."""

    def __init__(self) -> None:
        super().__init__()
        self.meanwhile: list[bool] = []  # the lock was held when the second job planned

    def create(self, manifest: Any) -> dict[str, Any] | None:
        if manifest["kind"] == "Pod" and manifest["metadata"]["name"] == "first-g1-s0-h0":
            assert self.cache is not None
            self.meanwhile.append(self.cache.planning.locked())
            if not self.cache.planning.locked():
                execute.reconcile_job(self, self.cache, NS, "second", SETTINGS, LOG)
        return super().create(manifest)


def test_a_job_planning_while_another_creates_its_pods_never_picks_the_same_pool() -> None:
    """Two pools of one slice each; the second job plans while the first one's pod 0 is still being
    created (not in the cache yet): the first job's reservation holds its pool, so the second takes the
    other one."""
    fake = PlanningMeanwhileAPI()
    for name, uid in (("first", "uid-1"), ("second", "uid-2")):
        job = _job()
        job["metadata"].update(name=name, uid=uid)
        fake.put(f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/{name}", job)
    _two_pools(fake)
    fake.cache = WorldCache(fake, [NS])
    for informer in fake.cache.informers():
        informer._relist()
    execute.reconcile_job(fake, fake.cache, NS, "first", SETTINGS, LOG)
    assert fake.meanwhile == [False]
    pools = {}
    for path, body in fake.objects.items():
        if "/pods/" in path:
            pools[body["metadata"]["name"]] = body["spec"]["nodeSelector"][api.NODE_POOL_LABEL]
    assert set(pools) == {"first-g1-s0-h0", "second-g1-s0-h0"}, pools
    assert pools["first-g1-s0-h0"] != pools["second-g1-s0-h0"], pools
