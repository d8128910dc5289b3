"""Saves under a training step that donates its state (issue 37): after `save()` returns, the step may
delete every array it was given, so a save never reads a donated buffer later. Both ways of taking
the shards off the devices run here on CPU devices, forced by `ManagerOptions.device_copy` (the same
code as on an accelerator), and `auto`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import resilax_ckpt as rc
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt.chunks.sources import HostBudget
from resilax_ckpt.options import InvalidOptionsError
from resilax_ckpt.saving import copy_choice as choice
from resilax_ckpt.saving import device_snapshot as snap
from resilax_ckpt.saving import drain, host_layout

STEPS = 6


def initial_state(devices: list[jax.Device]) -> dict[str, jax.Array]:
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(4, 2), ("a", "b"))
    rng = np.random.default_rng(7)
    return {
        "w": jax.device_put(rng.standard_normal((64, 32), dtype=np.float32), NamedSharding(mesh, P("a", "b"))),
        "b": jax.device_put(rng.standard_normal((32,), dtype=np.float32), NamedSharding(mesh, P("b"))),
        "replicated": jax.device_put(np.arange(40, dtype=np.int32).reshape(8, 5), NamedSharding(mesh, P())),
        "bf16": jax.device_put(rng.standard_normal((16, 8)).astype(jnp.bfloat16), NamedSharding(mesh, P("a"))),
    }


def changed(state: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Every value changed (any leaf beyond the four: doubled)."""
    return {**{k: v * 2 for k, v in state.items()},
            "w": state["w"] * 1.5 + 1.0, "b": state["b"] - 0.25, "replicated": state["replicated"] * 3 + 1,
            "bf16": state["bf16"] * 2 + 1}


train_step = jax.jit(changed, donate_argnums=0)
"""A training step that writes over its donated state."""


def run_loop(root: str, devices: list[jax.Device], device_copy: str) -> dict[int, dict[str, np.ndarray]]:
    """A loop that saves every step (async) and then donates the saved state to its next step; what
    each step held, taken before it was saved (the test's own copy, outside the library)."""
    expected: dict[int, dict[str, np.ndarray]] = {}
    state = initial_state(devices)
    opts = rc.ManagerOptions(device_copy=device_copy, async_save=True)
    with rc.CheckpointManager(root, opts) as mgr:
        for step in range(1, STEPS + 1):
            expected[step] = {k: np.array(v, copy=True) for k, v in state.items()}
            assert mgr.save(step, {"state": state})
            report = mgr.save_report
            assert report is not None and report["step"] == step
            assert report["device_copy"] == (choice.ON_DEVICE if device_copy in ("auto", "on_device")
                                             else choice.HOST_TRANSFER)
            old = state
            state = train_step(state)  # donates: the saved arrays are deleted now
            assert all(a.is_deleted() for a in old.values()), "the step did not donate the saved state"
            del old
        mgr.wait()
        assert mgr.steps() == list(range(1, STEPS + 1))
    return expected


@pytest.mark.parametrize(("device_copy", "as_accelerator", "drain_bytes"), [
    ("on_device", False, None), ("host_transfer", False, None), ("auto", False, None),
    ("on_device", True, None),  # the accelerator's drain thread, two transfers in flight
    ("on_device", True, 1),  # and its back-pressure at every shard: the chunk writer gives the bytes back
    ("host_transfer", True, None),
])
def test_donating_loop_restores_every_saved_step_bit_exact(tmp_path, devices, device_copy, as_accelerator, drain_bytes,
                                                           monkeypatch):
    budgets: list[HostBudget] = []
    if as_accelerator:
        monkeypatch.setenv(snap.FORCE_ACCELERATOR_ENV, "1")
        monkeypatch.setattr(drain, "DRAIN_WINDOW", 2)
    if drain_bytes is not None:
        class Recorded(HostBudget):
            def __init__(self, limit):
                super().__init__(limit)
                budgets.append(self)
        monkeypatch.setattr(drain, "DRAIN_HOST_BYTES", drain_bytes)
        monkeypatch.setattr(snap, "HostBudget", Recorded)
    expected = run_loop(str(tmp_path), devices, device_copy)
    if drain_bytes is not None:
        assert len(budgets) == STEPS
        assert all(b.held == 0 for b in budgets)  # every landed byte given back once written
        assert all(0 < b.peak <= max(a.nbytes for a in expected[1].values()) for b in budgets)  # one shard at most
    assert not np.array_equal(expected[1]["w"], expected[2]["w"])  # the state really changes
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(2, 4), ("x", "y"))
    with rc.CheckpointManager(str(tmp_path)) as mgr:
        for step, want in expected.items():
            target = {"state": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
                                for k, v in want.items()}}
            got = mgr.restore(step, target)["state"]
            for key, value in want.items():
                restored = np.asarray(got[key])
                assert restored.dtype == value.dtype
                assert restored.tobytes() == value.tobytes(), f"step {step}, leaf {key}"


def test_reports_the_path_and_its_device_bytes(tmp_path, devices):
    state = initial_state(devices)
    saved_bytes = sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize * len(a.sharding.device_set)
                      for a in state.values())
    with rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(device_copy="on_device")) as mgr:
        mgr.save(1, {"state": state})
        mgr.wait()
        report = mgr.save_report
    assert report is not None
    assert (report["device_copy"], report["reason"], report["platform"]) == ("on_device", "forced", "cpu")
    assert report["device_bytes"] == saved_bytes  # every device's copy, replicas included
    assert report["blocked_seconds"] >= 0 and report["transfer_seconds"] is not None
    with rc.CheckpointManager(str(tmp_path / "h"), rc.ManagerOptions(device_copy="host_transfer")) as mgr:
        mgr.save(1, {"state": state})
        report = mgr.save_report
    assert report is not None and (report["device_copy"], report["device_bytes"]) == ("host_transfer", 0)
    assert report["transfer_seconds"] is not None  # the loop waited for the transfers


def test_device_copy_option_is_validated():
    with pytest.raises(InvalidOptionsError, match="device_copy: 'gpu' must be one of 'auto', 'on_device', 'host_transfer'"):
        rc.ManagerOptions(device_copy="gpu")
    with pytest.raises(InvalidOptionsError, match="device_copy: 'sideways'"):
        rc.ManagerOptions.from_env({"RESILAX_DEVICE_COPY": "sideways"})
    assert rc.ManagerOptions.from_env({"RESILAX_DEVICE_COPY": "Host_Transfer"}).device_copy == "host_transfer"


GIB = 1 << 30


@pytest.mark.parametrize(("option", "platform", "room", "need", "largest", "want"), [
    ("host_transfer", "tpu", {}, {0: GIB}, {0: GIB}, ("host_transfer", "forced")),
    ("on_device", "tpu", {0: None}, {0: GIB}, {0: GIB}, ("on_device", "forced")),
    ("auto", "cpu", {}, {0: GIB}, {0: GIB}, ("on_device", "cpu")),
    ("auto", "tpu", {0: None}, {0: GIB}, {0: GIB}, ("host_transfer", "no memory statistics")),
    # 16 GiB, 2 GiB in use, peak 4 GiB: 2 GiB of copies fit with the margin (0.8 GiB)
    ("auto", "tpu", {0: choice.DeviceRoom(16 * GIB, 2 * GIB, 4 * GIB)}, {0: 2 * GIB}, {0: GIB},
     ("on_device", "room")),
    # the peak (the step's temporaries) leaves too little
    ("auto", "tpu", {0: choice.DeviceRoom(16 * GIB, 2 * GIB, 14 * GIB)}, {0: 2 * GIB}, {0: GIB},
     ("host_transfer", "no room")),
    # room in total, but one device of two is short
    ("auto", "tpu", {0: choice.DeviceRoom(16 * GIB, 2 * GIB), 1: choice.DeviceRoom(16 * GIB, 15 * GIB)},
     {0: GIB, 1: GIB}, {0: GIB, 1: GIB}, ("host_transfer", "no room")),
    # fragmented: the largest copy does not fit the largest free block
    ("auto", "tpu", {0: choice.DeviceRoom(16 * GIB, 2 * GIB, 2 * GIB, GIB // 2)}, {0: 2 * GIB}, {0: GIB},
     ("host_transfer", "no room")),
])
def test_choose_device_copy(option, platform, room, need, largest, want):
    assert choice.choose_device_copy(option, platform, room, need, largest) == want


def test_a_first_save_on_an_accelerator_does_not_compile_the_copy_in_the_loop():
    """auto: before the jitted copy is compiled, a runtime copy where there is room (the saver
    compiles the jitted one in the background), a host transfer where there is not."""
    roomy = {0: choice.DeviceRoom(16 * GIB, 2 * GIB)}
    assert choice.choose_device_copy("auto", "tpu", roomy, {0: GIB}, {0: GIB}, compiled=False) == (
        "on_device", choice.NOT_COMPILED)
    full = {0: choice.DeviceRoom(16 * GIB, 15 * GIB)}
    assert choice.choose_device_copy("auto", "tpu", full, {0: GIB}, {0: GIB}, compiled=False) == (
        "host_transfer", "no room")
    assert choice.choose_device_copy("on_device", "tpu", roomy, {0: GIB}, {0: GIB}, compiled=False) == (
        "on_device", "forced")
    assert choice.choose_device_copy("auto", "cpu", {}, {0: GIB}, {0: GIB}, compiled=False) == ("on_device", "cpu")
    assert choice.plan_runtime_copy("on_device", "tpu", compiled=False)
    assert not choice.plan_runtime_copy("on_device", "tpu", compiled=True)
    assert not choice.plan_runtime_copy("on_device", "cpu", compiled=False)  # CPU: the jit compiles fast
    assert not choice.plan_runtime_copy("host_transfer", "tpu", compiled=False)


def test_auto_on_an_accelerator_starts_with_a_runtime_copy_then_the_jitted_one(tmp_path, devices, monkeypatch):
    """The accelerator's choices on CPU devices (the test-only RESILAX_CKPT_FORCE_ACCELERATOR_PATH):
    the first save takes a runtime copy (device_put, nothing compiled; the jitted copy compiles in
    the background, and a save does not wait for it: `wait()` does) and the step after it donates
    the saved arrays; later saves take the jitted copy while the memory statistics leave room and a
    host transfer when they say nothing; every step restores bit-exact."""
    monkeypatch.setenv(snap.FORCE_ACCELERATOR_ENV, "1")
    compiles = []
    real_compile = snap.compile_copies
    monkeypatch.setattr(snap, "compile_copies", lambda signature: (compiles.append(1), real_compile(signature)))
    state = initial_state(devices)
    state = {k: v + 0 for k, v in state.items()}  # fresh shardings' arrays: a signature no test compiled
    state["extra"] = jax.device_put(np.ones((24, 8), np.float32), state["w"].sharding)  # a new signature
    rooms: list[choice.DeviceRoom | None] = [choice.DeviceRoom(16 * GIB, 0)]
    monkeypatch.setattr(snap, "device_room", lambda device: rooms[0])
    paths = []
    expected = {}
    with rc.CheckpointManager(str(tmp_path)) as mgr:
        for step in range(1, 5):
            if step == 4:
                rooms[0] = None  # a device without memory statistics
            expected[step] = {k: np.array(v, copy=True) for k, v in state.items()}
            mgr.save(step, {"state": state})
            report = mgr.save_report
            assert report is not None
            paths.append((report["device_copy"], report["reason"], report["runtime_copy"]))
            old = state
            state = train_step(state)
            assert all(a.is_deleted() for a in old.values()), "the step did not donate the saved state"
            del old
            mgr.wait()  # also waits for the copy's compile, which the first save started
        mgr.wait()
        for step, want in expected.items():
            got = mgr.restore(step)["state"]
            for key, value in want.items():
                assert np.asarray(got[key]).tobytes() == value.tobytes(), f"step {step}, leaf {key}"
    assert paths == [("on_device", choice.NOT_COMPILED, True), ("on_device", "room", False),
                     ("on_device", "room", False), ("host_transfer", "no memory statistics", False)]
    assert compiles == [1]  # compiled once, in the background, after the first save


class FakeShard:
    """A device shard whose transfer to the host is recorded (`events`), as `drain.drain` uses one."""

    def __init__(self, n: int, events: list[tuple[str, int]], nbytes: int = 4) -> None:
        self.n = n
        self.events = events
        self.nbytes = nbytes

    def copy_to_host_async(self) -> None:
        self.events.append(("start", self.n))

    def __array__(self, dtype=None, copy=None):
        self.events.append(("land", self.n))
        return np.full(1, self.n, np.int32)


@pytest.mark.parametrize("window", [1, 2, 4, 50])
def test_drain_lands_in_write_order_with_a_window_of_transfers(window, monkeypatch):
    """The drain never starts every transfer at once (on a TPU v5e that burst held the GIL 0.23 s and
    slowed the loop's steps 7-14x): at most `DRAIN_WINDOW` are in flight, landed in write order."""
    import threading

    from resilax_ckpt.chunks.sources import Landing
    monkeypatch.setattr(drain, "DRAIN_WINDOW", window)
    events: list[tuple[str, int]] = []
    landed = threading.Condition()
    landings = [Landing(landed) for _ in range(10)]
    shards = {(n, "d"): FakeShard(n, events) for n in range(10)}
    drain.drain([(landing, (n, "d")) for n, landing in enumerate(landings)], shards,
                HostBudget(drain.DRAIN_HOST_BYTES))
    assert [int(landing.get()[0]) for landing in landings] == list(range(10))
    assert [n for kind, n in events if kind == "land"] == list(range(10))
    started: set[int] = set()
    for kind, n in events:
        if kind == "start":
            started.add(n)
        else:
            in_flight = {m for m in started if m >= n} | {n}  # np.asarray transfers n itself if not started
            assert in_flight == set(range(n, min(n + window, 10))), events  # a full window, never more
    assert started == (set() if window == 1 else set(range(10)))


class FreedShard(FakeShard):
    """A FakeShard that records, when its last reference goes, the thread that dropped it."""

    def __init__(self, n: int, events: list[tuple[str, int]], freed: dict[int, str], nbytes: int = 4) -> None:
        super().__init__(n, events, nbytes)
        self.freed = freed

    def __del__(self) -> None:
        import threading
        self.freed[self.n] = threading.current_thread().name


def test_drain_frees_each_landed_shard_on_the_freeing_thread_before_it_returns():
    """Dropping a landed copy's device buffer cost the drain thread 0.27 s of 0.85 s on a TPU v5e
    (2.03 GiB, 154 leaves): the drain hands each landed shard to the freeing thread, which drops its
    last reference, and the drain returns only once every shard is freed (so the next save's room
    check sees the device memory free)."""
    import threading

    from resilax_ckpt.chunks.sources import Landing
    events: list[tuple[str, int]] = []
    freed: dict[int, str] = {}
    landed = threading.Condition()
    landings = [Landing(landed) for _ in range(12)]
    shards = {(n, "d"): FreedShard(n, events, freed) for n in range(12)}
    drain.drain([(landing, (n, "d")) for n, landing in enumerate(landings)], shards,
                HostBudget(drain.DRAIN_HOST_BYTES))
    assert freed == {n: "resilax-free" for n in range(12)}  # all of them, none on the drain's thread
    assert [int(landing.get()[0]) for landing in landings] == list(range(12))


def test_the_freeing_thread_runs_a_young_collection_every_reclaim_bytes():
    """jaxlib gives a TPU shard's host copy back only in its gc callback (on a TPU v5e a save's RSS grew
    by the whole state without one): the freeing thread runs `gc.collect(0)` every RECLAIM_BYTES of
    landed shards, on its own thread. Automatic collections are off here, so each one counted is ours."""
    import gc
    import threading

    from resilax_ckpt.chunks.sources import Landing
    collections: list[tuple[int, str]] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append((info["generation"], threading.current_thread().name))

    events: list[tuple[str, int]] = []
    freed: dict[int, str] = {}
    landings = [Landing(threading.Condition()) for _ in range(12)]
    shards = {(n, "d"): FreedShard(n, events, freed, nbytes=drain.RECLAIM_BYTES // 2) for n in range(12)}
    budget = HostBudget(drain.DRAIN_HOST_BYTES)
    budget.close()  # no writer gives bytes back here: the bound is not what this test is about
    was_enabled = gc.isenabled()
    gc.disable()
    gc.callbacks.append(record)
    try:
        drain.drain([(landing, (n, "d")) for n, landing in enumerate(landings)], shards, budget)
    finally:
        gc.callbacks.remove(record)
        if was_enabled:
            gc.enable()
    assert collections == [(0, "resilax-free")] * 6, collections  # 12 half-RECLAIM_BYTES shards
    assert len(freed) == 12


SHARD_BYTES = [30, 10, 40, 10, 50, 90, 20, 60, 50, 30, 10, 10, 10, 40]
"""A save's shards for the back-pressure tests: one (90) larger than their bound (64)."""


@pytest.mark.parametrize("window", [1, 2, 4, 50])
def test_drain_waits_for_the_writer_while_landed_bytes_exceed_its_bound(window, monkeypatch):
    """Back-pressure (DRAIN_HOST_BYTES): under a writer that writes (releases) a shard only when the
    drain cannot go on without it, the bytes landed on the host and not yet written never exceed
    the bound plus one shard, every shard still lands, in write order, and the window still starts
    transfers ahead where they fit. Counted, never timed: the fake writer is told when the drain
    waits (a budget that records it)."""
    import collections
    import threading

    from resilax_ckpt.chunks.sources import Landing

    class WatchedBudget(HostBudget):
        """Records that the drain waits in `take` (so the slow writer knows it must write one)."""

        stuck = False
        taking = False

        def take(self, nbytes):
            with self._cond:
                self.taking = True
                try:
                    super().take(nbytes)
                finally:
                    self.taking = False

        def _fits(self, nbytes):
            fits = super()._fits(nbytes)
            if not fits and self.taking:
                self.stuck, self.waits = True, getattr(self, "waits", 0) + 1
                self._cond.notify_all()
            return fits

    monkeypatch.setattr(drain, "DRAIN_WINDOW", window)
    limit, count = 64, len(SHARD_BYTES)
    budget = WatchedBudget(limit)
    cond = budget._cond  # the landings share it, so the writer wakes on a landing as on a wait
    events: list[tuple[str, int]] = []
    landings = [Landing(cond) for _ in range(count)]
    unwritten = {"now": 0, "max": 0}

    class CountedShard(FakeShard):
        def __array__(self, dtype=None, copy=None):
            with cond:
                unwritten["now"] += self.nbytes
                unwritten["max"] = max(unwritten["max"], unwritten["now"])
            return super().__array__(dtype, copy)

    shards = {(n, "d"): CountedShard(n, events, size) for n, size in enumerate(SHARD_BYTES)}
    drained = []
    got: list[int] = []

    def slow_writer():
        pending: collections.deque[int] = collections.deque()
        k = 0
        with cond:
            while k < count or pending:
                cond.wait_for(lambda k=k: (k < count and landings[k].landed) or bool(pending and (budget.stuck or drained)))
                if k < count and landings[k].landed:
                    got.append(int(landings[k].get()[0]))
                    pending.append(k)
                    k += 1
                    continue
                budget.stuck = False
                done = pending.popleft()
                unwritten["now"] -= SHARD_BYTES[done]
                landings[done].release()

    writer = threading.Thread(target=slow_writer)
    writer.start()
    drain.drain([(landing, (n, "d")) for n, landing in enumerate(landings)], shards, budget)
    with cond:
        drained.append(True)
        cond.notify_all()
    writer.join()
    assert got == list(range(count))
    assert [n for kind, n in events if kind == "land"] == list(range(count))
    assert unwritten["max"] <= limit + max(SHARD_BYTES), unwritten
    assert budget.peak <= max(limit, max(SHARD_BYTES))  # in flight + landed, never written yet
    assert budget.held == 0 and unwritten["now"] == 0
    assert getattr(budget, "waits", 0) > 0  # the bound did hold the drain back
    started = [n for kind, n in events if kind == "start"]
    assert (started == []) if window == 1 else (len(started) > 0)
    for kind, n in events:  # never more than the window in flight
        if kind == "start":
            landed = sum(1 for k2, _ in events[:events.index((kind, n))] if k2 == "land")
            assert n < landed + window


def test_a_closed_budget_never_holds_the_drain_back():
    """A save whose writes ended (failed) closes its budget: the drain lands the rest without a
    writer giving bytes back (else it would wait for ever, holding the device copies)."""
    import threading

    from resilax_ckpt.chunks.sources import Landing
    budget = HostBudget(1)
    budget.close()
    events: list[tuple[str, int]] = []
    landings = [Landing(threading.Condition()) for _ in SHARD_BYTES]
    shards = {(n, "d"): FakeShard(n, events, size) for n, size in enumerate(SHARD_BYTES)}
    drain.drain([(landing, (n, "d")) for n, landing in enumerate(landings)], shards, budget)
    assert all(landing.landed for landing in landings)
    assert budget.held == sum(SHARD_BYTES)


class StatsDevice:
    """Something with `memory_stats()`, as a device has (a TPU's keys)."""

    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats


@pytest.mark.parametrize(("stats", "want"), [
    (None, None),  # CPU devices
    ({}, None),
    (RuntimeError("not implemented"), None),
    ({"bytes_limit": 0, "bytes_in_use": 0}, None),
    ({"bytes_limit": 16 * GIB, "bytes_in_use": GIB, "peak_bytes_in_use": 3 * GIB, "largest_free_block_bytes": 12 * GIB},
     choice.DeviceRoom(16 * GIB, GIB, 3 * GIB, 12 * GIB)),
    ({"bytes_limit": 16 * GIB, "bytes_in_use": GIB, "largest_free_block_bytes": 0},  # 0: not reported
     choice.DeviceRoom(16 * GIB, GIB, 0, None)),
])
def test_device_room_reads_memory_stats(stats, want):
    assert choice.device_room(StatsDevice(stats)) == want
    assert choice.device_room(jax.devices()[0]) is None  # CPU devices give no statistics


def test_drain_window_env_is_validated(monkeypatch):
    monkeypatch.setenv(drain.DRAIN_WINDOW_ENV, "1")
    assert drain.drain_window() == 1
    monkeypatch.setenv(drain.DRAIN_WINDOW_ENV, "0")
    with pytest.raises(ValueError, match="RESILAX_CKPT_DRAIN_WINDOW: '0' is not a positive integer"):
        drain.drain_window()
    monkeypatch.delenv(drain.DRAIN_WINDOW_ENV)
    assert drain.drain_window() == drain.DRAIN_WINDOW


def test_a_runtime_copy_that_fails_falls_back_to_a_host_transfer(tmp_path, devices, monkeypatch):
    """Should `jax.device_put` refuse a first save's copy (some sharding it cannot copy as is), the
    save takes a host transfer instead of failing, the jitted copy still compiles for the next save,
    and both steps restore bit-exact under the donating step."""
    monkeypatch.setenv(snap.FORCE_ACCELERATOR_ENV, "1")
    monkeypatch.setattr(snap, "device_room", lambda device: choice.DeviceRoom(16 * GIB, 0))

    def refuse(arrays):
        raise ValueError("cannot copy this sharding")

    monkeypatch.setattr(snap, "_runtime_copy", refuse)
    state = {k: v + 0 for k, v in initial_state(devices).items()}
    state["odd"] = jax.device_put(np.ones((40, 8), np.float32), state["w"].sharding)  # a signature of its own
    paths, expected = [], {}
    with rc.CheckpointManager(str(tmp_path)) as mgr:
        for step in (1, 2):
            expected[step] = {k: np.array(v, copy=True) for k, v in state.items()}
            mgr.save(step, {"state": state})
            report = mgr.save_report
            assert report is not None
            paths.append((report["device_copy"], report["reason"]))
            state = train_step(state)
            mgr.wait()
        for step, want in expected.items():
            got = mgr.restore(step)["state"]
            for key, value in want.items():
                assert np.asarray(got[key]).tobytes() == value.tobytes(), f"step {step}, leaf {key}"
    assert paths == [("host_transfer", choice.RUNTIME_COPY_FAILED), ("on_device", "room")]


def test_a_column_major_leaf_is_copied_row_major_when_asked(tmp_path, devices, monkeypatch):
    """A leaf whose device layout is column major (as the TPU v5e gives the bench's (52992, 1472)
    leaves, which then land with the device's order and bounce through a host transpose in the
    writer): with RESILAX_CKPT_ROW_MAJOR_COPY=1 the on-device copy, runtime and jitted, asks for
    row-major outputs, which land C-contiguous; a save of it writes no bounce and restores
    bit-exact. Without it the copy is the plain one (CPU devices give that the default, row-major,
    layout already: the bounce itself shows only on the chip)."""
    from jax.experimental.layout import Format, Layout
    from resilax_ckpt.chunks import chunk_writer
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    values = np.random.default_rng(3).standard_normal((256, 96), dtype=np.float32)
    column_major = jax.jit(lambda x: x * 1, out_shardings=Format(Layout(major_to_minor=(1, 0)), sharding))
    leaf = column_major(jax.device_put(values, sharding))
    assert tuple(leaf.format.layout.major_to_minor) == (1, 0)
    assert np.asarray(leaf).flags.f_contiguous and not np.asarray(leaf).flags.c_contiguous
    assert host_layout.row_major_formats([leaf]) is None  # not asked
    monkeypatch.setenv(snap.ROW_MAJOR_ENV, "1")
    assert host_layout.row_major_formats([jax.device_put(values, sharding)]) is None  # row major already
    for runtime in (True, False):
        (copy,), took_runtime = snap._copy([leaf], runtime, accelerator=True)
        assert took_runtime == runtime
        assert tuple(copy.format.layout.major_to_minor) == (0, 1)
        host = np.asarray(copy)
        assert host.flags.c_contiguous and host.tobytes() == values.tobytes()
    monkeypatch.setenv(snap.FORCE_ACCELERATOR_ENV, "1")
    before = chunk_writer.bounced_writes()["writes"]
    with rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(device_copy="on_device")) as mgr:
        for step in (1, 2):  # the first save's runtime copy, then the jitted copy
            assert mgr.save(step, {"state": {"w": leaf}})
            mgr.wait()
        assert chunk_writer.bounced_writes()["writes"] == before
        target = {"state": {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=sharding)}}
        for step in (1, 2):
            assert np.asarray(mgr.restore(step, target)["state"]["w"]).tobytes() == values.tobytes()
