"""Any pytree as a checkpoint: a flax TrainState with an optax state, typed PRNG keys, and
`from_env` outside a pod."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import resilax_ckpt as rc
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from resilax_ckpt import layout


def _train_state(devices, seed: int) -> train_state.TrainState:
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(4, 2), ("a", "b"))
    params = {"dense": {"kernel": jax.device_put(jnp.arange(32.0).reshape(8, 4) + seed,
                                                 NamedSharding(mesh, P("a", "b"))),
                        "bias": jnp.full((4,), float(seed))}}
    return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))


def test_manager_saves_and_restores_a_train_state_as_one_item(tmp_path, devices):
    state = _train_state(devices, 3)
    state = state.replace(step=7)
    with rc.CheckpointManager(str(tmp_path), rc.ManagerOptions(save_every_steps=1)) as mgr:
        assert mgr.save(1, state)  # due at once: no AttributeError on a non-mapping
        mgr.wait()
        abstract = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array) else x, state)
        restored = mgr.restore(target=abstract)
        assert isinstance(restored, train_state.TrainState)
        assert int(restored.step) == 7
        np.testing.assert_array_equal(restored.params["dense"]["kernel"], state.params["dense"]["kernel"])
        assert restored.params["dense"]["kernel"].sharding == state.params["dense"]["kernel"].sharding
        assert jax.tree_util.tree_structure(restored.opt_state) == jax.tree_util.tree_structure(state.opt_state)
        # Without a target: the named item "state", as nested dicts.
        raw = mgr.restore()
        assert list(raw) == ["state"]
        np.testing.assert_array_equal(raw["state"]["params"]["dense"]["bias"], np.full((4,), 3.0))


def test_typed_prng_keys_round_trip_with_their_sharding(tmp_path, devices):
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(4, 2), ("a", "b"))
    keys = jax.device_put(jax.random.split(jax.random.key(42), 8), NamedSharding(mesh, P("a")))
    rbg = jax.random.key(5, impl="rbg")
    path = str(tmp_path / "one")
    rc.save(path, {"rng": {"keys": keys, "rbg": rbg, "legacy": jax.random.PRNGKey(1)}})
    target = {"rng": {"keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=NamedSharding(mesh, P("b"))),
                      "rbg": jax.ShapeDtypeStruct(rbg.shape, rbg.dtype),
                      "legacy": jax.ShapeDtypeStruct((2,), jnp.uint32)}}
    out = rc.restore(path, target)["rng"]
    assert out["keys"].dtype == keys.dtype and out["rbg"].dtype == rbg.dtype
    assert out["keys"].sharding.spec == P("b")  # resharded onto the target's layout
    np.testing.assert_array_equal(jax.random.key_data(out["keys"]), jax.random.key_data(keys))
    np.testing.assert_array_equal(jax.random.key_data(out["rbg"]), jax.random.key_data(rbg))
    # The restored keys draw the same numbers.
    np.testing.assert_array_equal(jax.random.uniform(out["keys"][3]), jax.random.uniform(keys[3]))
    # Without a target too.
    plain = rc.restore(path)["rng"]
    assert plain["keys"].dtype == keys.dtype
    np.testing.assert_array_equal(jax.random.key_data(plain["keys"]), jax.random.key_data(keys))


def test_pytree_save_and_restore_without_a_manager(tmp_path, devices):
    state = _train_state(devices, 1)
    rc.save(str(tmp_path / "s"), state)
    out = rc.restore(str(tmp_path / "s"), target=state)
    assert isinstance(out, train_state.TrainState)
    np.testing.assert_array_equal(out.params["dense"]["bias"], np.ones(4))


def test_from_env_outside_a_pod_uses_a_local_folder_and_says_so(tmp_path, monkeypatch, caplog, devices):
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="resilax_ckpt.manager"), rc.CheckpointManager.from_env({}) as mgr:
        assert mgr.directory == str(tmp_path / "resilax-checkpoints")
        mgr.save(1, {"x": np.arange(3)}, force=True)
    assert (tmp_path / "resilax-checkpoints" / layout.step_name(1)).is_dir()
    assert "RESILAX_CHECKPOINT_DIR is not set" in caplog.text
    assert str(tmp_path / "resilax-checkpoints") in caplog.text
