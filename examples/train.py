"""A small JAX training job that survives preemption, node loss and resizing.

Run by the JAXJob operator (one process per host), or by hand:  python examples/train.py --steps 50

Everything Resilax-specific is the five marked lines: join the job's processes, build the checkpoint
manager from the environment the operator injects, restore onto whatever mesh this generation has,
save each step (the manager decides when), and stop when asked. The data is a pure function of the
step, so the loss curve continues across generations and any lost step would show. `rc.run_kept(main)`
runs it: under `resilax run`, a restart that changes nothing but the generation (one process, the same
world: a rollback) runs in this same process (docs/architecture.md, "Keep what can be kept"); elsewhere
it is a plain call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import resilax_ckpt as rc
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

FEATURES, HIDDEN, BATCH = 32, 64, 256


def make_mesh() -> Mesh:
    """All devices of this generation: (data, model), model axis of 2 where the count allows."""
    devices = np.array(jax.devices())
    model = 2 if devices.size % 2 == 0 else 1
    return Mesh(devices.reshape(devices.size // model, model), ("data", "model"))


def param_shardings(mesh: Mesh) -> dict[str, NamedSharding]:
    return {
        "w1": NamedSharding(mesh, P(None, "model")),
        "b1": NamedSharding(mesh, P("model")),
        "w2": NamedSharding(mesh, P("model", None)),
        "b2": NamedSharding(mesh, P()),
    }


def raw_params() -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w1": jax.random.normal(k1, (FEATURES, HIDDEN)) / np.sqrt(FEATURES),
        "b1": jnp.zeros((HIDDEN,)),
        "w2": jax.random.normal(k2, (HIDDEN, 1)) / np.sqrt(HIDDEN),
        "b2": jnp.zeros((1,)),
    }


def init_params(mesh: Mesh) -> dict[str, jax.Array]:
    shardings = param_shardings(mesh)
    return {name: jax.device_put(value, shardings[name]) for name, value in raw_params().items()}


def init_state(mesh: Mesh, optimizer: optax.GradientTransformation) -> dict:
    """A fresh job's state: the parameters and Adam's moments, which follow the params' shardings; its
    step count is replicated over the mesh."""
    params = init_params(mesh)
    opt_state = jax.tree.map(lambda a: a if isinstance(a.sharding, NamedSharding)
                             else jax.device_put(a, NamedSharding(mesh, P())), optimizer.init(params))
    return {"params": params, "opt_state": opt_state, "meta": {"step": 0}}


def abstract_state(mesh: Mesh, optimizer: optax.GradientTransformation) -> dict:
    """`init_state`'s shapes, dtypes and shardings, computing nothing (jax.eval_shape): the restore's
    target. A restore overwrites every value, so a restarting generation makes no state of its own
    first (on the CPU test bed that was a dozen compiles before the restore could begin)."""
    shardings, replicated = param_shardings(mesh), NamedSharding(mesh, P())
    params = {name: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[name])
              for name, s in jax.eval_shape(raw_params).items()}

    def place(path: tuple, leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        name = getattr(path[-1], "key", None) if path else None  # Adam's mu and nu hold the params by name
        like = params.get(name) if isinstance(name, str) else None
        sharding = like.sharding if like is not None and like.shape == leaf.shape else replicated
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    opt_state = jax.tree_util.tree_map_with_path(place, jax.eval_shape(optimizer.init, params))
    return {"params": params, "opt_state": opt_state, "meta": {"step": 0}}


def batch(step: int, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """The same batch for a step in every generation, whatever the mesh."""
    key = jax.random.fold_in(jax.random.key(1), step)
    x = jax.random.normal(key, (BATCH, FEATURES))
    y = jnp.sin(x.sum(axis=1, keepdims=True))
    sharding = NamedSharding(mesh, P("data"))
    return jax.device_put(x, sharding), jax.device_put(y, sharding)


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    h = jax.nn.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def step_sleep(step_seconds: float, full_devices: int, devices: int) -> float:
    """The sleep per step: `step_seconds` at full size, scaled by full / current devices when
    `full_devices` is given (a compute-bound step's time), else fixed."""
    return step_seconds * full_devices / devices if full_devices else step_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="train until this step")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (to watch faults)")
    parser.add_argument("--full-devices", type=int, default=0, metavar="N",
                        help="simulate a compute-bound step: sleep --step-seconds x N / the devices this generation "
                             "has, so a step at half the devices takes twice as long (the global batch is split "
                             "over the data axis; on the CPU test bed the fake devices share the machine's cores, "
                             "so their compute does not show it). 0: a fixed sleep")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args(argv)
    if args.full_devices < 0:
        parser.error(f"--full-devices: {args.full_devices} is not allowed; give 0 (a fixed sleep) or the job's "
                     "device count at full size")

    rc.initialize_distributed_from_env()  # 1. join this generation's processes (the restore prefetch starts here)
    mesh = make_mesh()
    optimizer = optax.adam(args.lr)
    target = abstract_state(mesh, optimizer)  # shapes and shardings only: a restore fills it

    generation = int(os.environ.get("RESILAX_GENERATION", "0"))
    with rc.CheckpointManager.from_env() as mgr:  # 2. policy, storage and generation from the env
        restore_step = mgr.restore_step_from_env(target=target)  # the step all processes can read
        if restore_step is None:
            state = init_state(mesh, optimizer)  # a fresh job
        else:  # 3. restore onto this generation's mesh
            began = time.time()
            state = mgr.restore(restore_step, target=target)
            report = mgr.restore_report or {}
            print(json.dumps({"restored": restore_step, "from": mgr.restored_from, "sources": report.get("sources"),
                              "generation": generation,
                              "process": jax.process_index(), "node": os.environ.get("RESILAX_NODE_NAME", ""),
                              "began": began, "time": time.time()}),
                  flush=True)
        start = int(state["meta"]["step"])

        @jax.jit
        def train_step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        for step in range(start + 1, args.steps + 1):
            x, y = batch(step, mesh)
            params, opt_state, loss = train_step(state["params"], state["opt_state"], x, y)
            state = {"params": params, "opt_state": opt_state, "meta": {"step": step}}
            if jax.process_index() == 0:
                record = {"step": step, "loss": float(loss), "generation": generation,
                          "devices": jax.device_count(), "time": time.time()}
                print(json.dumps(record), flush=True)
            mgr.save(step, state)  # 4. saves when the policy or a save request says so
            if mgr.should_stop:  # 5. a preemption or resize asked us to stop after a final save
                mgr.wait()
                return rc.EXIT_CODE_STOPPED
            if args.step_seconds:
                time.sleep(step_sleep(args.step_seconds, args.full_devices, jax.device_count()))
        mgr.save(args.steps, state, force=True)
        mgr.wait()
    return 0


if __name__ == "__main__":
    sys.exit(rc.run_kept(main))  # under `resilax run`, this process may run the next generation too
