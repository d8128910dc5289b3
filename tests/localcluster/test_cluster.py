"""The local cluster end to end: control plane, pods as processes, faults, RBAC, sidecars, termination.

All against one session-wide cluster (fixtures in resilax_local.pytest_plugin); every wait is for a
condition with a generous bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from resilax_local.errors import KubeAPIError
from resilax_local.kubeapi import Credentials, KubeClient
from resilax_local.node.profiles import ACCELERATOR_LABEL, NODEPOOL_LABEL, TPU_RESOURCE
from resilax_local.processes import alive
from resilax_local.testing import (
    container_status,
    create_pod,
    force_delete_pod,
    get_pod,
    node_condition,
    node_taints,
    wait_for,
    wait_for_node,
    wait_for_pod_gone,
    wait_for_pod_phase,
)

TPU_TOLERATION = [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]


def python_pod(name: str, script: str, node: str | None = None, **spec):
    """A pod running `python -c script` (on `node` if given), tolerating the TPU taint."""
    container = {"name": "main", "image": "python:3.11", "command": ["python", "-c", textwrap.dedent(script)]}
    container.update(spec.pop("container", {}))
    pod_spec = {"containers": [container], "tolerations": TPU_TOLERATION, "terminationGracePeriodSeconds": 5,
                **spec}
    if node:
        pod_spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"metadata": {"name": name}, "spec": pod_spec}


def pid_of(cluster, namespace: str, pod: str, container: str = "main") -> int:
    def find():
        for p in cluster.pods():
            if p["namespace"] == namespace and p["name"] == pod and container in p["processes"]:
                return p["processes"][container]
        return None

    return wait_for(find, 60, message=f"process of {namespace}/{pod}/{container}")


def test_control_plane_and_tpu_nodes(cluster, kube):
    nodes = {n["metadata"]["name"]: n for n in kube.get("/api/v1/nodes")["items"]}
    assert {"tpu-slice-0-h0", "tpu-slice-0-h1", "tpu-slice-1-h0", "tpu-slice-1-h1", "cpu-0"} <= set(nodes)
    tpu = nodes["tpu-slice-1-h0"]
    assert tpu["metadata"]["labels"][ACCELERATOR_LABEL] == "tpu-v5-lite-podslice"
    assert tpu["metadata"]["labels"][NODEPOOL_LABEL] == "tpu-slice-1"
    assert tpu["status"]["capacity"][TPU_RESOURCE] == "4"
    assert {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"} in node_taints(tpu)
    assert node_condition(tpu) == "True"
    lease = kube.get("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/tpu-slice-1-h0")
    assert lease["spec"]["holderIdentity"] == "tpu-slice-1-h0"
    # as Kubernetes pairs them: a Lease lasts as long as the node controller waits for its renewal
    assert lease["spec"]["leaseDurationSeconds"] == cluster.settings.node_monitor_grace_seconds == 16
    out = subprocess.run(["kubectl", "--kubeconfig", str(cluster.kubeconfig), "get", "nodes", "-o", "name"],
                         capture_output=True, text=True, check=True).stdout
    assert "node/cpu-0" in out


def test_pod_runs_as_a_process_with_env_and_volumes(cluster, kube, namespace, tmp_path):
    kube.create(f"/api/v1/namespaces/{namespace}/configmaps",
                {"metadata": {"name": "cfg"}, "data": {"greeting": "hello", "file.txt": "from-configmap"}})
    kube.create(f"/api/v1/namespaces/{namespace}/secrets",
                {"metadata": {"name": "sec"}, "stringData": {"password": "s3cret"}})
    host_dir = tmp_path / "host"  # a hostPath: the node's own folder for that path
    on_node = cluster.node_path("tpu-slice-0-h1", host_dir)
    on_node.mkdir(parents=True)
    script = """
        import json, os, sys
        token = open("/var/run/secrets/kubernetes.io/serviceaccount/token").read()
        open("/scratch/x", "w").write("scratch ok")
        report = {
            "python": sys.executable, "cwd": os.getcwd(),
            "env": {k: os.environ.get(k) for k in ("POD_NAME", "POD_NS", "POD_UID", "POD_IP", "NODE", "APP",
                                                   "GREETING", "PASSWORD", "ADDRESS", "KUBERNETES_SERVICE_HOST")},
            "configmap": open("/etc/cfg/file.txt").read(),
            "secret": open("/etc/sec/password").read(),
            "labels": open("/etc/podinfo/labels").read(),
            "token_parts": len(token.split(".")),
            "memory_fs": [l.split()[2] for l in open("/proc/mounts") if l.split()[1] == "/scratch"],
        }
        open("/host/report.json", "w").write(json.dumps(report))
        print("report written")
        sys.exit(3)
    """
    manifest = python_pod("proc", script, node="tpu-slice-0-h1", restartPolicy="Never", container={
        "workingDir": "/work-dir-test",
        "resources": {"limits": {TPU_RESOURCE: "4"}},
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "greeting"}}},
            {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "password"}}},
            {"name": "ADDRESS", "value": "$(POD_IP):8476"},
        ],
        "volumeMounts": [
            {"name": "cfg", "mountPath": "/etc/cfg"}, {"name": "sec", "mountPath": "/etc/sec"},
            {"name": "podinfo", "mountPath": "/etc/podinfo"}, {"name": "scratch", "mountPath": "/scratch"},
            {"name": "host", "mountPath": "/host"},
        ],
    }, volumes=[
        {"name": "cfg", "configMap": {"name": "cfg"}}, {"name": "sec", "secret": {"secretName": "sec"}},
        {"name": "podinfo", "downwardAPI": {"items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
        {"name": "scratch", "emptyDir": {"medium": "Memory"}},
        {"name": "host", "hostPath": {"path": str(host_dir), "type": "Directory"}},
    ])
    manifest["metadata"]["labels"] = {"app": "demo"}
    create_pod(kube, namespace, manifest)
    pod = wait_for_pod_phase(kube, namespace, "proc", "Failed", timeout=90)

    status = container_status(pod, "main")
    assert status["state"]["terminated"]["exitCode"] == 3
    assert pod["spec"]["nodeName"] == "tpu-slice-0-h1"
    pod_ip = pod["status"]["podIP"]
    # The pod block the API server's pod proxy accepts (pod_network.py), not a node's 127 address.
    assert pod_ip.startswith("240.") and pod_ip != pod["status"]["hostIP"]

    report = json.loads((on_node / "report.json").read_text())
    assert not host_dir.exists()  # not this machine's folder of that name
    venv_python = Path(sys.executable).parent
    assert Path(report["python"]).parent == venv_python, "`python` in a pod is the venv's python"
    assert report["cwd"] == "/work-dir-test"
    env = report["env"]
    assert env["POD_NAME"] == "proc" and env["POD_NS"] == namespace and env["POD_UID"] == pod["metadata"]["uid"]
    assert env["POD_IP"] == pod_ip and env["NODE"] == "tpu-slice-0-h1" and env["APP"] == "demo"
    assert env["GREETING"] == "hello" and env["PASSWORD"] == "s3cret" and env["ADDRESS"] == f"{pod_ip}:8476"
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    assert report["configmap"] == "from-configmap" and report["secret"] == "s3cret"
    assert 'app="demo"' in report["labels"]
    assert report["token_parts"] == 3
    assert report["memory_fs"] == ["tmpfs"]
    assert "report written" in cluster.logs(namespace, "proc", "main")
    assert not Path("/scratch/x").exists(), "volumes are mounted in the pod's own mount namespace only"


def test_a_secret_volume_follows_its_secret_while_the_pod_runs(cluster, kube, namespace):
    """As a kubelet refreshes a mounted Secret (issue 40: the sidecar token's rotation reaches running
    sidecars): the running container reads the new value from the same file, never half a file."""
    kube.create(f"/api/v1/namespaces/{namespace}/secrets",
                {"metadata": {"name": "rotating"}, "stringData": {"token": "old-token"}})
    script = """
        import sys, time
        seen = set()
        for _ in range(400):
            value = open("/etc/tok/token").read()
            if value not in seen:
                print("read", value, flush=True)
                seen.add(value)
            if value == "new-token":
                sys.exit(0)
            if value != "old-token":
                sys.exit(2)
            time.sleep(0.25)
        sys.exit(1)
    """
    create_pod(kube, namespace, python_pod("reader", script, node="cpu-0", restartPolicy="Never", container={
        "volumeMounts": [{"name": "tok", "mountPath": "/etc/tok"}]},
        volumes=[{"name": "tok", "secret": {"secretName": "rotating"}}]))
    wait_for_pod_phase(kube, namespace, "reader", "Running", timeout=60)
    kube.patch(f"/api/v1/namespaces/{namespace}/secrets/rotating", {"data": {"token": "bmV3LXRva2Vu"}})  # new-token
    pod = wait_for_pod_phase(kube, namespace, "reader", ("Succeeded", "Failed"), timeout=90)
    assert container_status(pod, "main")["state"]["terminated"]["exitCode"] == 0, cluster.logs(namespace, "reader", "main")
    assert cluster.logs(namespace, "reader", "main").split() == ["read", "old-token", "read", "new-token"]


def test_restart_policy_on_failure_restarts_then_succeeds(cluster, kube, namespace):
    script = """
        import os, sys
        path = "/data/attempts"
        n = int(open(path).read()) if os.path.exists(path) else 0
        open(path, "w").write(str(n + 1))
        print("attempt", n)
        sys.exit(0 if n >= 1 else 7)
    """
    create_pod(kube, namespace, python_pod(
        "flaky", script, node="cpu-0", restartPolicy="OnFailure",
        container={"volumeMounts": [{"name": "data", "mountPath": "/data"}]},
        volumes=[{"name": "data", "emptyDir": {}}]))
    pod = wait_for_pod_phase(kube, namespace, "flaky", "Succeeded", timeout=90)
    status = container_status(pod, "main")
    assert status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 7
    assert "attempt 1" in cluster.logs(namespace, "flaky")
    assert "attempt 0" in cluster.logs(namespace, "flaky", previous=True)

    def reasons() -> set[str]:
        events = kube.get(f"/api/v1/namespaces/{namespace}/events")["items"]
        return {e["reason"] for e in events if e["involvedObject"]["name"] == "flaky"
                and e["source"].get("component") == "kubelet"}

    # the first restart is immediate, as on a kubelet (test_waiting_states.py covers the backoff after it)
    assert wait_for(lambda: {"Pulled", "Started"} <= reasons(), 30, message="kubelet events")


def test_rbac_refuses_a_service_account_without_rights(cluster, kube, namespace):
    kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts", {"metadata": {"name": "nobody"}})
    token = cluster.service_account_token(namespace, "nobody")
    as_nobody = KubeClient(Credentials(cluster.server, str(cluster.ca_file), token=token))
    with pytest.raises(KubeAPIError) as info:
        as_nobody.get(f"/api/v1/namespaces/{namespace}/pods")
    assert info.value.status == 403
    kube.create(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles", {
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]})
    kube.create(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings", {
        "metadata": {"name": "nobody-reads-pods"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pod-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "nobody", "namespace": namespace}]})
    wait_for(lambda: as_nobody.get(f"/api/v1/namespaces/{namespace}/pods"), 30, message="granted list")
    with pytest.raises(KubeAPIError) as info:
        as_nobody.get("/api/v1/namespaces/kube-system/pods")
    assert info.value.status == 403


SIDECAR_SCRIPT = """
    import signal, sys, time, os
    log = open("/events/log", "a", buffering=1)
    def stop(*_):
        main_done = os.path.exists("/events/main-stopped")
        log.write(f"sidecar-sigterm main-stopped={main_done}\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    log.write("sidecar-started\\n")
    open("/shared/sidecar-ready", "w").close()
    while True:
        time.sleep(0.1)
"""

MAIN_SCRIPT = """
    import os, signal, sys, time
    log = open("/events/log", "a", buffering=1)
    # As on a kubelet without a startup probe, the sidecar's process has started, not necessarily finished
    # its own start-up: wait for it the way a real main container would.
    for _ in range(600):
        if os.path.exists("/shared/sidecar-ready"):
            break
        time.sleep(0.05)
    log.write(f"main-started sidecar-ready={os.path.exists('/shared/sidecar-ready')} "
              f"init-done={os.path.exists('/shared/init-done')}\\n")
    def stop(*_):
        log.write("main-sigterm\\n")
        open("/events/main-stopped", "w").close()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    if os.environ.get("RUN_FOREVER"):
        while True:
            time.sleep(0.1)
    log.write("main-exiting\\n")
"""


def sidecar_pod(name: str, events: Path, run_forever: bool, restart_policy: str):
    shared = [{"name": "shared", "mountPath": "/shared"}, {"name": "events", "mountPath": "/events"}]
    return {"metadata": {"name": name}, "spec": {
        "nodeName": "cpu-0", "restartPolicy": restart_policy, "terminationGracePeriodSeconds": 10,
        "initContainers": [
            {"name": "init", "image": "python", "volumeMounts": shared, "command": [
                "python", "-c", "open('/shared/init-done','w').close(); open('/events/log','a').write('init-ran\\n')"]},
            {"name": "sidecar", "image": "python", "restartPolicy": "Always", "volumeMounts": shared,
             "command": ["python", "-c", textwrap.dedent(SIDECAR_SCRIPT)]},
        ],
        "containers": [{"name": "main", "image": "python", "volumeMounts": shared,
                        "lifecycle": {"preStop": {"exec": {"command": [
                            "python", "-c", "open('/events/log', 'a').write('main-prestop\\n')"]}}},
                        "env": [{"name": "RUN_FOREVER", "value": "1" if run_forever else ""}],
                        "command": ["python", "-c", textwrap.dedent(MAIN_SCRIPT)]}],
        "volumes": [{"name": "shared", "emptyDir": {}},
                    {"name": "events", "hostPath": {"path": str(events), "type": "DirectoryOrCreate"}}],
    }}


def test_native_sidecar_starts_before_main_and_stops_after_it_on_completion(cluster, kube, namespace, tmp_path):
    create_pod(kube, namespace, sidecar_pod("job", tmp_path, run_forever=False, restart_policy="Never"))
    tmp_path = cluster.node_path("cpu-0", tmp_path)  # the events hostPath, on the pod's node
    pod = wait_for_pod_phase(kube, namespace, "job", "Succeeded", timeout=90)
    wait_for(lambda: "sidecar-sigterm" in (tmp_path / "log").read_text(), 30, message="sidecar stopped")
    lines = (tmp_path / "log").read_text().splitlines()
    assert lines[0] == "init-ran"
    assert lines[1] == "sidecar-started"
    assert lines[2] == "main-started sidecar-ready=True init-done=True"
    assert lines[3] == "main-exiting"
    assert lines[4].startswith("sidecar-sigterm")
    sidecar = wait_for(lambda: (container_status(kube.get(f"/api/v1/namespaces/{namespace}/pods/job"), "sidecar")
                                or {}).get("state", {}).get("terminated"), 30, message="sidecar terminated status")
    assert sidecar["exitCode"] == 0
    main = container_status(pod, "main")["state"]["terminated"]
    assert main["exitCode"] == 0
    assert sidecar["startedAt"] <= main["startedAt"] and sidecar["finishedAt"] >= main["finishedAt"]


def test_a_containers_termination_message_is_kept_in_its_status(cluster, kube, namespace):
    """As the kubelet does: what a container wrote to its terminationMessagePath (default
    /dev/termination-log, a file of its own) is in its terminated state's `message`, at most 4096 bytes;
    a container that wrote nothing has no message."""
    spec = python_pod("last-words", """
        with open("/dev/termination-log", "w") as f:
            f.write("step 12 " + "y" * 5000)
    """, restartPolicy="Never")
    spec["spec"]["containers"].append({"name": "quiet", "image": "python:3.11", "command": ["python", "-c", "pass"]})
    create_pod(kube, namespace, spec)
    pod = wait_for_pod_phase(kube, namespace, "last-words", "Succeeded", timeout=90)
    main = container_status(pod, "main")["state"]["terminated"]
    assert main["message"].startswith("step 12 y") and len(main["message"]) == 4096, main
    assert "message" not in container_status(pod, "quiet")["state"]["terminated"]


def test_a_log_read_before_the_container_starts_is_answered_as_a_kubelet_does(cluster, kube, namespace, tmp_path):
    """As the kubelet answers `kubectl logs` for a container that has not started: 400 "... is waiting
    to start: PodInitializing" (passed on by the API server), not a 404 (CI 2026-12-07: `kubectl
    resilax logs -f` read generation 2's pod then and ended); its log once it ran."""
    gate = cluster.node_path("cpu-0", tmp_path) / "open"
    events = [{"name": "events", "mountPath": "/events"}]
    create_pod(kube, namespace, {"metadata": {"name": "gated"}, "spec": {
        "nodeName": "cpu-0", "restartPolicy": "Never", "terminationGracePeriodSeconds": 5,
        "volumes": [{"name": "events", "hostPath": {"path": str(tmp_path), "type": "DirectoryOrCreate"}}],
        "initContainers": [{"name": "gate", "image": "python", "volumeMounts": events, "command": [
            "python", "-c", "import os, time\nwhile not os.path.exists('/events/open'): time.sleep(0.1)"]}],
        "containers": [{"name": "main", "image": "python", "command": ["python", "-c", "print('main-ran')"]}]}})
    wait_for(lambda: ((container_status(get_pod(kube, namespace, "gated") or {}, "gate") or {})
                      .get("state") or {}).get("running"), 90, message="the init container running")
    with pytest.raises(KubeAPIError) as info:
        kube.get(f"/api/v1/namespaces/{namespace}/pods/gated/log", container="main")
    assert info.value.status == 400
    assert 'container "main" in pod "gated" is waiting to start: PodInitializing' in str(info.value), info.value
    gate.touch()
    wait_for_pod_phase(kube, namespace, "gated", "Succeeded", timeout=90)
    assert kube.get_text(f"/api/v1/namespaces/{namespace}/pods/gated/log?container=main") == "200 main-ran\n"


def test_graceful_deletion_stops_main_before_sidecar_then_deletes(cluster, kube, namespace, tmp_path):
    create_pod(kube, namespace, sidecar_pod("svc", tmp_path, run_forever=True, restart_policy="Always"))
    tmp_path = cluster.node_path("cpu-0", tmp_path)  # the events hostPath, on the pod's node
    wait_for(lambda: (get_pod(kube, namespace, "svc") or {}).get("status", {}).get("phase") == "Running"
             and "main-started" in (tmp_path / "log").read_text(), 90, message="pod running")
    ready = wait_for(lambda: [c for c in get_pod(kube, namespace, "svc")["status"]["conditions"]
                              if c["type"] == "Ready" and c["status"] == "True"], 30, message="Ready")
    assert ready
    kube.delete(f"/api/v1/namespaces/{namespace}/pods/svc")
    wait_for_pod_gone(kube, namespace, "svc", timeout=60)
    lines = (tmp_path / "log").read_text().splitlines()
    assert lines[-3:] == ["main-prestop", "main-sigterm", "sidecar-sigterm main-stopped=True"]


def test_sigterm_ignored_means_sigkill_after_the_grace_period(cluster, kube, namespace):
    script = """
        import signal, time
        signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
        print("running", flush=True)
        while True:
            time.sleep(0.1)
    """
    create_pod(kube, namespace, python_pod("stubborn", script, node="cpu-0", terminationGracePeriodSeconds=2))
    pid = pid_of(cluster, namespace, "stubborn")
    wait_for(lambda: "running" in cluster.logs(namespace, "stubborn"), 30, message="started")
    kube.delete(f"/api/v1/namespaces/{namespace}/pods/stubborn")
    wait_for_pod_gone(kube, namespace, "stubborn", timeout=60)
    assert not alive(pid)
    assert "ignoring SIGTERM" in cluster.logs(namespace, "stubborn")


def sleeper(name: str, node: str):
    return python_pod(name, "import time\nwhile True: time.sleep(0.2)", node=node, terminationGracePeriodSeconds=2)


def test_killed_node_goes_unknown_and_its_pods_hang_terminating(cluster, kube, namespace):
    victim = "tpu-slice-1-h1"
    create_pod(kube, namespace, sleeper("doomed", victim))
    create_pod(kube, namespace, sleeper("reference", "cpu-0"))
    pid = pid_of(cluster, namespace, "doomed")
    pid_of(cluster, namespace, "reference")

    cluster.kill_node(victim)
    assert wait_for(lambda: not alive(pid), 30, message="process SIGKILLed")
    node = wait_for_node(kube, victim, lambda n: node_condition(n) == "Unknown", timeout=90,
                         message="node Unknown")
    wait_for_node(kube, victim, lambda n: any(t["key"] == "node.kubernetes.io/unreachable"
                                              for t in node_taints(n)), timeout=60, message="unreachable taint")
    assert node_condition(node) == "Unknown"

    kube.delete(f"/api/v1/namespaces/{namespace}/pods/doomed")
    kube.delete(f"/api/v1/namespaces/{namespace}/pods/reference")
    wait_for_pod_gone(kube, namespace, "reference", timeout=60)  # a live kubelet confirms its deletion...
    stuck = get_pod(kube, namespace, "doomed")  # ...no kubelet answers for the dead node
    assert stuck is not None and stuck["metadata"].get("deletionTimestamp")
    force_delete_pod(kube, namespace, "doomed")
    wait_for_pod_gone(kube, namespace, "doomed", timeout=30)

    cluster.restore_node(victim)
    wait_for_node(kube, victim, lambda n: node_condition(n) == "True" and not any(
        t["key"].startswith("node.kubernetes.io/") for t in node_taints(n)), timeout=90, message="node back")


def test_partitioned_node_keeps_its_processes_running(cluster, kube, namespace, tmp_path):
    victim = "tpu-slice-1-h0"
    beat = tmp_path / "beat"
    script = f"""
        import time
        n = 0
        while True:
            n += 1
            open("{beat}", "w").write(str(n))
            time.sleep(0.2)
    """
    create_pod(kube, namespace, python_pod("zombie", script, node=victim, terminationGracePeriodSeconds=2))
    pid = pid_of(cluster, namespace, "zombie")
    cluster.partition_node(victim)
    wait_for_node(kube, victim, lambda n: node_condition(n) == "Unknown", timeout=90, message="node Unknown")
    assert alive(pid)
    before = int(beat.read_text() or 0)
    assert wait_for(lambda: int(beat.read_text() or 0) > before + 3, 30, message="still beating")

    force_delete_pod(kube, namespace, "zombie")
    wait_for_pod_gone(kube, namespace, "zombie", timeout=30)
    assert alive(pid), "the partitioned node has not heard of the deletion"
    cluster.restore_node(victim)
    assert wait_for(lambda: not alive(pid), 60, message="zombie stopped once the node is back")


def test_preemption_notice_taints_labels_then_kills(cluster, kube, namespace):
    victim = "tpu-slice-0-h0"
    create_pod(kube, namespace, sleeper("spot", victim))
    pid = pid_of(cluster, namespace, "spot")
    cluster.preempt_node(victim, delay_seconds=3)
    node = wait_for_node(kube, victim, lambda n: any(
        t["key"] == "cloud.google.com/impending-node-termination" for t in node_taints(n)), 30, message="notice")
    assert "cloud.google.com/scheduled-maintenance-time" in node["metadata"]["labels"]
    assert int(node["metadata"]["labels"]["cloud.google.com/scheduled-maintenance-time"]) >= int(time.time()) - 60
    assert wait_for(lambda: not alive(pid), 60, message="killed after the delay")
    assert {n["name"]: n["state"] for n in cluster.nodes()}[victim] == "Killed"
    force_delete_pod(kube, namespace, "spot")
    cluster.restore_node(victim)
    wait_for_node(kube, victim, lambda n: not any(
        t["key"] == "cloud.google.com/impending-node-termination" for t in node_taints(n))
        and "cloud.google.com/scheduled-maintenance-time" not in n["metadata"]["labels"], 30, message="notice gone")


def test_probes_gate_sidecar_start_readiness_and_liveness(cluster, kube, namespace):
    shared = [{"name": "shared", "mountPath": "/shared"}]
    side = ("import time, pathlib\ntime.sleep(1.5)\npathlib.Path('/shared/ready').touch()\n"
            "while True: time.sleep(0.2)")
    main = ("import os, sys, http.server\nprint('sidecar ready at main start:', os.path.exists('/shared/ready'), flush=True)\n"
            "http.server.HTTPServer((os.environ['POD_IP'], 8080), http.server.SimpleHTTPRequestHandler).serve_forever()")
    create_pod(kube, namespace, {"metadata": {"name": "probed"}, "spec": {
        "nodeName": "cpu-0", "terminationGracePeriodSeconds": 2,
        "initContainers": [{"name": "sidecar", "image": "python", "restartPolicy": "Always", "volumeMounts": shared,
                            "command": ["python", "-c", side],
                            "startupProbe": {"exec": {"command": ["test", "-f", "/shared/ready"]},
                                             "periodSeconds": 1, "failureThreshold": 30}}],
        "containers": [
            {"name": "web", "image": "python", "volumeMounts": shared, "command": ["python", "-c", main],
             "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
             "ports": [{"name": "http", "containerPort": 8080}],
             "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1}},
            {"name": "unhealthy", "image": "python", "command": ["python", "-c", "import time; time.sleep(3600)"],
             "livenessProbe": {"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 2}},
        ],
        "volumes": [{"name": "shared", "emptyDir": {}}],
    }})
    web = wait_for(lambda: (container_status(get_pod(kube, namespace, "probed"), "web") or {}).get("ready"), 60,
                   message="web ready through its httpGet probe")
    assert web
    assert "sidecar ready at main start: True" in cluster.logs(namespace, "probed", "web")
    restarted = wait_for(lambda: (container_status(get_pod(kube, namespace, "probed"), "unhealthy")
                                  or {}).get("restartCount", 0) >= 1, 60, message="liveness restart")
    assert restarted


def test_pods_resolve_each_other_by_hostname_and_subdomain(cluster, kube, namespace):
    server = ("import os, socket, http.server\nprint('hostname', socket.gethostname(), flush=True)\n"
              "http.server.HTTPServer((os.environ['POD_IP'], 8080), http.server.SimpleHTTPRequestHandler).serve_forever()")
    client = f"""
        import socket, time, urllib.request
        for name in ("w-0.workers", "w-0.workers.{namespace}.svc.cluster.local"):
            for _ in range(300):
                try:
                    urllib.request.urlopen(f"http://{{name}}:8080/", timeout=2)
                    break
                except OSError:
                    time.sleep(0.1)
            print("reached", name, socket.gethostbyname(name), flush=True)
    """
    create_pod(kube, namespace, python_pod("server", server, node="tpu-slice-0-h0", hostname="w-0", subdomain="workers",
                                           container={"env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {
                                               "fieldPath": "status.podIP"}}}]}))
    create_pod(kube, namespace, python_pod("client", client, node="tpu-slice-0-h1", restartPolicy="Never"))
    wait_for_pod_phase(kube, namespace, "client", "Succeeded", timeout=90)
    server_ip = get_pod(kube, namespace, "server")["status"]["podIP"]
    out = cluster.logs(namespace, "client")
    assert f"reached w-0.workers {server_ip}" in out
    assert f"reached w-0.workers.{namespace}.svc.cluster.local {server_ip}" in out
    assert "hostname w-0" in cluster.logs(namespace, "server")


def test_preemption_with_sigterm_warns_the_workers_at_once(cluster, kube, namespace):
    victim = "tpu-slice-0-h1"
    script = """
        import signal, sys, time
        def stop(*_):
            print("SIGTERM: saving and exiting", flush=True)
            sys.exit(75)
        signal.signal(signal.SIGTERM, stop)
        print("training", flush=True)
        while True:
            time.sleep(0.1)
    """
    create_pod(kube, namespace, python_pod("worker", script, node=victim, restartPolicy="Never"))
    wait_for(lambda: "training" in cluster.logs(namespace, "worker"), 60, message="worker started")
    cluster.preempt_node(victim, delay_seconds=60, sigterm=True)
    pod = wait_for_pod_phase(kube, namespace, "worker", "Failed", timeout=60)
    assert container_status(pod, "main")["state"]["terminated"]["exitCode"] == 75
    assert "SIGTERM: saving and exiting" in cluster.logs(namespace, "worker")
    assert {n["name"]: n for n in cluster.nodes()}[victim]["kill_pending"]


def test_graceful_node_shutdown_sigterms_the_pods_then_powers_off(cluster, kube, namespace):
    """A spot VM's preemption as the kubelet's shutdown manager runs it: no notice, the node NotReady at
    once, the pods SIGTERMed and left Failed (reason Terminated, DisruptionTarget), then the node off."""
    victim = "tpu-slice-0-h1"
    script = """
        import signal, sys, time
        def stop(*_):
            print("SIGTERM: saving and exiting", flush=True)
            sys.exit(75)
        signal.signal(signal.SIGTERM, stop)
        print("training", flush=True)
        while True:
            time.sleep(0.1)
    """
    create_pod(kube, namespace, python_pod("worker", script, node=victim, restartPolicy="Never",
                                           terminationGracePeriodSeconds=60))
    create_pod(kube, namespace, sleeper("elsewhere", "cpu-0"))
    wait_for(lambda: "training" in cluster.logs(namespace, "worker"), 60, message="worker started")
    other = pid_of(cluster, namespace, "elsewhere")
    answer = cluster.shutdown_node(victim, grace_seconds=8, critical_grace_seconds=2)
    assert answer["pods"] == 1
    node = wait_for_node(kube, victim, lambda n: node_condition(n) == "False", timeout=30, message="NotReady")
    ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
    assert ready["message"] == "node is shutting down"
    assert not any(t["key"] == "cloud.google.com/impending-node-termination" for t in node_taints(node))

    pod = wait_for_pod_phase(kube, namespace, "worker", "Failed", timeout=60)
    assert pod["status"]["reason"] == "Terminated"
    assert pod["status"]["message"] == "Pod was terminated in response to imminent node shutdown."
    disruption = next(c for c in pod["status"]["conditions"] if c["type"] == "DisruptionTarget")
    assert (disruption["status"], disruption["reason"]) == ("True", "TerminationByKubelet")
    assert container_status(pod, "main")["state"]["terminated"]["exitCode"] == 75
    assert "SIGTERM: saving and exiting" in cluster.logs(namespace, "worker")
    assert not pod["metadata"].get("deletionTimestamp")  # the kubelet leaves it for its owner

    wait_for(lambda: {n["name"]: n["state"] for n in cluster.nodes()}[victim] == "Killed", 30,
             message="powered off after the shutdown")
    assert alive(other)  # other nodes are not touched
    events = kube.get("/api/v1/namespaces/default/events",
                      fieldSelector=f"involvedObject.kind=Node,involvedObject.name={victim}")["items"]
    assert "NodeShutdown" in [e["reason"] for e in events]
    cluster.restore_node(victim)
    wait_for_node(kube, victim, lambda n: node_condition(n) == "True", timeout=60, message="node back")
