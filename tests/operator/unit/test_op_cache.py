"""The reconcile reads the watch cache: N reconciles of a steady job make no LIST and no write.

An in-memory API (`FakeAPI`) records every request the operator makes and, like a watch, feeds each
change into the cache's stores. It stands in for the API server only to count requests; the watch
itself (list, then watch from the resourceVersion, 410 → list again) runs against the real API server
in the cluster tests.
"""

from __future__ import annotations

import base64
import copy
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from op_world import apply_merge_patch
from resilax_operator import api, execute
from resilax_operator.k8s import Kube, KubeError
from resilax_operator.observed.cache import Informer, WatchGone, WorldCache, trim_live_pod
from resilax_operator.settings import OperatorSettings

NS = "team"
SETTINGS = OperatorSettings()
LOG = logging.getLogger("test")


def _job() -> dict[str, Any]:
    return {
        "apiVersion": api.API_VERSION, "kind": api.KIND,
        "metadata": {"name": "llama", "namespace": NS, "uid": "uid-1", "generation": 1},
        "spec": {
            "slices": {"accelerator": "tpu-v5-lite-podslice", "topology": "2x4", "count": 1, "chipsPerHost": 4},
            "checkpoint": {"storage": "gs://bucket/llama"},
            "template": {"spec": {"containers": [{"name": "trainer", "image": "example/train:1"}]}},
        },
    }


def _node(name: str) -> dict[str, Any]:
    return {
        "kind": "Node",
        "metadata": {"name": name, "labels": {api.NODE_POOL_LABEL: "pool-a",
                                              "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
                                              "cloud.google.com/gke-tpu-topology": "2x4"}},
        "spec": {},
        "status": {"allocatable": {"google.com/tpu": "4"},
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }


class FakeAPI(Kube):
    """The API calls of k8s.Kube answered from memory; every call recorded; changes fed to the cache."""

    def __init__(self) -> None:
        self._tokens: dict[str, str] = {}
        self._token_read_at: dict[str, float] = {}
        self._rotated_from: dict[str, tuple[str, float]] = {}
        self.clock = time.monotonic
        self.objects: dict[str, dict[str, Any]] = {}  # object path → body
        self.requests: list[tuple[str, str]] = []
        self.cache: WorldCache | None = None
        self.version = 0

    # ---- the recorded API ------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, query: Mapping[str, Any] | None = None,
                content_type: str = "application/json", ok: tuple[int, ...] = ()) -> dict[str, Any] | None:
        self.requests.append((method, path))
        if method == "POST":
            obj = copy.deepcopy(body)
            meta = obj.setdefault("metadata", {})
            meta.setdefault("name", meta.get("generateName", "x") + str(self.version))
            target = f"{path}/{meta['name']}"
            if target in self.objects:
                return None if 409 in ok else {}
            meta.setdefault("uid", f"uid-{meta['name']}-{self.version}")
            if "stringData" in obj:  # as the API server stores a Secret
                obj["data"] = {k: base64.b64encode(v.encode()).decode() for k, v in obj.pop("stringData").items()}
            return self.put(target, obj)
        if method == "PATCH" and path.endswith("/status"):
            obj = copy.deepcopy(self.objects[path[: -len("/status")]])
            obj["status"] = apply_merge_patch(obj.get("status") or {}, body["status"])
            return self.put(path[: -len("/status")], obj)
        if method == "PATCH":
            obj = copy.deepcopy(self.objects[path])
            obj["metadata"].setdefault("annotations", {}).update(body["metadata"]["annotations"])
            return self.put(path, obj)
        if method == "DELETE":
            wanted = ((body or {}).get("preconditions") or {}).get("uid")
            if wanted and path in self.objects and self.objects[path]["metadata"].get("uid") != wanted:
                return None if 409 in ok else {}
            gone = self.objects.pop(path, None)
            if gone is None and 404 not in ok:
                raise KubeError(404, f"DELETE {path}: 404 not found", "not found")
            if gone is not None:
                self._feed("DELETED", gone)
            return None
        if method == "GET" and path in self.objects:
            return copy.deepcopy(self.objects[path])
        if method == "GET" and 404 in ok:
            return None
        raise AssertionError(f"unexpected request {method} {path}")

    def sidecar(self, method: str, ip: str, port: int, path: str, body: Mapping[str, Any] | None = None,
                token: str | None = None) -> dict[str, Any]:
        return {"newest_persisted_step": 100}

    def list_page(self, path: str, query: Mapping[str, Any]) -> dict[str, Any]:
        items = [copy.deepcopy(b) for p, b in self.objects.items() if p.rsplit("/", 1)[0] == path
                 or (path == "/api/v1/pods" and "/pods/" in p)]
        return {"metadata": {"resourceVersion": str(self.version)}, "items": items}

    def watch(self, path: str, query: Mapping[str, Any], timeout_seconds: int,
              stop: threading.Event) -> Iterator[dict[str, Any]]:
        return iter(())

    # ---- the world changing ----------------------------------------------------------------
    def put(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        obj["metadata"].setdefault("namespace", NS) if "/namespaces/" in path else None
        new = path not in self.objects
        self.objects[path] = obj
        self._feed("ADDED" if new else "MODIFIED", obj)
        return copy.deepcopy(obj)

    def _feed(self, kind: str, obj: Mapping[str, Any]) -> None:
        """What the cache's watches would deliver."""
        if self.cache is None:
            return
        labels = (obj.get("metadata") or {}).get("labels") or {}
        kinds = {"Pod": ("pods", "live-pods"), "Service": ("services",), "Node": ("nodes",),
                 api.KIND: ("jaxjobs",)}.get(str(obj.get("kind")), ())
        for informer in self.cache.informers():
            if informer.kind not in kinds or (informer.label_selector and informer.label_selector not in labels):
                continue
            informer._apply(kind, obj, notify=False)

    def run_pods(self) -> None:
        """The scheduler and the kubelets: every pod Running and Ready on a node of its own."""
        pods = sorted(p for p in self.objects if "/pods/" in p)
        for i, path in enumerate(pods):
            pod = copy.deepcopy(self.objects[path])
            if (pod.get("status") or {}).get("phase") == "Running":
                continue
            pod["spec"]["nodeName"] = f"node-{i}"
            pod["status"] = {"phase": "Running", "podIP": f"10.0.0.{i + 1}",
                             "conditions": [{"type": "Ready", "status": "True"}],
                             "containerStatuses": [{"name": c["name"], "state": {"running": {}}}
                                                   for c in pod["spec"]["containers"]]}
            self.put(path, pod)


def install(fake: FakeAPI, job: dict[str, Any]) -> FakeAPI:
    """`fake` holding `job` (JAXJob "llama") and two Ready nodes, its watch cache listed once."""
    fake.put(f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{NS}/{api.PLURAL}/llama", job)
    for i in range(2):
        fake.put(f"/api/v1/nodes/node-{i}", _node(f"node-{i}"))
    fake.cache = WorldCache(fake, [NS])
    for informer in fake.cache.informers():
        informer._relist()
    return fake


@pytest.fixture
def steady() -> FakeAPI:
    fake = install(FakeAPI(), _job())
    for _ in range(20):
        execute.reconcile_job(fake, fake.cache, NS, "llama", SETTINGS, LOG)
        fake.run_pods()
        if (fake.cache.job(NS, "llama") or {}).get("status", {}).get("phase") == api.PHASE_RUNNING:
            break
    assert fake.cache.job(NS, "llama")["status"]["phase"] == api.PHASE_RUNNING
    execute.reconcile_job(fake, fake.cache, NS, "llama", SETTINGS, LOG)  # settle the checkpoint's time
    return fake


def test_steady_job_reconciles_without_any_api_request(steady: FakeAPI) -> None:
    steady.requests.clear()
    for _ in range(10):
        execute.reconcile_job(steady, steady.cache, NS, "llama", SETTINGS, LOG)  # type: ignore[arg-type]
    lists = [r for r in steady.requests if r[0] == "GET"]
    assert lists == [], f"reconciles read the API: {lists}"
    assert steady.requests == [], f"a steady job was written: {steady.requests}"


def test_reconcile_acts_on_a_change_seen_by_the_cache(steady: FakeAPI) -> None:
    """The cache is what the reconcile sees: a worker pod deleted behind the operator's back (the
    watch delivers it) is noticed without any LIST."""
    steady.requests.clear()
    pod = next(p for p in steady.objects if "/pods/" in p)
    steady.request("DELETE", pod)
    steady.requests.clear()
    for _ in range(3):
        execute.reconcile_job(steady, steady.cache, NS, "llama", SETTINGS, LOG)  # type: ignore[arg-type]
    # no LIST; the only reads are of the token Secret (one object), before the next generation's pods,
    # and the Leases of the nodes the missing pods last ran on (one object each: observed.nodes_needing_lease)
    reads = [p for m, p in steady.requests if m == "GET"]
    leases = {f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/node-{i}" for i in range(2)}
    assert set(reads) <= {f"/api/v1/namespaces/{NS}/secrets/llama-resilax-token", *leases}, reads
    assert any(m in ("PATCH", "POST", "DELETE") for m, _ in steady.requests), steady.requests


def test_a_pod_the_api_no_longer_has_is_not_waited_on(steady: FakeAPI) -> None:
    """Should the cache ever hold a pod the API has not (its deletion event lost), the delete's 404
    takes it out, and the next generation starts instead of a ghost being deleted for ever."""
    pods = sorted(p for p in steady.objects if "/pods/" in p)
    steady.objects.pop(pods[0])  # gone from the API, never reported to the cache
    steady.request("DELETE", pods[1])  # a worker lost, reported: the generation is replaced
    for _ in range(6):
        execute.reconcile_job(steady, steady.cache, NS, "llama", SETTINGS, LOG)  # type: ignore[arg-type]
        steady.run_pods()
    assert steady.cache.job(NS, "llama")["status"]["generation"] == 2
    names = {b["metadata"]["name"] for i in steady.cache.job_pods for b in i.items()}
    assert names and all("-g2-" in n for n in names), names


class _Source:
    """A list answer and then a scripted watch, for the informer's own mechanics."""

    def __init__(self, pages: list[dict[str, Any]], watches: list[list[dict[str, Any]]]) -> None:
        self.pages, self.watches, self.queries = pages, watches, []

    def list_page(self, path: str, query: Mapping[str, Any]) -> dict[str, Any]:
        return self.pages.pop(0)

    def watch(self, path: str, query: Mapping[str, Any], timeout_seconds: int,
              stop: threading.Event) -> Iterator[dict[str, Any]]:
        self.queries.append(dict(query))
        return iter(self.watches.pop(0))


def _pod(name: str, rv: str, phase: str = "Running") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NS, "resourceVersion": rv, "labels": {api.LABEL_JOB: "j"}},
            "spec": {"nodeName": "n", "containers": [{"name": "c", "image": "i",
                                                      "resources": {"limits": {"google.com/tpu": "4"}}}]},
            "status": {"phase": phase}}


def test_informer_lists_then_follows_the_watch_and_relists_when_gone() -> None:
    source = _Source(
        pages=[{"metadata": {"resourceVersion": "10"}, "items": [_pod("a", "9")]},
               {"metadata": {"resourceVersion": "30"}, "items": [_pod("c", "29")]}],
        watches=[[{"type": "ADDED", "object": _pod("b", "11")},
                  {"type": "MODIFIED", "object": _pod("a", "12", "Pending")},
                  {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "15"}}}],
                 [{"type": "DELETED", "object": _pod("b", "16")},
                  {"type": "ERROR", "object": {"code": 410, "message": "too old"}}]])
    seen: list[tuple[str, bool]] = []
    informer = Informer(source, "pods", "/api/v1/namespaces/team/pods", label_selector=api.LABEL_JOB,
                        on_change=lambda kind, key, body, deleted: seen.append((key, deleted)))
    version = informer._relist()
    assert version == "10" and [b["metadata"]["name"] for b in informer.items()] == ["a"]
    version = informer._watch_once(version)
    assert version == "15" and sorted(b["metadata"]["name"] for b in informer.items()) == ["a", "b"]
    assert informer.get(f"{NS}/a")["status"]["phase"] == "Pending"
    assert source.queries[0]["resourceVersion"] == "10" and source.queries[0]["labelSelector"] == api.LABEL_JOB
    with pytest.raises(WatchGone):
        informer._watch_once(version)
    assert source.queries[1]["resourceVersion"] == "15"
    informer._relist()
    assert [b["metadata"]["name"] for b in informer.items()] == ["c"]
    assert (f"{NS}/b", True) in seen and (f"{NS}/a", True) in seen  # a vanished between the lists


def test_informer_keeps_the_newer_of_a_write_and_a_late_event() -> None:
    informer = Informer(_Source([], []), "pods", "/api/v1/pods")
    informer.remember(_pod("a", "20", "Running"))
    informer._apply("MODIFIED", _pod("a", "19", "Pending"), notify=False)  # an event older than our write
    assert informer.get(f"{NS}/a")["status"]["phase"] == "Running"


def test_a_write_answered_before_a_deletion_does_not_bring_the_pod_back() -> None:
    """The goodput bench's stuck job: the freshness annotation of a terminating pod was answered
    (rv 20), the watch then reported its deletion (rv 21), and the answer, remembered last, put the pod
    back; the operator force-deleted a ghost every 5 s and never started the next generation."""
    informer = Informer(_Source([], []), "pods", "/api/v1/pods")
    informer._apply("ADDED", _pod("a", "19"), notify=True)
    informer._apply("DELETED", _pod("a", "21"), notify=True)
    informer.remember(_pod("a", "20"))
    assert informer.get(f"{NS}/a") is None
    informer.remember(_pod("a", "25"))  # created again under the name since: the operator's own create
    assert informer.get(f"{NS}/a")["metadata"]["resourceVersion"] == "25"


def test_a_pod_gone_between_two_lists_is_not_brought_back_by_a_late_answer() -> None:
    source = _Source(pages=[{"metadata": {"resourceVersion": "10"}, "items": [_pod("a", "9")]},
                            {"metadata": {"resourceVersion": "30"}, "items": []}], watches=[])
    informer = Informer(source, "pods", "/api/v1/pods")
    informer._relist()
    informer._relist()
    informer.remember(_pod("a", "12"))
    assert informer.items() == []


def test_live_pods_are_trimmed_to_what_capacity_reads() -> None:
    trimmed = trim_live_pod({**_pod("a", "1"), "spec": {**_pod("a", "1")["spec"], "volumes": [{"name": "v"}]}})
    assert "volumes" not in trimmed["spec"] and "image" not in trimmed["spec"]["containers"][0]
    assert trimmed["spec"]["containers"][0]["resources"]["limits"] == {"google.com/tpu": "4"}


def test_a_restore_that_skipped_bad_steps_is_shown_once(steady: FakeAPI) -> None:
    """Pod 0's sidecar reports that the workers restored an older step (issue 16): the job gets the
    CheckpointFallback condition and one Warning event naming the step and why; deciding again with
    the same report writes nothing."""
    report = {"step": 20, "skipped": [{"step": 30, "reason": "CorruptCheckpointError: chunk file /ck/30/params/w/c/0/0 "
                                                           "has 12 bytes, expected 4096"}]}
    steady.sidecar = lambda *a, **k: {"newest_persisted_step": 100, "restore": report}  # type: ignore[method-assign]
    steady.requests.clear()
    execute.reconcile_job(steady, steady.cache, NS, "llama", SETTINGS, LOG)  # type: ignore[arg-type]
    events = [steady.objects[p] for p in steady.objects
              if "/events/" in p and steady.objects[p]["reason"] == api.STEPS_SKIPPED.name]
    assert [e["type"] for e in events] == ["Warning"]
    assert "restored step 20" in events[0]["message"] and "step 30" in events[0]["message"]
    assert "/ck/30/params/w/c/0/0" in events[0]["message"]
    job = steady.cache.job(NS, "llama")
    cond = next(c for c in job["status"]["conditions"] if c["type"] == api.COND_CHECKPOINT_FALLBACK)
    assert cond["status"] == "True" and cond["reason"] == api.STEPS_SKIPPED.name
    assert job["status"]["phase"] == api.PHASE_RUNNING  # running, from the older step
    steady.requests.clear()
    for _ in range(3):
        execute.reconcile_job(steady, steady.cache, NS, "llama", SETTINGS, LOG)  # type: ignore[arg-type]
    assert steady.requests == []


@pytest.mark.parametrize(("body", "want"), [
    ({}, None),
    ({"restore": None}, None),
    ({"restore": {"step": 5, "skipped": []}}, (5, ())),
    ({"restore": {"step": 5, "skipped": [{"step": 7, "reason": "bad"}]}}, (5, ((7, "bad"),))),
    ({"restore": {"step": "x"}}, None),
], ids=["absent", "null", "clean", "skipped", "malformed"])
def test_parse_restore_report(body: dict, want) -> None:
    from resilax_operator.observed.snapshot import parse_restore_report

    got = parse_restore_report(body)
    assert (None if got is None else (got.step, got.skipped)) == want
