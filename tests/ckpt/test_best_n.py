"""Orbax habits on real storage (tensorstore on disk, and gs:// on fake-gcs-server): `save(...,
metrics=)` with best-N retention, preservation by steps and by time, `delete(step)`, `metadata(step)`;
with rollback branches and bad steps, which are never deleted."""

from __future__ import annotations

import types
from pathlib import Path

import jax
import numpy as np
import pytest
import resilax_ckpt as rc
from ckpt_procs import run_processes, snapshot_files
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt import commit, layout
from resilax_ckpt.saving import saver
from resilax_ckpt.storage import open_storage

WHERE = ["folder", pytest.param("gcs", marks=pytest.mark.gcs)]
LOSS = {1: 0.9, 2: 0.5, 3: 0.7, 4: 0.2, 5: 0.8, 6: 0.95}
"""step -> loss; the two best (lowest) are steps 4 and 2."""


def _root(where: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    return str(tmp_path / "run") if where == "folder" else request.getfixturevalue("gcs_root")


def _state(step: int) -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + step
    return {"params": {"w": jax.device_put(w, NamedSharding(mesh, P("a", "b")))}, "meta": {"step": step}}


def _manager(root: str, generation: int, **kw) -> rc.CheckpointManager:
    return rc.CheckpointManager(root, rc.ManagerOptions(job_uid="uid-a", generation=generation, async_save=False,
                                                        **kw))


def _check(mgr: rc.CheckpointManager, step: int) -> None:
    out = mgr.restore(step)
    np.testing.assert_array_equal(out["params"]["w"], np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + step)
    assert out["meta"] == {"step": step}


BEST = {"keep_best": 2, "keep_best_metric": "loss", "keep_best_mode": "min"}


@pytest.mark.parametrize("where", WHERE)
def test_best_n_keeps_the_best_steps_and_the_newest(where, tmp_path, request, devices):
    root = _root(where, tmp_path, request)
    with _manager(root, 1, **BEST) as mgr:
        for step in range(1, 6):
            assert mgr.save(step, _state(step), metrics={"loss": LOSS[step], "accuracy": 1 - LOSS[step]})
            # each commit's retention: the two lowest losses so far, and the newest step
        assert mgr.steps() == [2, 4, 5]
        for step in mgr.steps():
            _check(mgr, step)
            assert mgr.metadata(step).metrics == {"loss": LOSS[step], "accuracy": pytest.approx(1 - LOSS[step])}
    # A later generation reads the metrics from the steps' metadata: the worst step, 6, is kept as the
    # newest, and 5 (no longer the newest, not among the best) goes.
    with _manager(root, 2, **BEST) as mgr:
        _check(mgr, 4)  # the step a restore read is kept anyway (here: one of the best)
        mgr.save(6, _state(6), metrics={"loss": LOSS[6]})
        assert mgr.steps() == [2, 4, 6]
        mgr.save(7, _state(7), metrics={"loss": 0.1})  # a new best: 2 (now third best) goes
        assert mgr.steps() == [4, 7]
    storage = open_storage(root)
    assert sorted(s for s in (layout.parse_step(n.rstrip("/")) for n in storage.list_dir(root)) if s is not None) == [
        4, 7], "a deleted step left its folder"


def test_steps_without_the_metric_are_kept_by_recency(tmp_path, devices):
    root = str(tmp_path / "run")
    with _manager(root, 1, keep_last=2, **BEST) as mgr:
        mgr.save(1, _state(1), metrics={"loss": 0.1})
        mgr.save(2, _state(2))  # e.g. a final save on preemption, no metrics
        mgr.save(3, _state(3), metrics={"accuracy": 0.5})  # not the ranked metric
        mgr.save(4, _state(4), metrics={"loss": 0.3})
        mgr.save(5, _state(5))
        # best 2: 1 and 4; the newest 2: 4 and 5; 2 and 3 (no loss) aged out by keep_last.
        assert mgr.steps() == [1, 4, 5]
    with _manager(root, 2, **BEST) as mgr:  # without keep_last, steps without the metric are all kept
        mgr.save(6, _state(6))
        mgr.save(7, _state(7), metrics={"loss": 0.9})
        assert mgr.steps() == [1, 4, 5, 6, 7]
        mgr.save(8, _state(8), metrics={"loss": 0.8})
        assert mgr.steps() == [1, 4, 5, 6, 8]


def test_preservation_by_steps_and_by_time(tmp_path, devices, monkeypatch):
    """keep_every_steps and keep_every_seconds keep steps outside the keep-last count; the save time
    comes from the saver's wall clock (faked: one save per 40 s)."""
    now = {"t": 1_800_000_000.0}
    monkeypatch.setattr(saver, "time", types.SimpleNamespace(time=lambda: now["t"], perf_counter=saver.time.perf_counter))
    root = str(tmp_path / "run")
    with _manager(root, 1, keep_last=1, keep_every_steps=5, keep_every_seconds=100.0) as mgr:
        for step in range(1, 12):
            mgr.save(step, _state(step))
            now["t"] += 40.0
        # by time: 1 (t=0), 4 (t=120), 7 (t=240), 10 (t=360); by steps: 5, 10; the newest: 11.
        assert mgr.steps() == [1, 4, 5, 7, 10, 11]
        assert [mgr.metadata(s).time - 1_800_000_000.0 for s in (1, 4, 7)] == [0.0, 120.0, 240.0]


@pytest.mark.parametrize("where", WHERE)
def test_delete_removes_only_committed_steps_resilax_wrote(where, tmp_path, request, devices):
    root = _root(where, tmp_path, request)
    storage = open_storage(root)
    with _manager(root, 1) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, _state(step), metrics={"loss": step / 100})
        # a folder Resilax did not write, with a step-like name (an Orbax step beside ours)
        storage.write_bytes(storage.join(root, "40", "_CHECKPOINT_METADATA"), b"{}")
        mgr.delete(20)
        assert mgr.steps() == [10, 30]
        assert not [n for n in storage.list_dir(root) if n.rstrip("/") == "20"], "step 20's folder is left"
        with pytest.raises(rc.StepNotFoundError, match=r"no committed step 20 to delete; committed steps: 10, 30"):
            mgr.delete(20)
        with pytest.raises(rc.StepNotFoundError, match="no committed step 40 to delete"):
            mgr.delete(40)
        assert storage.read_bytes(storage.join(root, "40", "_CHECKPOINT_METADATA")) == b"{}"
        mgr.delete(30)  # the newest too, when asked
        assert mgr.steps() == [10] and mgr.latest_step() == 10
        _check(mgr, 10)
        mgr.save(40 + 1, _state(41))
        assert mgr.steps() == [10, 41]


@pytest.mark.parametrize("where", WHERE)
def test_bad_and_superseded_steps_are_never_deleted(where, tmp_path, request, devices):
    """A rollback (restore.step: 100 over 100/200/300) keeps the old timeline; best-N retention and
    delete() leave it and a step marked bad alone, and the new branch's retention still works."""
    root = _root(where, tmp_path, request)
    storage = open_storage(root)
    with _manager(root, 1) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, _state(step), metrics={"loss": 0.01})  # the best losses ever
    old = {s: snapshot_files(root, commit.step_data_path(storage, root, s)) for s in (200, 300)}
    with _manager(root, 2, **BEST) as mgr:
        asked = mgr.restore_step_from_env({"RESILAX_RESTORE_STEP": "100"})
        _check(mgr, asked)
        assert mgr.superseded_steps() == [200, 300]
        for step in (110, 120, 130, 140):
            mgr.save(step, _state(step), metrics={"loss": 1.0 - step / 1000})
        assert mgr.steps() == [100, 140]  # the 2 best (100: also restored; 140: also the newest)
        with pytest.raises(rc.ResilaxCkptError, match="step 200 is superseded by a rollback: Resilax keeps"):
            mgr.delete(200)
        commit.mark_bad(storage, root, 140, "test: a damaged chunk")
        with pytest.raises(rc.ResilaxCkptError, match="step 140 is marked bad"):
            mgr.delete(140)
        for step in (150, 160):
            mgr.save(step, _state(step), metrics={"loss": 0.5})
        assert mgr.steps() == [100, 160]
    assert commit.read_bad(storage, root).keys() == {140}
    assert snapshot_files(root, commit.step_data_path(storage, root, 140)), "the bad step's files were deleted"
    for step, files in old.items():
        assert snapshot_files(root, commit.step_data_path(storage, root, step)) == files, (
            f"the old timeline's step {step} was changed or deleted")


@pytest.mark.parametrize("where", WHERE)
def test_metadata_reads_no_array_data(where, tmp_path, request, devices):
    root = _root(where, tmp_path, request)
    storage = open_storage(root)
    with _manager(root, 3) as mgr:
        mgr.save(5, _state(5), metrics={"loss": 0.25, "tokens": 1_000_000})
        info = mgr.metadata(5)
        # every array file of the step gone: metadata() still answers (it reads no array data)
        data = commit.step_data_path(storage, root, 5)
        storage.delete_tree(storage.join(data, "params"))
        info_again = mgr.metadata()
        assert info_again == info
    assert info.step == 5 and info.generation == 3 and info.era >= 1
    assert info.metrics == {"loss": 0.25, "tokens": 1e6}
    assert info.shapes() == {"params": {"['w']": ((16, 8), "float32")}}
    assert {name: item.kind for name, item in info.items.items()} == {"params": "pytree", "meta": "json"}
    assert info.time > 1.7e9 and info.process_count == 1
    with _manager(root, 4) as mgr, pytest.raises(rc.StepNotFoundError,
                                                 match="no committed step 6 to describe; committed steps: 5"):
        mgr.metadata(6)


def test_two_processes_rank_by_metrics_and_delete_together(tmp_path):
    """2 JAX processes x 4 devices on a shared folder: best-N on the primary's commits, and delete()
    called on both (the primary decides and deletes, the other waits for its outcome): both see the same
    steps after each call, and both raise StepNotFoundError for a step that is gone."""
    losses = {1: 0.4, 2: 0.1, 3: 0.9, 4: 0.3, 5: 0.8}
    out = run_processes({"scenario": "save", "root": str(tmp_path / "run"), "mesh": [4, 2], "steps": list(losses),
                         "metrics": {str(s): {"loss": v} for s, v in losses.items()}, "delete": [4], "delete_missing": [4],
                         "options": {"keep_best": 2, "keep_best_metric": "loss", "keep_best_mode": "min"}},
                        num_processes=2)
    for result in out:
        assert result["after_deletes"] == [[2, 5]], result  # best 2: 2 and 4, newest 5; then 4 deleted
        assert result["refused"] == ["StepNotFoundError"], result
        assert result["steps"] == [2, 5] and result["metrics"] == {"2": {"loss": 0.1}, "5": {"loss": 0.8}}


@pytest.mark.parametrize("where", WHERE)
def test_a_transient_metadata_read_error_never_deletes_the_best_step(where, tmp_path, request, devices, monkeypatch):
    """Issue 40, item 3: with keep_last=2 and the best 1 by loss, the metadata of the best step (100)
    fails to read once (a GCS 503 is an OSError), at the seam retention reads through (the storage's
    read_bytes). That pass keeps step 100 instead of ranking it as "no metrics"; the next pass reads it
    again and it stays the best while 200 ages out."""
    root = _root(where, tmp_path, request)
    with _manager(root, 1) as mgr:
        for step, loss in ((100, 0.1), (200, 0.5)):
            mgr.save(step, _state(step), metrics={"loss": loss})
    storage_type = type(open_storage(root))
    read_bytes = storage_type.read_bytes
    failures: list[str] = []

    def flaky(self, path: str) -> bytes:
        if path.rstrip("/").endswith(layout.METADATA_FILE) and "/100/" in path and not failures:
            failures.append(path)
            raise rc.errors.StorageError(f"reading {path}: HttpError: 503 Service Unavailable")
        return read_bytes(self, path)

    # A new generation: its manager never saw the steps' metrics, it reads them from their metadata.
    with _manager(root, 2, keep_last=2, keep_best=1, keep_best_metric="loss", keep_best_mode="min") as mgr:
        monkeypatch.setattr(storage_type, "read_bytes", flaky)
        mgr.save(300, _state(300), metrics={"loss": 0.9})
        assert failures, "the metadata of step 100 was never read"
        assert mgr.steps() == [100, 200, 300]  # 100 unread: kept; 200 and 300 the newest two
        mgr.save(400, _state(400), metrics={"loss": 0.8})
        assert len(failures) == 1
        assert mgr.steps() == [100, 300, 400]  # read again: the best; 200 aged out
        _check(mgr, 100)
        assert mgr.metadata(100).metrics == {"loss": 0.1}
