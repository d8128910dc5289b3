"""`kubectl resilax logs NAME [-f] [--process N]`: a trainer's log across generations.

Process 0's pod is `<job>-g<generation>-s0-h0`, a new name with every generation (a pod kept by an
in-place restart keeps its name and its log goes on). `logs` finds the pod of process N of the job's
current generation (its labels and owner), prints its trainer container's log and, with `-f`, follows
it; when that pod ends it looks again, prints the next generation's, and stops once the job
Succeeded or Failed. `plan_log_pod` is pure; kubectl/client.py makes the calls.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .. import api
from ..ownership import owner_uid
from .client import JobAPI, PluginError

#: How often `logs -f` looks for the next generation's pod.
LOGS_POLL_SECONDS = 2.0


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


def run_logs(kube: JobAPI, namespace: str, name: str, process: int, follow: bool) -> None:
    """Print process `process`'s trainer log; with `follow`, go on with the pod of each new generation
    (process 0's pod name changes with every generation) until the job Succeeded or Failed."""
    from .plugin import escape_controls  # the screens' escaping (plugin.py imports this module)

    done: set[str] = set()
    while True:
        job = kube.get_job(namespace, name)
        status = job.get("status") or {}
        uid = str((job.get("metadata") or {}).get("uid") or "")
        generation = int(status.get("generation") or 0)
        target = plan_log_pod(kube.worker_pods(namespace, name, generation), process, uid)
        if target is not None and target[1] not in done:
            pod, pod_uid, container = target
            print(f"==> {namespace}/{pod} ({container}, generation {generation}, process {process})",
                  file=sys.stderr, flush=True)
            for line in kube.pod_log(namespace, pod, container, follow):
                print(escape_controls(line), flush=True)
            done.add(pod_uid)
            if not follow:
                return
            continue
        if not follow:
            raise PluginError(f"jaxjob {namespace}/{name}: no pod of process {process} in generation {generation}")
        if status.get("phase") in api.TERMINAL_PHASES:
            return
        time.sleep(LOGS_POLL_SECONDS)
