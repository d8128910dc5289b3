"""`kubectl resilax ... -o json|yaml`, `list [-A]` and `version` against the local cluster's API server:
two JAXJobs in two namespaces whose status is written through the status subresource as the operator
writes it (no operator, no workers: these commands only read). Every read command's `-o json` parses
with json.loads and names the job; `-o yaml` parses the same; `list` shows the namespace's jobs and
`list -A` every namespace's."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_cluster import job_manifest, jobs_path, unique_name
from resilax_local.cluster import LocalCluster
from resilax_local.errors import KubeAPIError
from resilax_local.kubeapi import KubeClient

pytestmark = pytest.mark.cluster

STATUS = {
    "phase": "Running", "generation": 2, "shape": {"topology": "2x4", "count": 2, "hosts": 4}, "restarts": 1,
    "checkpoint": {"step": 120, "committed": True, "tier": "persistent"},
    "history": [{"generation": 1, "start": "2026-12-06T10:00:00Z", "shape": {"topology": "2x4", "count": 2, "hosts": 4},
                 "end": "2026-12-06T11:00:00Z", "endReason": "NodeLoss"},
                {"generation": 2, "start": "2026-12-06T11:00:30Z", "shape": {"topology": "2x4", "count": 2, "hosts": 4},
                 "restoredStep": 120}],
}


def _plugin(*args: str, cluster: LocalCluster) -> subprocess.CompletedProcess[str]:
    path = Path(sys.executable).parent / "kubectl-resilax"
    exe = str(path) if path.exists() else shutil.which("kubectl-resilax")
    assert exe, "kubectl-resilax is not installed: reinstall the project (scripts/setup)"
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, (args, proc.stderr)
    return proc


def _job(kube: KubeClient, namespace: str, name: str, tmp_path: Path) -> None:
    kube.create(jobs_path(namespace), {**job_manifest(name, tmp_path / name), "metadata": {"name": name}})
    kube.patch(jobs_path(namespace, name) + "/status", {"status": STATUS})


def test_every_read_command_prints_json_and_yaml_and_list_spans_namespaces(
        crds: None, kube: KubeClient, cluster: LocalCluster, namespace: str, tmp_path: Path) -> None:
    other = f"cli-other-{uuid.uuid4().hex[:6]}"
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}})
    try:
        mine, theirs = unique_name("out"), unique_name("other")
        _job(kube, namespace, mine, tmp_path)
        _job(kube, other, theirs, tmp_path)

        documents: dict[str, dict[str, Any]] = {}
        for command in ("status", "goodput", "timeline"):
            text = _plugin(command, mine, "-n", namespace, "-o", "json", cluster=cluster).stdout
            documents[command] = json.loads(text)
            assert (documents[command]["namespace"], documents[command]["name"]) == (namespace, mine), text
            assert yaml.safe_load(_plugin(command, mine, "-n", namespace, "-o", "yaml", cluster=cluster).stdout) \
                == documents[command]
        assert documents["status"]["kind"] == "JAXJobStatus"
        assert documents["status"]["status"]["phase"] == "Running"
        assert documents["status"]["status"]["checkpoint"]["step"] == 120
        assert documents["goodput"] == {"kind": "JAXJobGoodput", "namespace": namespace, "name": mine,
                                        "uid": documents["status"]["uid"], "goodput": None}
        assert [e["generation"] for e in documents["timeline"]["history"]] == [1, 2]

        listed = json.loads(_plugin("list", "-n", namespace, "-o", "json", cluster=cluster).stdout)
        assert [(r["namespace"], r["name"], r["phase"], r["generation"], r["savedStep"]) for r in listed["items"]] \
            == [(namespace, mine, "Running", 2, 120)]
        everywhere = json.loads(_plugin("list", "-A", "-o", "json", cluster=cluster).stdout)
        names = {(r["namespace"], r["name"]) for r in everywhere["items"]}
        assert {(namespace, mine), (other, theirs)} <= names
        table = _plugin("list", "-A", cluster=cluster).stdout.splitlines()
        assert table[0].split() == ["NAMESPACE", "NAME", "PHASE", "GENERATION", "SHAPE", "SAVED", "GOODPUT"]
        assert any(line.split()[:3] == [other, theirs, "Running"] for line in table[1:]), table

        version = json.loads(_plugin("version", "-o", "json", cluster=cluster).stdout)
        assert version["kind"] == "Version" and version["apiVersion"] == "resilax.dev/v1alpha1"
        assert version["clientVersion"] in _plugin("version", cluster=cluster).stdout
    finally:
        with contextlib.suppress(KubeAPIError):
            kube.delete(f"/api/v1/namespaces/{other}")
