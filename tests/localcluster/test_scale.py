"""Scale: the node agent's no-process mode registers and heartbeats hundreds of TPU hosts.

On a cluster of its own, so that the load of 200 nodes never slows the session cluster other tests share.
"""

from __future__ import annotations

import pytest
from resilax_local import LocalCluster
from resilax_local.profiles import build_tpu_slice
from resilax_local.testing import node_condition, wait_for


@pytest.mark.slow
def test_two_hundred_tpu_nodes_register_and_stay_ready(tmp_path):
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
