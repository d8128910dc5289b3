"""A tiny training loop that uses resilax_ckpt the way a worker does; the sidecar tests run it.

By default it never saves by policy (every 10**9 steps): only save requests (from the sidecar) and
SIGTERM make it save; RESILAX_SAVE_EVERY_STEPS overrides that. With RESILAX_LOCAL_DIR it saves to the
local tier; else to RESILAX_CHECKPOINT_DIR. With JAX_NUM_PROCESSES > 1 it joins jax.distributed and its
weights are one array sharded over every process's devices (2 CPU devices per process). It prints
`saved step <n>` lines and exits with EXIT_CODE_STOPPED after a stop save.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np
import resilax_ckpt as rc


def initial_weights(floats: int) -> object:
    """Host weights for one process; for several, one array sharded over all processes."""
    if int(os.environ.get("JAX_NUM_PROCESSES", "1")) <= 1:
        return np.zeros(floats, np.float32)
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    base = np.arange(floats, dtype=np.float32)
    return jax.make_array_from_callback((floats,), NamedSharding(mesh, P("x")), lambda idx: base[idx])


def main() -> int:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    rc.initialize_distributed_from_env()
    local = os.environ.get("RESILAX_LOCAL_DIR")
    directory = local or os.environ["RESILAX_CHECKPOINT_DIR"]
    every = int(os.environ.get("RESILAX_SAVE_EVERY_STEPS") or 10**9)
    options = rc.ManagerOptions.from_env(local_tier=bool(local), save_every_steps=every)
    max_steps = int(os.environ.get("TRAINER_MAX_STEPS", "100000"))
    floats = int(os.environ.get("TRAINER_FLOATS", "4096"))
    sleep = float(os.environ.get("TRAINER_STEP_SECONDS", "0.02"))
    with rc.CheckpointManager(directory, options) as mgr:
        w = initial_weights(floats)
        print("trainer ready", flush=True)
        for step in range(1, max_steps + 1):
            w = w + 1
            if mgr.save(step, {"params": {"w": w}, "meta": {"step": step}}):
                print(f"saved step {step}", flush=True)
            if mgr.should_stop:
                print(f"stopped at step {step}", flush=True)
                return rc.EXIT_CODE_STOPPED
            time.sleep(sleep)
    print("trainer done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
