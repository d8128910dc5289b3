"""A pod's status as the kubelet writes it: the phase, the conditions this worker computes, each
container's state (running, terminated, waiting with its reason) and the shutdown manager's marks.
Pure: pods.py patches what `build_status` returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .containers import ContainerRun, container_id
from .podhost import Pod, now_rfc3339

#: What the kubelet's shutdown manager writes on the pods it stops (pkg/kubelet/nodeshutdown).
NODE_SHUTDOWN_REASON = "Terminated"
NODE_SHUTDOWN_MESSAGE = "Pod was terminated in response to imminent node shutdown."
NODE_SHUTDOWN_REJECTED_REASON = "NodeShutdown"
NODE_SHUTDOWN_REJECTED_MESSAGE = "Pod was rejected as the node is shutting down."


@dataclass
class Condition:
    status: str
    since: str
    reason: str | None = None
    message: str | None = None


def set_condition(conditions: dict[str, Condition], kind: str, value: bool, reason: str | None = None) -> None:
    """One of the conditions this worker computes (a condition set once, e.g. DisruptionTarget,
    is kept as it is)."""
    status = "True" if value else "False"
    current = conditions.get(kind)
    if current is None or current.status != status or current.reason != reason:
        conditions[kind] = Condition(status, now_rfc3339(), reason)


def container_status(c: ContainerRun, uid: str) -> dict[str, Any]:
    state: dict[str, Any]
    if c.running():
        state = {"running": {"startedAt": c.started_at}}
    elif c.terminated is not None and c.restart_at is None:
        state = {"terminated": c.terminated}
    else:
        waiting: dict[str, Any] = {"reason": c.waiting_reason or "PodInitializing"}
        if c.waiting_message:
            waiting["message"] = c.waiting_message
        state = {"waiting": waiting}
    last = c.terminated if (c.terminated is not None and c.restart_at is not None) else c.last_terminated
    out: dict[str, Any] = {
        "name": c.name, "image": c.spec.get("image", ""), "imageID": "", "state": state,
        "lastState": {"terminated": last} if last else {}, "ready": c.is_ready(),
        "restartCount": c.restart_count, "started": c.is_started(),
    }
    if c.ever_started:
        out["containerID"] = container_id(uid, c)
    return out


def decide_phase(terminal: str | None, initialized: bool, containers: list[ContainerRun]) -> str:
    if terminal:
        return terminal
    if initialized and any(c.ever_started for c in containers if c.kind == "main"):
        return "Running"
    return "Pending"


def build_status(pod: Pod, containers: list[ContainerRun], conditions: dict[str, Condition], *,
                 pod_ip: str | None, host_ip: str, start_time: str | None, initialized: bool,
                 terminal: str | None, prepare_error: str | None, status_reason: str | None) -> dict[str, Any]:
    """The pod's `status` (updating `conditions`, which keeps each condition's transition time)."""
    uid = pod["metadata"]["uid"]
    inits = [c for c in containers if c.kind != "main"]
    mains = [c for c in containers if c.kind == "main"]
    phase = decide_phase(terminal, initialized, containers)
    set_condition(conditions, "PodReadyToStartContainers", pod_ip is not None)
    set_condition(conditions, "Initialized", initialized or terminal is not None)
    ready = terminal is None and initialized and all(c.is_ready() for c in containers if c.kind != "init")
    reason = "PodCompleted" if terminal else (None if ready else "ContainersNotReady")
    set_condition(conditions, "ContainersReady", ready, reason)
    set_condition(conditions, "Ready", ready, reason)
    rows = [{"type": k, "status": v.status, "lastTransitionTime": v.since,
             "lastProbeTime": None, **({"reason": v.reason} if v.reason else {}),
             **({"message": v.message} if v.message else {})}
            for k, v in conditions.items()]
    foreign = [c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] not in conditions]
    status: dict[str, Any] = {
        "phase": phase, "hostIP": host_ip, "hostIPs": [{"ip": host_ip}],
        "conditions": foreign + rows,
        "containerStatuses": [container_status(c, uid) for c in mains],
    }
    if pod_ip:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    if start_time:
        status["startTime"] = start_time
    if inits:
        status["initContainerStatuses"] = [container_status(c, uid) for c in inits]
    if prepare_error:
        status["message"] = prepare_error
    if status_reason == NODE_SHUTDOWN_REASON:
        status["reason"], status["message"] = NODE_SHUTDOWN_REASON, NODE_SHUTDOWN_MESSAGE
    return status


def build_fake_running_status(pod: Pod, pod_ip: str, host_ip: str) -> dict[str, Any]:
    """No-process mode (scale tests): the status of a pod reported Running at once, every container
    started and ready."""
    now = now_rfc3339()
    containers = [{"name": c["name"], "image": c.get("image", ""), "imageID": "", "ready": True,
                   "restartCount": 0, "started": True, "state": {"running": {"startedAt": now}}}
                  for c in pod["spec"]["containers"]]
    conditions = [{"type": t, "status": "True", "lastTransitionTime": now}
                  for t in ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")]
    foreign = [c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"]
    return {"phase": "Running", "podIP": pod_ip, "podIPs": [{"ip": pod_ip}], "hostIP": host_ip,
            "hostIPs": [{"ip": host_ip}], "startTime": now, "conditions": foreign + conditions,
            "containerStatuses": containers}
