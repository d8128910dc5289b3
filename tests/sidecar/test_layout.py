"""The sidecar repeats a few names of resilax_ckpt's layout (it must not import JAX); they agree."""

from __future__ import annotations

import itertools

import pytest
from resilax_ckpt import fencing as ckpt_fencing
from resilax_ckpt import layout as ckpt_layout
from resilax_ckpt import requests as ckpt_requests
from resilax_sidecar import control, layout


def test_names_agree_with_resilax_ckpt():
    assert layout.METADATA_FILE == ckpt_layout.METADATA_FILE
    assert layout.COMMIT_FILE == ckpt_layout.COMMIT_FILE
    assert layout.UPLOADED_PREFIX == ckpt_layout.UPLOADED_PREFIX
    assert layout.FENCES_DIR == ckpt_layout.FENCES_DIR
    assert layout.TMP_PREFIX == ckpt_layout.TMP_PREFIX
    assert layout.TRASH_PREFIX == ckpt_layout.TRASH_PREFIX
    assert control.REQUESTS_DIR == ckpt_requests.REQUESTS_DIR
    assert control.RESULTS_DIR == ckpt_requests.RESULTS_DIR
    assert control.TRAINER_LOCK == ckpt_requests.TRAINER_LOCK
    for pid in (None, 0, 3):
        assert layout.commit_name(pid) == ckpt_layout.commit_name(pid)
        assert layout.metadata_name(pid) == ckpt_layout.metadata_name(pid)
    for name in ("0", "120", "0120", "x", "12a", ".tmp-3-g1", "_fences"):
        assert layout.parse_step(name) == ckpt_layout.parse_step(name), name


@pytest.mark.parametrize(
    "fences",
    [{}, {3: 10}, {3: None}, {1: 5, 4: 20}, {2: 7}],
    ids=["none", "newer-with-step", "newer-without-step", "two", "older"],
)
def test_the_fence_rule_agrees_with_resilax_ckpt(fences):
    for step, generation in itertools.product((5, 10, 11, 25), (0, 2, 3, 5)):
        want = ckpt_fencing.decide_visible(step, generation, fences)
        assert layout.decide_visible(step, generation, fences) == want, (step, generation)


def test_a_request_written_by_the_sidecar_is_read_by_resilax_ckpt(tmp_path):
    control.write_request(tmp_path, "abc-1", "resize", True)
    watcher = ckpt_requests.RequestWatcher(str(tmp_path))
    (request,) = watcher.poll()
    assert (request.id, request.reason, request.stop) == ("abc-1", "resize", True)
    watcher.write_result(request, 42, True, None)
    assert control.read_result(tmp_path, "abc-1") == control.SaveResult("abc-1", 42, True, None)
    assert not control.request_pending(tmp_path, "abc-1")


def test_the_sidecar_never_imports_jax_or_the_checkpoint_library():
    import subprocess
    import sys

    code = "import sys, resilax_sidecar.app; print(sorted(m for m in ('jax', 'resilax_ckpt', 'kopf') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
