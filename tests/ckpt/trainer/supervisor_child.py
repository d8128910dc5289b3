"""A trainer stand-in for tests/ckpt/trainer/test_supervisor.py: `supervisor_child.py <report dir> <mode> [arg]`.

It writes `<report dir>/child-<incarnation>.json` at start (its pid, the environment the supervisor gave
it, and whether the previous incarnation's pid still existed), then behaves by mode:
- `exit N`: exit with N at once.
- `cooperate N`: run until SIGTERM, then record it and exit N (a final save, then 75).
- `stubborn`: record SIGTERM and ignore it; start a grandchild in its own session that ignores SIGTERM
  too (its pid in the report), then run until killed.
- `stacks`: call `initialize_distributed_from_env` (one process: no JAX started; it binds SIGUSR1 to
  faulthandler) and run in a distinctively named function until killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

report_dir, mode = sys.argv[1], sys.argv[2]
arg = sys.argv[3] if len(sys.argv) > 3 else ""
incarnation = os.environ.get("RESILAX_INCARNATION", "?")


def write(name: str, body: dict[str, object]) -> None:
    path = os.path.join(report_dir, name)
    with open(f"{path}.tmp", "w") as f:
        json.dump(body, f)
    os.replace(f"{path}.tmp", path)


def previous_alive() -> bool | None:
    """Whether the previous incarnation's process still exists (None: no previous one reported)."""
    try:
        with open(os.path.join(report_dir, f"child-{int(incarnation) - 1}.json")) as f:
            pid = json.load(f)["pid"]
    except (OSError, ValueError, KeyError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def a_distinctively_named_training_step() -> None:
    # The report from inside this frame: a test that stops the process once it sees the report finds
    # this function on the stack (written before the call, a stop could land between the two).
    write(f"child-{incarnation}.json", report)
    while True:
        time.sleep(0.05)


report: dict[str, object] = {"pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
                             "env": {k: v for k, v in os.environ.items() if k.startswith(("RESILAX_", "JAX_", "X_"))},
                             "previous_alive": previous_alive()}
if mode == "stubborn":
    grandchild = subprocess.Popen([sys.executable, "-c",
                                   "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                   "while True: time.sleep(1)"], start_new_session=True)
    report["grandchild"] = grandchild.pid


def on_term(signum: int, _frame: object) -> None:
    write(f"sigterm-{incarnation}.json", {"signal": signum})
    if mode == "cooperate":
        sys.exit(int(arg))


signal.signal(signal.SIGTERM, on_term)
if mode == "stacks":
    from resilax_ckpt import initialize_distributed_from_env

    initialize_distributed_from_env({})
if mode != "stacks":
    write(f"child-{incarnation}.json", report)
if mode == "exit":
    sys.exit(int(arg))
if mode == "stacks":
    a_distinctively_named_training_step()
while True:
    time.sleep(0.05)
