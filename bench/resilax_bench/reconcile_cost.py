"""What one reconcile's view of the cluster costs, in memory: ``python -m resilax_bench.reconcile_cost [--jobs 100] [--hosts 16]``.

No cluster: the nodes of the scale benchmark (`scale.build_nodes`: one CPU node and `jobs + 1` slices of
`hosts` TPU hosts) and `jobs` JAXJobs of one slice each, every worker pod bound and Running, are fed to
a `WorldCache` as watch events. For every job, in turn, the CPU time of
1. the full parse (`observed.build_observed` over every Node and every live pod, what each reconcile
   did before the indexes), and
2. the indexed view (`WorldCache.pods_of` / `services_of` / `nodes_for` + `assemble_observed`,
   what `observe.observe` does now),
asserting that both give the same `Observed`. Prints mean, p50 and p99 in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

from resilax_operator import api
from resilax_operator.observed.cache import WorldCache
from resilax_operator.observed.snapshot import Observed, assemble_observed, build_observed

from .scale import ScaleConfig, build_job, build_nodes, job_name, pool_name

NAMESPACE = "bench"


class _Idle:
    def list_page(self, path: str, query: Mapping[str, Any]) -> dict[str, Any]:
        raise AssertionError("fed by hand")

    def watch(self, path: str, query: Mapping[str, Any], timeout_seconds: int,
              stop: threading.Event) -> Iterator[dict[str, Any]]:
        raise AssertionError("fed by hand")


def build_world(jobs: int, hosts: int) -> tuple[WorldCache, list[dict[str, Any]]]:
    """A cache holding the fleet, and the JAXJobs (status Running, generation 1)."""
    cache = WorldCache(_Idle(), [NAMESPACE])
    version = 0
    for spec in build_nodes(ScaleConfig(jobs=jobs, hosts=hosts)):
        version += 1
        cache.nodes._apply("ADDED", {
            "kind": "Node", "metadata": {"name": spec.name, "labels": spec.labels, "resourceVersion": str(version)},
            "spec": {"taints": list(spec.taints)},
            "status": {"capacity": spec.capacity, "allocatable": spec.capacity,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "lastTransitionTime": "2026-12-04T08:00:00Z"}]}}, notify=False)
    bodies = []
    for i in range(jobs):
        name = job_name(i)
        job = build_job(name, hosts, "/tmp/unused", 5)
        job["metadata"].update(namespace=NAMESPACE, uid=f"uid-{i}", generation=1)
        job["status"] = {"phase": api.PHASE_RUNNING, "generation": 1, "hosts": hosts}
        bodies.append(job)
        owner = [{"apiVersion": api.API_VERSION, "kind": api.KIND, "name": name, "uid": f"uid-{i}", "controller": True}]
        for h in range(hosts):
            version += 1
            pod = {"kind": "Pod", "metadata": {
                "name": f"{name}-g1-s0-h{h}", "namespace": NAMESPACE, "resourceVersion": str(version),
                "ownerReferences": owner, "labels": {api.LABEL_JOB: name, api.LABEL_GENERATION: "1", api.LABEL_SLICE: "0", api.LABEL_HOST: str(h)}},
                "spec": {"nodeName": f"{pool_name(i)}-h{h}", "nodeSelector": {api.NODE_POOL_LABEL: pool_name(i)},
                         "containers": [{"name": "trainer", "resources": {"limits": {api.TPU_RESOURCE: "4"}}}]},
                "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}],
                           "containerStatuses": [{"name": "trainer", "state": {"running": {}}}]}}
            for informer in (*cache.job_pods, *cache.live_pods):
                informer._apply("ADDED", pod, notify=False)
        version += 1
        service = {"kind": "Service", "metadata": {"name": f"{name}-g1", "namespace": NAMESPACE,
                                                   "resourceVersion": str(version), "ownerReferences": owner,
                                                   "labels": {api.LABEL_JOB: name, api.LABEL_GENERATION: "1"}}}
        for informer in cache.services:
            informer._apply("ADDED", service, notify=False)
    return cache, bodies


def full_parse(cache: WorldCache, job: Mapping[str, Any], now: datetime) -> Observed:
    name = job["metadata"]["name"]
    mine = [p for i in cache.job_pods for p in i.items() if p["metadata"]["labels"].get(api.LABEL_JOB) == name]
    services = [s for i in cache.services for s in i.items() if s["metadata"]["labels"].get(api.LABEL_JOB) == name]
    return build_observed(job, now=now, pods=mine, services=services, nodes=cache.nodes.items(),
                          other_pods=[p for i in cache.live_pods for p in i.items()])


def indexed(cache: WorldCache, job: Mapping[str, Any], now: datetime) -> Observed:
    name = job["metadata"]["name"]
    _, workers = cache.pods_of(NAMESPACE, name)
    return assemble_observed(job, now=now, pods=workers, services=cache.services_of(NAMESPACE, name),
                             nodes=cache.nodes_for(NAMESPACE, name))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m resilax_bench.reconcile_cost", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=100)
    p.add_argument("--hosts", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    cache, jobs = build_world(a.jobs, a.hosts)
    now = datetime.now(UTC)
    print(f"{cache.node_count()} nodes, {a.jobs} jobs x {a.hosts} hosts; CPU ms per job's view "
          f"({a.rounds} rounds):")
    for label, view in (("full parse (before)", full_parse), ("indexes (now)", indexed)):
        times = []
        for _ in range(a.rounds):
            for job in jobs:
                t0 = time.process_time()
                view(cache, job, now)
                times.append(1000 * (time.process_time() - t0))
        times.sort()
        print(f"  {label:20s} mean {statistics.fmean(times):7.2f}  p50 {times[len(times) // 2]:7.2f}  "
              f"p99 {times[int(0.99 * (len(times) - 1))]:7.2f}")
    for job in jobs[:: max(1, len(jobs) // 10)]:
        view = indexed(cache, job, now)
        if full_parse(cache, job, now) != view:
            raise SystemExit(f"{job['metadata']['name']}: the indexed view differs from the full parse")
        if len(view.pods) != a.hosts:  # the job's own (by owner uid): a view without them measures nothing
            raise SystemExit(f"{job['metadata']['name']}: {len(view.pods)} of its {a.hosts} pods in its view")
    print("  the two views are equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
