"""A sidecar without a local tier reports the newest step a restore would see (issue 40, item 6).

Its state's `newest_persisted_step` (which the operator's status.checkpoint.step, history, freshness
and steps at risk follow) obeys the visibility rules of docs/checkpointing.md, "Timelines": after a
rollback the abandoned timeline's newer steps are never reported, nor is a step marked bad. Real
checkpoints saved and restored by the library on tmp_path, read by an in-process sidecar.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import jax.numpy as jnp
import resilax_ckpt as rc
from resilax_ckpt import commit, layout
from resilax_ckpt.history import visibility
from resilax_ckpt.storage import open_storage
from resilax_sidecar.app import Sidecar
from resilax_sidecar.config import SidecarConfig
from resilax_sidecar.direct_view import StoreReader
from resilax_sidecar.store import LocalFolderStore
from sidecar_harness import build_sidecar_env


def _manager(root: Path, generation: int) -> rc.CheckpointManager:
    return rc.CheckpointManager(str(root), rc.ManagerOptions(job_uid="uid-a", generation=generation,
                                                             async_save=False))


def _state(step: int) -> dict:
    return {"w": jnp.arange(8, dtype=jnp.float32) + step}


def _state_of(root: Path, home: Path) -> dict:
    """The state of a fresh sidecar of the job (no local tier)."""
    home.mkdir(exist_ok=True)
    config = SidecarConfig.from_env({**build_sidecar_env(home), "RESILAX_CHECKPOINT_DIR": str(root)})
    sidecar = Sidecar(config)
    sidecar.store = LocalFolderStore(root)
    state = asyncio.run(sidecar.state_json())
    assert state["last_error"] is None
    return state


def _reported(root: Path, home: Path) -> int | None:
    """What a fresh sidecar of the job (no local tier) reports as its newest persisted step."""
    return _state_of(root, home)["newest_persisted_step"]


def test_after_a_rollback_the_sidecar_reports_the_new_branch_never_the_abandoned_timeline(tmp_path: Path) -> None:
    root = tmp_path / "run"
    with _manager(root, 1) as mgr:  # the old timeline
        for step in (4, 8, 40, 44):
            mgr.save(step, _state(step))
    assert _reported(root, tmp_path / "s1") == 44
    assert _state_of(root, tmp_path / "s1")["branch"] is None  # never rolled back

    with _manager(root, 2) as mgr:  # applied again with checkpoint.restore.step: 8
        out = mgr.restore(mgr.restore_step_from_env({"RESILAX_RESTORE_STEP": "8"}))
        assert int(out["w"][0]) == 8
        assert mgr.superseded_steps() == [40, 44]
        # The branch record is written before the restore returns: 40 and 44 are hidden at once.
        assert _reported(root, tmp_path / "s2") == 8
        # ... and the state names the rollback (era of job uid-a, generation 2, parent 8): the operator
        # never takes the 44 that words left before it for newer (resilax_operator/status_fields/checkpoint.py).
        assert _state_of(root, tmp_path / "s2")["branch"] == {"era": 1, "generation": 2, "parent": 8}
        for step in (12, 16):
            mgr.save(step, _state(step))
            assert _reported(root, tmp_path / f"s2-{step}") == step
        assert mgr.steps()[-1] == 16
    # Still there, committed, kept, and never reported.
    assert {40, 44} <= set(visibility.list_committed(open_storage(str(root)), str(root)))

    commit.mark_bad(open_storage(str(root)), str(root), 16, "a restore could not read it")
    assert _reported(root, tmp_path / "s3") == 12


def test_the_sidecar_and_the_library_see_the_same_newest_step(tmp_path: Path) -> None:
    """The store the sidecar reads through (StoreReader) gives the library's reader the same answer as
    the library's own storage, also for a root without steps and a folder without a marker."""
    root = tmp_path / "run"
    store, storage = LocalFolderStore(root), open_storage(str(root))
    assert visibility.newest_visible(StoreReader(store), "") is None
    with _manager(root, 1) as mgr:
        for step in (10, 20):
            mgr.save(step, _state(step))
    (root / "30").mkdir()  # an interrupted save: no commit marker
    assert not (root / "30" / layout.COMMIT_FILE).exists()
    assert visibility.newest_visible(StoreReader(store), "") == 20
    assert visibility.newest_visible(storage, str(root)) == visibility.list_visible(storage, str(root))[-1] == 20
