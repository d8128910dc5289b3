"""One JAX process of tests/ckpt/test_exit_watchdog.py: joins a 2-process jax.distributed on 127.0.0.1
through resilax_ckpt.initialize_distributed_from_env (which arms the exit watchdog), then process 1
raises while process 0 waits for it (a blocking key-value get, as a barrier would); with `collective`,
process 0 waits in an all-gather (gloo) instead, which fails once process 1 is gone."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax
from jax._src import distributed
from resilax_ckpt import initialize_distributed_from_env

jax.config.update("jax_cpu_collectives_implementation", "gloo")
process_id, address, wait_ms = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
collective = len(sys.argv) > 4 and sys.argv[4] == "collective"
env = {"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(process_id),
       "RESILAX_EXIT_GRACE_SECONDS": os.environ.get("RESILAX_EXIT_GRACE_SECONDS", "")}
assert initialize_distributed_from_env(env)
client = distributed.global_state.client
client.key_value_set(f"up/{process_id}", "1")
client.blocking_key_value_get(f"up/{1 - process_id}", 120_000)
print(f"process {process_id}: both up", flush=True)
if collective:
    import numpy as np
    from jax.experimental import multihost_utils

    multihost_utils.process_allgather(np.ones(4))  # both: gloo connects its pairs
if process_id == 1:
    raise RuntimeError("the trainer's own bug")
if collective:
    multihost_utils.process_allgather(np.ones(4))  # process 1 never joins, then exits: the pair closes
client.blocking_key_value_get("never", wait_ms)  # waits for process 1, which is gone
