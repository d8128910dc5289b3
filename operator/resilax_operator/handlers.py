"""Thin kopf handlers: every JAXJob gets a reconcile daemon; pod and node events wake it sooner.

State-driven: the daemon observes, decides (reconcile.decide_raw) and executes (observe.py) in a loop,
at least every few seconds and at once when one of the job's pods or a node's readiness, taints or
labels change. Every reconcile starts from what it observes, so a missed or repeated wake-up changes
nothing but the timing. Kopf passes `memo` (main.py fills it before kopf copies it per object, so
its dicts are shared): `kube` (k8s.Kube), `settings` (OperatorSettings), `peering_lifetime`,
`wakeups` ((namespace, name) → asyncio.Event), `node_digests`, `spec_generations`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Mapping
from typing import Any

import kopf

from . import api, observe

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


@kopf.on.login(id="login")
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """$KUBECONFIG when set (`resilax operator --kubeconfig`), else in-cluster / the default kubeconfig."""
    if os.environ.get("KUBECONFIG"):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_via_client(**kwargs)


def _wake(memo: Any, namespace: str | None, name: str | None) -> None:
    event = memo.wakeups.get((namespace, name))
    if event is not None:
        event.set()


@kopf.daemon(api.GROUP, api.VERSION, api.PLURAL, id="reconcile", cancellation_timeout=10.0)
async def reconcile(name: str, namespace: str | None, memo: Any, logger: kopf.Logger,
                    stopped: kopf.DaemonStopped, **_: Any) -> None:
    """Observe → decide → execute, again after the actions' RequeueAfter (≤ 5 s) or a wake-up."""
    wake = memo.wakeups.setdefault((namespace, name), asyncio.Event())
    try:
        while not stopped:
            wake.clear()
            try:
                delay = await asyncio.to_thread(observe.reconcile_job, memo.kube, namespace or "", name,
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
    observe.cleanup_job(memo.kube, dict(body), memo.settings, logger)


@kopf.on.event("", "v1", "pods", labels={api.LABEL_JOB: kopf.PRESENT}, id="pod-event")
async def pod_event(namespace: str | None, labels: Mapping[str, str], memo: Any, **_: Any) -> None:
    _wake(memo, namespace, labels.get(api.LABEL_JOB))


@kopf.on.event("", "v1", "nodes", id="node-event")
async def node_event(name: str, body: kopf.Body, type: str | None, memo: Any, **_: Any) -> None:
    """Wake every job when a node's readiness, taints, labels or schedulability change (not on its
    heartbeats)."""
    digest = _node_digest(body) if type != "DELETED" else None
    digests = memo.node_digests
    if digests.get(name) == digest:
        return
    first = name not in digests
    digests[name] = digest
    if first and type is None:
        return  # the initial listing
    for event in list(memo.wakeups.values()):
        event.set()


def _node_digest(body: Mapping[str, Any]) -> str:
    spec, status, meta = body.get("spec") or {}, body.get("status") or {}, body.get("metadata") or {}
    ready = next((c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    taints = sorted((t.get("key"), t.get("effect")) for t in spec.get("taints") or [])
    return repr((ready, taints, bool(spec.get("unschedulable")), sorted((meta.get("labels") or {}).items())))


@kopf.on.event(api.GROUP, api.VERSION, api.PLURAL, id="job-event")
async def job_event(name: str, namespace: str | None, meta: Mapping[str, Any], memo: Any, **_: Any) -> None:
    """Wake the job's daemon when its spec changes (metadata.generation), not on its status writes."""
    seen = memo.spec_generations
    generation = meta.get("generation")
    if seen.get((namespace, name)) != generation:
        seen[(namespace, name)] = generation
        _wake(memo, namespace, name)
