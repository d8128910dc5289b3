"""What the watch cache keeps parsed between reconciles (pure: no I/O), updated per watch event.

A reconcile of one job reads prepared data instead of parsing the cluster again: at 100 jobs on 1,600
nodes, parsing every Node and every live pod for each reconcile cost more than all else the operator
does. cache.py's informers call `update(key, old, new)` for every change of their stores (an event, a
relist's difference, the operator's own write) with the stored bodies before and after (None: absent);
the indexes hold:

1. `JobIndex`: the objects labelled `resilax.dev/job` (the job's pods, its Services) grouped by
   (namespace, job), each with its parsed form (`observed.parse_pod`, `observed.parse_service`);
2. `LastWordsIndex`: each job's worker pods' sidecar last words (`observed.sidecar.parse_last_words`),
   kept after the pod is gone (the watch's last state of a deleted pod) for the job's two newest
   generations: the final save and the trainer's last step they tell are needed after the teardown;
3. `FleetIndex`: every Node parsed (`observed.parse_node`), kept sorted by name, each with the devices
   the live pods bound to it hold; the devices per node of each job's own pods; the pending pods pinned
   to a node pool.

`FleetIndex.nodes_for(namespace, job)` is then the node list `observed.build_observed` computes from the
raw bodies (the full parse), with the devices of every pod except that job's counted: the nodes
are shared between reconciles; only the nodes where the job's own pods hold devices (and, while pods
are pending, the nodes of their pools) are rebuilt. tests/operator/unit/test_op_indexes.py checks the
two against each other over random event sequences.

Thread-safe: the watch threads update, the reconcile threads read; each index has its own lock and
hands out immutable values (frozen dataclasses, tuples) or copies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Generic, TypeVar

from .. import api
from .devices import DeviceUse, add_devices, parse_device_use, place_pending
from .sidecar import LastWords, parse_last_words
from .snapshot import ObservedNode, parse_node

Body = Mapping[str, Any]
T = TypeVar("T")
JobKey = tuple[str, str]


def _job_key(body: Body) -> JobKey | None:
    meta = body.get("metadata") or {}
    job = (meta.get("labels") or {}).get(api.LABEL_JOB)
    return None if job is None else (str(meta.get("namespace") or ""), str(job))


class JobIndex(Generic[T]):
    """Objects labelled `resilax.dev/job`, by (namespace, job), each with `parse(body)`."""

    def __init__(self, parse: Callable[[Body], T | None]) -> None:
        self._parse = parse
        self._lock = threading.Lock()
        self._groups: dict[JobKey, dict[str, tuple[Body, T | None]]] = {}

    def update(self, key: str, old: Body | None, new: Body | None) -> None:
        with self._lock:
            if old is not None and (group := _job_key(old)) is not None:
                members = self._groups.get(group)
                if members is not None:
                    members.pop(key, None)
                    if not members:
                        del self._groups[group]
            if new is not None and (group := _job_key(new)) is not None:
                self._groups.setdefault(group, {})[key] = (new, self._parse(new))

    def of(self, namespace: str, job: str) -> tuple[list[Body], list[T]]:
        """The bodies of one job's objects (by key) and their parsed forms (those that parse)."""
        with self._lock:
            members = sorted((self._groups.get((namespace, job)) or {}).items())
        return [body for _, (body, _parsed) in members], [p for _, (_body, p) in members if p is not None]


class LastWordsIndex:
    """The sidecars' last words of each job's worker pods, by (namespace, job) and pod name, kept after
    the pods are gone, for the two newest generations that left any (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[JobKey, dict[tuple[str, str], LastWords]] = {}  # (owner uid, pod name) -> its words

    def update(self, key: str, old: Body | None, new: Body | None) -> None:
        body = new if new is not None else old
        group = None if body is None else _job_key(body)
        words = None if body is None or group is None else parse_last_words(body)
        if words is None or group is None:
            return
        with self._lock:
            kept = self._jobs.setdefault(group, {})
            kept[(words.owner_uid, words.pod)] = words
            newest = max(w.generation for w in kept.values() if w.owner_uid == words.owner_uid)
            for k in [k for k, w in kept.items() if w.owner_uid == words.owner_uid and w.generation < newest - 1]:
                del kept[k]

    def forget(self, namespace: str, job: str) -> None:
        """The job is gone."""
        with self._lock:
            self._jobs.pop((namespace, job), None)

    def of(self, namespace: str, job: str) -> tuple[LastWords, ...]:
        with self._lock:
            return tuple(w for _, w in sorted((self._jobs.get((namespace, job)) or {}).items()))


class FleetIndex:
    """Every node parsed and the devices live pods hold on it, kept per watch event (see the module)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: name → the node parsed, nothing counted in use
        self._parsed: dict[str, ObservedNode] = {}
        #: every node by name with the devices of all bound live pods counted; `_pos`: name → index
        self._view: list[ObservedNode] = []
        self._pos: dict[str, int] = {}
        self._stale_order = False
        #: pool → node → its allocatable devices (where a pending pod of the pool is counted)
        self._pools: dict[str, dict[str, Mapping[str, int]]] = {}
        #: pod key → what it holds; bound pods' devices per node, in all and per job; pending pods
        self._uses: dict[str, DeviceUse] = {}
        self._bound: dict[str, dict[str, int]] = {}
        self._bound_by_job: dict[JobKey, dict[str, dict[str, int]]] = {}
        self._pending: dict[str, DeviceUse] = {}

    # ---- updates (from the watch threads) ------------------------------------------------------
    def update_node(self, key: str, old: Body | None, new: Body | None) -> None:
        """A Node added, changed (new parse) or deleted (`new` None)."""
        name = key.rpartition("/")[2]
        parsed = None if new is None else parse_node(new)
        with self._lock:
            before = self._parsed.get(name)
            if before is not None and before.pool is not None:
                self._pools.get(before.pool, {}).pop(name, None)
                if not self._pools.get(before.pool):
                    self._pools.pop(before.pool, None)
            if parsed is None:
                self._parsed.pop(name, None)
                self._stale_order = self._stale_order or before is not None
                return
            self._parsed[name] = parsed
            if parsed.pool is not None:
                self._pools.setdefault(parsed.pool, {})[name] = parsed.allocatable
            if before is None:
                self._stale_order = True
            else:
                self._refresh_node(name)

    def update_pod(self, key: str, old: Body | None, new: Body | None) -> None:
        """A live pod added, changed or gone (deleted, or finished: it left the live pods' watch)."""
        use = None if new is None else parse_device_use(new)
        with self._lock:
            before = self._uses.pop(key, None)
            if before is not None:
                self._count(key, before, -1)
            if use is not None:
                self._uses[key] = use
                self._count(key, use, 1)

    def _count(self, key: str, use: DeviceUse, sign: int) -> None:
        if use.node is None:
            if sign > 0:
                self._pending[key] = use
            else:
                self._pending.pop(key, None)
            return
        add_devices(self._bound, use.node, use.asked, sign)
        if use.job is not None:
            job = (use.namespace, use.job)
            by_node = self._bound_by_job.setdefault(job, {})
            add_devices(by_node, use.node, use.asked, sign)
            if not by_node:
                del self._bound_by_job[job]
        self._refresh_node(use.node)

    def _refresh_node(self, name: str) -> None:
        if self._stale_order or name not in self._parsed:
            return
        self._view[self._pos[name]] = self._counted(name)

    def _counted(self, name: str) -> ObservedNode:
        node, in_use = self._parsed[name], self._bound.get(name)
        return replace(node, in_use_by_others=dict(in_use)) if in_use else node

    def _order(self) -> None:
        if self._stale_order:
            names = sorted(self._parsed)
            self._view = [self._counted(n) for n in names]
            self._pos = {n: i for i, n in enumerate(names)}
            self._stale_order = False

    # ---- reads (from the reconciles) -----------------------------------------------------------
    def nodes_for(self, namespace: str, job: str) -> tuple[ObservedNode, ...]:
        """Every node, sorted by name, with `in_use_by_others` = the devices held by the live pods that
        are not this job's (pending pods pinned to a pool counted as `devices.count_devices_in_use`)."""
        with self._lock:
            self._order()
            nodes = list(self._view)
            mine = self._bound_by_job.get((namespace, job)) or {}
            pending = [u for u in self._pending.values() if (u.namespace, u.job) != (namespace, job)]
            if not mine and not pending:
                return tuple(nodes)
            touched = set(mine) | {n for u in pending for n in self._pools.get(u.pool or "", {})}
            in_use = {n: dict(self._bound[n]) for n in touched if n in self._bound}
            for n, amounts in mine.items():
                add_devices(in_use, n, amounts, -1)
            by_pool = {u.pool or "": list(self._pools.get(u.pool or "", {}).items()) for u in pending}
            place_pending(in_use, pending, by_pool)
            for n in touched:
                i = self._pos.get(n)
                if i is not None and nodes[i].in_use_by_others != in_use.get(n, {}):
                    nodes[i] = replace(self._parsed[n], in_use_by_others=in_use.get(n, {}))
        return tuple(nodes)

    def node_count(self) -> int:
        with self._lock:
            return len(self._parsed)
