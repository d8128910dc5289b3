"""pytest fixtures for tests against the local cluster; enable with `pytest_plugins = ["resilax_local.pytest_plugin"]`.

Fixtures:
- `local_cluster` (session): a `LocalCluster` started once per test session (profile `default`: 2 TPU
  slices x 2 hosts + `cpu-0`), stopped at the end. With `RESILAX_TEST_CLUSTER_DIR` set to the run
  folder of a cluster started by `resilax local up --dir ...`, that cluster is reused and left running.
- `cluster` (function): the same cluster; after the test every node the test killed, partitioned,
  preempted (even with the kill still pending) or made unhealthy is restored, so tests do not leak faults.
- `kube` (session): a dict-based admin REST client (`resilax_local.kubeapi.KubeClient`).
- `namespace` (function): a fresh namespace (its `default` ServiceAccount ready), deleted afterwards.
- `fake_gcs` (session): a `FakeGCS` server; `gcs_bucket` (function): a fresh bucket, yields `gs://<name>`.
- `kueue` (session): Kueue running on the session's cluster (built on first use: minutes; started here
  unless the reused cluster runs it, then stopped with its webhook configurations deleted); yields its
  `KueueState`. Tests that use it are marked `kueue` (and `cluster`).
Tests that use `local_cluster`/`cluster` (or `kube`, `namespace`) are marked `cluster`, those that use
`fake_gcs`/`gcs_bucket` `gcs`: the fixtures mark their tests (`FIXTURE_MARKS`; a conftest adds its own
fixtures there), and a test that reaches such a fixture without its marker (through
`request.getfixturevalue`, e.g. in a parametrised `[gcs]` case) fails with the fix in the message, so
`-m "not cluster and not gcs"` never starts a cluster or fake-gcs-server.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .cluster import LocalCluster
from .controlplane.kueue import KueueState
from .errors import KubeAPIError
from .gcs.server import FakeGCS
from .kubeapi import KubeClient
from .node.podhost import NodeState
from .testing import wait_for

#: fixture -> the marker of every test that uses it (what it needs: a local cluster, fake-gcs-server, ...).
FIXTURE_MARKS: dict[str, str] = {
    "local_cluster": "cluster", "cluster": "cluster", "kube": "cluster", "namespace": "cluster",
    "fake_gcs": "gcs", "gcs_bucket": "gcs", "kueue": "kueue",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            mark = FIXTURE_MARKS.get(name)
            if mark is not None and item.get_closest_marker(mark) is None:
                item.add_marker(getattr(pytest.mark, mark))


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> None:
    """A test that reaches a marked fixture at run time (`request.getfixturevalue`) must carry the
    fixture's marker, or `-m "not <marker>"` would still start what the fixture needs."""
    mark = FIXTURE_MARKS.get(fixturedef.argname)
    item = getattr(request, "_pyfuncitem", None)
    if mark is None or item is None or item.get_closest_marker(mark) is not None:
        return
    pytest.fail(f"{item.nodeid} uses the fixture {fixturedef.argname!r} without the {mark!r} marker: mark the "
                f"test, or the parameter that needs it (pytest.param(..., marks=pytest.mark.{mark}))", pytrace=False)


@pytest.fixture(scope="session")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    reuse = os.environ.get("RESILAX_TEST_CLUSTER_DIR")
    if reuse:
        yield LocalCluster.attach(Path(reuse))
        return
    cluster = LocalCluster(tmp_path_factory.mktemp("local-cluster"), profile="default")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster(local_cluster: LocalCluster) -> Iterator[LocalCluster]:
    yield local_cluster
    restored = []
    for node in local_cluster.nodes():
        if node["state"] != NodeState.READY or node.get("kill_pending") or node.get("health_fault"):
            local_cluster.restore_node(node["name"])
            restored.append(node["name"])
    # Ready again in the API (and free of the unreachable taints) before the next test plans on them:
    # else an elastic job started right after would see a slice short and start smaller.
    if restored:
        local_cluster.wait_nodes_ready(restored)


@pytest.fixture(scope="session")
def kube(local_cluster: LocalCluster) -> KubeClient:
    return local_cluster.client()


@pytest.fixture
def namespace(request: pytest.FixtureRequest, kube: KubeClient) -> Iterator[str]:
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:6]}"
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    wait_for(lambda: kube.get(f"/api/v1/namespaces/{name}/serviceaccounts/default"), timeout=60,
             message=f"default ServiceAccount in {name}")
    yield name
    with contextlib.suppress(KubeAPIError):
        kube.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="session")
def kueue(local_cluster: LocalCluster) -> Iterator[KueueState]:
    running = local_cluster.kueue_state()
    if running is not None:
        yield running
        return
    state = local_cluster.start_kueue()
    try:
        yield state
    finally:
        local_cluster.stop_kueue()


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGCS]:
    server = FakeGCS(log_dir=tmp_path_factory.mktemp("fake-gcs"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs_bucket(fake_gcs: FakeGCS) -> str:
    name = f"test-{uuid.uuid4().hex[:10]}"
    fake_gcs.create_bucket(name)
    return f"gs://{name}"
