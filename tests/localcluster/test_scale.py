"""Scale: the node agent's no-process mode registers and heartbeats hundreds of TPU hosts, and reports
the pods bound to them Running (several at once, each pod's own events in order) and gone once deleted.
Then `up` then `down` leaves no process behind (control plane, agent, a pod's process).

On a cluster of its own, so that the load of 200 nodes never slows the session cluster other tests share;
the same cluster's stop is the one checked (CI time: one cluster of its own started and stopped, not two).
"""

from __future__ import annotations

import time

import pytest
from resilax_local import LocalCluster
from resilax_local.node.profiles import build_tpu_slice
from resilax_local.processes import alive
from resilax_local.testing import create_pod, node_condition, wait_for


@pytest.mark.slow
def test_two_hundred_tpu_nodes_register_stay_ready_and_run_fake_pods_and_stop_leaves_no_process_behind(tmp_path):
    nodes = []
    for i in range(100):
        nodes += build_tpu_slice(f"scale-{i}", "tpu-v5-lite-podslice", "2x4", run_pods=False)
    names = {n.name for n in nodes}
    assert len(names) == 200
    with LocalCluster(tmp_path / "run", profile="cpu").start() as cluster:
        kube = cluster.client()
        cluster.add_nodes(nodes)

        def ready_count() -> int:
            items = kube.get("/api/v1/nodes", labelSelector="cloud.google.com/gke-tpu-accelerator")["items"]
            return sum(1 for n in items if n["metadata"]["name"] in names and node_condition(n) == "True"
                       and not any(t["key"].startswith("node.kubernetes.io/") for t in n["spec"].get("taints") or []))

        wait_for(lambda: ready_count() == 200, 300, interval=1.0, message="200 nodes Ready")
        # still Ready after a lease renewal: the Leases are being renewed
        path = "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/scale-99-h1"
        first = kube.get(path)["spec"]["renewTime"]
        wait_for(lambda: kube.get(path)["spec"]["renewTime"] != first, 60, message="lease renewed")
        assert ready_count() == 200

        # pods bound to no-process nodes: Running with an address each, then gone once deleted
        pods = [f"fake-{i}" for i in range(48)]
        for i, name in enumerate(pods):
            create_pod(kube, "default", {"metadata": {"name": name, "labels": {"test": "fake-pods"}}, "spec": {
                "nodeName": f"scale-{i}-h{i % 2}",
                "tolerations": [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
                "containers": [{"name": "main", "image": "python", "command": ["sleep", "infinity"]}]}})

        def fake_pods() -> dict[str, dict]:
            items = kube.get("/api/v1/namespaces/default/pods", labelSelector="test=fake-pods")["items"]
            return {p["metadata"]["name"]: p for p in items}

        def all_running() -> bool:
            seen = fake_pods()
            return len(seen) == len(pods) and all(p["status"].get("phase") == "Running" for p in seen.values())

        wait_for(all_running, 120, interval=0.5, message="48 fake pods Running")
        running = fake_pods()
        assert {p["spec"]["nodeName"] for p in running.values()} == {f"scale-{i}-h{i % 2}" for i in range(48)}
        ips = [p["status"].get("podIP") for p in running.values()]
        assert all(ips) and len(set(ips)) == len(pods)  # an address each, none shared
        for name in pods:
            kube.delete(f"/api/v1/namespaces/default/pods/{name}")
        wait_for(lambda: not fake_pods(), 120, interval=0.5, message="48 fake pods gone")

        # A pod with a process of its own (on the CPU node), then the cluster stopped (leaving the block).
        create_pod(kube, "default", {"metadata": {"name": "forever"}, "spec": {
            "containers": [{"name": "main", "image": "python",
                            "command": ["python", "-c", "import time\nwhile True: time.sleep(1)"]}]}})

        def pod_pid() -> int | None:
            for pod in cluster.pods():
                if pod["name"] == "forever" and "main" in pod["processes"]:
                    return int(pod["processes"]["main"])
            return None

        pid = wait_for(pod_pid, 60, message="pod process")
        pids = dict(cluster.status()["processes"])
        assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "node-agent"}
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (alive(pid) or any(alive(p["pid"]) for p in pids.values())):
        time.sleep(0.1)
    assert not alive(pid)
    assert not [name for name, p in pids.items() if alive(p["pid"])]
    assert not (tmp_path / "run" / "cluster.json").exists()
