"""Stuck containers: a container of a worker (init, trainer, sidecar) waits for a reason that will not
go away by itself, and the generation would sit in WorkersStarting forever.

The first waiting container (pods by name, containers in status order) decides; the timeout counts
from the generation's start (`containerWaitingTimeoutSeconds`, an operator setting):

| the container waits with                                       | before the timeout                | after it |
|----------------------------------------------------------------|-----------------------------------|----------|
| ImagePullBackOff, ErrImagePull, InvalidImageName, CreateContainerConfigError, CreateContainerError | Ready=False ContainerWaiting naming pod, container, reason and the fix (an event once per pod and container) | Failed, ContainerWaitingTimeout (the spec must change) |
| CrashLoopBackOff (any container, the sidecar too)              | the same                          | WorkerFailure: counted, backoff, a new generation; Failed past maxRestarts |
| any other reason                                               | the same                          | the same as CrashLoopBackOff |
| nothing stuck                                                  | nothing (the next check runs)     |          |
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Final

from .. import api
from .. import status as st
from ..actions import POLL_SECONDS, Action, EmitEvent, RequeueAfter, SetStatus, status_change
from ..observed import Observed
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


def check(spec: JobSpec, observed: Observed, s: JobStatus, settings: OperatorSettings) -> Verdict:
    now, g = observed.now, s.generation
    stuck = next(((p.name, c, reason, message) for p in observed.pods_of(g) for c, reason, message in p.waiting),
                 None)
    if stuck is None:
        return None
    pod, container, reason, message = stuck
    detail = api.CONTAINER_WAITING.format(
        pod=pod, generation=g, container=container, reason=reason,
        message=f" ({message[:300]})" if message else "", fix=FIXES.get(reason, DEFAULT_FIX))
    timeout = timedelta(seconds=settings.container_waiting_timeout_seconds)
    started = s.workers_since or now
    if now - started < timeout:
        text = f"{detail}; giving up at {st.format_time(started + timeout)}"
        old = s.condition(api.COND_READY)
        new = st.set_condition(s, api.COND_READY, False, api.CONTAINER_WAITING.name, text, now)
        # One event per stuck container: the kubelet's reason and message change while it waits
        # (ErrImagePull and ImagePullBackOff take turns, the crash-loop delay grows); the condition follows.
        head = api.CONTAINER_WAITING.message.split("{reason}")[0].format(pod=pod, generation=g, container=container)
        same = old is not None and old.reason == api.CONTAINER_WAITING.name and old.message.startswith(head)
        events = [] if same else [EmitEvent("Warning", api.CONTAINER_WAITING.name, text)]
        return [*status_change(observed.status, new, *events), RequeueAfter(POLL_SECONDS)]
    seconds = settings.container_waiting_timeout_seconds
    if reason in PERMANENT_REASONS:
        text = api.CONTAINER_WAITING_TIMEOUT.format(seconds=seconds, detail=detail)
        new = replace(s, phase=api.PHASE_FAILED)
        new = st.set_condition(new, api.COND_READY, False, api.CONTAINER_WAITING_TIMEOUT.name, text, now)
        out: list[Action] = [SetStatus(new), EmitEvent("Warning", api.CONTAINER_WAITING_TIMEOUT.name, text),
                             plan_delete(observed, spec, g, "job failed", settings)]
        return out
    return counted_failure(spec, observed, s, settings, f"{detail} for {seconds}s")
