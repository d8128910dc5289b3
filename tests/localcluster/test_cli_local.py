"""`resilax local ...` against the session cluster (read-only commands) and without a cluster."""

from __future__ import annotations

import json
import subprocess
import sys

from resilax_local.testing import create_pod, wait_for_pod_phase


def resilax(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "resilax_operator.cli", "local", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_nodes_and_logs_of_a_running_cluster(cluster, kube, namespace):
    out = resilax("nodes", "--dir", str(cluster.run_dir))
    assert out.returncode == 0, out.stderr
    assert "tpu-slice-1-h1" in out.stdout and "Ready" in out.stdout
    create_pod(kube, namespace, {"metadata": {"name": "hello"}, "spec": {
        "nodeName": "cpu-0", "restartPolicy": "Never",
        "containers": [{"name": "main", "image": "python", "command": ["python", "-c", "print('hello from a pod')"]}]}})
    wait_for_pod_phase(kube, namespace, "hello", "Succeeded", timeout=60)
    out = resilax("logs", f"{namespace}/hello", "--dir", str(cluster.run_dir))
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello from a pod\n"
    kubectl = subprocess.run(["kubectl", "--kubeconfig", str(cluster.kubeconfig), "-n", namespace, "logs", "hello"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert kubectl.stdout == "hello from a pod\n", kubectl.stderr


def test_set_image_adds_a_registry_row_and_refuses_a_bad_one(cluster):
    out = resilax("set-image", "example.com/cli-root:1", "--user", "0", "--dir", str(cluster.run_dir))
    assert out.returncode == 0, out.stderr
    out = resilax("images", "--dir", str(cluster.run_dir))
    assert out.returncode == 0, out.stderr
    assert {"image": "example.com/cli-root:1", "pullable": True, "error": "", "user": "0"} in json.loads(out.stdout)
    out = resilax("set-image", "Example/App", "--unpullable", "--dir", str(cluster.run_dir))
    assert out.returncode == 1 and "image entry: image: " in out.stderr and "must be lowercase" in out.stderr


def test_commands_without_a_cluster_say_how_to_start_one(tmp_path):
    out = resilax("nodes", "--dir", str(tmp_path))
    assert out.returncode == 1
    assert "resilax local up" in out.stderr


def test_up_refuses_to_wipe_a_folder_that_is_not_a_cluster(tmp_path):
    (tmp_path / "precious").write_text("keep me")
    out = resilax("up", "--dir", str(tmp_path))
    assert out.returncode == 1 and "refusing to wipe" in out.stderr
    assert (tmp_path / "precious").read_text() == "keep me"
