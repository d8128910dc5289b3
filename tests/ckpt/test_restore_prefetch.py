"""The restore hidden under start-up (prefetch.py, issue 38): a restarting trainer's checkpoint read
starts before JAX initialises its backend, proven by the order of events in one log (the prefetch's
own events, JAX's backend-initialisation hook, the trainer's steps), not by timing; what it restores
is bit-exact; and a prefetch of a step the restore does not pick, or of files that changed since, is
never restored from."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import resilax_ckpt as rc
from ckpt_procs import run_processes
from ckpt_worker import expected, global_mesh, make_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt.chunks import chunk_format
from resilax_ckpt.metadata import LeafMetadata
from resilax_ckpt.options import InvalidOptionsError
from resilax_ckpt.restoring import prefetch, read_ahead, restore_choice
from test_local_tier import merge_like_the_uploader

TRAINER = Path(__file__).with_name("prefetch_trainer.py")
ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 60
"""How long a child may take before the test fails instead of hanging (not a measurement)."""


@pytest.fixture(autouse=True)
def _no_prefetch_left():
    """Each test starts and ends without a process prefetch (start_prefetch is once per process)."""
    prefetch.stop()
    yield
    prefetch.stop()


def save_steps(directory: Path, steps: list[int], local_tier: bool = False) -> None:
    mesh = global_mesh([4, 2])
    with rc.CheckpointManager(str(directory), rc.ManagerOptions(async_save=False, local_tier=local_tier)) as mgr:
        for step in steps:
            mgr.save(step, {"params": make_state(step, mesh), "meta": {"step": step}}, force=True)


def run_trainer(tmp_path: Path, env: dict[str, str], devices: int = 1, between: str | None = None) -> dict:
    out = tmp_path / "out"
    out.mkdir()
    full = {k: v for k, v in os.environ.items() if not k.startswith(("RESILAX_", "JAX_"))}
    full.update(env, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
                PYTHONPATH=os.pathsep.join([str(ROOT / "ckpt_lib"), str(TRAINER.parent), full.get("PYTHONPATH", "")]))
    args = {"out": str(out), "devices": devices, "between": between}
    proc = subprocess.run([sys.executable, str(TRAINER), json.dumps(args)], env=full, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((out / "events.json").read_text())
    with np.load(out / "restored.npz") as data:
        result["arrays"] = {k: data[k] for k in data.files}
    return result


def index(events: list[dict], name: str) -> int:
    found = [i for i, e in enumerate(events) if e["event"] == name]
    assert found, f"no {name!r} event in {[e['event'] for e in events]}"
    return found[0]


def assert_bit_exact(arrays: dict[str, np.ndarray], step: int) -> None:
    want = expected(step)
    assert sorted(arrays) == sorted(want)
    for name, value in want.items():
        assert arrays[name].dtype == value.dtype, name
        assert arrays[name].tobytes() == value.tobytes(), name


# ---------------------------------------------------------------------------- a restarting trainer


@pytest.mark.parametrize("devices", [1, 4], ids=["one-device", "four-devices"])
def test_read_starts_before_the_backend_and_the_restore_takes_it(tmp_path, devices):
    save_steps(tmp_path / "ckpt", [10, 20])
    result = run_trainer(tmp_path, {"RESILAX_CHECKPOINT_DIR": str(tmp_path / "ckpt")}, devices)
    events = result["events"]
    started = index(events, "prefetch-started")
    # The step is chosen, its metadata read and its chunk reads queued before the trainer even imports
    # JAX; the backend comes up later (JAX's own hook says when), after jax.devices() was entered.
    assert events[started]["step"] == 20
    assert started < index(events, "start_prefetch-returned") < index(events, "jax-imported")
    assert index(events, "jax-imported") < index(events, "devices-entered") < index(events, "backend-initialized")
    assert not events[started]["backends_initialized"]
    assert not events[index(events, "start_prefetch-returned")]["jax_imported"]
    leaves = [e for e in events if e["event"] == "prefetch-leaf"]
    assert len(leaves) == 3 and all(e["thread"] == "resilax-prefetch" for e in leaves)
    # The restore picked the prefetched step and took every leaf from it (no second read), bit-exact.
    taken = [e for e in events if e["event"] == "prefetch-taken"]
    assert index(events, "restore-entered") < index(events, "prefetch-taken")
    for leaf in ("['b']", "['e']", "['w']"):  # each leaf read before the restore took it
        read_at = next(i for i, e in enumerate(events) if e["event"] == "prefetch-leaf" and e["leaf"] == leaf)
        taken_at = next(i for i, e in enumerate(events) if e["event"] == "prefetch-taken" and e["leaf"] == leaf)
        assert read_at < taken_at, leaf
    assert sorted(e["leaf"] for e in taken) == ["['b']", "['e']", "['w']"]
    stats = result["stats"]
    assert (stats["step"], stats["read_leaves"], stats["taken_leaves"], stats["error"]) == (20, 3, 3, None)
    assert stats["taken_bytes"] == stats["bytes"] == sum(v.nbytes for v in expected(20).values())
    assert result["report"]["step"] == 20 and result["shardings_as_asked"]
    assert_bit_exact(result["arrays"], 20)


def test_a_pinned_step_is_the_one_read_ahead(tmp_path):
    save_steps(tmp_path / "ckpt", [10, 20])
    result = run_trainer(tmp_path, {"RESILAX_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "RESILAX_RESTORE_STEP": "10"})
    assert (result["stats"]["step"], result["stats"]["taken_leaves"]) == (10, 3)
    assert_bit_exact(result["arrays"], 10)


def test_a_step_marked_bad_after_the_prefetch_is_not_restored_from_it(tmp_path):
    """Between the prefetch of step 20 and the restore, step 20 is marked bad (another process could
    not read it): the restore's choice, unchanged, falls to step 10 and reads it; the prefetched
    buffers of step 20 are dropped unused."""
    save_steps(tmp_path / "ckpt", [10, 20])
    result = run_trainer(tmp_path, {"RESILAX_CHECKPOINT_DIR": str(tmp_path / "ckpt")}, between="mark_bad")
    events = result["events"]
    assert result["stats"]["step"] == 20 and result["stats"]["read_leaves"] == 3
    assert result["stats"]["taken_leaves"] == 0 and not any(e["event"] == "prefetch-taken" for e in events)
    released = events[index(events, "prefetch-released")]
    assert "step 10" in released["reason"]
    assert result["report"]["step"] == 10
    assert_bit_exact(result["arrays"], 10)


def test_a_file_replaced_after_the_prefetch_is_read_again(tmp_path):
    """One of step 20's chunk files is replaced with damaged bytes after the prefetch read it: the
    restore does not take the prefetched (good) copy of that leaf; it reads the file, finds the
    checksum wrong, marks step 20 bad and falls back to step 10, as without a prefetch."""
    save_steps(tmp_path / "ckpt", [10, 20])
    result = run_trainer(tmp_path, {"RESILAX_CHECKPOINT_DIR": str(tmp_path / "ckpt")}, between="replace_file")
    assert result["report"]["step"] == 10
    assert [s["step"] for s in result["report"]["skipped"]] == [20]
    assert "checksum" in result["report"]["skipped"][0]["reason"].lower()
    assert_bit_exact(result["arrays"], 10)


def test_off_by_environment(tmp_path):
    save_steps(tmp_path / "ckpt", [10])
    result = run_trainer(tmp_path, {"RESILAX_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "RESILAX_RESTORE_PREFETCH": "0"})
    assert result["stats"] is None and not any(e["event"].startswith("prefetch-") for e in result["events"])
    assert_bit_exact(result["arrays"], 10)


# ---------------------------------------------------------------------------- several processes


@pytest.mark.slow
@pytest.mark.parametrize("lost", [False, True], ids=["same-mesh", "host-1-lost-its-newest-step"])
def test_two_processes_read_their_own_local_files_ahead(tmp_path, devices, lost):
    """Two JAX processes, each with its own local tier (a node's), restart on the same mesh: each reads
    ahead the chunks of its own local files of its newest step and its restore takes every leaf from
    them (bit-exact: the worker checks every shard). When host 1 lost step 2, it reads ahead step 1
    while process 0 reads ahead step 2; the processes agree on step 1 as always: process 0 drops its
    prefetch unused and reads step 1, process 1 takes its prefetch."""
    local = str(tmp_path / "local{pid}")
    persistent = str(tmp_path / "persistent")
    run_processes({"scenario": "save", "root": local, "mesh": [4, 2], "steps": [1, 2],
                   "options": {"local_tier": True}}, num_processes=2)
    merge_like_the_uploader([local.format(pid=0), local.format(pid=1)], 1, persistent)
    if lost:
        shutil.rmtree(tmp_path / "local1" / "2")
    restored = run_processes({"scenario": "restore", "root": local, "persistent": persistent, "mesh": [4, 2],
                              "latest_from_env": True, "prefetch": True, "options": {"local_tier": True}},
                             num_processes=2)
    stats = [r["prefetch"] for r in restored]
    assert [r["restored_from"] for r in restored] == ["local", "local"]
    if not lost:
        assert [r["step"] for r in restored] == [2, 2]
        assert [(s["step"], s["tier"], s["read_leaves"], s["taken_leaves"]) for s in stats] == [(2, "local", 3, 3)] * 2
        # each process read its own shards only (with the replicated `b`): less than the whole state
        whole = sum(v.nbytes for v in expected(2).values())
        assert all(s["read_bytes"] < whole for s in stats)
    else:
        assert [r["step"] for r in restored] == [1, 1]
        assert [(s["step"], s["taken_leaves"]) for s in stats] == [(2, 0), (1, 3)]
        assert "step 1" in stats[0]["released"]


# ---------------------------------------------------------------------------- in this process


def test_local_tier_prefetch_restored_onto_another_mesh(tmp_path, devices):
    """A local tier (one process): the prefetch reads the local step (whole arrays); the restore onto
    a 2x4 mesh takes each device's box from them."""
    save_steps(tmp_path / "local", [5, 7], local_tier=True)
    env = {"RESILAX_LOCAL_DIR": str(tmp_path / "local"), "RESILAX_CHECKPOINT_DIR": str(tmp_path / "persistent")}
    handle = prefetch.start_prefetch(env)
    assert handle is not None and (handle.step, handle.tier) == (7, "local")
    assert prefetch.start_prefetch(env) is handle, "idempotent"
    mesh = global_mesh([2, 4])
    specs = {"w": P("b", "a"), "b": P("b"), "e": P(None, "b")}
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, specs[k]))
                         for k, v in expected(0).items()}}
    with rc.CheckpointManager.from_env(env) as mgr:
        out = mgr.restore(mgr.restore_step_from_env(env, target=target), target=target)
    assert handle.stats()["taken_leaves"] == 3 and mgr.restored_from == "local"
    for name, value in expected(7).items():
        assert out["params"][name].sharding == target["params"][name].sharding
        np.testing.assert_array_equal(np.asarray(out["params"][name]), value)


def test_a_new_node_reads_the_persistent_tier_ahead(tmp_path, devices):
    """A replaced pod (one process) with an empty local tier: the prefetch reads the persistent tier's
    newest step, which the restore then reads from there."""
    save_steps(tmp_path / "persistent", [3, 4])
    env = {"RESILAX_LOCAL_DIR": str(tmp_path / "local"), "RESILAX_CHECKPOINT_DIR": str(tmp_path / "persistent")}
    handle = prefetch.start_prefetch(env)
    assert handle is not None and (handle.step, handle.tier) == (4, "persistent")
    with rc.CheckpointManager.from_env(env) as mgr:
        out = mgr.restore(mgr.restore_step_from_env(env))
    assert mgr.restored_from == "persistent" and handle.stats()["taken_leaves"] == 3
    for name, value in expected(4).items():
        assert out["params"][name].tobytes() == value.tobytes()


@pytest.mark.gcs
def test_a_gcs_persistent_tier_is_read_ahead_through_tensorstore(gcs_root, tmp_path, devices):
    """gs:// (tensorstore's reads, write-once attempts: no file check): read ahead, taken, bit-exact.
    With an object store the step is chosen on the prefetch's thread (start_prefetch returns at once);
    the test waits for the choice, as a trainer's JAX start-up does in effect."""
    mesh = global_mesh([4, 2])
    with rc.CheckpointManager(gcs_root, rc.ManagerOptions(async_save=False)) as mgr:
        mgr.save(6, {"params": make_state(6, mesh), "meta": {"step": 6}}, force=True)
    env = {"RESILAX_LOCAL_DIR": str(tmp_path / "local"), "RESILAX_CHECKPOINT_DIR": gcs_root}
    handle = prefetch.start_prefetch(env)
    assert handle is not None and handle.wait_chosen(60) and (handle.step, handle.tier) == (6, "persistent")
    with rc.CheckpointManager.from_env(env) as mgr:
        out = mgr.restore(mgr.restore_step_from_env(env))
    assert handle.stats()["taken_leaves"] == 3 and handle.stats()["error"] is None
    for name, value in expected(6).items():
        assert out["params"][name].tobytes() == value.tobytes()


UNANSWERED_CHILD = """
import json, sys
from resilax_ckpt.restoring import prefetch
from resilax_ckpt.storage import LocalStorage

handle = prefetch.start_prefetch()  # the trainer's first line
print(json.dumps({"returned": handle is not None}), flush=True)
sys.stdin.readline()  # the test holds the prefetch's connection now, unanswered
fill = prefetch.claim(LocalStorage(), sys.argv[1], 7)  # the restore reads the local tier's step 7
every = prefetch.reads_every_leaf()
prefetch.release()
print(json.dumps({"claimed": fill is not None, "every_leaf": every, "chosen": handle.wait_chosen(0),
                  "stats": handle.stats()}), flush=True)
"""


def test_an_object_store_that_never_answers_holds_neither_the_start_nor_the_restore(tmp_path):
    """The persistent tier is gs:// behind a real endpoint that accepts connections and never answers
    (a hung or black-holed GCS: this test holds it), the local tier has step 7. The trainer's first
    line returns while the prefetch's listing waits on that endpoint (it used to wait there: ~35-50 s
    of gcsfs retries for an unreachable one, for ever here); the restore of the local step then
    neither waits for the listing nor is handed anything: the prefetch, still choosing, is dropped.
    Proven by order: the endpoint has the prefetch's connection and never answers while the child
    claims and releases. The deadline only turns a hang (the old behaviour) into a failure."""
    save_steps(tmp_path / "local", [7], local_tier=True)
    step_path = str(tmp_path / "local" / "7")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RESILAX_", "JAX_", "STORAGE_EMULATOR"))}
    listener = socket.create_server(("127.0.0.1", 0))
    env.update(RESILAX_LOCAL_DIR=str(tmp_path / "local"), RESILAX_CHECKPOINT_DIR="gs://bucket/run",
               STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{listener.getsockname()[1]}",
               PYTHONPATH=str(ROOT / "ckpt_lib"))
    proc = subprocess.Popen([sys.executable, "-c", UNANSWERED_CHILD, step_path], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    held = []
    try:
        listener.settimeout(DEADLINE_S)
        held.append(listener.accept()[0])  # the prefetch's listing is under way; nothing answers it
        out, err = proc.communicate("go\n", timeout=DEADLINE_S)
    finally:
        proc.kill()
        for conn in (*held, listener):
            conn.close()
    assert proc.returncode == 0, err
    returned, restored = (json.loads(line) for line in out.splitlines())
    assert returned == {"returned": True}
    assert (restored["claimed"], restored["every_leaf"], restored["chosen"]) == (False, False, False)
    stats = restored["stats"]
    assert stats["step"] is None and stats["read_leaves"] == 0
    assert "the restore reads step 7" in stats["released"] and "had chosen no step yet" in stats["released"]


def test_the_restore_takes_leaves_while_later_ones_are_read(tmp_path, devices, monkeypatch):
    """One leaf per batch, and the restore starts at once: whichever leaves are read by then or later,
    each is taken as its read ends (or read by the restore when the prefetch ended without it), and
    the result is bit-exact."""
    monkeypatch.setattr(read_ahead, "BATCH_BYTES", 1)
    state = {f"l{i:02d}": np.arange(64 * 1024, dtype=np.float32) * (i + 1) for i in range(24)}
    with rc.CheckpointManager(str(tmp_path / "ckpt"), rc.ManagerOptions(async_save=False)) as mgr:
        mgr.save(1, {"params": state})
    env = {"RESILAX_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    handle = prefetch.start_prefetch(env)
    assert handle is not None
    with rc.CheckpointManager.from_env(env) as mgr:
        out = mgr.restore()
    assert handle.stats()["taken_leaves"] == 24 and handle.stats()["error"] is None
    for name, value in state.items():
        assert out["params"][name].tobytes() == value.tobytes(), name


def test_an_observer_that_raises_stops_nothing(tmp_path, devices):
    save_steps(tmp_path / "ckpt", [2])
    env = {"RESILAX_CHECKPOINT_DIR": str(tmp_path / "ckpt")}

    def broken(name, info):
        raise RuntimeError("observer bug")

    handle = prefetch.start_prefetch(env, on_event=broken)
    assert handle is not None and handle.wait(60)
    with rc.CheckpointManager.from_env(env) as mgr:
        out = mgr.restore()
    assert (handle.stats()["error"], handle.stats()["taken_leaves"]) == (None, 3)
    assert out["params"]["w"].tobytes() == expected(2)["w"].tobytes()


def test_jax_dtypes_are_read_ahead_before_jax_is_imported(tmp_path):
    """bfloat16 (and JAX's other ml_dtypes) are NumPy dtypes only once ml_dtypes is imported, which
    `import jax` does: the prefetch, before JAX, imports it itself."""
    import ml_dtypes

    value = (np.arange(4096, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16)
    with rc.CheckpointManager(str(tmp_path / "ckpt"), rc.ManagerOptions(async_save=False)) as mgr:
        mgr.save(3, {"params": {"w": value, "n": np.arange(5, dtype=np.int32)}})
    code = ("import json, sys; from resilax_ckpt.restoring import prefetch; h = prefetch.start_prefetch(); h.wait(); "
            "print(json.dumps({**h.stats(), 'jax': 'jax' in sys.modules}))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILAX_")}
    env.update(RESILAX_CHECKPOINT_DIR=str(tmp_path / "ckpt"), PYTHONPATH=str(ROOT / "ckpt_lib"))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    assert (stats["error"], stats["read_leaves"], stats["jax"]) == (None, 2, False)
    assert stats["read_bytes"] == value.nbytes + 5 * 4


def test_the_prefetch_module_does_not_import_jax():
    code = ("import sys; from resilax_ckpt import multihost; from resilax_ckpt.restoring import prefetch, read_ahead; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(ROOT / "ckpt_lib")})


def test_malformed_settings_are_named():
    with pytest.raises(InvalidOptionsError) as e:
        prefetch.PrefetchSettings.from_env({"RESILAX_RESTORE_PREFETCH": "maybe", "RESILAX_RESTORE_PREFETCH_MEMORY": "2",
                                            "RESILAX_RESTORE_STEP": "newest", "RESILAX_CHECKPOINT_DIR": "/x"})
    for name in ("RESILAX_RESTORE_PREFETCH='maybe'", "RESILAX_RESTORE_PREFETCH_MEMORY='2'", "RESILAX_RESTORE_STEP='newest'"):
        assert name in str(e.value)


@pytest.mark.parametrize(("env", "on"), [
    ({}, False),  # not configured as a worker
    ({"RESILAX_CHECKPOINT_DIR": "/c"}, True),
    ({"RESILAX_CHECKPOINT_DIR": "/c", "RESILAX_RESTORE_PREFETCH": "off"}, False),
    ({"RESILAX_CHECKPOINT_DIR": "/c", "RESILAX_RESTORE_STEP": "none"}, False),
], ids=["unconfigured", "on-by-default", "off", "no-restore"])
def test_when_it_is_on(env, on):
    assert (prefetch.PrefetchSettings.from_env(env) is not None) == on


# ---------------------------------------------------------------------------- pure choices


@pytest.mark.parametrize(("local", "persistent", "asked", "want"), [
    ([], [], None, None),
    ([10, 20], [], None, (20, "local")),
    ([10, 20], [], 10, (10, "local")),
    ([10, 20], [], 15, None),
    ([30], [10, 20], None, (30, "local")),
    ([20], [10, 20], None, (20, "local")),  # both hold it: the restore reads its own tier first
    ([10], [10, 20], None, (20, "persistent")),
    ([], [10, 20], 10, (10, "persistent")),
], ids=["nothing", "newest", "pinned", "pinned-missing", "local-newer", "both", "persistent-newer",
        "pinned-persistent"])
def test_decide_prefetch_step(local, persistent, asked, want):
    assert restore_choice.decide_prefetch_step(local, persistent, asked) == want


def _leaf(shape, chunks, shard=()):
    return LeafMetadata(keystr="['x']", path=[["d", "x"]], kind="array", dir="0", shape=shape, dtype="float32",
                        chunks=chunks, shard=shard)


def test_plan_leaf_boxes():
    leaf = _leaf((8, 6), (4, 3))
    whole = [((0, 8), (0, 6))]
    assert read_ahead.plan_leaf_boxes(leaf, True, None) == whole  # one process, a shared folder
    assert read_ahead.plan_leaf_boxes(leaf, False, None) == []  # several: which chunks is not known yet
    files = chunk_format.ArrayFiles.of(leaf)
    mine = {files.locate((0, 1))[0], files.locate((1, 1))[0]}
    # a local tier: the chunks of the files this host holds; all of them, as one box, for one process
    assert read_ahead.plan_leaf_boxes(leaf, False, lambda key: key in mine) == [((0, 4), (3, 6)), ((4, 8), (3, 6))]
    assert read_ahead.plan_leaf_boxes(leaf, True, lambda key: key in mine) == [((0, 4), (3, 6)), ((4, 8), (3, 6))]
    assert read_ahead.plan_leaf_boxes(leaf, True, lambda key: True) == whole
    assert read_ahead.plan_leaf_boxes(_leaf((0, 6), (4, 3)), True, None) == []


def test_plan_within_memory():
    assert read_ahead.plan_within_memory([4, 4, 4], 8) == 2
    assert read_ahead.plan_within_memory([9, 1], 8) == 0
    assert read_ahead.plan_within_memory([], 8) == 0


def test_find_box():
    whole = np.arange(48, dtype=np.float32).reshape(8, 6)
    held = {((0, 8), (0, 6)): whole}
    assert read_ahead.find_box(held, ((0, 8), (0, 6))) is whole
    part = read_ahead.find_box(held, ((4, 8), (3, 6)))
    assert part is not None and part.tobytes() == whole[4:8, 3:6].tobytes()
    assert read_ahead.find_box({((0, 4), (0, 6)): whole[:4]}, ((2, 6), (0, 6))) is None


def test_the_prefetch_faults_its_buffers_in_before_reading_into_them(tmp_path, devices, monkeypatch):
    """No page of a prefetch buffer is first touched inside `read()` (on the gVisor TPU test host such
    faults stalled the trainer's start-up; docs/checkpointing.md): every buffer a read fills was
    populated first, here with `madvise(MADV_POPULATE_WRITE)` refused, as there, so page by page in
    user space. Proven by the order of calls (populate, then the reads into it), not by timing."""
    from resilax_ckpt.chunks import chunk_writer, file_reader, host_ring, staging

    state = {f"l{i}": np.arange(96 * 1024 + i * 999, dtype=np.float32) * (i + 1) for i in range(3)}
    with rc.CheckpointManager(str(tmp_path / "ckpt"), rc.ManagerOptions(async_save=False)) as mgr:
        mgr.save(2, {"params": state})
    refused = []

    def refusing_madvise():
        def madvise(addr, length, advice):
            if advice == host_ring.MADV_POPULATE_WRITE:
                refused.append(length)
                return -1
            return 0
        return madvise

    populated: list[tuple[int, int]] = []
    real_touch, real_read = host_ring.touch_pages, file_reader._preadv_exact
    unpopulated = []

    def touch(buf):
        populated.append((buf.ctypes.data, buf.ctypes.data + buf.nbytes))
        real_touch(buf)

    def read(fd, views, offset, path):
        for v in views:
            lo, hi = v.ctypes.data, v.ctypes.data + v.nbytes
            if v.nbytes > 4096 and not any(a <= lo and hi <= b for a, b in populated):
                unpopulated.append((path, v.nbytes))
        real_read(fd, views, offset, path)

    monkeypatch.setattr(staging, "libc_madvise", refusing_madvise)
    # Buffered reads, as from tmpfs (the local tier there); O_DIRECT reads go through reused staging buffers.
    monkeypatch.setattr(chunk_writer, "use_direct_io", lambda folder, wanted: False)
    monkeypatch.setattr(host_ring, "touch_pages", touch)
    monkeypatch.setattr(file_reader, "_preadv_exact", read)
    before = host_ring.host_buffer_counts()
    env = {"RESILAX_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    handle = prefetch.start_prefetch(env)
    assert handle is not None and handle.wait(60)
    stats = handle.stats()
    after = host_ring.host_buffer_counts()
    assert stats["read_leaves"] == 3 and stats["error"] is None
    assert refused and not unpopulated, unpopulated
    assert after["touched_bytes"] - before["touched_bytes"] >= stats["read_bytes"] > 0
    with rc.CheckpointManager.from_env(env) as mgr:
        out = mgr.restore()
    assert handle.stats()["taken_leaves"] == 3
    for name, value in state.items():
        assert out["params"][name].tobytes() == value.tobytes(), name


def test_no_host_ring_is_warmed_when_the_prefetch_holds_every_leaf(tmp_path, devices, monkeypatch):
    """On accelerators a manager warms the restore's host ring at its creation, unless the prefetch
    reads every leaf (the restore then reads none into the ring); with leaves left to the restore it does."""
    from resilax_ckpt.chunks import host_ring

    save_steps(tmp_path / "ckpt", [2])
    warmed: list[int] = []
    monkeypatch.setattr(host_ring, "ring_expected", lambda reuse: True)
    monkeypatch.setattr(host_ring, "warm_host_ring", lambda nbytes: warmed.append(nbytes))
    env = {"RESILAX_CHECKPOINT_DIR": str(tmp_path / "ckpt")}
    handle = prefetch.start_prefetch(env)
    assert handle is not None and prefetch.reads_every_leaf()
    with rc.CheckpointManager.from_env(env) as mgr:
        mgr.restore(mgr.restore_step_from_env(env))
    assert warmed == [] and handle.stats()["taken_leaves"] == 3
    prefetch.stop()
    monkeypatch.setattr(read_ahead, "plan_within_memory", lambda sizes, limit: 1)  # two leaves left
    handle = prefetch.start_prefetch(env)
    assert handle is not None and handle.stats()["left_to_restore"] == 2 and not prefetch.reads_every_leaf()
    with rc.CheckpointManager.from_env(env) as mgr:
        mgr.restore(mgr.restore_step_from_env(env))
    assert len(warmed) == 1


@pytest.mark.parametrize(("platforms", "ring"), [("tpu", True), ("cpu", False), ("", False)])
def test_accelerator_expected_without_importing_jax(platforms, ring):
    assert prefetch.accelerator_expected({"JAX_PLATFORMS": platforms}) is ring  # "": no TPU/CUDA plugin here


def test_a_local_tier_in_memory_on_accelerators_warms_the_ring_instead_of_reading_ahead(devices):
    """The local tier on tmpfs with accelerators expected: nothing is read ahead (the state is in memory
    already); the prefetch thread faults in the host ring, sized as the restore sizes it (its set size
    or the two largest leaves when bigger), and the restore then reads through that ring, allocating nothing.
    RESILAX_RESTORE_PREFETCH=read reads ahead as elsewhere."""
    from resilax_ckpt.chunks import host_ring

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    folder = Path("/dev/shm") / f"resilax-test-ring-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)
    try:
        state = {f"l{i}": np.arange(8192 * (i + 1), dtype=np.float32) * (i + 1) for i in range(3)}
        with rc.CheckpointManager(str(folder), rc.ManagerOptions(async_save=False)) as mgr:
            mgr.save(4, {"params": state})
        env = {"RESILAX_CHECKPOINT_DIR": str(folder), "JAX_PLATFORMS": "tpu"}
        host_ring.release_host_buffers()
        handle = prefetch.start_prefetch(env)
        assert handle is not None and handle.wait(60)
        stats = handle.stats()
        assert stats["read_leaves"] == 0 and stats["left_to_restore"] == 3 and stats["error"] is None
        ring = stats["ring_bytes"]
        assert ring == (32 + 64 + 96) * 1024  # the default 512 MiB, as the restore caps it: the whole state
        before = host_ring.host_buffer_counts()
        assert host_ring.warm_host_ring(ring) is None  # warmed already, of that size
        options = rc.ManagerOptions(restore_reuse_host_buffers=True)
        with rc.CheckpointManager(str(folder), options) as mgr:
            out = mgr.restore(4, {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                                      sharding=jax.sharding.SingleDeviceSharding(devices[0]))
                                             for k, v in state.items()}})
        assert host_ring.host_buffer_counts()["allocations"] == before["allocations"]  # the prefetch's ring
        assert handle.stats()["taken_leaves"] == 0
        for name, value in state.items():
            assert np.asarray(out["params"][name]).tobytes() == value.tobytes(), name
        prefetch.stop()
        handle = prefetch.start_prefetch({**env, "RESILAX_RESTORE_PREFETCH": "read"})
        assert handle is not None and handle.wait(60)
        assert handle.stats()["read_leaves"] == 3 and handle.stats()["ring_bytes"] == 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
