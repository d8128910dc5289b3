"""Two live JAXJobs on one storage root (issue 25, item 9).

The newest era claim holds the storage. A job whose storage is held by a live job of another uid (the
operator passes the other live jobs with the same storage: RESILAX_LIVE_JOB_UIDS) refuses to start
there, naming that job (StorageInUseError, exit code 78), and never fences it or deletes its steps;
with take_over (spec.checkpoint.takeOver) it claims the storage. A job re-created (a new uid, the old
one gone) and a job's own later generations keep working as before.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import resilax_ckpt as rc
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt import layout
from resilax_ckpt.errors import StorageInUseError
from resilax_ckpt.history import fencing
from resilax_ckpt.storage import open_storage

A = fencing.EraClaim(1, "uid-a", "ns/a")
B = fencing.EraClaim(2, "uid-b", "ns/b")


@pytest.mark.parametrize(("claims", "me", "live", "take_over", "want"), [
    ([], "uid-a", set(), False, fencing.ClaimDecision(1)),
    ([A], "uid-a", {"uid-b"}, False, fencing.ClaimDecision(1)),  # its own later generation
    ([A], "uid-b", {"uid-a"}, False, fencing.ClaimDecision(None, A)),  # a second live job: refused
    ([A], "uid-b", {"uid-a"}, True, fencing.ClaimDecision(2)),  # ... unless it takes the storage over
    ([A], "uid-b", set(), False, fencing.ClaimDecision(2)),  # a re-created job: the old one is gone
    ([A, B], "uid-a", {"uid-b"}, False, fencing.ClaimDecision(None, B, taken_over=True)),  # taken over
    ([A, B], "uid-a", set(), False, fencing.ClaimDecision(1)),  # replaced, the other gone: stays fenced
    ([A, B], "uid-a", {"uid-b"}, True, fencing.ClaimDecision(3)),  # takes it back
], ids=["first", "own", "second-live", "take-over", "recreated", "taken-over", "replaced", "take-back"])
def test_decide_claim(claims, me, live, take_over, want) -> None:
    assert fencing.decide_claim(claims, me, live, take_over) == want


def _state(step: int) -> dict:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + step
    return {"params": {"w": jax.device_put(w, NamedSharding(mesh, P("a", "b")))}, "meta": {"step": step}}


def _opts(uid: str, generation: int, **kw) -> rc.ManagerOptions:
    return rc.ManagerOptions(job_uid=uid, job_name=f"ns/{uid}", generation=generation, async_save=False,
                             keep_last=2, **kw)


@pytest.mark.parametrize("where", ["folder", pytest.param("gcs", marks=pytest.mark.gcs)])
def test_a_second_live_job_on_a_root_is_refused_and_never_fences_the_first(where: str, tmp_path: Path, request,
                                                                            devices) -> None:
    root = str(tmp_path / "run") if where == "folder" else request.getfixturevalue("gcs_root")
    storage = open_storage(root)
    first = rc.CheckpointManager(root, _opts("uid-a", 1, live_job_uids=("uid-b",)))
    for step in (1, 2, 3):
        first.save(step, _state(step))
    with pytest.raises(StorageInUseError) as caught:
        rc.CheckpointManager(root, _opts("uid-b", 1, live_job_uids=("uid-a",)))
    message = str(caught.value)
    assert "JAXJob ns/uid-a (uid uid-a)" in message and "takeOver" in message and root in message
    assert caught.value.holder_uid == "uid-a" and not caught.value.taken_over
    first.save(4, _state(4))  # still commits: not fenced
    assert first.steps() == [3, 4]
    first.close()
    # The first job's own next generation keeps its era.
    with rc.CheckpointManager(root, _opts("uid-a", 2, live_job_uids=("uid-b",))) as again:
        assert again.restore()["meta"] == {"step": 4}
        again.save(5, _state(5))
    assert [n for n in storage.list_dir(storage.join(root, layout.FENCES_DIR)) if n.startswith("era-")] == ["era-1.json"]
    assert json.loads(storage.read_bytes(storage.join(root, layout.FENCES_DIR, "era-1.json")))["job"] == "ns/uid-a"

    # Told to take over: the second job claims the storage; the first can no longer commit, and its
    # next start is refused, naming the job that took over.
    with rc.CheckpointManager(root, _opts("uid-b", 1, live_job_uids=("uid-a",), take_over=True)) as second:
        assert second.restore()["meta"] == {"step": 5}
        second.save(6, _state(6))
        second.save(7, _state(7))
        assert second.steps() == [4, 5, 6, 7]  # retention (keep 2) never deletes the live job's 4 and 5
    with pytest.raises(StorageInUseError, match="taken over by JAXJob ns/uid-b") as caught:
        rc.CheckpointManager(root, _opts("uid-a", 3, live_job_uids=("uid-b",)))
    assert caught.value.taken_over


def test_a_recreated_job_whose_old_uid_is_gone_still_resumes(tmp_path: Path, devices) -> None:
    """The documented resume flow (delete and re-apply): the old uid is no live job, so no refusal."""
    root = str(tmp_path / "run")
    with rc.CheckpointManager(root, _opts("uid-old", 4)) as old:
        old.save(7, _state(7))
    with rc.CheckpointManager(root, _opts("uid-new", 1, live_job_uids=("uid-other",))) as new:
        assert new.restore()["meta"] == {"step": 7}
        new.save(8, _state(8))
        assert new.steps() == [7, 8]


def test_options_from_env_read_the_claim_settings() -> None:
    opts = rc.ManagerOptions.from_env({"RESILAX_JOB_UID": "u", "RESILAX_JOB_NAME": "llama", "RESILAX_NAMESPACE": "ml",
                                       "RESILAX_LIVE_JOB_UIDS": "x, y,", "RESILAX_TAKE_OVER": "true"})
    assert (opts.job_name, opts.live_job_uids, opts.take_over) == ("ml/llama", ("x", "y"), True)
    assert rc.ManagerOptions.from_env({}).take_over is False
