"""hostPath volumes on the local cluster: every fake node is the same machine, so each node has its own
root folder (`<run_dir>/nodes/<node>/root/<path>`, or the cluster's tmpfs folder for paths on /dev/shm).
A pod recreated on the same node finds what the previous one left; a pod on another node does not; a
removed node takes its folders with it (a lost node loses its disks). What `checkpoint.local.scope: Node`
relies on."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from resilax_local.node.volumes import map_host_path, memory_root
from resilax_local.testing import create_pod, wait_for, wait_for_pod_phase

SCRIPT = """
    import os, sys
    before = sorted(os.listdir("/data"))
    open(f"/data/{os.environ['TAG']}", "w").write(os.environ['TAG'])
    print("BEFORE", ",".join(before))
"""


def _pod(name: str, node: str, tag: str, path: str) -> dict:
    return {"metadata": {"name": name}, "spec": {
        "restartPolicy": "Never", "nodeSelector": {"kubernetes.io/hostname": node}, "terminationGracePeriodSeconds": 2,
        "containers": [{"name": "main", "image": "python", "command": ["python", "-c", textwrap.dedent(SCRIPT)],
                        "env": [{"name": "TAG", "value": tag}], "volumeMounts": [{"name": "d", "mountPath": "/data"}]}],
        "volumes": [{"name": "d", "hostPath": {"path": path, "type": "DirectoryOrCreate"}}]}}


def _run(cluster, kube, namespace: str, name: str, node: str, tag: str, path: str) -> str:
    create_pod(kube, namespace, _pod(name, node, tag, path))
    wait_for_pod_phase(kube, namespace, name, "Succeeded", timeout=90)
    line = next(ln for ln in cluster.logs(namespace, name, "main").splitlines() if ln.startswith("BEFORE"))
    return line[len("BEFORE "):]


def test_map_host_path_gives_each_node_its_own_root(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert map_host_path(run, "n1", "/var/lib/resilax/local/ns_job_uid") == \
        run / "nodes" / "n1" / "root" / "var/lib/resilax/local/ns_job_uid"
    assert map_host_path(run, "n2", "/var/lib/x") != map_host_path(run, "n1", "/var/lib/x")
    assert map_host_path(run, "n1", "/dev/shm/resilax/ns_job_uid") == memory_root(run) / "nodes" / "n1" / "resilax/ns_job_uid"
    assert str(memory_root(run)).startswith("/dev/shm/resilax-local/")
    for bad in ("relative/path", "/var/../etc"):
        with pytest.raises(ValueError, match=r"absolute path without '\.\.'"):
            map_host_path(run, "n1", bad)


@pytest.mark.parametrize("path", ["/var/lib/resilax-test/job", "/dev/shm/resilax-test/job"], ids=["disk", "memory"])
def test_host_path_is_per_node_kept_across_pods_and_lost_with_the_node(cluster, kube, namespace, path) -> None:
    nodes = [f"hp-{namespace[-6:]}-{i}" for i in (1, 2)]
    cluster.add_cpu_node(nodes[0])
    cluster.add_cpu_node(nodes[1])
    try:
        cluster.wait_nodes_ready(nodes, timeout=120)
        assert _run(cluster, kube, namespace, "first", nodes[0], "a", path) == ""
        # the same node, a new pod: it finds what the first one left
        assert _run(cluster, kube, namespace, "again", nodes[0], "b", path) == "a"
        # another node: its own folder
        assert _run(cluster, kube, namespace, "other", nodes[1], "c", path) == ""
        folder = cluster.node_path(nodes[0], path)
        assert sorted(p.name for p in folder.iterdir()) == ["a", "b"]
        assert sorted(p.name for p in cluster.node_path(nodes[1], path).iterdir()) == ["c"]
        if path.startswith("/dev/shm/"):
            assert str(folder).startswith("/dev/shm/resilax-local/")
        else:
            assert str(folder).startswith(str(cluster.run_dir / "nodes"))
        assert not Path(path).exists()  # not this machine's folder of that name
        cluster.remove_node(nodes[0])
        wait_for(lambda: not folder.exists(), timeout=30, message="the removed node's folder deleted")
        assert cluster.node_path(nodes[1], path).exists()
    finally:
        for node in nodes:
            if any(n["name"] == node for n in cluster.nodes()):
                cluster.remove_node(node)
