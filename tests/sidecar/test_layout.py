"""The sidecar reads and writes the checkpoint format through the library's JAX-free format modules
(layout, fencing, requests, visibility): one source of the names and rules, and no JAX in the sidecar."""

from __future__ import annotations

import subprocess
import sys

from resilax_ckpt import layout as ckpt_layout
from resilax_ckpt.control import requests as ckpt_requests
from resilax_ckpt.history import visibility as ckpt_visibility
from resilax_sidecar import control, direct_view, uploader


def test_the_sidecar_uses_the_library_format_modules():
    assert uploader.layout is ckpt_layout and direct_view.visibility is ckpt_visibility
    assert (control.REQUESTS_DIR, control.RESULTS_DIR, control.TRAINER_LOCK) == (
        ckpt_requests.REQUESTS_DIR, ckpt_requests.RESULTS_DIR, ckpt_requests.TRAINER_LOCK)


def test_the_format_modules_and_the_sidecar_load_without_jax():
    code = ("import sys; import resilax_ckpt, resilax_ckpt.layout, resilax_ckpt.history.fencing, resilax_ckpt.saving.policy, "
            "resilax_ckpt.saving.retention, "
            "resilax_ckpt.control.requests, resilax_ckpt.storage, resilax_sidecar.app, resilax_sidecar.uploader; "
            "heavy = sorted(m for m in ('jax', 'jaxlib', 'tensorstore', 'numpy') if m in sys.modules); "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"the sidecar's imports loaded {out.stdout.strip()}"


def test_the_package_still_exposes_the_manager_lazily():
    code = "import resilax_ckpt as rc; assert rc.CheckpointManager.__name__ == 'CheckpointManager'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
