"""The watch cache's parsed indexes (observed/indexes.py) give what the full parse of its stores gives.

A reconcile builds its `Observed` from what the cache keeps parsed per watch event (the nodes, the
devices in use per node, each job's pods and Services); `observed.build_observed` parses the stores'
raw bodies from scratch. Random event sequences (adds, changes, deletes, events arriving late and out of
order, events lost then a relist, the operator's own writes and forgets) must leave the two equal for
every job, after every step.
"""

from __future__ import annotations

import copy
import random
import threading
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any

import pytest
from resilax_operator import api
from resilax_operator.observed.cache import Informer, WorldCache, object_key
from resilax_operator.observed.indexes import FleetIndex
from resilax_operator.observed.snapshot import assemble_observed, build_observed

TPU, GPU = api.TPU_RESOURCE, api.GPU_RESOURCE
NOW = datetime(2026, 12, 4, 9, tzinfo=UTC)
POOLS = ("pool-a", "pool-b", "pool-c")
JOBS = (("ns-a", "x"), ("ns-a", "y"), ("ns-b", "x"), ("ns-b", "z"))


class _Idle:
    """A source that is never called: the test drives the informers by hand."""

    def list_page(self, path: str, query: Mapping[str, Any]) -> dict[str, Any]:
        raise AssertionError("not listed here")

    def watch(self, path: str, query: Mapping[str, Any], timeout_seconds: int,
              stop: threading.Event) -> Iterator[dict[str, Any]]:
        raise AssertionError("not watched here")


def _random_node(rng: random.Random, name: str, version: int) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name}
    if rng.random() < 0.9:
        labels[api.NODE_POOL_LABEL] = rng.choice(POOLS)
    allocatable: dict[str, str] = {"cpu": "8"}
    if rng.random() < 0.8:
        allocatable[TPU] = rng.choice(["4", "8", "0"])
    if rng.random() < 0.1:
        allocatable[GPU] = "2"
    ready = rng.choice(["True", "True", "True", "False", "Unknown"])
    taints = [{"key": api.UNREACHABLE_TAINT, "effect": "NoExecute"}] if rng.random() < 0.1 else []
    return {"kind": "Node",
            "metadata": {"name": name, "resourceVersion": str(version), "labels": labels},
            "spec": {"taints": taints, "unschedulable": rng.random() < 0.05},
            "status": {"allocatable": allocatable,
                       "conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": "2026-12-04T08:00:00Z"}]}}


def _random_pod(rng: random.Random, namespace: str, name: str, version: int, nodes: list[str]) -> dict[str, Any]:
    labels: dict[str, str] = {}
    if rng.random() < 0.85:
        labels[api.LABEL_JOB] = rng.choice(["x", "y", "z"])
        labels.update({api.LABEL_GENERATION: str(rng.randint(1, 3)), api.LABEL_SLICE: "0",
                       api.LABEL_HOST: str(rng.randint(0, 3))})
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "resourceVersion": str(version), "labels": labels}
    if rng.random() < 0.15:
        meta["deletionTimestamp"] = "2026-12-04T08:30:00Z"
    where = rng.random()
    spec: dict[str, Any] = {"containers": [{"name": "trainer", "resources": {}}]}
    if where < 0.6 and nodes:
        spec["nodeName"] = rng.choice([*nodes, "node-gone"])
    elif where < 0.9:
        spec["nodeSelector"] = {api.NODE_POOL_LABEL: rng.choice([*POOLS, "pool-none"])}
    kind = rng.choice(["limits", "requests", "none"])
    if kind != "none":
        spec["containers"][0]["resources"][kind] = {TPU: rng.choice(["4", "2", "0"]), "cpu": "1"}
    if rng.random() < 0.2:
        spec["initContainers"] = [{"name": "sidecar", "resources": {"limits": {TPU: "1"}}}]
    phase = rng.choice(["Pending", "Running", "Running", "Succeeded", "Failed"])
    return {"kind": "Pod", "metadata": meta, "spec": spec, "status": {"phase": phase, "podIP": "10.0.0.1"}}


def _service(namespace: str, job: str, generation: str, version: int) -> dict[str, Any]:
    return {"kind": "Service", "metadata": {"name": f"{job}-g{generation}", "namespace": namespace,
                                            "resourceVersion": str(version),
                                            "labels": {api.LABEL_JOB: job, api.LABEL_GENERATION: generation}}}


class _World:
    """The truth an API server holds, and watches that deliver its changes to one cache: sometimes late
    (after a newer event), sometimes lost until a relist."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.version = rng, 0
        self.cache = WorldCache(_Idle(), ["ns-a", "ns-b"])
        self.truth: dict[str, dict[str, dict[str, Any]]] = {"nodes": {}, "pods": {}, "services": {}}
        self.late: list[tuple[Informer, str, dict[str, Any]]] = []

    def _informers(self, kind: str, body: Mapping[str, Any]) -> list[Informer]:
        namespace = (body.get("metadata") or {}).get("namespace")
        if kind == "nodes":
            return [self.cache.nodes]
        scoped = [i for i in [*self.cache.job_pods, *self.cache.live_pods, *self.cache.services]
                  if f"/namespaces/{namespace}/" in i.path]
        if kind == "services":
            return [i for i in scoped if i in self.cache.services]
        return [i for i in scoped if i not in self.cache.services]

    def _matches(self, informer: Informer, body: Mapping[str, Any]) -> bool:
        labels = (body.get("metadata") or {}).get("labels") or {}
        if informer.label_selector and informer.label_selector not in labels:
            return False
        return not (informer.field_selector and (body.get("status") or {}).get("phase") in ("Succeeded", "Failed"))

    def _deliver(self, kind: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        for informer in self._informers(kind, new or old or {}):
            was = old is not None and self._matches(informer, old)
            now = new is not None and self._matches(informer, new)
            if not (was or now):
                continue
            if now:
                event = ("ADDED" if not was else "MODIFIED", copy.deepcopy(new))
            else:  # deleted, or no longer matching the selector: the API server sends DELETED
                event = ("DELETED", copy.deepcopy({**(new or old or {}), "metadata": {
                    **((new or old or {})["metadata"]), "resourceVersion": str(self.version)}}))
            roll = self.rng.random()
            if roll < 0.05:
                continue  # lost: only a relist brings it
            if roll < 0.15 and event[0] != "DELETED":
                self.late.append((informer, event[0], event[1]))  # delivered after newer ones
                continue
            informer._apply(event[0], event[1], notify=False)

    def change(self) -> None:
        rng = self.rng
        self.version += 1
        kind = rng.choice(["nodes", "pods", "pods", "pods", "services"])
        store = self.truth[kind]
        if kind == "nodes":
            key = f"/node-{rng.randint(0, 11)}"
            new = None if rng.random() < 0.15 else _random_node(rng, key[1:], self.version)
        elif kind == "pods":
            namespace = rng.choice(["ns-a", "ns-b"])
            key = f"{namespace}/pod-{rng.randint(0, 24)}"
            nodes = [k[1:] for k in self.truth["nodes"]]
            new = None if rng.random() < 0.15 else _random_pod(rng, namespace, key.split("/")[1], self.version, nodes)
        else:
            namespace, job = rng.choice(JOBS)
            generation = str(rng.randint(1, 3))
            key = f"{namespace}/{job}-g{generation}"
            new = None if rng.random() < 0.3 else _service(namespace, job, generation, self.version)
        old = store.get(key)
        if new is None:
            store.pop(key, None)
            if old is None:
                return
        else:
            store[key] = new
        self._deliver(kind, old, new)

    def deliver_late(self) -> None:
        while self.late:
            informer, kind, body = self.late.pop(self.rng.randrange(len(self.late)))
            informer._apply(kind, body, notify=False)

    def relist(self, informer: Informer) -> None:
        kind = "nodes" if informer is self.cache.nodes else "services" if informer in self.cache.services else "pods"
        items = [copy.deepcopy(b) for b in self.truth[kind].values()
                 if self._informers(kind, b).count(informer) and self._matches(informer, b)]
        informer.source = _Page(items, self.version)  # type: ignore[assignment]
        informer._relist()

    def own_write(self) -> None:
        """The operator remembers a pod it just created (the API's answer), or forgets one."""
        pods = list(self.truth["pods"].values())
        if not pods:
            return
        body = self.rng.choice(pods)
        if self.rng.random() < 0.7:
            self.cache.remember({**body, "kind": "Pod"})
        else:
            for informer in self.cache.job_pods:
                informer.forget(object_key(body))


class _Page:
    def __init__(self, items: list[dict[str, Any]], version: int) -> None:
        self.items, self.version = items, version

    def list_page(self, path: str, query: Mapping[str, Any]) -> dict[str, Any]:
        return {"metadata": {"resourceVersion": str(self.version)}, "items": self.items}


def _full_parse(cache: WorldCache, namespace: str, job: str) -> Any:
    body = {"metadata": {"name": job, "namespace": namespace, "uid": "u", "generation": 1}}
    pods = [p for i in cache.job_pods for p in i.items()
            if p["metadata"]["namespace"] == namespace and p["metadata"]["labels"].get(api.LABEL_JOB) == job]
    services = [s for i in cache.services for s in i.items()
                if s["metadata"]["namespace"] == namespace and s["metadata"]["labels"].get(api.LABEL_JOB) == job]
    return build_observed(body, now=NOW, pods=pods, services=services, nodes=cache.nodes.items(),
                          other_pods=[p for i in cache.live_pods for p in i.items()])


def _from_indexes(cache: WorldCache, namespace: str, job: str) -> Any:
    body = {"metadata": {"name": job, "namespace": namespace, "uid": "u", "generation": 1}}
    raw, workers = cache.pods_of(namespace, job)
    assert sorted(object_key(p) for p in raw) == sorted(
        object_key(p) for i in cache.job_pods for p in i.items()
        if p["metadata"]["namespace"] == namespace and p["metadata"]["labels"].get(api.LABEL_JOB) == job)
    return assemble_observed(body, now=NOW, pods=workers, services=cache.services_of(namespace, job),
                             nodes=cache.nodes_for(namespace, job))


def _assert_same(cache: WorldCache, where: str) -> None:
    for namespace, job in JOBS:
        full, indexed = _full_parse(cache, namespace, job), _from_indexes(cache, namespace, job)
        assert indexed.nodes == full.nodes, f"{where}: nodes of {namespace}/{job} differ"
        assert indexed == full, f"{where}: {namespace}/{job} differs"


@pytest.mark.parametrize("seed", range(12))
def test_indexes_match_the_full_parse_after_any_event_sequence(seed: int) -> None:
    rng = random.Random(seed)
    world = _World(rng)
    for step in range(400):
        roll = rng.random()
        if roll < 0.8:
            world.change()
        elif roll < 0.88:
            world.deliver_late()
        elif roll < 0.95:
            world.relist(rng.choice(world.cache.informers()))
        else:
            world.own_write()
        _assert_same(world.cache, f"seed {seed} step {step}")
    world.deliver_late()
    for informer in world.cache.informers():
        world.relist(informer)
    _assert_same(world.cache, f"seed {seed} after relisting everything")
    # And the cache then holds the truth: its nodes are the truth's, parsed.
    assert [n.name for n in world.cache.nodes_for("ns-a", "x")] == sorted(k[1:] for k in world.truth["nodes"])


# ---- the cases the random walk covers, one by one ----------------------------------------------------
def _node(name: str, pool: str = "pool-a", tpus: str = "4") -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {api.NODE_POOL_LABEL: pool}},
            "status": {"allocatable": {TPU: tpus}, "conditions": [{"type": "Ready", "status": "True"}]}}


def _pod(name: str, job: str | None, *, namespace: str = "ns", node: str | None = None, pool: str | None = None,
         phase: str = "Running", tpus: str = "4") -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"resources": {"limits": {TPU: tpus}}}]}
    if node:
        spec["nodeName"] = node
    if pool:
        spec["nodeSelector"] = {api.NODE_POOL_LABEL: pool}
    return {"metadata": {"name": name, "namespace": namespace, "labels": {api.LABEL_JOB: job} if job else {}},
            "spec": spec, "status": {"phase": phase}}


def _in_use(fleet: FleetIndex, job: str, namespace: str = "ns") -> dict[str, dict[str, int]]:
    return {n.name: dict(n.in_use_by_others) for n in fleet.nodes_for(namespace, job) if n.in_use_by_others}


CASES: dict[str, tuple[list[tuple[str, str, dict[str, Any] | None]], str, dict[str, dict[str, int]]]] = {
    # id: (updates (kind, key, new body or None = gone), the job asking, the devices others hold)
    "others-bound": ([("node", "/a0", _node("a0")), ("pod", "ns/p", _pod("p", "other", node="a0"))],
                     "mine", {"a0": {TPU: 4}}),
    "own-pods-not-counted": ([("node", "/a0", _node("a0")), ("pod", "ns/p", _pod("p", "mine", node="a0"))],
                             "mine", {}),
    "same-job-name-other-namespace": ([("node", "/a0", _node("a0")),
                                       ("pod", "ns2/p", _pod("p", "mine", namespace="ns2", node="a0"))],
                                      "mine", {"a0": {TPU: 4}}),
    "deleted-pod-frees": ([("node", "/a0", _node("a0")), ("pod", "ns/p", _pod("p", "other", node="a0")),
                           ("pod", "ns/p", None)], "mine", {}),
    "finished-pod-frees": ([("node", "/a0", _node("a0")), ("pod", "ns/p", _pod("p", "other", node="a0")),
                            ("pod", "ns/p", _pod("p", "other", node="a0", phase="Succeeded"))], "mine", {}),
    "pod-moves-node": ([("node", "/a0", _node("a0")), ("node", "/a1", _node("a1")),
                        ("pod", "ns/p", _pod("p", "other", node="a0")),
                        ("pod", "ns/p", _pod("p", "other", node="a1"))], "mine", {"a1": {TPU: 4}}),
    "bound-before-its-node": ([("pod", "ns/p", _pod("p", "other", node="a0")), ("node", "/a0", _node("a0"))],
                              "mine", {"a0": {TPU: 4}}),
    "pending-holds-freest-of-pool": ([("node", "/a0", _node("a0")), ("node", "/a1", _node("a1")),
                                      ("pod", "ns/q", _pod("q", "other", node="a0")),
                                      ("pod", "ns/p", _pod("p", "other", pool="pool-a"))],
                                     "mine", {"a0": {TPU: 4}, "a1": {TPU: 4}}),
    "pending-of-own-job-holds-nothing": ([("node", "/a0", _node("a0")),
                                          ("pod", "ns/p", _pod("p", "mine", pool="pool-a"))], "mine", {}),
    "pending-then-bound": ([("node", "/a0", _node("a0")), ("node", "/a1", _node("a1")),
                            ("pod", "ns/p", _pod("p", "other", pool="pool-a")),
                            ("pod", "ns/p", _pod("p", "other", node="a1"))], "mine", {"a1": {TPU: 4}}),
    "node-leaves-pool": ([("node", "/a0", _node("a0")), ("node", "/a0", _node("a0", pool="pool-b")),
                          ("pod", "ns/p", _pod("p", "other", pool="pool-a"))], "mine", {}),
    "node-deleted": ([("node", "/a0", _node("a0")), ("pod", "ns/p", _pod("p", "other", node="a0")),
                      ("node", "/a0", None)], "mine", {}),
}


@pytest.mark.parametrize(("updates", "job", "want"), list(CASES.values()), ids=list(CASES))
def test_fleet_index_counts_devices_of_others(updates: list[tuple[str, str, dict[str, Any] | None]], job: str,
                                              want: dict[str, dict[str, int]]) -> None:
    fleet = FleetIndex()
    stored: dict[str, dict[str, Any]] = {}
    for kind, key, new in updates:
        old = stored.pop(kind + key, None)
        if new is not None:
            stored[kind + key] = new
        (fleet.update_node if kind == "node" else fleet.update_pod)(key, old, new)
    assert _in_use(fleet, job) == want
    # What the full parse of the same bodies says.
    nodes = [b for k, b in stored.items() if k.startswith("node")]
    pods = [b for k, b in stored.items() if k.startswith("pod")]
    full = build_observed({"metadata": {"name": job, "namespace": "ns"}}, now=NOW, pods=[], services=[],
                          nodes=nodes, other_pods=pods)
    assert fleet.nodes_for("ns", job) == full.nodes


def test_a_node_changed_keeps_its_devices_in_use() -> None:
    fleet = FleetIndex()
    fleet.update_node("/a0", None, _node("a0"))
    fleet.update_pod("ns/p", None, _pod("p", "other", node="a0"))
    fleet.nodes_for("ns", "mine")
    cordoned = {**_node("a0"), "spec": {"unschedulable": True}}
    fleet.update_node("/a0", _node("a0"), cordoned)
    (node,) = fleet.nodes_for("ns", "mine")
    assert node.unschedulable and node.in_use_by_others == {TPU: 4}
