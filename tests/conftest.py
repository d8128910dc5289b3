"""Shared pytest set-up. Each area's fixtures live in its own conftest under tests/<area>/."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent  # this checkout
PACKAGES = ("resilax_ckpt", "resilax_operator", "resilax_sidecar", "resilax_local")

# The local cluster's fixtures (local_cluster, cluster, kube, namespace, fake_gcs, gcs_bucket) for every area.
pytest_plugins = ["resilax_local.pytest_plugin"]

#: The other fixtures that need something the fast tier (`scripts/test --fast`) does not start: each
#: marks the tests that use it (added to the plugin's FIXTURE_MARKS, which its hooks apply).
FIXTURE_MARKS = {
    "gcs_server": "gcs", "gcs_root": "gcs", "gcs_env": "gcs",  # fake-gcs-server (tests/ckpt, tests/sidecar)
    "helm": "helm", "helm_env": "helm", "render": "helm",  # helm, built from its Go module (tests/chart)
    "promtool": "prometheus",  # Debian's prometheus (scripts/setup-prometheus)
    "chromium": "browser",  # Debian's chromium, headless (scripts/setup-chromium, tests/web)
    "container_privileges": "cluster",  # root (CAP_SYS_ADMIN), as the local cluster's node agent needs
}


@pytest.fixture
def container_privileges() -> None:
    """A test that needs what the local cluster's containers need (root: CAP_SYS_ADMIN for their mount
    and UTS namespaces). Marked `cluster` (FIXTURE_MARKS): the fast tier runs without root."""

#: The test process's JAX: 8 fake CPU devices (the checkpoint tests save on a 4x2 mesh and restore on
#: others). Set once for the whole process, before any test imports JAX, whichever folders run.
#: gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT once, when first imported (a test may import it before any
#: fake-GCS fixture runs); its experimental path probes Google's API, which nothing here answers.
TEST_PROCESS_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu",
                    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def _origin(package: str) -> str:
    spec = importlib.util.find_spec(package)
    return os.path.realpath(spec.origin) if spec is not None and spec.origin else "(not installed)"


def pytest_configure(config: pytest.Config) -> None:
    """The same environment for one folder or the whole suite (a hook, not an import side effect);
    a value the caller set wins. Stops at once when the project's packages resolve to another
    checkout (an editable install moved by hand): every test would then test that checkout's code."""
    elsewhere = {name: origin for name in PACKAGES if not (origin := _origin(name)).startswith(f"{ROOT}{os.sep}")}
    if elsewhere:
        raise pytest.UsageError(f"the resilax packages resolve outside {ROOT}: {elsewhere}; "
                                f"run scripts/setup from this checkout")
    for key, value in TEST_PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    from resilax_local import pytest_plugin

    pytest_plugin.FIXTURE_MARKS.update(FIXTURE_MARKS)
