"""Fixtures of the CLI tests that need the local cluster: the operator's end-to-end fixtures (`crds`,
`operator_rbac`, `operator`, `jobs`) from tests/operator/cluster/conftest.py, loaded under their own
module name so that the two conftest modules never shadow each other."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_CLUSTER_TESTS = Path(__file__).resolve().parents[1] / "operator" / "cluster"
if str(_CLUSTER_TESTS) not in sys.path:
    sys.path.insert(0, str(_CLUSTER_TESTS))  # op_cluster, which those fixtures import

_spec = importlib.util.spec_from_file_location("operator_cluster_fixtures", _CLUSTER_TESTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

crds = _fixtures.crds
operator_rbac = _fixtures.operator_rbac
operator = _fixtures.operator
jobs = _fixtures.jobs
pytest_runtest_makereport = _fixtures.pytest_runtest_makereport
