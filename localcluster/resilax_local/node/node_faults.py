"""The faults the node agent plays on a node (its HTTP control API, agent.py): a hard kill (the
Lease stops, the processes die), a network partition, GKE's preemption notice (the
`cloud.google.com/impending-node-termination` taint and the `cloud.google.com/scheduled-maintenance-time`
label, then a kill), the kubelet's graceful node shutdown (GracefulNodeShutdown), and the node's
return. Each takes the agent and a node name and returns the control API's answer."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from .kube_events import build_node_event
from .podhost import NodeState, now_rfc3339

if TYPE_CHECKING:
    from .agent import AgentNode, NodeAgent
    from .pods import PodWorker

log = logging.getLogger(__name__)

IMPENDING_TERMINATION_TAINT = "cloud.google.com/impending-node-termination"
MAINTENANCE_TIME_LABEL = "cloud.google.com/scheduled-maintenance-time"
#: Pods at or above this priority are system-critical for graceful node shutdown (system-node-critical
#: and system-cluster-critical; the kubelet's `shutdownGracePeriodCriticalPods` applies to them).
CRITICAL_PRIORITY = 2_000_000_000


def kill_node(agent: NodeAgent, name: str) -> dict[str, Any]:
    node = agent.node_record(name)
    with agent.lock:
        node.state = NodeState.KILLED
        if node.kill_timer:
            node.kill_timer.cancel()
            node.kill_timer = None
    killed = 0
    for worker in agent.workers_on(name):
        killed += len(worker.processes())
        worker.kill_now()
    log.warning("node %s killed (%d processes)", name, killed)
    return {"node": name, "state": node.state, "killed_processes": killed}

def partition_node(agent: NodeAgent, name: str) -> dict[str, Any]:
    node = agent.node_record(name)
    with agent.lock:
        node.state = NodeState.PARTITIONED
    log.warning("node %s partitioned", name)
    return {"node": name, "state": node.state}

def preempt_node(agent: NodeAgent, name: str, delay_seconds: float = 30.0, sigterm: bool = False) -> dict[str, Any]:
    node = agent.node_record(name)
    when = int(time.time() + delay_seconds)

    def add_notice(obj: dict[str, Any]) -> dict[str, Any]:
        taints = [t for t in obj["spec"].get("taints") or [] if t["key"] != IMPENDING_TERMINATION_TAINT]
        taints.append({"key": IMPENDING_TERMINATION_TAINT, "value": "true", "effect": "NoSchedule"})
        return {"metadata": {"labels": {MAINTENANCE_TIME_LABEL: str(when)}}, "spec": {"taints": taints}}

    agent.update_node(name, add_notice)
    if sigterm:
        for worker in agent.workers_on(name):
            for c in worker.containers:
                if c.kind == "main":
                    c.signal(signal.SIGTERM)
    with agent.lock:
        if node.kill_timer:
            node.kill_timer.cancel()
        node.kill_timer = threading.Timer(delay_seconds, kill_node, args=(agent, name))
        node.kill_timer.daemon = True
        node.kill_timer.start()
    log.warning("node %s: preemption notice, killed in %.0f s", name, delay_seconds)
    return {"node": name, "state": node.state, "scheduled_maintenance_time": when}

def shutdown_node(agent: NodeAgent, name: str, grace_seconds: float = 30.0, critical_grace_seconds: float = 15.0
                  ) -> dict[str, Any]:
    """Graceful node shutdown, as the kubelet's shutdown manager (GracefulNodeShutdown) runs it
    when the machine is told to power off (a spot VM's preemption: GKE gives 30 s, 15 of them to
    system-critical pods): no taint or label warns anyone first. The node turns NotReady at once
    and gets a `NodeShutdown` event; the pods that are still running are terminated (SIGTERM, then
    SIGKILL after min(their own grace, `grace - critical`); system-critical pods after the others,
    within `critical`), end Failed with reason `Terminated` and a `DisruptionTarget` condition and
    stay; then the node powers off (`kill_node`). Returns at once; the shutdown runs behind."""
    node = agent.node_record(name)
    if not 0 <= critical_grace_seconds <= grace_seconds:
        raise ValueError(f"critical_grace_seconds {critical_grace_seconds} must be between 0 and "
                         f"grace_seconds {grace_seconds}")
    with agent.lock:
        if node.state != NodeState.READY:
            raise ValueError(f"node {name} is {node.state}: only a Ready node can shut down")
        node.state = NodeState.SHUTTING_DOWN
        node.ready_since = now_rfc3339()
        node.shutdown_token += 1
        token = node.shutdown_token
    _emit_node_event(agent, node, "NodeShutdown", "Shutdown manager detected shutdown event")
    agent.post_node_status(node)
    active = [w for w in agent.workers_on(name) if w.terminal is None and not w.finished]
    critical = [w for w in active if int(w.pod["spec"].get("priority") or 0) >= CRITICAL_PRIORITY]
    regular = [w for w in active if w not in critical]
    groups = [(regular, grace_seconds - critical_grace_seconds), (critical, critical_grace_seconds)]
    threading.Thread(target=_run_shutdown, args=(agent, node, token, groups), name=f"shutdown-{name}",
                     daemon=True).start()
    log.warning("node %s: graceful shutdown (%d pods, grace %.0f s, critical %.0f s)", name, len(active),
                grace_seconds, critical_grace_seconds)
    return {"node": name, "state": node.state, "pods": len(active)}

def _run_shutdown(agent: NodeAgent, node: AgentNode, token: int, groups: list[tuple[list[PodWorker], float]]) -> None:
    def current() -> bool:
        with agent.lock:
            return node.shutdown_token == token and node.state == NodeState.SHUTTING_DOWN

    for workers, seconds in groups:
        if not workers or not current():
            continue
        for worker in workers:
            worker.notify("shutdown", int(seconds))
        deadline = time.monotonic() + seconds + 2.0  # the workers' own SIGKILL comes at `seconds`
        while time.monotonic() < deadline and current() and not all(w.finished for w in workers):
            time.sleep(0.1)
    if current():
        log.warning("node %s: shutdown done, powering off", node.name)
        kill_node(agent, node.name)

def _emit_node_event(agent: NodeAgent, node: AgentNode, reason: str, message: str) -> None:
    body = build_node_event(node.name, reason, message)

    def send() -> None:
        try:
            agent.client.create("/api/v1/namespaces/default/events", body)
        except Exception as e:
            log.debug("event %s for node %s: %s", reason, node.name, e)

    agent.events.submit(send)


HEALTH_FAULT_PARTS = ("devices", "matmul", "collective", "hang")


def make_node_unhealthy(agent: NodeAgent, name: str, part: str = "matmul") -> dict[str, Any]:
    """A Ready node whose hardware is bad: the containers it starts from now on fail that part of
    `resilax health-check` (RESILAX_HEALTH_FAULT); the Lease and the kubelet stay healthy, as a flaky
    host that still reports Ready does. `restore` makes it healthy again."""
    if part not in HEALTH_FAULT_PARTS:
        raise ValueError(f"part: {part!r} is not allowed; allowed: {', '.join(HEALTH_FAULT_PARTS)}")
    node = agent.node_record(name)
    with agent.lock:
        node.health_fault = part
    log.warning("node %s unhealthy: its containers fail the health check's %s part", name, part)
    return {"node": name, "state": node.state, "health_fault": part}


def restore_node(agent: NodeAgent, name: str) -> dict[str, Any]:
    node = agent.node_record(name)
    with agent.lock:
        node.health_fault = ""
        if node.kill_timer:
            node.kill_timer.cancel()
            node.kill_timer = None
        node.shutdown_token += 1
        if node.state == NodeState.SHUTTING_DOWN:
            node.state = NodeState.KILLED  # powered off before it comes back

    def remove_notice(obj: dict[str, Any]) -> dict[str, Any] | None:
        taints = obj["spec"].get("taints") or []
        kept = [t for t in taints if t["key"] != IMPENDING_TERMINATION_TAINT]
        labels = obj["metadata"].get("labels") or {}
        if len(kept) == len(taints) and MAINTENANCE_TIME_LABEL not in labels:
            return None
        return {"metadata": {"labels": {MAINTENANCE_TIME_LABEL: None}}, "spec": {"taints": kept}}

    agent.register(node)
    agent.update_node(name, remove_notice)
    with agent.lock:
        node.state = NodeState.READY
    for worker in agent.workers_on(name):
        worker.notify("resync")
    for pod in agent.client.get("/api/v1/pods", fieldSelector=f"spec.nodeName={name}").get("items", []):
        agent.dispatch("ADDED", pod)
    log.warning("node %s restored", name)
    return {"node": name, "state": node.state}
