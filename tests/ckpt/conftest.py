"""Fixtures of the checkpoint library's tests: 8 fake CPU devices, subprocess workers, fake-gcs-server
(the plugin's `fake_gcs`, resilax_local.gcs.server.FakeGCS: one harness for every area)."""

from __future__ import annotations

import os

import jax
import pytest
from resilax_local.gcs.server import FakeGCS


@pytest.fixture(scope="session")
def devices() -> list[jax.Device]:
    devs = jax.devices()
    if len(devs) < 8:
        pytest.fail(f"need 8 fake CPU devices, got {len(devs)}: XLA_FLAGS was set to "
                    f"{os.environ.get('XLA_FLAGS')!r} before pytest started (tests/conftest.py asks for 8)")
    return devs


@pytest.fixture(scope="session")
def gcs_server(fake_gcs: FakeGCS) -> FakeGCS:
    """The session's fake-gcs-server (the local cluster plugin's `fake_gcs`)."""
    return fake_gcs


@pytest.fixture
def gcs_root(gcs_server: FakeGCS, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the session's fake-gcs-server, with the environment pointing at it."""
    for key, value in gcs_server.env.items():
        monkeypatch.setenv(key, value)
    bucket = gcs_server.create_bucket()
    return f"gs://{bucket}/run"
