"""Stopping a pod's containers as the kubelet does: the preStop hook, SIGTERM, the grace period, then
SIGKILL; the main containers in parallel, the sidecars after them in reverse order (a container
whose probe failed is killed by probes.kill_for_probe). `label` is the pod's `namespace/name` for the log.
Which grace applies is `plan_grace`'s (pure)."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from .containers import ContainerRun
from .probes import run_probe

log = logging.getLogger(__name__)

#: The least time a container gets between SIGTERM and SIGKILL, whatever the pod's grace (kuberuntime
#: killContainer: "always give containers a minimal shutdown window", minimumGracePeriodInSeconds).
MIN_CONTAINER_GRACE_SECONDS = 2
#: A pod's terminationGracePeriodSeconds when its spec has none (the API server's default).
DEFAULT_GRACE_SECONDS = 30


def plan_grace(current: int | None, pod: dict[str, Any]) -> int:
    """The grace period (seconds) the kubelet gives a pod it terminates, as pod_workers.go
    calculateEffectiveGracePeriod computes it: the deletion's (`metadata.deletionGracePeriodSeconds`, the
    grace of the DELETE; 0 for a force delete) when set and shorter than the one already in force
    (`current`, None before the termination started: a grace only ever shrinks), else `current`, else the
    pod's `terminationGracePeriodSeconds`; never under 1 s. A kill already under way keeps the grace it
    started with (the kubelet's SyncTerminatingPod runs to its end; a shorter grace applies to the next)."""
    grace = current or 0
    deletion = (pod.get("metadata") or {}).get("deletionGracePeriodSeconds")
    if deletion is not None and (grace == 0 or int(deletion) < grace):
        grace = int(deletion)
    elif grace == 0:
        grace = int((pod.get("spec") or {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS))
    return max(1, grace)


def pre_stop_then_sigterm(c: ContainerRun, pod_ip: str | None, deadline: float) -> None:
    """The container's preStop hook (exec, httpGet or sleep; bounded by the grace period), then SIGTERM."""
    hook = (c.spec.get("lifecycle") or {}).get("preStop")
    if hook and c.running() and c.proc is not None and pod_ip is not None:
        remaining = max(1.0, deadline - time.monotonic())
        if "sleep" in hook:
            time.sleep(min(float(hook["sleep"].get("seconds", 0)), remaining))
        else:
            run_probe({**hook, "timeoutSeconds": remaining}, c.spec, pod_ip, c.proc.pid, c.env)
    c.signal(signal.SIGTERM)


def await_exit(containers: list[ContainerRun], deadline: float, label: str) -> None:
    while time.monotonic() < deadline and any(c.running() for c in containers):
        time.sleep(0.05)
    for c in containers:
        if c.running():
            log.info("pod %s: SIGKILL container %s after the grace period", label, c.name)
            c.signal(signal.SIGKILL, group=True)
            if c.proc is not None:
                c.proc.wait()


def stop_in_order(containers: list[ContainerRun], pod_ip: str | None, deadline: float, label: str) -> None:
    """SIGTERM each running container (last first), wait for it (at least MIN_CONTAINER_GRACE_SECONDS),
    SIGKILL if needed."""
    for c in reversed(containers):
        if not c.running():
            continue
        pre_stop_then_sigterm(c, pod_ip, max(deadline, time.monotonic() + MIN_CONTAINER_GRACE_SECONDS))
        await_exit([c], max(deadline, time.monotonic() + MIN_CONTAINER_GRACE_SECONDS), label)


def stop_all(containers: list[ContainerRun], pod_ip: str | None, grace: int, label: str) -> None:
    """SIGTERM the main containers (in parallel, after their preStop hooks), SIGKILL what is left
    at the deadline (at least MIN_CONTAINER_GRACE_SECONDS away), then the sidecars in reverse order within
    what is left of the grace."""
    deadline = time.monotonic() + max(grace, MIN_CONTAINER_GRACE_SECONDS)
    for c in containers:
        c.restart_at = None
    mains = [c for c in containers if c.kind != "sidecar"]
    stoppers = [threading.Thread(target=pre_stop_then_sigterm, args=(c, pod_ip, deadline), daemon=True)
                for c in mains if c.running()]
    for t in stoppers:  # in parallel, as the kubelet kills the containers of a pod
        t.start()
    await_exit(mains, deadline, label)
    stop_in_order([c for c in containers if c.kind == "sidecar"], pod_ip, deadline, label)
