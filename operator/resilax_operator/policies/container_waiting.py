"""Stuck containers: a container of a worker (init, trainer, sidecar) waits for a reason that will not
go away by itself, and the generation would sit in WorkersStarting forever.

The first waiting container (pods by name, containers in status order) decides; the timeout counts
from the generation's start (`containerWaitingTimeoutSeconds`, an operator setting):

| the container waits with                                       | before the timeout                | after it |
|----------------------------------------------------------------|-----------------------------------|----------|
| ImagePullBackOff, ErrImagePull, InvalidImageName, CreateContainerConfigError, CreateContainerError | Ready=False ContainerWaiting naming pod, container, reason and the fix (an event once per pod and container) | Failed, ContainerWaitingTimeout (the spec must change) |
| CrashLoopBackOff (any container, the sidecar too)              | the same                          | WorkerFailure: counted, backoff, a new generation; Failed past maxRestarts |
| any other reason                                               | the same                          | the same as CrashLoopBackOff |
| ContainerCreating, PodInitializing (start-up: image pulls, volume mounts; no timeout of the kubelet's) | nothing | the same report, counted from the pod's scheduling; no teardown (a large image may take that long); the job's token Secret is checked and re-created if gone (`EnsureTokenSecret`: a deleted Secret keeps pods here for ever) |
| nothing stuck                                                  | nothing (the next check runs)     |          |
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Final

from .. import api
from .. import status as st
from ..actions import (
    POLL_SECONDS,
    Action,
    EmitEvent,
    EnsureTokenSecret,
    RequeueAfter,
    SetStatus,
    status_change,
)
from ..observed.snapshot import Observed
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus
from . import Verdict
from .transition import plan_delete
from .worker_exit import counted_failure

#: Reasons a new generation cannot cure: the image or the pod's configuration is wrong.
PERMANENT_REASONS: Final = frozenset({"ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                                      "CreateContainerConfigError", "CreateContainerError"})

#: What to do about each reason (the message names it).
FIXES: Final = {
    "ImagePullBackOff": "check the image name and tag, and that the nodes may pull it (imagePullSecrets, "
                        "Artifact Registry reader role for the nodes' service account)",
    "ErrImagePull": "check the image name and tag, and that the nodes may pull it (imagePullSecrets)",
    "InvalidImageName": "fix the image reference in spec.template",
    "CreateContainerConfigError": "a Secret or ConfigMap the container uses is missing, or the image runs as root "
                                  "while the pod sets runAsNonRoot: set securityContext.runAsUser to a non-zero "
                                  "user in spec.template, or use an image with a non-root USER",
    "CreateContainerError": "read `kubectl describe pod` for the runtime's message (a bad command, mount or "
                            "device)",
    "CrashLoopBackOff": "the container keeps exiting: read `kubectl logs POD -c CONTAINER --previous`",
}
DEFAULT_FIX: Final = "read `kubectl describe pod` for the kubelet's message"
#: What a container still starting long after its pod was scheduled usually waits for.
STARTING_FIX: Final = ("a volume the kubelet cannot mount (a Secret, ConfigMap or PersistentVolumeClaim that does not "
                       "exist: `kubectl describe pod` shows FailedMount), or an image still being pulled; the operator "
                       "re-creates its own token Secret if that is the one missing")


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Verdict:
    now, g = observed.now, s.generation
    stuck = next(((p.name, c, reason, message) for p in observed.pods_of(g) for c, reason, message in p.waiting),
                 None)
    if stuck is None:
        return check_starting(observed, s, settings)
    pod, container, reason, message = stuck
    detail = api.CONTAINER_WAITING.format(
        pod=pod, generation=g, container=container, reason=reason,
        message=f" ({message[:300]})" if message else "", fix=FIXES.get(reason, DEFAULT_FIX))
    timeout = timedelta(seconds=settings.container_waiting_timeout_seconds)
    started = s.workers_since or now
    if now - started < timeout:
        return report(observed, s, f"{detail}; giving up at {st.format_time(started + timeout)}", pod, container)
    seconds = settings.container_waiting_timeout_seconds
    if reason in PERMANENT_REASONS:
        text = api.CONTAINER_WAITING_TIMEOUT.format(seconds=seconds, detail=detail)
        new = replace(s, phase=api.PHASE_FAILED)
        new = st.set_condition(new, api.COND_READY, False, api.CONTAINER_WAITING_TIMEOUT.name, text, now)
        out: list[Action] = [SetStatus(new), EmitEvent("Warning", api.CONTAINER_WAITING_TIMEOUT.name, text),
                             plan_delete(observed, spec, g, "job failed", settings)]
        return out
    return counted_failure(spec, observed, s, settings, f"{detail} for {seconds}s")


def check_starting(observed: Observed, s: JobStatus, settings: OperatorSettings) -> Verdict:
    """A worker scheduled longer than the timeout ago whose containers still start (ContainerCreating,
    PodInitializing): reported as a waiting container, the token Secret ensured; nothing torn down."""
    now, g = observed.now, s.generation
    timeout = timedelta(seconds=settings.container_waiting_timeout_seconds)
    for p in observed.pods_of(g):
        if p.node_name is None or p.phase != "Pending" or not p.starting:
            continue
        times = [t for t in (s.workers_since, p.scheduled_at) if t is not None]
        since = max(times) if times else now
        if now - since < timeout:
            continue
        container, reason = p.starting[0]
        detail = api.CONTAINER_WAITING.format(pod=p.name, generation=g, container=container, reason=reason,
                                              message="", fix=STARTING_FIX)
        text = f"{detail}; scheduled at {st.format_time(since)}, over {settings.container_waiting_timeout_seconds}s ago"
        return [*report(observed, s, text, p.name, container), EnsureTokenSecret()]
    return None


def report(observed: Observed, s: JobStatus, text: str, pod: str, container: str) -> list[Action]:
    """Ready=False ContainerWaiting with `text`; one event per stuck container (the kubelet's reason and
    message change while it waits: ErrImagePull and ImagePullBackOff take turns, the crash-loop delay
    grows; the condition follows)."""
    g, now = s.generation, observed.now
    old = s.condition(api.COND_READY)
    new = st.set_condition(s, api.COND_READY, False, api.CONTAINER_WAITING.name, text, now)
    head = api.CONTAINER_WAITING.message.split("{reason}")[0].format(pod=pod, generation=g, container=container)
    same = old is not None and old.reason == api.CONTAINER_WAITING.name and old.message.startswith(head)
    events = [] if same else [EmitEvent("Warning", api.CONTAINER_WAITING.name, text)]
    return [*status_change(observed.status, new, *events), RequeueAfter(POLL_SECONDS)]
