"""What the node agent must emulate for supervised trainers (docs/architecture.md, "In-place restart of
the survivors"): a container's end kills its whole session, as a cgroup kill does, also the processes a
supervisor (`resilax run`) started in process groups of their own; and an httpGet probe may target
another container's port (the trainer's readinessProbe on its sidecar's `/v1/trainer/ready`).

Against the session-wide cluster (resilax_local.pytest_plugin); waits are for conditions."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

from resilax_local.processes import alive
from resilax_local.testing import container_status, create_pod, get_pod, wait_for, wait_for_pod_gone

TPU_TOLERATION = [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]

# A supervisor's shape: the container's process starts a child in a process group of its own (same
# session), says its pid, and ends when the file EXIT_FILE appears (never when it is unset).
SPAWNER = textwrap.dedent("""
    import os, subprocess, sys, time
    child = subprocess.Popen(["sleep", "3600"], process_group=0)
    print(f"CHILD {child.pid} pgid {os.getpgid(child.pid)} own {os.getpgid(0)}", flush=True)
    exit_file = os.environ.get("EXIT_FILE")
    while not (exit_file and os.path.exists(exit_file)):
        time.sleep(0.1)
    sys.exit(3)
""")
SIDECAR = textwrap.dedent("""
    import http.server, os
    http.server.HTTPServer((os.environ["POD_IP"], 8491), http.server.SimpleHTTPRequestHandler).serve_forever()
""")


def _child_pid(cluster, namespace: str, pod: str, container: str) -> int:
    def find() -> int | None:
        match = re.search(r"CHILD (\d+) pgid (\d+) own (\d+)", cluster.logs(namespace, pod, container))
        if match is None:
            return None
        assert match.group(2) != match.group(3), "the child leads a process group of its own"
        return int(match.group(1))
    return wait_for(find, 60, message=f"{container}'s child pid")


def test_a_containers_end_kills_its_whole_session_and_a_probe_may_target_the_sidecars_port(
        cluster, kube, namespace, tmp_path: Path) -> None:
    exit_file = tmp_path / "trainer-exit"
    pod_ip = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    create_pod(kube, namespace, {"metadata": {"name": "supervised"}, "spec": {
        "nodeName": "cpu-0", "restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
        "tolerations": TPU_TOLERATION,
        "initContainers": [{"name": "sidecar", "image": "python", "restartPolicy": "Always", "env": pod_ip,
                            "command": ["python", "-c", SIDECAR]}],
        "containers": [
            {"name": "trainer", "image": "python", "command": ["python", "-c", SPAWNER],
             "env": [{"name": "EXIT_FILE", "value": str(exit_file)}],
             # the sidecar's port, not one of the trainer's own (as the operator's doorbell probe)
             "readinessProbe": {"httpGet": {"path": "/", "port": 8491}, "periodSeconds": 1}},
            {"name": "keeper", "image": "python", "command": ["python", "-c", SPAWNER]},
        ]}})
    ready = wait_for(lambda: (container_status(get_pod(kube, namespace, "supervised"), "trainer") or {}).get("ready"),
                     90, message="the trainer ready through a probe on the sidecar's port")
    assert ready

    trainer_child = _child_pid(cluster, namespace, "supervised", "trainer")
    keeper_child = _child_pid(cluster, namespace, "supervised", "keeper")
    assert alive(trainer_child) and alive(keeper_child)

    # the container's own end (its main process exits): its whole session goes
    exit_file.touch()
    terminated = wait_for(lambda: ((container_status(get_pod(kube, namespace, "supervised"), "trainer") or {})
                                   .get("state") or {}).get("terminated"), 60, message="the trainer terminated")
    assert terminated["exitCode"] == 3
    assert wait_for(lambda: not alive(trainer_child), 30, message="the trainer's child killed with it")
    assert alive(keeper_child), "another container's session is not touched"

    # the pod's deletion: each container's whole session goes
    kube.delete(f"/api/v1/namespaces/{namespace}/pods/supervised")
    wait_for_pod_gone(kube, namespace, "supervised", timeout=60)
    assert wait_for(lambda: not alive(keeper_child), 30, message="the keeper's child killed with the pod")
