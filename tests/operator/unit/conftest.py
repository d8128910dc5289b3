"""Fixtures for the operator's pure unit tests."""

from __future__ import annotations

from typing import Any

import pytest
from op_samples import good_spec


@pytest.fixture
def raw_spec() -> dict[str, Any]:
    return good_spec()
