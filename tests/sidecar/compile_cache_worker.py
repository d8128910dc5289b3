"""A trainer stand-in for test_compile_cache.py: joins from the environment (which counts JAX's
persistent compilation cache events), compiles one step function, saves step 1 with the manager (which
writes trainer.json with the counts) and prints them."""

from __future__ import annotations

import json
import os

os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import jax.numpy as jnp
import resilax_ckpt as rc
from resilax_ckpt.control.trainer_metrics import COMPILATION_CACHE

rc.initialize_distributed_from_env()
train_step = jax.jit(lambda w: jnp.tanh(w @ w.T) * 0.5 + 1)
with rc.CheckpointManager(os.environ["RESILAX_CHECKPOINT_DIR"], rc.ManagerOptions.from_env(async_save=False)) as mgr:
    w = train_step(jnp.ones((16, 16)))
    mgr.save(1, {"params": {"w": w}}, force=True)
print("COUNTS " + json.dumps({"requests": COMPILATION_CACHE.requests, "hits": COMPILATION_CACHE.hits}), flush=True)
