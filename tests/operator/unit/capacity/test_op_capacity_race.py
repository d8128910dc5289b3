"""Jobs that start together never plan the same free node pool.

Found by the scale benchmark (bench/resilax_bench/scale.py): 100 JAXJobs created at once all planned
pool 0 (capacity counted only pods bound to nodes, and each job planned before the others' pods
existed), waited 300 s for pods that could not be scheduled, and planned again. A pod still pending
but pinned to a pool now holds that pool's devices, the operator's own new pods are in the cache at
once, and one job at a time plans and creates a generation.
"""

from __future__ import annotations

import copy
import logging
import threading
from typing import Any

from resilax_operator import api, execute
from resilax_operator.observed.cache import WorldCache, trim_live_pod
from resilax_operator.observed.devices import count_devices_in_use
from resilax_operator.settings import OperatorSettings
from test_op_cache import NS, FakeAPI, _job

LOG = logging.getLogger("test")
TPU = "google.com/tpu"


def _node(name: str, pool: str) -> dict[str, Any]:
    return {"kind": "Node",
            "metadata": {"name": name, "labels": {api.NODE_POOL_LABEL: pool,
                                                  "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                                  "cloud.google.com/gke-tpu-topology": "2x4"}},
            "spec": {}, "status": {"allocatable": {TPU: "4"}, "conditions": [{"type": "Ready", "status": "True"}]}}


def _pod(job: str, *, node: str | None = None, pool: str | None = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"{job}-{node or pool}", "labels": {api.LABEL_JOB: job}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    spec: dict[str, Any] = {"containers": [{"resources": {"limits": {TPU: "4"}}}]}
    if node:
        spec["nodeName"] = node
    if pool:
        spec["nodeSelector"] = {api.NODE_POOL_LABEL: pool}
    return {"metadata": meta, "spec": spec, "status": {"phase": "Pending" if node is None else "Running"}}


NODES = [_node("a0", "pool-a"), _node("a1", "pool-a"), _node("b0", "pool-b")]


def test_a_pending_pod_holds_the_freest_node_of_its_pool() -> None:
    pods = [_pod("other", node="a0"), _pod("other", pool="pool-a")]
    assert count_devices_in_use(pods, "mine", NODES) == {"a0": {TPU: 4}, "a1": {TPU: 4}}


def test_pending_pods_of_this_job_or_going_away_hold_nothing() -> None:
    pods = [_pod("mine", pool="pool-a"), _pod("other", pool="pool-b", deleting=True)]
    assert count_devices_in_use(pods, "mine", NODES) == {}


def test_a_pending_pod_survives_the_cache_trim() -> None:
    trimmed = trim_live_pod({**_pod("other", pool="pool-a"), "metadata": {"name": "p", "namespace": NS}})
    assert trimmed["spec"]["nodeSelector"] == {api.NODE_POOL_LABEL: "pool-a"}
    assert count_devices_in_use([trimmed], "mine", NODES) == {"a0": {TPU: 4}}


def _two_jobs_two_pools() -> FakeAPI:
    fake = FakeAPI()
    for name in ("llama", "gemma"):
        job = _job()
        job["metadata"].update(name=name, uid=f"uid-{name}")
        fake.put(f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/{name}", job)
    for pool in ("pool-a", "pool-b"):
        for host in range(2):
            node = copy.deepcopy(_node(f"{pool}-{host}", pool))
            fake.put(f"/api/v1/nodes/{pool}-{host}", node)
    fake.cache = WorldCache(fake, [NS])
    for informer in fake.cache.informers():
        informer._relist()
    return fake


def _pools_of_created_pods(fake: FakeAPI) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path, pod in fake.objects.items():
        if "/pods/" in path:
            job = pod["metadata"]["labels"][api.LABEL_JOB]
            out.setdefault(job, set()).add(pod["spec"]["nodeSelector"][api.NODE_POOL_LABEL])
    return out


def test_the_second_job_plans_the_other_pool_before_any_pod_is_scheduled() -> None:
    """No watch event and no scheduling between the two reconciles: only what the operator wrote."""
    fake = _two_jobs_two_pools()
    fake._feed = lambda kind, obj: None  # type: ignore[method-assign]  # the watches say nothing yet
    for name in ("llama", "gemma"):
        execute.reconcile_job(fake, fake.cache, NS, name, OperatorSettings(), LOG)  # type: ignore[arg-type]
    assert _pools_of_created_pods(fake) == {"llama": {"pool-a"}, "gemma": {"pool-b"}}


def test_jobs_reconciled_at_once_plan_different_pools(monkeypatch) -> None:
    """Both reconciles decide once before either creates a pod (a barrier in their first decision)."""
    fake = _two_jobs_two_pools()
    fake._feed = lambda kind, obj: None  # type: ignore[method-assign]
    both_decided = threading.Barrier(2, timeout=10)
    seen = threading.local()
    decide = execute.decide_raw

    def decide_together(*args: Any, **kwargs: Any) -> Any:
        actions = decide(*args, **kwargs)
        if not getattr(seen, "first", False):
            seen.first = True
            both_decided.wait()
        return actions

    monkeypatch.setattr(execute, "decide_raw", decide_together)
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            execute.reconcile_job(fake, fake.cache, NS, name, OperatorSettings(), LOG)  # type: ignore[arg-type]
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(name,)) for name in ("llama", "gemma")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    pools = _pools_of_created_pods(fake)
    assert sorted(pools) == ["gemma", "llama"] and pools["llama"] != pools["gemma"], pools
