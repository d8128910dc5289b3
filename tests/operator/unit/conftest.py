"""Fixtures for the operator's pure unit tests.

The tests are grouped as the package is: policies/ (one file per policy), observed/, pods/, spec/ (the
CRD, its CEL rules, validation), status/ and capacity/ (shape and pool planning). A file an issue names
by its path (`issues show N`) stays at this level, as do the tests of the core modules (reconcile,
execute, settings, metrics, purity, fuzz) and the helpers every folder imports: op_world.py (an
in-memory world to decide on), op_samples.py (sample specs), op_restart.py (an operator that dies part
way through a decision's actions resumes). pytest puts this folder on sys.path when it loads this
conftest, so `from op_world import ...` works from the subfolders too.
"""

from __future__ import annotations

from typing import Any

import pytest
from op_samples import good_spec


@pytest.fixture
def raw_spec() -> dict[str, Any]:
    return good_spec()
