"""A cluster of its own: `up` then `down` leaves no process behind (control plane, agent, pods)."""

from __future__ import annotations

import time

import pytest
from resilax_local import LocalCluster
from resilax_local.processes import alive
from resilax_local.testing import create_pod, wait_for


@pytest.mark.slow
def test_stop_leaves_no_process_behind(tmp_path):
    cluster = LocalCluster(tmp_path / "run", profile="cpu")
    try:
        cluster.start()
        kube = cluster.client()
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
    finally:
        cluster.stop()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (alive(pid) or any(alive(p["pid"]) for p in pids.values())):
        time.sleep(0.1)
    assert not alive(pid)
    assert not [name for name, p in pids.items() if alive(p["pid"])]
    assert not (tmp_path / "run" / "cluster.json").exists()
