"""The job's sidecar token rotates when its Secret is deleted (issue 40, item 5), against the real API
server of the local cluster: `kubectl resilax rotate-token` deletes the job's own Secret, the
operator's `Kube` writes a new random token (never the copy it had), a real `resilax sidecar` refuses
the old token once its mounted file holds the new one, and until then the operator's calls still reach
it (the job keeps running across the rotation). The kubelet's part, refreshing the mounted Secret's
file, is played by writing the Secret's value, as the API server holds it, into the sidecar's token
file."""

from __future__ import annotations

import base64
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from resilax_local.kubeapi import KubeAPIError
from resilax_local.testing import wait_for
from resilax_operator import api
from resilax_operator.generation import JobRef, build_token_secret_name
from resilax_operator.k8s import TOKEN_RECHECK_SECONDS, Kube, SidecarError
from resilax_operator.kubectl import plugin as kubectl_plugin

pytestmark = [pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[2]
JOB = {"apiVersion": api.API_VERSION, "kind": api.KIND, "spec": {
    "suspend": True,  # no workers: an operator another test runs leaves it be
    "slices": {"accelerator": "tpu-v5-lite-podslice", "topology": "2x4", "machineType": "ct5lp-hightpu-4t", "count": 1},
    "checkpoint": {"storage": "/tmp/resilax-rotation/ckpt", "every": {"steps": 10}},
    "template": {"spec": {"containers": [{"name": "trainer", "image": "resilax-worker:0.1.0",
                                          "command": ["python", "examples/train.py"]}]}}}}
STOP = {"generation": 2, "reason": "test", "stacks": False}
"""A call that needs the token and is answered after the token check: 409 not_supervised (no trainer)."""


def install_crd(kube: Any) -> None:
    crd = yaml.safe_load((ROOT / api.CRD_FILE).read_text())
    try:
        kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    except KubeAPIError as e:
        if e.status != 409:
            raise

    def served() -> bool:
        got = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{api.CRD_NAME}")
        return any(c["type"] == "Established" and c["status"] == "True"
                   for c in (got.get("status") or {}).get("conditions") or [])

    wait_for(served, timeout=60, message="the JAXJob CRD Established")


def secret_token(kube: Any, namespace: str, name: str) -> str:
    secret = kube.get(f"/api/v1/namespaces/{namespace}/secrets/{build_token_secret_name(name)}")
    return base64.b64decode(secret["data"][api.TOKEN_KEY]).decode().strip()


def test_the_token_rotates_after_its_secret_is_deleted_and_the_old_token_is_refused(
        cluster: Any, kube: Any, namespace: str, sidecar_env: dict[str, str], start_sidecar: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    install_crd(kube)
    name = f"rot-{uuid.uuid4().hex[:6]}"
    job = kube.create(f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{namespace}/{api.PLURAL}",
                      {**JOB, "metadata": {"name": name, "namespace": namespace}})
    ref = JobRef(name, namespace, job["metadata"]["uid"])
    operator = Kube(cluster.api_client())
    now = [time.monotonic()]
    operator.clock = lambda: now[0]  # time injected: the re-check interval passes when the test says so
    old = operator.ensure_token_secret(ref, check=True)
    assert secret_token(kube, namespace, name) == old

    # A sidecar of the job with the Secret's token in its (mounted) file.
    token_file = Path(sidecar_env["RESILAX_SIDECAR_TOKEN_FILE"])
    token_file.write_text(old)
    sidecar = start_sidecar(sidecar_env)
    assert sidecar.post("/v1/trainer/stop", STOP, token=old).status == 409  # accepted; nothing to stop
    with pytest.raises(SidecarError, match="409"):
        operator.sidecar("POST", "127.0.0.1", sidecar.port, "/v1/trainer/stop", STOP, token=old)

    # The documented command: only the job's own Secret, deleted.
    code = kubectl_plugin.main(["rotate-token", name, "-n", namespace, "--kubeconfig", str(cluster.kubeconfig)])
    assert code == 0, capsys.readouterr().err
    assert "deleted; the operator writes a new token" in capsys.readouterr().out
    with pytest.raises(KubeAPIError) as gone:
        kube.get(f"/api/v1/namespaces/{namespace}/secrets/{build_token_secret_name(name)}")
    assert gone.value.status == 404

    # Within the re-check interval the operator uses its copy; after it, it reads the Secret, finds it
    # gone and writes a new random token: never the copy it had.
    assert operator.ensure_token_secret(ref) == old
    now[0] += TOKEN_RECHECK_SECONDS
    new = operator.ensure_token_secret(ref)
    assert new != old and secret_token(kube, namespace, name) == new
    secret = kube.get(f"/api/v1/namespaces/{namespace}/secrets/{build_token_secret_name(name)}")
    assert [r["uid"] for r in secret["metadata"]["ownerReferences"]] == [ref.uid]

    # Until the kubelet refreshes the sidecar's file, the operator's calls with the new token still get
    # through (it falls back to the token it replaced): the job keeps running.
    with pytest.raises(SidecarError, match="409"):
        operator.sidecar("POST", "127.0.0.1", sidecar.port, "/v1/trainer/stop", STOP, token=new)

    # The kubelet refreshes the mounted file: the new token opens the sidecar, the old one no longer.
    token_file.write_text(secret_token(kube, namespace, name) + "\n")
    assert sidecar.post("/v1/trainer/stop", STOP, token=new).status == 409
    refused = sidecar.post("/v1/trainer/stop", STOP, token=old)
    assert refused.status == 403 and refused.body["error"]["code"] == "forbidden"
    refused = sidecar.post("/v1/save", {"reason": "manual"}, token=old)
    assert refused.status == 403

    # A Secret of that name that is not the job's is never deleted by the command.
    kube.delete(f"/api/v1/namespaces/{namespace}/secrets/{build_token_secret_name(name)}")
    kube.create(f"/api/v1/namespaces/{namespace}/secrets", {
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": build_token_secret_name(name)},
        "stringData": {api.TOKEN_KEY: "someone-elses"}})
    code = kubectl_plugin.main(["rotate-token", name, "-n", namespace, "--kubeconfig", str(cluster.kubeconfig)])
    assert code == kubectl_plugin.EXIT_ERROR and "not deleted" in capsys.readouterr().err
    assert secret_token(kube, namespace, name) == "someone-elses"
