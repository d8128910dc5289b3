"""Thin kopf handlers: every JAXJob gets a reconcile daemon; changes seen by the watch cache wake it.

State-driven: the daemon observes (observed/observe.py, from the watch cache), decides (reconcile.py, pure) and
executes (execute.py) in a loop, at least every few seconds and at once when one of the job's pods, its
spec, or a node's readiness, taints or labels change. Every reconcile starts from what it observes, so a
missed or repeated wake-up changes nothing but the timing. Kopf passes `memo` (main.py fills it before
kopf copies it per object, so its dicts are shared): `kube` (k8s.Kube), `settings` (OperatorSettings),
`namespaces` (the watched ones; empty: all), `peering_lifetime`, `wakeups` ((namespace, name) →
asyncio.Event); the startup handler adds `cache` (cache.WorldCache).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf

from . import api, execute
from .observed.cache import WorldCache

#: The finalizer kopf puts on JAXJobs (it runs `cleanup` before the object goes).
FINALIZER = "resilax.dev/operator"


@kopf.on.startup(id="configure")
def configure(settings: kopf.OperatorSettings, memo: Any, logger: kopf.Logger, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.resilax.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kopf.resilax.dev")
    settings.posting.enabled = False  # the operator posts its own Events, one per transition
    settings.peering.lifetime = int(getattr(memo, "peering_lifetime", 60))
    settings.peering.stealth = True
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    logger.info("resilax operator configured (peering %s, lifetime %ss)",
                "standalone" if settings.peering.standalone else settings.peering.name, settings.peering.lifetime)


@kopf.on.startup(id="watch-cache")
async def start_cache(memo: Any, logger: kopf.Logger, **_: Any) -> None:
    """Start the watches (pods, Services, nodes, JAXJobs) and wait until each has listed once, so the
    first reconcile reads a full cache."""
    loop = asyncio.get_running_loop()
    # the reconciles run in the loop's default executor (asyncio.to_thread), sized for a fleet of jobs
    loop.set_default_executor(ThreadPoolExecutor(max_workers=memo.settings.reconcile_threads,
                                                 thread_name_prefix="resilax-reconcile"))
    waker = Waker(memo.wakeups)

    def on_change(kind: str, key: str, body: dict[str, Any], deleted: bool) -> None:
        loop.call_soon_threadsafe(waker.changed, kind, key, body, deleted)

    memo.cache = WorldCache(memo.kube, memo.namespaces, on_change).start()
    if not await asyncio.to_thread(memo.cache.wait_synced, 120.0):
        raise kopf.TemporaryError("the watch cache has not listed every kind within 120 s", delay=5)
    logger.info("watch cache synced: %d nodes, %d job pods", memo.cache.node_count(),
                sum(len(i.items()) for i in memo.cache.job_pods))


@kopf.on.cleanup(id="stop-cache")
async def stop_cache(memo: Any, **_: Any) -> None:
    cache = getattr(memo, "cache", None)
    if cache is not None:
        cache.stop()


@kopf.on.login(id="login")
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """$KUBECONFIG when set (`resilax operator --kubeconfig`), else in-cluster / the default kubeconfig."""
    if os.environ.get("KUBECONFIG"):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_via_client(**kwargs)


@kopf.daemon(api.GROUP, api.VERSION, api.PLURAL, id="reconcile", cancellation_timeout=10.0)
async def reconcile(name: str, namespace: str | None, memo: Any, logger: kopf.Logger,
                    stopped: kopf.DaemonStopped, **_: Any) -> None:
    """Observe → decide → execute, again after the actions' RequeueAfter (≤ 5 s) or a wake-up."""
    wake = memo.wakeups.setdefault((namespace, name), asyncio.Event())
    try:
        while not stopped:
            wake.clear()
            try:
                delay = await asyncio.to_thread(execute.reconcile_job, memo.kube, memo.cache, namespace or "", name,
                                                memo.settings, logger)
            except kopf.TemporaryError as e:
                logger.warning("reconcile: %s (retrying in %ss)", e, e.delay)
                delay = float(e.delay or 2.0)
            except Exception:
                logger.exception("reconcile failed; retrying")
                delay = 5.0
            if delay is None:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=delay)
    finally:
        memo.wakeups.pop((namespace, name), None)


@kopf.on.delete(api.GROUP, api.VERSION, api.PLURAL, id="cleanup")
def cleanup(body: kopf.Body, memo: Any, logger: kopf.Logger, **_: Any) -> None:
    """Force-delete the workers no kubelet will confirm; the garbage collector removes the rest
    (pods, Services and the token Secret carry owner references). Checkpoints stay in storage."""
    execute.cleanup_job(memo.kube, memo.cache, dict(body), memo.settings, logger)


class Waker:
    """Turns the cache's changes into wake-ups (on the event loop): a job's pod → that job; a node's
    readiness, taints, labels or schedulability (not its heartbeats) → every job; a JAXJob's spec
    (metadata.generation, not its status writes) → that job."""

    def __init__(self, wakeups: dict[tuple[str | None, str | None], asyncio.Event]) -> None:
        self.wakeups = wakeups
        self.node_digests: dict[str, str | None] = {}
        self.spec_generations: dict[str, Any] = {}

    def changed(self, kind: str, key: str, body: Mapping[str, Any], deleted: bool) -> None:
        namespace, _, name = key.partition("/")
        if kind == "pods":
            job = ((body.get("metadata") or {}).get("labels") or {}).get(api.LABEL_JOB)
            if job:
                self._wake(namespace, job)
        elif kind == "nodes":
            digest = None if deleted else _node_digest(body)
            if self.node_digests.get(name, "") != digest:
                self.node_digests[name] = digest
                self._wake_all()
        elif kind == "jaxjobs":
            generation = None if deleted else (body.get("metadata") or {}).get("generation")
            if self.spec_generations.get(key) != generation:
                self.spec_generations[key] = generation
                self._wake(namespace, name)

    def _wake(self, namespace: str, name: str) -> None:
        event = self.wakeups.get((namespace or None, name)) or self.wakeups.get((namespace, name))
        if event is not None:
            event.set()

    def _wake_all(self) -> None:
        for event in list(self.wakeups.values()):
            event.set()


def _node_digest(body: Mapping[str, Any]) -> str:
    spec, status, meta = body.get("spec") or {}, body.get("status") or {}, body.get("metadata") or {}
    ready = next((c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    taints = sorted((t.get("key"), t.get("effect")) for t in spec.get("taints") or [])
    return repr((ready, taints, bool(spec.get("unschedulable")), sorted((meta.get("labels") or {}).items())))
