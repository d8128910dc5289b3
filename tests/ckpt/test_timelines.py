"""A rollback starts a new branch (issue 25, item 3; docs/checkpointing.md, "Timelines").

A generation that restores a step older than the newest visible one (RESILAX_RESTORE_STEP=<n>, or a
fallback from a damaged step) hides the old timeline's later steps from itself and every later
generation: they are kept on storage and listed as superseded, never deleted, never restored. The new
branch's saves survive retention, are uploaded by the sidecars (two tiers) and restore on every host,
also on a host that holds the old branch's copy of a step number locally or none at all. Values
encode the timeline that saved them (`step + offset`), and every restore checks every shard.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
import pytest
import resilax_ckpt as rc
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt import commit, layout
from resilax_ckpt.control import requests
from resilax_ckpt.history import fencing, timelines, visibility
from resilax_ckpt.storage import open_storage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))
from ckpt_procs import snapshot_files
from sidecar_harness import SidecarProcess, build_sidecar_env, wait_until

#: The new branch's values: `step + NEW` (the old timeline saved `step + 0`).
NEW = 1000


def _mesh() -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))


def _state(step: int, offset: int = 0) -> dict:
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + step + offset
    return {"params": {"w": jax.device_put(w, NamedSharding(_mesh(), P("a", "b")))},
            "meta": {"step": step, "offset": offset}}


def _check(out: dict, step: int, offset: int) -> None:
    assert out["meta"] == {"step": step, "offset": offset}
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.asarray(_state(step, offset)["params"]["w"]))


def _manager(root: str, generation: int, **kw) -> rc.CheckpointManager:
    return rc.CheckpointManager(root, rc.ManagerOptions(job_uid="uid-a", generation=generation, async_save=False,
                                                        **kw))


def _root(where: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    return str(tmp_path / "run") if where == "folder" else request.getfixturevalue("gcs_root")


WHERE = ["folder", pytest.param("gcs", marks=pytest.mark.gcs)]


# ---------------------------------------------------------------- the rules (pure)


@pytest.mark.parametrize(("step", "epoch", "branches", "hidden"), [
    (200, (1, 2), [timelines.Branch((1, 3), 100)], True),  # the old timeline above the restored step
    (100, (1, 2), [timelines.Branch((1, 3), 100)], False),  # the restored step itself
    (200, (1, 3), [timelines.Branch((1, 3), 100)], False),  # the new branch's own saves
    (200, (1, 4), [timelines.Branch((1, 3), 100)], False),  # and a later generation's
    (200, (1, 2), [timelines.Branch((2, 1), 100)], True),  # a re-created job (a newer era) rolled back
    (120, (1, 3), [timelines.Branch((1, 3), 100), timelines.Branch((1, 4), 110)], True),  # a second rollback
], ids=["old-above", "parent", "own", "later", "newer-era", "second-rollback"])
def test_decide_superseded(step, epoch, branches, hidden) -> None:
    assert (timelines.decide_superseded(step, epoch, branches) is not None) is hidden


@pytest.mark.parametrize(("restored", "newest", "branch"), [
    (100, 300, timelines.Branch((1, 3), 100, 300)),
    (300, 300, None),
    (100, None, None),
], ids=["older", "newest", "empty"])
def test_decide_branch(restored, newest, branch) -> None:
    assert timelines.decide_branch(restored, newest, (1, 3)) == branch


def test_records_round_trip() -> None:
    b = timelines.Branch((2, 5), 100, 300)
    assert timelines.parse_branch(timelines.branch_name(b), timelines.build_branch(b)) == b
    assert timelines.parse_branch("x.json", b"{") is None
    body = timelines.build_kept(200, timelines.SUPERSEDED, commit.build_marker(200, (1, 2), "a-e1-g2-0123abcd"),
                                attempt="a-e1-g2-0123abcd")
    kept = timelines.parse_kept("200-1.json", body)
    assert kept == timelines.Kept(200, "superseded", "a-e1-g2-0123abcd", None, (1, 2))
    assert timelines.kept_attempts([kept], 200) == {"a-e1-g2-0123abcd"}


# ---------------------------------------------------------------- one tier, in this process


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("how", ["restore_step", "fallback"])
def test_a_rollback_on_one_tier_hides_and_keeps_the_old_timeline(how: str, where: str, tmp_path: Path, request,
                                                                  devices) -> None:
    root = _root(where, tmp_path, request)
    storage = open_storage(root)
    with _manager(root, 1) as mgr:  # the old timeline
        for step in (100, 200, 300):
            mgr.save(step, _state(step))
    if how == "fallback":  # step 300 is damaged: the next generation falls back to 200
        storage.write_bytes(storage.join(commit.step_data_path(storage, root, 300), layout.METADATA_FILE), b"{")
        parent, later, new_steps = 200, [300], [210, 220, 300]
    else:
        parent, later, new_steps = 100, [200, 300], [110, 120, 200, 250]
    old = {s: snapshot_files(root, commit.step_data_path(storage, root, s)) for s in later}

    with _manager(root, 2, keep_last=2) as mgr:
        if how == "fallback":
            _check(mgr.restore(), parent, 0)
        else:
            asked = mgr.restore_step_from_env({"RESILAX_RESTORE_STEP": str(parent)})
            _check(mgr.restore(asked), parent, 0)
        assert mgr.steps()[-1] == parent and mgr.latest_step() == parent
        assert mgr.superseded_steps() == later
        for step in new_steps:  # retention (keep 2, and the restored step) runs after each commit
            mgr.save(step, _state(step, NEW))
            assert step in mgr.steps(), f"retention deleted the new branch's step {step}: {mgr.steps()}"
        assert mgr.steps() == [parent, *new_steps[-2:]]
        assert visibility.newest_visible(storage, root) == new_steps[-1]

    with _manager(root, 3, keep_last=2) as mgr:  # a later generation: the new branch, restored whole
        assert mgr.steps() == [parent, *new_steps[-2:]]
        _check(mgr.restore(), new_steps[-1], NEW)
        assert mgr.superseded_steps() == later
        hidden = [s for s in later if s not in new_steps]
        for step in hidden:  # never restored, by number either
            with pytest.raises(rc.StepNotCommittedError, match="superseded"):
                mgr.restore(step)
    with _manager(root, 4, keep_last=2) as mgr:  # one more start: cleanup keeps the old timeline
        assert mgr.superseded_steps() == later
    kept = {k.step: k for k in timelines.read_kept(storage, root)}
    for step, files in old.items():
        if step in new_steps:  # its number was saved again: kept aside, named by a record
            where_now = (storage.join(root, kept[step].folder) if kept[step].folder
                         else storage.join(root, str(step), kept[step].attempt))
        else:
            where_now = commit.step_data_path(storage, root, step)
        assert snapshot_files(root, where_now) == files, f"the old timeline's step {step} was changed or deleted"
    branches = timelines.read_branches(storage, root)
    assert [(b.epoch[1], b.parent) for b in branches] == [(2, parent)]
    assert fencing.claim_era(storage, root, "uid-a") == branches[0].epoch[0]


def test_a_pinned_restore_writes_its_report_like_any_restore(tmp_path: Path, devices) -> None:
    """RESILAX_RESTORE_STEP=<n> (a rollback) reports the restored step and its source, in the manager
    and in `$RESILAX_CONTROL_DIR/restore.json` (what the sidecar serves and status.history shows as
    restoredStep/restoredFrom), as a restore of the newest step does (issue 40, item 6)."""
    root, control = str(tmp_path / "run"), tmp_path / "control"
    with _manager(root, 1) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, _state(step))
    with _manager(root, 2, control_dir=str(control)) as mgr:
        _check(mgr.restore(mgr.restore_step_from_env({"RESILAX_RESTORE_STEP": "100"})), 100, 0)
        want = {"step": 100, "skipped": [], "generation": 2, "source": "persistent"}
        assert mgr.restore_report == want
        assert requests.read_restore_report(str(control)) == want
        assert visibility.newest_visible(open_storage(root), root) == 100  # 200 and 300 are superseded


@pytest.mark.slow
@pytest.mark.parametrize("where", WHERE)
def test_a_rollback_restores_the_new_branch_on_every_host(where: str, tmp_path: Path, request) -> None:
    """Two JAX processes: the old timeline 100/200/300, a generation restoring 100 and saving 110, 200
    and 250 with retention, then a generation on another mesh restoring the newest step and step 200 by
    number: the new branch's, on both processes, checked shard by shard."""
    from ckpt_procs import run_processes

    root = _root(where, tmp_path, request)
    base = {"scenario": "timeline", "root": root, "mesh": [4, 2]}
    run_processes({**base, "restore_step": "none", "steps": [100, 200, 300],
                   "options": {"generation": 1, "job_uid": "uid-a"}}, num_processes=2)
    results = run_processes({**base, "restore_step": 100, "steps": [110, 200, 250], "offset": NEW,
                             "options": {"generation": 2, "job_uid": "uid-a", "keep_last": 2}}, num_processes=2)
    for r in results:
        assert r["restored"] == {"step": 100, "offset": 0}
        assert r["steps"] == [100, 200, 250] and r["superseded"] == [200, 300]
    for step in ("latest", 200):
        results = run_processes({**base, "mesh": [2, 4], "restore_step": step,
                                 "options": {"generation": 3, "job_uid": "uid-a", "keep_last": 2}},
                                num_processes=2)
        want = 250 if step == "latest" else 200
        assert [r["restored"] for r in results] == [{"step": want, "offset": NEW}] * 2


# ---------------------------------------------------------------- two tiers, with real sidecars


@pytest.fixture
def started() -> Iterator[list[SidecarProcess]]:
    """The sidecars a test started: each is stopped at its end, whatever happened."""
    sidecars: list[SidecarProcess] = []
    yield sidecars
    for sidecar in sidecars:
        with contextlib.suppress(Exception):
            sidecar.close()


def _start_sidecars(started: list[SidecarProcess], tmp_path: Path, persistent: str, generation: int,
                    env: dict[str, str], keep_last: int | None = None) -> list[SidecarProcess]:
    sidecars = []
    for pid in range(2):
        home = tmp_path / f"sidecar-g{generation}-p{pid}"
        home.mkdir()
        sidecar_env = {**build_sidecar_env(home), **env,
                       "RESILAX_LOCAL_DIR": str(tmp_path / f"local{pid}"), "RESILAX_CHECKPOINT_DIR": persistent,
                       "RESILAX_GENERATION": str(generation), "RESILAX_JOB_UID": "uid-a",
                       "JAX_PROCESS_ID": str(pid), "JAX_NUM_PROCESSES": "2",
                       "RESILAX_KEEP_LAST": "" if keep_last is None else str(keep_last)}
        sidecar = SidecarProcess(sidecar_env, home / "sidecar.log")
        started.append(sidecar)
        sidecar.wait_ready()
        sidecars.append(sidecar)
    return sidecars


def _stop(sidecars: list[SidecarProcess]) -> None:
    for sidecar in sidecars:
        sidecar.close()


@pytest.mark.slow
@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("how", ["restore_step", "fallback"])
def test_a_rollback_on_two_tiers_uploads_and_restores_the_new_branch(how: str, where: str, tmp_path: Path,
                                                                      request, started) -> None:
    """Two JAX processes, each with its local tier and a real `resilax sidecar` uploading to the
    persistent tier (a folder or gs://). The old timeline 100/200/300 is uploaded; a generation rolls
    back (RESILAX_RESTORE_STEP=100, or a fallback from a damaged 300 to 200) and saves on: each save
    is uploaded under its own attempt (the trainer waits for exactly that), persistent retention
    (keep 2) never deletes one, the old timeline stays on storage. Then a generation whose process 1
    has the OLD local tier (a node that missed the rollback) and one with no local tier at all restore
    the new branch on both processes; `wait_persisted` of a save is false until that save's own
    attempt is committed."""
    from ckpt_procs import run_processes
    from resilax_sidecar.config import SidecarConfig
    from resilax_sidecar.metrics import SidecarMetrics
    from resilax_sidecar.store import open_store
    from resilax_sidecar.uploader import Uploader

    persistent = (str(tmp_path / "persistent") if where == "folder"
                  else request.getfixturevalue("gcs_root"))
    gcs_env = request.getfixturevalue("gcs_server").env if where == "gcs" else {}
    storage = open_storage(persistent)
    local = str(tmp_path / "local{pid}")
    base = {"scenario": "timeline", "root": local, "persistent": persistent, "mesh": [4, 2], "wait_persisted": True}

    def opts(generation: int) -> dict:
        return {"generation": generation, "job_uid": "uid-a", "local_tier": True}

    old_steps = [100, 200, 300] if how == "fallback" else [100, 200, 300, 400]
    sidecars = _start_sidecars(started, tmp_path, persistent, 1, gcs_env)
    run_processes({**base, "restore_step": "none", "steps": old_steps, "options": opts(1)}, num_processes=2,
                  env=gcs_env)
    _stop(sidecars)
    assert commit.list_visible(storage, persistent) == old_steps
    shutil.copytree(tmp_path / "local1", tmp_path / "local1-old")  # a host that will miss the rollback
    if how == "fallback":  # step 300 damaged on both tiers: the next generation falls back to 200
        storage.write_bytes(storage.join(commit.step_data_path(storage, persistent, 300), layout.METADATA_FILE), b"{")
        for metadata in (tmp_path / "local0" / "300", tmp_path / "local1" / "300"):
            for name in metadata.glob("_METADATA*"):  # _METADATA.<process>.json with several processes
                name.write_text("{")
        parent, later, new_steps, restore_step = 200, [300], [210, 300], "latest"
    else:
        # the new branch saves 200 and 300 again: process 1's old local copies carry those numbers
        parent, later, new_steps, restore_step = 100, [200, 300, 400], [110, 200, 300], 100
    old = {s: snapshot_files(persistent, commit.step_data_path(storage, persistent, s)) for s in later}

    sidecars = _start_sidecars(started, tmp_path, persistent, 2, gcs_env, keep_last=2)
    results = run_processes({**base, "restore_step": restore_step, "steps": new_steps, "offset": NEW,
                             "options": opts(2)}, num_processes=2, env=gcs_env)
    _stop(sidecars)
    for r in results:
        assert r["restored"] == {"step": parent, "offset": 0}
        assert r["superseded"] == later
    visible = commit.list_visible(storage, persistent)
    assert visible[-2:] == new_steps[-2:], visible  # uploaded, and kept by the sidecar's retention
    assert commit.list_superseded(storage, persistent) == later
    kept = {k.step: k for k in timelines.read_kept(storage, persistent)}
    for step, files in old.items():
        now = (storage.join(persistent, str(step), kept[step].attempt) if step in new_steps
               else commit.step_data_path(storage, persistent, step))
        assert snapshot_files(persistent, now) == files, f"the old timeline's step {step} was changed or deleted"

    # Process 1 comes back with the old timeline's local tier; then neither process has a local tier.
    (tmp_path / "local1").rename(tmp_path / "local1-new")
    (tmp_path / "local1-old").rename(tmp_path / "local1")
    for generation, wipe in ((3, False), (4, True)):
        if wipe:
            for pid in (0, 1):
                shutil.rmtree(tmp_path / f"local{pid}")
        results = run_processes({**base, "mesh": [2, 4], "restore_step": "latest", "options": opts(generation)},
                                num_processes=2, env=gcs_env)
        assert [r["restored"] for r in results] == [{"step": new_steps[-1], "offset": NEW}] * 2, results
        assert results[1]["restored_from"] == "persistent"  # its local copy of that number is the old one

    # "Persisted" is this save's own attempt committed: not an old timeline's step of that number or newer.
    step = new_steps[-1] + 50  # restore_step: below the old timeline's persisted 400
    run_processes({**base, "wait_persisted": False, "restore_step": "latest", "steps": [step], "offset": NEW,
                   "options": opts(5)}, num_processes=2, env=gcs_env)
    uploaders = []
    for pid in (0, 1):
        config = SidecarConfig.from_env({"RESILAX_CONTROL_DIR": str(tmp_path / f"control-up{pid}"),
                                         "RESILAX_LOCAL_DIR": str(tmp_path / f"local{pid}"),
                                         "RESILAX_CHECKPOINT_DIR": persistent, "JAX_PROCESS_ID": str(pid),
                                         "JAX_NUM_PROCESSES": "2", "RESILAX_GENERATION": "5"})
        uploaders.append(Uploader(config, open_store(persistent), SidecarMetrics()))
    uploaders[0].run_once()  # process 0's files are up; process 1's are not: not committed
    assert not uploaders[0].wait_persisted(step, 0), "persisted before its own upload committed"
    uploaders[1].run_once()
    wait_until(lambda: uploaders[0].run_once() is None and uploaders[0].wait_persisted(step, 0), 30,
               f"step {step} persisted")
    assert json.loads(storage.read_bytes(storage.join(persistent, str(step), layout.COMMIT_FILE)))["generation"] == 5


def test_persisted_means_this_saves_own_attempt_not_a_step_number(tmp_path: Path) -> None:
    """`wait_persisted(250)` of this generation's save of 250 is false while only an older generation's
    step 300 is committed (a number compare said true), and true once this save's own attempt is."""
    from resilax_sidecar.config import SidecarConfig
    from resilax_sidecar.metrics import SidecarMetrics
    from resilax_sidecar.store import LocalFolderStore
    from resilax_sidecar.uploader import Uploader
    from sidecar_harness import step_files, write_local_step

    persistent = tmp_path / "persistent"
    (persistent / "300").mkdir(parents=True)
    (persistent / "300" / layout.COMMIT_FILE).write_bytes(commit.build_marker(300, (0, 2)))  # committed in place
    def start_uploaders() -> list[Uploader]:
        out = []
        for pid in (0, 1):
            config = SidecarConfig.from_env({"RESILAX_CONTROL_DIR": str(tmp_path / f"control{pid}"),
                                             "RESILAX_LOCAL_DIR": str(tmp_path / f"local{pid}"),
                                             "RESILAX_CHECKPOINT_DIR": str(persistent), "JAX_PROCESS_ID": str(pid),
                                             "JAX_NUM_PROCESSES": "2", "RESILAX_GENERATION": "3"})
            out.append(Uploader(config, LocalFolderStore(persistent), SidecarMetrics()))
        return out

    for pid in (0, 1):
        write_local_step(tmp_path / f"local{pid}", 250, step_files(2, 64, seed=pid), generation=3)
    uploaders = start_uploaders()
    uploaders[0].run_once()  # without a branch record 300 is the newest persisted step: 250 waits
    assert uploaders[0].state.committed_steps == [300]
    assert uploaders[0].state.to_json()["branch"] is None  # no rollback yet
    assert not uploaders[0].wait_persisted(250, 0), "an older generation's step 300 made save 250 'persisted'"
    # The rollback recorded (generation 3 restored 200, before saving 250; its sidecars start): 300 is
    # superseded, 250 is uploaded and persisted.
    storage = open_storage(str(persistent))
    timelines.write_branch(storage, str(persistent), timelines.Branch((0, 3), 200, 300))
    uploaders = start_uploaders()
    uploaders[0].run_once()
    assert not uploaders[0].wait_persisted(250, 0), "persisted before process 1's files were up"
    uploaders[1].run_once()
    uploaders[0].run_once()
    assert uploaders[0].wait_persisted(250, 0) and uploaders[1].wait_persisted(250, 0)
    # The state says the rollback its steps' branch comes from (the operator orders by it).
    assert uploaders[0].state.to_json()["branch"] == {"era": 0, "generation": 3, "parent": 200}
    assert commit.list_visible(storage, str(persistent)) == [250]
    assert commit.list_superseded(storage, str(persistent)) == [300]
