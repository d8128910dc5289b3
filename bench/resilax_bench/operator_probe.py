"""`resilax operator` with each reconcile timed: ``python -m resilax_bench.operator_probe LOG -- ARGS...``.

The scale benchmark runs the operator through this launcher, the same way for the code before the watch
cache and after it: the function the reconcile daemon calls (`reconcile_job` of the module handlers.py
calls it from) is wrapped, and each call appends ``<start unix time> <seconds>`` to LOG. Nothing else
changes; which `resilax_operator` was imported (PYTHONPATH picks the version) is written to LOG's first
line as ``# <path>``.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any


def wrap_reconcile(module: types.ModuleType, out: Any) -> None:
    original: Callable[..., Any] = module.reconcile_job
    lock = threading.Lock()

    def timed(*args: Any, **kwargs: Any) -> Any:
        start, t0 = time.time(), time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            took = time.perf_counter() - t0
            with lock:
                out.write(f"{start:.3f} {took:.6f}\n")

    module.reconcile_job = timed


def main(argv: list[str]) -> int:
    log_path, args = argv[0], [a for a in argv[1:] if a != "--"]
    import resilax_operator
    from resilax_operator import handlers, main

    targets = [m for m in vars(handlers).values() if isinstance(m, types.ModuleType) and hasattr(m, "reconcile_job")]
    if len(targets) != 1:
        raise SystemExit(f"operator_probe: handlers.py should call reconcile_job of one module, found {targets}")
    out = open(log_path, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    out.write(f"# {resilax_operator.__file__}\n")
    wrap_reconcile(targets[0], out)
    return main.main(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
