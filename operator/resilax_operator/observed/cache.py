"""The operator's view of the cluster: watches held in memory, so a reconcile issues no LIST.

The informer pattern of every controller-runtime operator (JobSet, Kueue, the Kubeflow Trainer):
each kind is listed once, then watched from that list's resourceVersion; events update an in-memory
store; a `410 Gone` (the watch fell too far behind) lists again. A reconcile reads the stores.

One `WorldCache` per operator process holds, for each watched scope (the whole cluster, or each
namespace given with `--namespace`):
1. `jobs`: the JAXJobs;
2. `job_pods`: pods carrying `resilax.dev/job` (server-side label selector), any phase;
3. `services`: Services carrying `resilax.dev/job`;
4. `live_pods`: pods not Succeeded/Failed (server-side field selector), trimmed to what capacity
   accounting reads (node, labels, device requests) — the devices other pods hold;
5. `nodes`: every Node (cluster-scoped; one watch whatever the scope).
The cost per job is nothing: the watches are shared and their number does not grow with the jobs.

Parsed once: every change of a store also goes to an index (observed/indexes.py) that keeps the parsed nodes,
the devices in use per node and each job's pods and Services, so a reconcile reads prepared data.

Waking: `on_change(kind, key, body)` is called (from the watch thread) for every event that matters;
handlers.py turns it into wake-ups of the jobs' reconcile daemons.

Freshness: a reconcile may run just before the watch reports the operator's own last write. Every
action is idempotent (409 on create and 404 on delete are success), and the operator's own writes are
put into the stores at once (`remember`), so what it just did is never decided again from stale state.
A write answered before a deletion but remembered after the watch reported that deletion must not
bring the object back: each store keeps the resourceVersion of its recent deletions (tombstones) and
`remember` drops an answer not newer than the deletion (a ghost pod would be waited on for ever).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

from .. import api
from .indexes import FleetIndex, JobIndex, LastWordsIndex
from .sidecar import LastWords
from .snapshot import ObservedNode, ObservedPod, parse_pod, parse_service

log = logging.getLogger(__name__)

#: Server-side watch timeout (seconds); a watch ending normally is resumed from its last resourceVersion.
WATCH_TIMEOUT_SECONDS: Final = 300
#: Pause after a failed list or watch before trying again (seconds).
RETRY_SECONDS: Final = 1.0
LIVE_PODS_SELECTOR: Final = "status.phase!=Succeeded,status.phase!=Failed"
#: Key prefix of a planned pod counted in the fleet index before it exists (`WorldCache.reserve`).
RESERVATION_PREFIX: Final = "reserved:"
#: Deletions remembered per store (the oldest forgotten first): a write's answer arrives within seconds.
TOMBSTONES: Final = 4096

Body = dict[str, Any]
#: (kind, "namespace/name", the object (its last state when deleted), deleted)
OnChange = Callable[[str, str, Body, bool], None]
#: ("namespace/name", the stored object before, after): every change of a store (None: absent)
OnStore = Callable[[str, Body | None, Body | None], None]


class WatchSource(Protocol):
    """What the cache needs from the API (k8s.Kube implements it)."""

    def list_page(self, path: str, query: Mapping[str, Any]) -> Body: ...

    def watch(self, path: str, query: Mapping[str, Any], timeout_seconds: int,
              stop: threading.Event) -> Iterator[Body]: ...


class WatchGone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


def object_key(body: Mapping[str, Any]) -> str:
    meta = body.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


def _version(body: Mapping[str, Any]) -> int | None:
    v = str((body.get("metadata") or {}).get("resourceVersion") or "")
    return int(v) if v.isdigit() else None


def _newer_or_equal(new: Mapping[str, Any], old: Mapping[str, Any] | None) -> bool:
    """Whether `new` is at least as recent as `old` (resourceVersions are etcd revisions; where one
    is not a number, the newer write wins)."""
    if old is None:
        return True
    a, b = _version(new), _version(old)
    return a is None or b is None or a >= b


def trim_live_pod(body: Mapping[str, Any]) -> Body:
    """What capacity accounting reads of a pod that is not ours (devices.count_devices_in_use): its
    node, or the node pool a pending one is pinned to, and its device requests."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}

    def resources(c: Mapping[str, Any]) -> Body:
        r = c.get("resources") or {}
        return {"resources": {k: r[k] for k in ("limits", "requests") if k in r}}

    return {
        "metadata": {k: meta[k] for k in ("name", "namespace", "labels", "resourceVersion", "deletionTimestamp")
                     if k in meta},
        "spec": {"nodeName": spec.get("nodeName"), "nodeSelector": spec.get("nodeSelector") or {},
                 "containers": [resources(c) for c in spec.get("containers") or []],
                 "initContainers": [resources(c) for c in spec.get("initContainers") or []]},
        "status": {"phase": (body.get("status") or {}).get("phase")},
    }


@dataclass
class Informer:
    """One list+watch of one kind in one scope, held in memory. Thread-safe reads."""

    source: WatchSource
    kind: str
    path: str
    label_selector: str | None = None
    field_selector: str | None = None
    trim: Callable[[Mapping[str, Any]], Body] | None = None
    on_change: OnChange | None = None
    #: Told of every change of the store, under its lock (an index kept beside it, observed/indexes.py).
    on_store: OnStore | None = None

    def __post_init__(self) -> None:
        self._items: dict[str, Body] = {}
        #: key → resourceVersion of its deletion (at most TOMBSTONES, the newest kept)
        self._tombstones: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.relists = 0

    # ---- reading ---------------------------------------------------------------------------
    def items(self) -> list[Body]:
        with self._lock:
            return list(self._items.values())

    def get(self, key: str) -> Body | None:
        with self._lock:
            return self._items.get(key)

    # ---- the operator's own writes ---------------------------------------------------------
    def remember(self, body: Mapping[str, Any]) -> None:
        """Put an object the operator just wrote (the API's answer) into the store, unless the watch
        already holds a newer version or has reported its deletion since."""
        self._apply("MODIFIED", body, notify=False, written=True)

    def forget(self, key: str) -> None:
        with self._lock:
            gone = self._items.pop(key, None)
            if gone is not None and self.on_store is not None:
                self.on_store(key, gone, None)

    # ---- the watch -------------------------------------------------------------------------
    def start(self) -> Informer:
        self._thread = threading.Thread(target=self._run, name=f"watch-{self.kind}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _query(self) -> dict[str, Any]:
        q: dict[str, Any] = {}
        if self.label_selector:
            q["labelSelector"] = self.label_selector
        if self.field_selector:
            q["fieldSelector"] = self.field_selector
        return q

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                version = self._relist()
                while not self._stop.is_set():
                    version = self._watch_once(version)
            except WatchGone:
                log.info("watch %s: resourceVersion too old; listing again", self.kind)
            except Exception as e:  # transport trouble, 5xx, 403 while RBAC settles: retry
                log.warning("watch %s (%s): %s; retrying", self.kind, self.path, e)
                self._stop.wait(RETRY_SECONDS)

    def _relist(self) -> str:
        answer = self.source.list_page(self.path, self._query())
        fresh = {object_key(b): self._store_form(b) for b in answer.get("items") or []}
        listed = _version(answer)
        with self._lock:
            gone = {k: b for k, b in self._items.items() if k not in fresh}
            changed = [k for k, b in fresh.items() if self._items.get(k) != b]
            for k in fresh:
                self._tombstones.pop(k, None)
            if listed is not None:
                for k in gone:
                    self._bury(k, listed)
            if self.on_store is not None:
                for k, b in gone.items():
                    self.on_store(k, b, None)
                for k in changed:
                    self.on_store(k, self._items.get(k), fresh[k])
            self._items = fresh
        self.relists += 1
        self.synced.set()
        if self.on_change is not None:
            for k, b in gone.items():
                self.on_change(self.kind, k, b, True)
            for k in changed:
                self.on_change(self.kind, k, fresh[k], False)
        return str((answer.get("metadata") or {}).get("resourceVersion") or "")

    def _watch_once(self, version: str) -> str:
        query = {**self._query(), "resourceVersion": version, "allowWatchBookmarks": "true"}
        for event in self.source.watch(self.path, query, WATCH_TIMEOUT_SECONDS, self._stop):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise WatchGone(str(obj.get("message")))
                raise RuntimeError(f"watch error: {obj.get('message')}")
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self._apply(str(kind), obj, notify=True)
        return version

    def _store_form(self, body: Mapping[str, Any]) -> Body:
        return self.trim(body) if self.trim is not None else dict(body)

    def _bury(self, key: str, version: int) -> None:
        """Under the lock: remember that `key` was deleted at `version`."""
        self._tombstones[key] = version
        self._tombstones.move_to_end(key)
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _apply(self, kind: str, body: Mapping[str, Any], *, notify: bool, written: bool = False) -> None:
        key = object_key(body)
        version = _version(body)
        with self._lock:
            before = self._items.get(key)
            if kind == "DELETED":
                self._items.pop(key, None)
                if version is not None:
                    self._bury(key, version)
                stored = dict(body)
                after = None
            else:
                if not _newer_or_equal(body, before):
                    return
                buried = self._tombstones.get(key)
                if buried is not None and before is None:
                    if written and (version is None or version <= buried):
                        return  # an answer from before the deletion the watch has reported: a ghost
                    if version is not None and version > buried:
                        del self._tombstones[key]  # created again under the name
                stored = after = self._store_form(body)
                self._items[key] = stored
            if self.on_store is not None and (before is not None or after is not None):
                self.on_store(key, before, after)
        if notify and self.on_change is not None:
            self.on_change(self.kind, key, stored, kind == "DELETED")


class WorldCache:
    """Every informer of one operator process; what `observe` reads instead of the API."""

    def __init__(self, source: WatchSource, namespaces: Sequence[str] = (), on_change: OnChange | None = None) -> None:
        scopes: list[str | None] = [*namespaces] or [None]
        job_path = f"/apis/{api.GROUP}/{api.VERSION}"

        def path(prefix: str, ns: str | None, plural: str) -> str:
            return f"{prefix}/namespaces/{ns}/{plural}" if ns else f"{prefix}/{plural}"

        #: The parsed forms (observed/indexes.py): each job's pods and Services; the nodes and the devices in use.
        self.pod_index: JobIndex[ObservedPod] = JobIndex(parse_pod)
        self.last_words = LastWordsIndex()
        self.service_index: JobIndex[tuple[int, str]] = JobIndex(parse_service)
        self.fleet = FleetIndex()
        self.jobs = [Informer(source, "jaxjobs", path(job_path, ns, api.PLURAL), on_change=on_change,
                              on_store=self._job_stored) for ns in scopes]
        self.job_pods = [Informer(source, "pods", path("/api/v1", ns, "pods"), label_selector=api.LABEL_JOB,
                                  on_change=on_change, on_store=self._pod_stored) for ns in scopes]
        self.services = [Informer(source, "services", path("/api/v1", ns, "services"),
                                  label_selector=api.LABEL_JOB, on_store=self.service_index.update) for ns in scopes]
        self.live_pods = [Informer(source, "live-pods", path("/api/v1", ns, "pods"),
                                   field_selector=LIVE_PODS_SELECTOR, trim=trim_live_pod,
                                   on_store=self.fleet.update_pod) for ns in scopes]
        self.nodes = Informer(source, "nodes", "/api/v1/nodes", on_change=on_change, on_store=self.fleet.update_node)
        self._namespaced = bool(namespaces)
        #: Held by the reconcile that plans a new generation's node pools and creates its first pod: two
        #: jobs planning at once would pick the same free pool (the next plan must see the pod created).
        self.planning = threading.Lock()

    def _pod_stored(self, key: str, old: Body | None, new: Body | None) -> None:
        self.pod_index.update(key, old, new)
        self.last_words.update(key, old, new)

    def _job_stored(self, key: str, old: Body | None, new: Body | None) -> None:
        if new is None and old is not None:
            meta = old.get("metadata") or {}
            self.last_words.forget(str(meta.get("namespace") or ""), str(meta.get("name") or ""))

    def informers(self) -> list[Informer]:
        return [*self.jobs, *self.job_pods, *self.services, *self.live_pods, self.nodes]

    def start(self) -> WorldCache:
        for informer in self.informers():
            informer.start()
        return self

    def stop(self) -> None:
        for informer in self.informers():
            informer.stop()

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        return all(i.synced.wait(max(0.0, deadline - time.monotonic())) for i in self.informers())

    @property
    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self.informers())

    # ---- reads for one reconcile -----------------------------------------------------------
    def job(self, namespace: str, name: str) -> Body | None:
        for informer in self._scoped(self.jobs, namespace):
            found = informer.get(f"{namespace}/{name}")
            if found is not None:
                return found
        return None

    def all_jobs(self) -> list[Body]:
        """Every JAXJob the operator watches (for the jobs sharing a storage: observed.decide_storage_sharers)."""
        return [body for informer in self.jobs for body in informer.items()]

    def pods_of(self, namespace: str, job: str) -> tuple[list[Mapping[str, Any]], list[ObservedPod]]:
        """The pods labelled with the job's name (any generation, by name): as stored, and parsed (the
        workers among them). Which are the job's own is the owner's uid's to say (`observed.owner_uid`)."""
        return self.pod_index.of(namespace, job)

    def last_words_of(self, namespace: str, job: str) -> tuple[LastWords, ...]:
        """The sidecars' last words of the job's worker pods, also of pods already gone (observed/indexes.py)."""
        return self.last_words.of(namespace, job)

    def service(self, namespace: str, name: str) -> Body | None:
        """A Service labelled `resilax.dev/job` (any job's), as stored; None when the cache has none."""
        for informer in self._scoped(self.services, namespace):
            found = informer.get(f"{namespace}/{name}")
            if found is not None:
                return found
        return None

    def services_of(self, namespace: str, job: str) -> list[tuple[int, str]]:
        """(generation, owner uid) of each headless Service labelled with the job's name."""
        return self.service_index.of(namespace, job)[1]

    def nodes_for(self, namespace: str, job: str) -> tuple[ObservedNode, ...]:
        """Every node parsed, sorted by name, with the devices others' live pods hold (indexes.FleetIndex)."""
        return self.fleet.nodes_for(namespace, job)

    def node_count(self) -> int:
        return self.fleet.node_count()

    # ---- the planning's reservations ------------------------------------------------------
    def reserve(self, pods: Sequence[Mapping[str, Any]]) -> list[str]:
        """Count pods about to be created (pinned to their node pools) as pending in the fleet index, so
        the next job's plan sees their pools taken before they exist; the keys for `release`. Called
        under `planning`."""
        keys = []
        for pod in pods:
            meta = pod.get("metadata") or {}
            key = f"{RESERVATION_PREFIX}{meta.get('namespace')}/{meta.get('name')}"
            self.fleet.update_pod(key, None, pod)
            keys.append(key)
        return keys

    def release(self, keys: Sequence[str]) -> None:
        """End reservations (the pods created are in the cache by then, or were never created)."""
        for key in keys:
            self.fleet.update_pod(key, None, None)

    # ---- the operator's own writes ---------------------------------------------------------
    def remember(self, body: Mapping[str, Any] | None) -> None:
        """Record an object the operator just created or patched (the API's answer)."""
        if not body:
            return
        kind = body.get("kind")
        namespace = str((body.get("metadata") or {}).get("namespace") or "")
        if kind == api.KIND:
            targets = self._scoped(self.jobs, namespace)
        elif kind == "Pod":  # a pending pod holds its pool's devices for the next job's plan
            targets = [*self._scoped(self.job_pods, namespace), *self._scoped(self.live_pods, namespace)]
        elif kind == "Service":
            targets = self._scoped(self.services, namespace)
        else:
            return
        for informer in targets:
            informer.remember(body)

    def forget_pod(self, namespace: str, name: str) -> None:
        """Drop a pod the API answered 404 for (its deletion event may still be on its way)."""
        for informer in [*self._scoped(self.job_pods, namespace), *self._scoped(self.live_pods, namespace)]:
            informer.forget(f"{namespace}/{name}")

    def _scoped(self, informers: list[Informer], namespace: str) -> list[Informer]:
        if not self._namespaced:
            return informers
        return [i for i in informers if f"/namespaces/{namespace}/" in i.path]

