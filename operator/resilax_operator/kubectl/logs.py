"""`kubectl resilax logs NAME [-f] [--process N]`: a trainer's log across generations.

Process 0's pod is `<job>-g<generation>-s0-h0`, a new name with every generation (a pod kept by an
in-place restart keeps its name and its log goes on). `logs` finds the pod of process N of the job's
current generation (its labels and owner), prints its trainer container's log and, with `-f`, follows
it; when that pod ends it looks again, prints the next generation's, and stops once the job
Succeeded or Failed. A pod found before its trainer container started (ContainerCreating,
PodInitializing, not placed yet: the kubelet answers 400 "is waiting to start") is waited for with `-f`,
quietly, until the container runs, the pod goes or a newer generation's pod replaces it; without `-f`
that is an error that says so. `plan_log_pod`, `plan_log_read` and `is_log_not_ready` are pure;
kubectl/client.py makes the calls.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from .. import api
from ..ownership import owner_uid
from .client import JobAPI, PluginError

#: How often `logs -f` looks for the next generation's pod, or again at a pod whose trainer has not started.
LOGS_POLL_SECONDS = 2.0
#: The kubelet's words for a container whose log cannot be read yet (kubelet_pods.go,
#: validateContainerLogStatus); the API server passes them on in its 400 answer.
NOT_STARTED_WORDS = ("is waiting to start", "is not available")

LogRead = Literal["read", "wait", "skip"]


def plan_log_pod(pods: Sequence[Mapping[str, Any]], process: int, uid: str) -> tuple[str, str, str] | None:
    """The pod whose log `logs --process N` prints: the one the JAXJob (`uid`) owns with that process
    label, not being deleted, of the newest generation among `pods`; (name, pod uid, the trainer's
    container: the first that is not the operator's own), or None."""
    found = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if owner_uid(pod) != uid or str(labels.get(api.LABEL_PROCESS)) != str(process) or meta.get("deletionTimestamp"):
            continue
        containers = [str(c.get("name")) for c in (pod.get("spec") or {}).get("containers") or []
                      if c.get("name") not in api.RESERVED_CONTAINER_NAMES]
        if containers:
            found.append((int(labels.get(api.LABEL_GENERATION) or 0), str(meta.get("name")), str(meta.get("uid")),
                          containers[0]))
    if not found:
        return None
    _, name, pod_uid, container = max(found)
    return name, pod_uid, container


def plan_log_read(pod: Mapping[str, Any], container: str) -> tuple[LogRead, str]:
    """Whether `container`'s log in `pod` (its JSON) can be read now, and why not: "read" once the
    container runs or ran (its state running or terminated, or a last termination); "skip" when the pod
    ended (Succeeded, Failed) without it ever running: there is no log to read; else "wait" with the
    waiting reason (ContainerCreating, PodInitializing) or the pod's phase (Pending: not placed yet)."""
    status = pod.get("status") or {}
    found = next((c for c in status.get("containerStatuses") or [] if c.get("name") == container), None) or {}
    state, last = found.get("state") or {}, found.get("lastState") or {}
    if state.get("running") or state.get("terminated") or last.get("terminated"):
        return "read", ""
    phase = str(status.get("phase") or "Pending")
    if phase in ("Succeeded", "Failed"):
        return "skip", f"the pod is {phase} and its container {container} never ran"
    return "wait", str((state.get("waiting") or {}).get("reason") or phase)


def is_log_not_ready(status: int | None, message: str) -> bool:
    """A log read's error that only says "not yet" while the pod is still there: the kubelet's 400
    "... is waiting to start" or "... is not available" (the pod's status read a moment before was
    older than the kubelet's), or a 404 (a kubelet that has not admitted the pod yet; the pod deleted
    meanwhile, which the next look finds). Any other answer is an error to show."""
    return status == 404 or (status == 400 and any(words in message for words in NOT_STARTED_WORDS))


def run_logs(kube: JobAPI, namespace: str, name: str, process: int, follow: bool) -> None:
    """Print process `process`'s trainer log; with `follow`, go on with the pod of each new generation
    (process 0's pod name changes with every generation) until the job Succeeded or Failed."""
    from .plugin import escape_controls  # the screens' escaping (plugin.py imports this module)

    done: set[str] = set()
    announced: set[str] = set()
    while True:
        job = kube.get_job(namespace, name)
        status = job.get("status") or {}
        uid = str((job.get("metadata") or {}).get("uid") or "")
        generation = int(status.get("generation") or 0)
        pods = kube.worker_pods(namespace, name, generation)
        target = plan_log_pod(pods, process, uid)
        if target is not None and target[1] not in done:
            pod, pod_uid, container = target
            if pod_uid not in announced:
                print(f"==> {namespace}/{pod} ({container}, generation {generation}, process {process})",
                      file=sys.stderr, flush=True)
                announced.add(pod_uid)
            read, why = plan_log_read(next(p for p in pods if (p.get("metadata") or {}).get("uid") == pod_uid),
                                      container)
            if read == "read":
                try:
                    for line in kube.pod_log(namespace, pod, container, follow):
                        print(escape_controls(line), flush=True)
                except PluginError as e:  # raised before any line: the stream swallows later breaks
                    if not (follow and is_log_not_ready(e.status, e.reason)):
                        raise
                else:
                    done.add(pod_uid)
                    if not follow:
                        return
                    continue
            elif not follow:
                raise PluginError(f"{namespace}/{pod}: no log of container {container}: "
                                  + (why if read == "skip" else f"it has not started yet ({why}); -f waits for it"))
            elif read == "skip":
                done.add(pod_uid)
                continue
        elif not follow:
            raise PluginError(f"jaxjob {namespace}/{name}: no pod of process {process} in generation {generation}")
        if status.get("phase") in api.TERMINAL_PHASES:
            return
        time.sleep(LOGS_POLL_SECONDS)
