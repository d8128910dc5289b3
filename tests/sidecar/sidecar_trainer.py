"""A tiny training loop that uses resilax_ckpt the way a worker does; the sidecar tests run it.

It never saves by policy (every 10**9 steps): only save requests (from the sidecar) and SIGTERM make
it save. With RESILAX_LOCAL_DIR it saves to the local tier; else to RESILAX_CHECKPOINT_DIR. It prints
`step <n>` lines so tests can see it progress, and exits with EXIT_CODE_STOPPED after a stop save.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import resilax_ckpt as rc


def main() -> int:
    local = os.environ.get("RESILAX_LOCAL_DIR")
    directory = local or os.environ["RESILAX_CHECKPOINT_DIR"]
    options = rc.ManagerOptions.from_env(local_tier=bool(local), save_every_steps=10**9)
    max_steps = int(os.environ.get("TRAINER_MAX_STEPS", "100000"))
    floats = int(os.environ.get("TRAINER_FLOATS", "4096"))
    sleep = float(os.environ.get("TRAINER_STEP_SECONDS", "0.02"))
    with rc.CheckpointManager(directory, options) as mgr:
        w = np.zeros(floats, np.float32)
        print("trainer ready", flush=True)
        for step in range(1, max_steps + 1):
            w = w + 1
            if mgr.save(step, {"params": {"w": w}, "meta": {"step": step}}):
                print(f"saved step {step}", flush=True)
            if mgr.should_stop:
                print(f"stopped at step {step}", flush=True)
                return rc.EXIT_CODE_STOPPED
            time.sleep(sleep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
