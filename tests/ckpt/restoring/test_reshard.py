"""Save on 8 fake CPU devices, restore onto other meshes, shardings and dtypes; error messages."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import resilax_ckpt as rc
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def mesh(shape, names=("a", "b"), devices=None):
    devs = np.array(devices if devices is not None else jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devs, names)


def make_state(m):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((16, 8), dtype=np.float32)
    b = rng.standard_normal((8,), dtype=np.float32).astype(jnp.bfloat16)
    e = rng.integers(0, 100, (8, 6), dtype=np.int32)
    state = {
        "params": {
            "w": jax.device_put(w, NamedSharding(m, P("a", "b"))),
            "b": jax.device_put(b, NamedSharding(m, P())),
            "emb": jax.device_put(e, NamedSharding(m, P("b", None))),
            "host": np.arange(5, dtype=np.int64),
            "count": 7,
            "lr": np.float32(0.5),
        },
        "meta": {"epoch": 3, "name": "run", "tags": ["a", "b"]},
    }
    return state, {"w": w, "b": b, "emb": e}


@pytest.fixture
def saved(tmp_path, devices):
    m = mesh((4, 2))
    state, raw = make_state(m)
    with rc.CheckpointManager(str(tmp_path)) as mgr:
        assert mgr.save(10, state)
        mgr.wait()
        assert mgr.steps() == [10]
    return str(tmp_path), raw


def target_for(m, specs, dtype=None):
    return {"params": {
        "w": jax.ShapeDtypeStruct((16, 8), dtype or jnp.float32, sharding=NamedSharding(m, specs[0])),
        "b": jax.ShapeDtypeStruct((8,), jnp.bfloat16, sharding=NamedSharding(m, specs[1])),
        "emb": jax.ShapeDtypeStruct((8, 6), jnp.int32, sharding=NamedSharding(m, specs[2])),
    }}


@pytest.mark.parametrize(("mesh_shape", "specs"), [
    ((2, 4), (P("b", "a"), P(), P("a", None))),
    ((8, 1), (P("a", None), P("a"), P(None, None))),
    ((2, 2), (P("a", "b"), P("b"), P("b", "a"))),
    ((4, 2), (P(), P("a"), P())),
], ids=["2x4-transposed", "8x1", "4-devices", "sharded-to-replicated"])
def test_restore_onto_another_mesh_is_bit_exact(saved, mesh_shape, specs):
    root, raw = saved
    m = mesh(mesh_shape)
    target = target_for(m, specs)
    out = rc.CheckpointManager(root).restore(target=target, items=["params"])
    assert list(out) == ["params"]
    for name in ("w", "b", "emb"):
        arr = out["params"][name]
        assert arr.sharding == target["params"][name].sharding
        assert arr.dtype == target["params"][name].dtype
        np.testing.assert_array_equal(np.asarray(arr), raw[name])


def test_restore_onto_jax_array_target_and_dtype_cast(saved):
    root, raw = saved
    m = mesh((2, 4))
    like = jax.device_put(np.zeros((16, 8), np.float32), NamedSharding(m, P(None, "b")))
    out = rc.CheckpointManager(root).restore(target={"params": {"w": like}}, items=["params"])
    assert out["params"]["w"].sharding == like.sharding
    np.testing.assert_array_equal(np.asarray(out["params"]["w"]), raw["w"])
    cast = rc.CheckpointManager(root).restore(target=target_for(m, (P("a"), P(), P()), jnp.bfloat16),
                                              items=["params"])
    assert cast["params"]["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(cast["params"]["w"]), raw["w"].astype(jnp.bfloat16))


def test_restore_without_target_gives_numpy_and_json(saved):
    root, raw = saved
    out = rc.CheckpointManager(root).restore()
    params = out["params"]
    assert isinstance(params["w"], np.ndarray)
    np.testing.assert_array_equal(params["w"], raw["w"])
    np.testing.assert_array_equal(params["b"], raw["b"])
    np.testing.assert_array_equal(params["host"], np.arange(5))
    assert params["count"] == 7 and isinstance(params["count"], int)
    assert params["lr"] == np.float32(0.5) and isinstance(params["lr"], np.float32)
    assert out["meta"] == {"epoch": 3, "name": "run", "tags": ["a", "b"]}


def test_replicated_to_sharded(tmp_path, devices):
    m = mesh((4, 2))
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    rc.save(str(tmp_path / "ck"), {"x": {"v": jax.device_put(value, NamedSharding(m, P()))}})
    target = {"x": {"v": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh((2, 4)), P("b", "a")))}}
    out = rc.restore(str(tmp_path / "ck"), target=target)
    np.testing.assert_array_equal(np.asarray(out["x"]["v"]), value)
    assert out["x"]["v"].sharding == target["x"]["v"].sharding


def test_items_subset_reads_nothing_else(saved, monkeypatch):
    root, _ = saved
    os.rename(os.path.join(root, "10", "params"), os.path.join(root, "10", "params.gone"))
    out = rc.CheckpointManager(root).restore(items=["meta"])
    assert out == {"meta": {"epoch": 3, "name": "run", "tags": ["a", "b"]}}


def test_restore_onto_flax_optax_state(tmp_path, devices):
    import optax

    m = mesh((4, 2))
    params = {"dense": {"kernel": jax.device_put(jnp.ones((8, 4)), NamedSharding(m, P("a", "b"))),
                        "bias": jax.device_put(jnp.zeros((4,)), NamedSharding(m, P()))}}
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    with rc.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, {"params": params, "opt_state": opt_state})
    m2 = mesh((2, 4))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(m2, P())),
                            {"params": params, "opt_state": opt_state})
    out = rc.CheckpointManager(str(tmp_path)).restore(target=abstract)
    assert jax.tree.structure(out["opt_state"]) == jax.tree.structure(opt_state)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves({"params": params, "opt_state": opt_state}),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_errors_name_the_problem(saved, tmp_path):
    root, _ = saved
    mgr = rc.CheckpointManager(root)
    with pytest.raises(rc.StepNotFoundError, match="step 99 does not exist; committed steps: \\[10\\]"):
        mgr.restore(99)
    os.makedirs(os.path.join(root, "11"))
    with pytest.raises(rc.StepNotCommittedError, match="step 11 is not committed"):
        mgr.restore(11)
    m = mesh((2, 4))
    bad = {"params": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(m, P()))}}
    with pytest.raises(rc.ShapeMismatchError,
                       match=r"step 10: array 'params/\['w'\]' has shape \(16, 8\) on disk, the target expects \(8, 8\)"):
        mgr.restore(target=bad, items=["params"])
    missing = {"params": {"nope": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=NamedSharding(m, P()))}}
    with pytest.raises(rc.TreeMismatchError, match="the target has leaves the checkpoint lacks: \\['nope'\\]"):
        mgr.restore(target=missing, items=["params"])
    with pytest.raises(rc.TreeMismatchError, match="no item\\(s\\) 'opt'"):
        mgr.restore(items=["opt"])
    assert isinstance(rc.StepNotFoundError("x"), FileNotFoundError)
    meta_path = os.path.join(root, "10", "_METADATA.json")
    with open(meta_path) as f:
        raw = json.load(f)
    raw["version"] = 7
    with open(meta_path, "w") as f:
        json.dump(raw, f)
    with pytest.raises(rc.MetadataError, match="format version 7 is not supported"):
        mgr.restore(10)
    with pytest.raises(rc.StepNotFoundError, match="no committed checkpoint"):
        rc.CheckpointManager(str(tmp_path / "empty")).restore()


def test_unsupported_leaf_is_reported(tmp_path):
    with rc.CheckpointManager(str(tmp_path)) as mgr, pytest.raises(rc.UnsupportedLeafError, match="object"):
        mgr.save(1, {"p": {"x": object()}})
