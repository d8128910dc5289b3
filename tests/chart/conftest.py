"""Fixtures of the chart tests: helm (built from its Go module, cached), and helpers to render the chart.

helm is `go install helm.sh/helm/v4/cmd/helm@v4.3.2` into `~/.cache/resilax/bin/helm-v4.3.2/` through the
local cluster's binary builder (`resilax_local.binaries`: KUBEBUILDER_ASSETS first, then the cache, then
`go install`, logging to `~/.cache/resilax/helm-build.log`). A cold build takes a few minutes.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import (
    CHART,
    HELM_VERSION,
    KUBE_VERSION,
    RELEASE,
    RELEASE_NAMESPACE,
    ensure_helm,
    is_node_sweeper,
    write_values,
)
from resilax_local.errors import BinaryError


def pytest_collection_finish(session: pytest.Session) -> None:
    """Build helm (when missing) before the tests run, outside any test's timeout: a cold build takes
    minutes on a busy machine."""
    if not any("helm" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    try:
        ensure_helm(build=False)
    except BinaryError:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"building helm {HELM_VERSION} with `go install` (cached afterwards) ...")
        ensure_helm()


@pytest.fixture(scope="session")
def helm_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """helm's environment: its caches and config in a scratch folder, never the user's."""
    home = tmp_path_factory.mktemp("helm-home")
    return {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        "NO_COLOR": "1",
    }


@pytest.fixture(scope="session")
def helm(helm_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run helm with the given arguments; returns the completed process (check it yourself)."""
    binary = ensure_helm()

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(binary), *args], capture_output=True, text=True, env=helm_env,
                              timeout=timeout, check=False)

    return run


@pytest.fixture
def render(helm: Callable[..., subprocess.CompletedProcess[str]], tmp_path: Path) -> Iterator[Callable[..., list[dict[str, Any]]]]:
    """Render the chart (`helm template --include-crds`) with the given values; returns the objects."""
    counter = iter(range(1000))

    def run(values: dict[str, Any] | None = None, chart: Path = CHART,
            node_sweeper: bool = False) -> list[dict[str, Any]]:
        """The objects; the node sweeper's (its own DaemonSet, ServiceAccount and RBAC, checked by
        test_chart_render.py's node-sweeper tests) only with `node_sweeper`."""
        values_file = write_values(tmp_path / f"values-{next(counter)}.yaml", values or {})
        proc = helm("template", RELEASE, str(chart), "--namespace", RELEASE_NAMESPACE, "--include-crds",
                    "--kube-version", KUBE_VERSION, "-f", str(values_file))
        assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
        docs = [doc for doc in yaml.safe_load_all(proc.stdout) if doc]
        return docs if node_sweeper else [d for d in docs if not is_node_sweeper(d)]

    yield run


@pytest.fixture(scope="session")
def promtool() -> str:
    """promtool's path (Debian's prometheus package, scripts/setup-prometheus); marks its tests `prometheus`."""
    from prometheus_tool import binary

    return binary("promtool")
