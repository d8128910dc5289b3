"""A kept trainer stand-in for tests/ckpt/trainer/test_kept_trainer.py (no JAX): `kept_child.py <report dir> <mode>`.

Its entry point, run by `resilax_ckpt.run_kept`, writes `<report dir>/child-<incarnation>.json` (its pid and
the environment it was given) at each call, then by mode:
- `cooperate`: run until SIGTERM, then return EXIT_CODE_STOPPED (75: a stop's final save done);
- `raise`: run until SIGTERM, then raise (the entry point failed);
- `exit0`: return 0 at once (training finished);
- `park-late`: return EXIT_CODE_STOPPED at once (a final save asked by a request let the loop end), and
  park only once a SIGTERM came (the supervisor's stop, sent while the process was on its way to park).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import resilax_ckpt as rc
from resilax_ckpt.trainer import kept_trainer

report_dir, mode = sys.argv[1], sys.argv[2]
# What JAX's TPU start-up does to the process's own environment when it is imported (cloud_tpu_init):
# a kept incarnation must still see it (its compile-cache keys include LIBTPU_INIT_ARGS).
os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") + " --xla_tpu_use_enhanced_launch_barrier=true").lstrip()
os.environ.setdefault("TPU_ML_PLATFORM", "JAX")


def _drop_after_a_sigterm(marks: dict[str, float]) -> object:
    deadline = time.monotonic() + 60
    while not kept_trainer.terms_while_parking and time.monotonic() < deadline:
        time.sleep(0.02)
    return drop_backends(marks)


drop_backends = kept_trainer._drop_backends
if mode == "park-late":
    kept_trainer._drop_backends = _drop_after_a_sigterm


def main() -> int:
    incarnation = os.environ.get("RESILAX_INCARNATION", "?")
    stopped: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: stopped.append(signum))
    path = os.path.join(report_dir, f"child-{incarnation}.json")
    with open(f"{path}.tmp", "w") as f:
        json.dump({"pid": os.getpid(), "env": {k: v for k, v in os.environ.items()
                                               if k.startswith(("RESILAX_", "JAX_", "TPU_", "LIBTPU_"))}}, f)
    os.replace(f"{path}.tmp", path)
    if mode == "exit0":
        return 0
    if mode == "park-late":
        signal.signal(signal.SIGTERM, previous)  # as the manager's close puts the handler before it back
        return 75
    while not stopped:
        time.sleep(0.02)
    signal.signal(signal.SIGTERM, previous)
    if mode == "raise":
        raise RuntimeError("the entry point failed")
    return 75


sys.exit(rc.run_kept(main))
