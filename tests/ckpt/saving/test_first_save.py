"""A job's first save on an accelerator (issue 37): a trainer that starts as Resilax's does
(examples/transformer.py: `restore_step_from_env(target=...)` before it makes its state) has the
save's on-device copy compiled in the background by then, so its first save takes the jitted copy,
not the runtime copy the next donating step waits for. On CPU devices through the test-only
RESILAX_CKPT_FORCE_ACCELERATOR_PATH, counted (which path, how many compiles), not timed."""

from __future__ import annotations

import jax
import numpy as np
import resilax_ckpt as rc
from jax._src import test_util as jtu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt import items as items_lib
from resilax_ckpt.saving import copy_choice as choice
from resilax_ckpt.saving import device_snapshot as snap
from test_donation import GIB, initial_state, train_step


def fresh_state(devices) -> dict[str, jax.Array]:
    state = {k: v + 0 for k, v in initial_state(devices).items()}
    # a shape no other test saves: a signature nothing compiled yet in this process
    state["first"] = jax.device_put(np.ones((24, 40), np.float32), state["w"].sharding)
    return state


def abstract(state: dict[str, jax.Array]) -> dict[str, jax.ShapeDtypeStruct]:
    """The state's shapes, each sharding spelled with every dimension named (`P("a", None)` for
    `P("a")`): the same sharding to the compiler, another object to jit's cache."""
    def spelled(s: NamedSharding, ndim: int) -> NamedSharding:
        return NamedSharding(s.mesh, P(*s.spec, *[None] * (ndim - len(s.spec))))

    return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=spelled(v.sharding, v.ndim)) for k, v in state.items()}


def test_a_target_of_shapes_gives_the_signature_the_arrays_give(devices):
    state = fresh_state(devices)
    kw = {"process_index": 0, "process_count": 1, "local_tier": False}
    real = items_lib.copy_signature({"state": state}, **kw)
    shapes = items_lib.copy_signature({"state": abstract(state), "meta": {"step": 0}}, **kw)
    assert [snap._group_key(g) for g in shapes] == [snap._group_key(g) for g in real]
    # several processes writing replica 0 each: which arrays this one writes is not known from shapes
    assert items_lib.copy_signature({"state": abstract(state)}, **{**kw, "process_count": 2}) == []


def test_a_job_started_as_resilax_starts_it_takes_the_compiled_copy_at_its_first_save(tmp_path, devices,
                                                                                      monkeypatch):
    monkeypatch.setenv(snap.FORCE_ACCELERATOR_ENV, "1")
    monkeypatch.setattr(snap, "device_room", lambda device: choice.DeviceRoom(16 * GIB, 0))
    compiles = []
    real_compile = snap.compile_copies
    monkeypatch.setattr(snap, "compile_copies", lambda signature: (compiles.append(1), real_compile(signature)))
    made = fresh_state(devices)
    with rc.CheckpointManager(str(tmp_path)) as mgr:
        # the trainer's start: nothing to restore; the target's shapes start the copy's compile
        assert mgr.restore_step_from_env({}, target={"state": abstract(made), "meta": {"step": 0}}) is None
        mgr.wait()  # the compile, done while the job made its state
        assert compiles == [1]
        state = train_step(made)
        want = {k: np.array(v, copy=True) for k, v in state.items()}
        with jtu.count_jit_compilation_cache_miss() as misses:
            mgr.save(1, {"state": state, "meta": {"step": 1}})
        assert misses() == 0  # the executable compiled ahead took the step's arrays: no compile in the loop
        report = mgr.save_report
        assert report is not None
        assert (report["device_copy"], report["reason"], report["runtime_copy"]) == ("on_device", "room", False)
        old, state = state, train_step(state)
        assert all(a.is_deleted() for a in old.values())  # the step after the save donated the saved arrays
        mgr.wait()
        got = mgr.restore(1)["state"]
        for key, value in want.items():
            assert np.asarray(got[key]).tobytes() == value.tobytes(), key
    assert compiles == [1]  # nothing compiled again at the save or after it


def test_a_restore_step_to_read_leaves_the_compile_to_the_restore(tmp_path, devices, monkeypatch):
    """With a step to restore, `restore_step_from_env` compiles nothing (the restore does, from what it
    returns: its reads are not slowed by a compile beside them)."""
    monkeypatch.setenv(snap.FORCE_ACCELERATOR_ENV, "1")
    compiles = []
    monkeypatch.setattr(snap, "compile_copies", lambda signature: compiles.append(1))
    with rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(device_copy="host_transfer")) as mgr:
        mgr.save(3, {"state": initial_state(devices)})
        mgr.wait()
    with rc.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.restore_step_from_env({}, target={"state": abstract(initial_state(devices))}) == 3
        mgr.wait()
        assert compiles == []


def test_an_executable_that_refuses_the_arrays_is_forgotten_and_no_compile_happens_in_the_loop(devices,
                                                                                               monkeypatch):
    """Compiled ahead for something these arrays turn out not to be (other device layouts, say): on an
    accelerator the save takes the runtime copy (the saver then compiles for the arrays themselves),
    on CPU devices jit's copy; either way the executable is forgotten and the copy is right."""
    state = fresh_state(devices)
    group = [state["first"], state["w"]]

    def refuse(arrays):
        raise ValueError("Computation was compiled for input shardings that disagree with the arguments")

    for accelerator in (True, False):
        key = snap._group_key(group)
        monkeypatch.setitem(snap._COMPILED, key, refuse)
        made, runtime = snap._copy(group, False, accelerator)
        assert runtime == accelerator
        assert key not in snap._COMPILED
        for copy, original in zip(made, group, strict=True):
            assert np.asarray(copy).tobytes() == np.asarray(original).tobytes()
