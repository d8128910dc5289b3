"""How the node agent ends a pod, held against the kubelet's own code (Kubernetes v1.37, pkg/kubelet):
what a failed init container shows while the pod is torn down, and which grace a deletion gets.

All against the session-wide local cluster (resilax_local.pytest_plugin); every wait is for a condition
with a generous bound, and the order of what happened is read from a watch, not from clocks.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from resilax_local.processes import alive
from resilax_local.testing import container_status, create_pod, force_delete_pod, wait_for

TPU_TOLERATION = [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]


def python_container(name: str, script: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "python:3.11", "command": ["python", "-c", textwrap.dedent(script)], **extra}


def watch_pod(kube: Any, namespace: str, name: str, since: str, until: Callable[[dict[str, Any]], bool],
              timeout: float = 120) -> list[dict[str, Any]]:
    """Every version of pod `namespace/name` after resourceVersion `since`, in order, up to the first
    for which `until` holds (a watch that ends early is resumed from the last version seen)."""
    seen: list[dict[str, Any]] = []

    def more() -> bool | None:
        version = seen[-1]["metadata"]["resourceVersion"] if seen else since
        for event in kube.watch(f"/api/v1/namespaces/{namespace}/pods", version, timeout_seconds=10,
                                fieldSelector=f"metadata.name={name}"):
            if event["type"] in ("ADDED", "MODIFIED"):
                seen.append(event["object"])
                if until(event["object"]):
                    return True
        return None

    wait_for(more, timeout, interval=0.05, message=f"pod {namespace}/{name}: the awaited status")
    return seen


def state_of(pod: dict[str, Any], container: str) -> str:
    """'running', 'terminated' or 'waiting' (or '' when the container has no status yet)."""
    return next(iter((container_status(pod, container) or {}).get("state") or {}), "")


def test_a_failed_init_container_is_reported_before_its_sidecar_is_stopped(cluster, kube, namespace):
    """restartPolicy Never and an init container that fails, behind a native sidecar (the operator's
    worker: checkpoint sidecar, then the health check). The kubelet writes the status at once: the init
    container terminated with its exit code while the sidecar still runs, the phase not yet terminal (its
    status manager holds a terminal phase back while containers may run: status_manager.go
    mergePodStatus); only then does it stop the sidecar (SyncTerminatingPod), and the pod ends Failed."""
    sidecar = """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        while True:
            time.sleep(0.1)
    """
    pod = create_pod(kube, namespace, {"metadata": {"name": "checked"}, "spec": {
        "nodeName": "cpu-0", "restartPolicy": "Never", "terminationGracePeriodSeconds": 30,
        "tolerations": TPU_TOLERATION,
        "initContainers": [python_container("sidecar", sidecar, restartPolicy="Always"),
                           python_container("check", "import sys; sys.exit(3)")],
        "containers": [python_container("main", "print('never runs')")]}})
    history = watch_pod(kube, namespace, "checked", pod["metadata"]["resourceVersion"],
                        lambda p: p.get("status", {}).get("phase") == "Failed")
    failed = [p for p in history if state_of(p, "check") == "terminated"]
    first = failed[0]
    assert container_status(first, "check")["state"]["terminated"]["exitCode"] == 3, first["status"]
    assert state_of(first, "sidecar") == "running", first["status"]  # reported before the sidecar stops
    assert first["status"]["phase"] == "Pending", first["status"]
    last = history[-1]
    assert state_of(last, "sidecar") == "terminated" and state_of(last, "main") == "waiting", last["status"]


def test_a_force_deleted_pod_gets_the_kubelets_short_grace_not_its_own(cluster, kube, namespace, tmp_path: Path):
    """`kubectl delete --grace-period=0 --force` removes the object at once, but the kubelet saw the
    deletion's grace (0) first and stops the containers with it: at least 1 s for the pod
    (pod_workers.go calculateEffectiveGracePeriod), at least 2 s for each container (kuberuntime
    killContainer's minimumGracePeriodInSeconds): SIGTERM, then SIGKILL soon after. Not the pod's own
    terminationGracePeriodSeconds (here 300 s), and not a SIGKILL without a SIGTERM first."""
    script = """
        import signal, time
        log = open("/events/log", "a", buffering=1)
        signal.signal(signal.SIGTERM, lambda *_: log.write("sigterm\\n"))  # and keeps running
        log.write("running\\n")
        while True:
            time.sleep(0.05)
    """
    create_pod(kube, namespace, {"metadata": {"name": "stubborn"}, "spec": {
        "nodeName": "cpu-0", "terminationGracePeriodSeconds": 300, "tolerations": TPU_TOLERATION,
        "containers": [python_container("main", script, volumeMounts=[{"name": "events", "mountPath": "/events"}])],
        "volumes": [{"name": "events", "hostPath": {"path": str(tmp_path), "type": "DirectoryOrCreate"}}]}})
    log = cluster.node_path("cpu-0", tmp_path) / "log"

    def pid() -> int | None:
        return next((p["processes"]["main"] for p in cluster.pods()
                     if p["namespace"] == namespace and p["name"] == "stubborn" and "main" in p["processes"]), None)

    main = wait_for(pid, 60, message="the container's process")
    wait_for(lambda: log.exists() and "running" in log.read_text(), 60, message="the container running")
    force_delete_pod(kube, namespace, "stubborn")
    wait_for(lambda: not alive(main), 60, message="the force-deleted pod's process killed (its grace is 300 s)")
    assert log.read_text().splitlines() == ["running", "sigterm"]
