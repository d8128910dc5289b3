"""restore_orbax against checkpoints written by real orbax-checkpoint (in a separate process, on a
4x2 mesh): StandardCheckpointer with and without OCDBT, CheckpointManager roots with one item and
with named items, a flax TrainState; resharding onto a different mesh."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import resilax_ckpt as rc
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

WRITER = textwrap.dedent("""
    import os, sys
    import jax, jax.numpy as jnp, numpy as np, optax
    import orbax.checkpoint as ocp
    from flax.training import train_state
    from jax.sharding import NamedSharding, PartitionSpec as P
    root = sys.argv[1]
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    w = jax.device_put(jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8), NamedSharding(mesh, P("a", "b")))
    tree = {"params": {"w": w, "b": jnp.arange(3, dtype=jnp.bfloat16)}, "step": 5, "lst": [jnp.zeros(2), 3.5]}
    with ocp.StandardCheckpointer() as ck:
        ck.save(os.path.join(root, "std"), tree)
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False)).save(os.path.join(root, "plain"), tree)
    with ocp.CheckpointManager(os.path.join(root, "mgr")) as mgr:
        for step in (3, 4):
            mgr.save(step, args=ocp.args.StandardSave(jax.tree_util.tree_map(lambda x: x + step, tree)))
    with ocp.CheckpointManager(os.path.join(root, "named"), item_names=("state", "extra")) as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                             extra=ocp.args.JsonSave({"epoch": 2})))
    params = {"dense": {"kernel": w, "bias": jnp.ones(8)}}
    ts_ = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3)).replace(step=11)
    with ocp.CheckpointManager(os.path.join(root, "flax")) as mgr:
        mgr.save(11, args=ocp.args.StandardSave(ts_))
    keys = jax.device_put(jax.random.split(jax.random.key(7), 8), NamedSharding(mesh, P("a")))
    with ocp.StandardCheckpointer() as ck:
        ck.save(os.path.join(root, "keys"), {"rng": keys, "one": jax.random.key(3, impl="rbg")})
""")


@pytest.fixture(scope="module")
def orbax_root(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("orbax"))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", WRITER, root], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"the Orbax writer failed:\n{proc.stderr[-4000:]}"
    return root


def _expected(step: int = 0) -> dict:
    return {"w": np.arange(64.0, dtype=np.float32).reshape(8, 8) + step,
            "b": np.arange(3).astype(ml_dtypes.bfloat16) + step}


@pytest.mark.parametrize("name", ["std", "plain"])
def test_reads_a_standard_checkpointer_folder_with_and_without_ocdbt(orbax_root, name, devices):
    out = rc.restore_orbax(os.path.join(orbax_root, name))
    np.testing.assert_array_equal(out["params"]["w"], _expected()["w"])
    assert out["params"]["b"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(out["params"]["b"], _expected()["b"])
    assert out["step"] == 5 and isinstance(out["step"], int)
    assert out["lst"][1] == 3.5
    np.testing.assert_array_equal(out["lst"][0], np.zeros(2))


def test_reshards_onto_a_different_mesh(orbax_root, devices):
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(2, 4), ("x", "y"))
    target = {"params": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("y", "x"))),
                         "b": jax.ShapeDtypeStruct((3,), jnp.float32)},
              "step": 0}
    out = rc.restore_orbax(os.path.join(orbax_root, "std"), target=target)
    w = out["params"]["w"]
    assert isinstance(w, jax.Array) and w.sharding == target["params"]["w"].sharding
    for shard in w.addressable_shards:
        np.testing.assert_array_equal(shard.data, _expected()["w"][shard.index])
    assert out["params"]["b"].dtype == np.float32  # cast to the target's dtype
    assert out["step"] == 5


def test_manager_root_picks_the_newest_step_or_the_one_asked(orbax_root, devices):
    root = os.path.join(orbax_root, "mgr")
    np.testing.assert_array_equal(rc.restore_orbax(root)["params"]["w"], _expected(4)["w"])
    np.testing.assert_array_equal(rc.restore_orbax(root, step=3)["params"]["w"], _expected(3)["w"])
    with pytest.raises(rc.StepNotFoundError, match=r"no finished Orbax step 7; steps: \[3, 4\]"):
        rc.restore_orbax(root, step=7)


def test_named_items_come_back_by_name(orbax_root, devices):
    out = rc.restore_orbax(os.path.join(orbax_root, "named"))
    assert out["extra"] == {"epoch": 2}
    np.testing.assert_array_equal(out["state"]["params"]["w"], _expected()["w"])


def test_a_flax_train_state_restores_into_its_target(orbax_root, tmp_path, devices):
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(8, 1), ("x", "y"))
    params = {"dense": {"kernel": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("x"))),
                        "bias": jax.ShapeDtypeStruct((8,), jnp.float32)}}
    abstract = jax.eval_shape(lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adam(1e-3)),
                              params)
    abstract = abstract.replace(params=params)
    out = rc.restore_orbax(os.path.join(orbax_root, "flax"), target=abstract)
    assert isinstance(out, train_state.TrainState)
    assert int(out.step) == 11
    np.testing.assert_array_equal(out.params["dense"]["kernel"], _expected()["w"])
    assert out.params["dense"]["kernel"].sharding.spec == P("x")
    # And it saves with Resilax as one item.
    rc.save(str(tmp_path / "resaved"), out)
    again = rc.restore(str(tmp_path / "resaved"), target=abstract)
    np.testing.assert_array_equal(again.params["dense"]["kernel"], _expected()["w"])


def test_a_target_leaf_the_checkpoint_lacks_is_named(orbax_root, devices):
    with pytest.raises(rc.TreeMismatchError, match=r"lacks: params\.nope"):
        rc.restore_orbax(os.path.join(orbax_root, "std"), target={"params": {"nope": np.zeros(2)}})
    with pytest.raises(rc.ShapeMismatchError, match=r"'params\.w' has shape \(8, 8\)"):
        rc.restore_orbax(os.path.join(orbax_root, "std"),
                         target={"params": {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}})


@pytest.mark.gcs
def test_reads_an_orbax_checkpoint_on_gcs(orbax_root, gcs_root, devices):
    """The same OCDBT and plain folders, uploaded to fake-gcs-server, read through gs:// paths."""
    from resilax_ckpt.storage import GcsStorage

    storage = GcsStorage()
    for name in ("std", "plain"):
        local = os.path.join(orbax_root, name)
        for folder, _, files in os.walk(local):
            for f in files:
                rel = os.path.relpath(os.path.join(folder, f), local)
                with open(os.path.join(folder, f), "rb") as data:
                    storage.write_bytes(f"{gcs_root}/{name}/{rel}", data.read())
        mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(2, 4), ("x", "y"))
        target = {"params": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("x", "y")))}}
        out = rc.restore_orbax(f"{gcs_root}/{name}", target=target)
        np.testing.assert_array_equal(out["params"]["w"], _expected()["w"])


@pytest.mark.slow
def test_two_processes_each_read_their_own_shards(orbax_root):
    """Two JAX processes (4 devices each) restore the Orbax checkpoint onto a 2x4 global mesh."""
    from ckpt_procs import run_processes

    results = run_processes({"scenario": "orbax_restore", "root": os.path.join(orbax_root, "std"), "mesh": [2, 4]},
                            num_processes=2, timeout=300)
    assert [r["process"] for r in results] == [0, 1]
    assert [r["shards"] for r in results] == [4, 4]


def test_typed_prng_keys_come_back_as_keys(orbax_root, devices):
    keys = jax.random.split(jax.random.key(7), 8)
    one = jax.random.key(3, impl="rbg")
    plain = rc.restore_orbax(os.path.join(orbax_root, "keys"))
    assert plain["rng"].dtype == keys.dtype and plain["one"].dtype == one.dtype
    np.testing.assert_array_equal(jax.random.key_data(plain["rng"]), jax.random.key_data(keys))
    mesh = jax.sharding.Mesh(np.array(devices[:8]).reshape(2, 4), ("x", "y"))
    target = {"rng": jax.ShapeDtypeStruct((8,), keys.dtype, sharding=NamedSharding(mesh, P("y"))),
              "one": jax.ShapeDtypeStruct((), one.dtype)}
    out = rc.restore_orbax(os.path.join(orbax_root, "keys"), target=target)
    assert out["rng"].sharding.spec == P("y")
    np.testing.assert_array_equal(jax.random.uniform(out["rng"][5]), jax.random.uniform(keys[5]))
    np.testing.assert_array_equal(jax.random.key_data(out["one"]), jax.random.key_data(one))
