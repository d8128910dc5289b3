"""Fixtures for the operator's end-to-end tests against the local cluster.

- `crds` (session): the chart's CRDs (JAXJob, kopf peering) applied and Established.
- `operator_rbac` (function): a ServiceAccount in the test's namespace bound to a ClusterRole made of
  charts/resilax/files/operator-rules.yaml (exactly the chart's rules, not admin), a KopfPeering, and a
  kubeconfig with that ServiceAccount's token.
- `operator` (function): `resilax operator --namespace <ns> --peering <name>` as a separate process
  with that kubeconfig; `.restart()`, `.kill()`; stopped (and its log printed on failure) at teardown,
  after the test's JAXJobs and then their pods were deleted (the pods with a 1 s grace: `_delete_jobs`).
  A test whose jobs got a `TrainerHung` event fails at teardown unless it is marked `expects_hang`: every
  end-to-end flow checks that a healthy job is never taken for hung.
- `jobs` (function): helpers to create/read JAXJobs and read the workers' loss logs.
- `shared_runs` (session): the records of end-to-end flows that several tests assert on, each its own
  asserts (CI time: one job and one flow instead of one each); the first test that needs a flow runs
  it under its own operator and namespace, the others read its record (test_op_e2e_inplace.py,
  `shrink_and_grow_back`).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_cluster import CRD_DIR, RULES_FILE, Jobs, OperatorProcess, OperatorRBAC, jobs_path
from resilax_local.cluster import LocalCluster
from resilax_local.controlplane.rbac import build_operator_rbac
from resilax_local.errors import KubeAPIError
from resilax_local.kubeapi import KubeClient
from resilax_local.testing import wait_for


@pytest.fixture(scope="session")
def crds(kube: KubeClient) -> None:
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            name = doc["metadata"]["name"]
            try:
                current = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
                doc["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                kube.put(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}", doc)
            except KubeAPIError as e:
                if e.status != 404:
                    raise
                kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", doc)

            def established(name: str = name) -> bool:
                crd = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
                return any(c["type"] == "Established" and c["status"] == "True"
                           for c in (crd.get("status") or {}).get("conditions") or [])

            wait_for(established, timeout=60, message=f"CRD {name} Established")


@pytest.fixture
def operator_rbac(cluster: LocalCluster, kube: KubeClient, crds: None, namespace: str,
                  tmp_path: Path) -> Iterator[OperatorRBAC]:
    account = "resilax-operator"
    role = f"resilax-operator-{namespace}"[:63]
    account_body, role_body, binding = build_operator_rbac(namespace, account, role,
                                                           yaml.safe_load(RULES_FILE.read_text()))
    kube.create(f"/api/v1/namespaces/{namespace}/serviceaccounts", account_body)
    kube.create("/apis/rbac.authorization.k8s.io/v1/clusterroles", role_body)
    kube.create("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding)
    peering = "resilax"
    kube.create(f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings",
                {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": peering}})
    kubeconfig = cluster.service_account_kubeconfig(namespace, account, path=tmp_path / "operator-kubeconfig")
    yield OperatorRBAC(namespace, account, role, peering, kubeconfig)
    for path in (f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{role}",
                 f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{role}"):
        with contextlib.suppress(KubeAPIError):
            kube.delete(path)


@pytest.fixture
def operator(operator_rbac: OperatorRBAC, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[OperatorProcess]:
    proc = OperatorProcess(operator_rbac, tmp_path).start()
    yield proc
    alive = proc.proc is not None and proc.proc.poll() is None
    hung = [] if request.node.get_closest_marker("expects_hang") else _hang_events(request, operator_rbac.namespace)
    # Delete the test's JAXJobs while the operator still runs (it removes its finalizer), so no worker
    # outlives the test and the namespace can go.
    _delete_jobs(request, operator_rbac.namespace, restart=proc if not alive else None)
    proc.kill(signal.SIGTERM)
    report = getattr(request.node, "rep_call", None)
    if report is None or report.failed or not alive or hung:
        print(f"---- operator log (alive at teardown: {alive}) ----\n" + proc.logs()[-30000:])
    if hung:
        pytest.fail("TrainerHung in a test that does not expect a hang (mark it expects_hang if it does): "
                    + "; ".join(hung), pytrace=False)


def _hang_events(request: pytest.FixtureRequest, namespace: str) -> list[str]:
    """The TrainerHung events of the test's namespace ("<job>: <message>")."""
    kube: KubeClient = request.getfixturevalue("kube")
    try:
        items = kube.get(f"/api/v1/namespaces/{namespace}/events", fieldSelector="reason=TrainerHung")["items"]
    except KubeAPIError:
        return []
    return [f"{e['involvedObject'].get('name')}: {e.get('message')}" for e in items]


def _delete_jobs(request: pytest.FixtureRequest, namespace: str, restart: OperatorProcess | None) -> None:
    """Delete the test's JAXJobs, then their pods with a 1 s grace: the test is over, so no trainer's
    final save and no sidecar's upload on SIGTERM is waited for (up to the pods' grace, finalSave plus
    30 s; the garbage collector would delete them with it). Each pod still ends as a kubelet ends one."""
    kube: KubeClient = request.getfixturevalue("kube")
    if restart is not None:
        restart.start()
    with contextlib.suppress(KubeAPIError):
        for job in kube.get(jobs_path(namespace))["items"]:
            with contextlib.suppress(KubeAPIError):
                kube.delete(jobs_path(namespace, job["metadata"]["name"]))
    with contextlib.suppress(KubeAPIError):
        for pod in kube.get(f"/api/v1/namespaces/{namespace}/pods")["items"]:
            with contextlib.suppress(KubeAPIError):
                kube.delete(f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}", {"gracePeriodSeconds": 1})
    with contextlib.suppress(TimeoutError):
        wait_for(lambda: not kube.get(jobs_path(namespace))["items"]
                 and not kube.get(f"/api/v1/namespaces/{namespace}/pods")["items"], timeout=180,
                 message="the test's JAXJobs and pods gone")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def jobs(kube: KubeClient, cluster: LocalCluster, namespace: str) -> Jobs:
    return Jobs(kube, cluster, namespace)


@pytest.fixture(scope="session")
def shared_runs() -> dict[str, Any]:
    return {}
