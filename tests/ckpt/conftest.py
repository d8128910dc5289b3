"""Fixtures of the checkpoint library's tests: 8 fake CPU devices, subprocess workers, fake-gcs-server
(the plugin's `fake_gcs`, resilax_local.gcs.server.FakeGCS: one harness for every area).

Layout: the subfolders mirror resilax_ckpt's subpackages (`trainer/`, `restoring/`, `saving/`,
`incluster/`). A test file an issue cites by its path stays in this folder whatever its concern
(test_best_n, test_buffer_reuse, test_donation, test_exit_watchdog, test_integrity, test_kill_fuzz,
test_local_tier, test_manager, test_multiprocess, test_reader, test_recycle, test_restore_prefetch,
test_storage_claims, test_timelines, test_trainer_metrics), as do the whole-library ones (test_gcs,
test_guide, test_planning, test_pytrees), the control folder's and the reader pool's (two files) and
the shared helpers (ckpt_procs, ckpt_worker and the other workers). The subfolders' tests import those
helpers by name: pytest's default (prepend) import mode puts this conftest's folder on sys.path."""

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
