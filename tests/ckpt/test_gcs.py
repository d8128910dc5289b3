"""gs:// against fake-gcs-server: round trips, resharding, retention, leftovers, create-only markers,
an injected storage failure."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest
import resilax_ckpt as rc
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt import commit, layout
from resilax_ckpt.history import fencing
from resilax_ckpt.storage import GcsStorage
from resilax_local.gcs.proxy import GcsProxy
from resilax_local.gcs.server import FakeGCS

pytestmark = pytest.mark.gcs


def mesh(shape):
    return jax.sharding.Mesh(np.array(jax.devices()[: shape[0] * shape[1]]).reshape(shape), ("a", "b"))


def state(step):
    w = np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + step
    return {"params": {"w": jax.device_put(w, NamedSharding(mesh((4, 2)), P("a", "b"))), "n": np.arange(3)},
            "meta": {"step": step}}, w


def test_round_trip_reshard_and_retention(gcs_root, devices):
    with rc.CheckpointManager(gcs_root, rc.ManagerOptions(keep_last=2)) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, state(step)[0])
        mgr.wait()
        assert mgr.steps() == [2, 3]
        target = {"params": {"w": jax.ShapeDtypeStruct((16, 8), np.float32,
                                                       sharding=NamedSharding(mesh((2, 4)), P("b", "a")))}}
        out = mgr.restore(target=target, items=["params"])
        np.testing.assert_array_equal(np.asarray(out["params"]["w"]), state(3)[1])
        assert out["params"]["w"].sharding == target["params"]["w"].sharding
        assert mgr.restore(2)["meta"] == {"step": 2}
    assert rc.restore(f"{gcs_root}/3", items=["meta"]) == {"meta": {"step": 3}}


def test_markers_are_create_only_and_leftovers_are_cleaned(gcs_root, devices):
    storage = GcsStorage()
    marker = f"{gcs_root}/probe/{layout.COMMIT_FILE}"
    storage.write_bytes(marker, b"1", create_only=True)
    with pytest.raises(FileExistsError):
        storage.write_bytes(marker, b"2", create_only=True)
    assert storage.read_bytes(marker) == b"1"

    with rc.CheckpointManager(gcs_root, rc.ManagerOptions(generation=1)) as mgr:
        mgr.save(5, state(5)[0])
    # an interrupted save of ours (a writer marker, no _COMMIT), and a foreign folder that looks alike
    storage.write_bytes(f"{gcs_root}/6/{layout.writer_name(0)}", b"")
    storage.write_bytes(f"{gcs_root}/6/params/w/zarr.json", b"{}")
    storage.write_bytes(f"{gcs_root}/7/params/w/zarr.json", b"{}")
    assert commit.list_committed(storage, gcs_root) == [5]
    with rc.CheckpointManager(gcs_root, rc.ManagerOptions(generation=2)) as mgr:
        assert mgr.steps() == [5]
        assert "6" not in storage.list_dir(gcs_root)
        assert storage.read_bytes(f"{gcs_root}/7/params/w/zarr.json") == b"{}"  # not ours: left alone
        with pytest.raises(rc.StepNotFoundError):
            mgr.restore(6)


class _NoBackoff:
    """gcsfs.retry's `asyncio` with a `sleep` that only yields: gcsfs still makes every try it makes
    against a refused connection (6), without waiting its backoff between them (1 + 2 + 4 + 8 + 16 s,
    which the test would only wait out)."""

    def __getattr__(self, name: str) -> object:
        return getattr(asyncio, name)

    @staticmethod
    async def sleep(delay: float, result: object = None) -> object:
        await asyncio.sleep(0)
        return result


def test_storage_failure_surfaces_from_wait(devices, monkeypatch):
    import gcsfs.retry

    monkeypatch.setattr(gcsfs.retry, "asyncio", _NoBackoff())
    server = FakeGCS().start()
    try:
        for key, value in server.env.items():
            monkeypatch.setenv(key, value)
        root = f"gs://{server.create_bucket()}/run"
        mgr = rc.CheckpointManager(root, rc.ManagerOptions(gcs_retries=1))
        server.stop()
        assert mgr.save(1, state(1)[0])
        with pytest.raises(rc.StorageError, match=r"gs://.*(connect|Connect)"):
            mgr.wait()
        mgr.close()
    finally:
        server.stop()


def test_a_retried_commit_that_finds_its_own_marker_is_committed(gcs_server, gcs_root, devices, monkeypatch):
    """The store creates `_COMMIT` but its answer is lost (a 503 after the write, as a dropped
    connection gives): gcsfs retries the create, which finds the marker (412). That marker is this
    attempt's own: the save committed, no StepExistsError. Another attempt's marker still refuses."""
    proxy = GcsProxy(gcs_server.url)
    try:
        for key in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL"):
            monkeypatch.setenv(key, proxy.url)
        proxy.lose_answer_once(lambda r: r.method == "POST" and f'/5/{layout.COMMIT_FILE}"'.encode() in r.body)
        with rc.CheckpointManager(gcs_root, rc.ManagerOptions(generation=1)) as mgr:
            assert mgr.save(5, state(5)[0])
            mgr.wait()
            assert proxy.lost, "the commit's answer was never lost: the test did not exercise the retry"
            assert mgr.steps() == [5]
            out = mgr.restore(5, items=["params"])
            np.testing.assert_array_equal(np.asarray(out["params"]["w"]), state(5)[1])

        storage = GcsStorage()
        final = f"{gcs_root}/5"
        marker = storage.read_bytes(f"{final}/{layout.COMMIT_FILE}")
        epoch = fencing.parse_marker_epoch(marker)
        other = commit.build_marker(5, epoch, layout.attempt_name(*epoch, "00000000"))
        with pytest.raises(rc.StepExistsError):
            commit.commit_object(storage, gcs_root, final, 5, other, epoch)
        commit.commit_object(storage, gcs_root, final, 5, marker, epoch)  # its own marker: committed
        assert storage.read_bytes(f"{final}/{layout.COMMIT_FILE}") == marker
    finally:
        proxy.close()
