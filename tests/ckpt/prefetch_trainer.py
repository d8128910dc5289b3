"""A restarting trainer's start-up, for tests/ckpt/test_restore_prefetch.py: it starts the restore
prefetch as its first line, then imports JAX, opens the devices and restores through the manager
built from the environment, recording every event in one ordered log (the prefetch's own events,
JAX's backend initialisation through its hook, the trainer's steps), and writes the log and the
restored arrays.

Usage: python prefetch_trainer.py '{"out": DIR, "devices": 1, "between": null | "mark_bad" | "replace_file"}'
`between`: what happens to the prefetched step after its reads are done and before the restore (the
prefetched step marked bad by another process's failed read; one of its chunk files replaced).
"""

from __future__ import annotations

import json
import os
import sys
import threading

_events: list[dict] = []
_lock = threading.Lock()


def record(event: str, **info) -> None:
    """One event, in the order they happened (one lock: the log's order is the order of the calls)."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    # Its dict of initialised backends, read without its lock (JAX calls the init hook holding it); the
    # module may still be importing on the main thread while the prefetch's thread records an event.
    initialized = bool(getattr(bridge, "_backends", None))
    with _lock:
        _events.append({"event": event, "thread": threading.current_thread().name,
                        "backends_initialized": initialized, **info})


def main() -> None:
    args = json.loads(sys.argv[1])
    # 1. the first line of a trainer: no JAX yet
    from resilax_ckpt.restoring import prefetch

    handle = prefetch.start_prefetch(on_event=lambda name, info: record(
        f"prefetch-{name}", **{k: v for k, v in info.items() if k in ("step", "leaf", "bytes", "reason")}))
    record("start_prefetch-returned", step=None if handle is None else handle.step,
           jax_imported="jax" in sys.modules)
    if args.get("between"):
        assert handle is not None
        handle.wait()
        if args["between"] == "mark_bad":  # another process could not read it (restorer.newest_good)
            from resilax_ckpt import commit
            from resilax_ckpt.storage import open_storage

            root = os.environ["RESILAX_CHECKPOINT_DIR"]
            commit.mark_bad(open_storage(root), root, handle.step, "process 1: test: unreadable")
        elif args["between"] == "replace_file":  # a chunk file rewritten (a new inode) with other bytes
            folder = os.path.join(handle.step_path, "params", "w")
            victim = sorted(os.path.join(d, n) for d, _, names in os.walk(folder) for n in names
                            if n != "zarr.json")[0]
            with open(victim, "rb") as f:
                data = bytearray(f.read())
            data[0] ^= 0xFF
            with open(victim + ".new", "wb") as f:
                f.write(data)
            os.replace(victim + ".new", victim)
        record("between-done", what=args["between"])

    # 2. the imports and the chip
    import jax
    from jax._src import xla_bridge

    record("jax-imported")
    xla_bridge.register_backend_initialization_hook(lambda backend: record("backend-initialized",
                                                                           platform=backend.platform))
    record("devices-entered")
    devices = jax.devices()
    record("devices-returned", count=len(devices))

    # 3. the five lines' restore
    import numpy as np
    import resilax_ckpt as rc
    from ckpt_worker import expected
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(devices).reshape(len(devices), 1), ("a", "b"))
    specs = {"w": P("a", None), "b": P(), "e": P(None, "a")}
    target = {"params": {name: jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=NamedSharding(mesh, specs[name]))
                         for name, value in expected(0).items()}}
    with rc.CheckpointManager.from_env() as mgr:
        step = mgr.restore_step_from_env(target=target)
        record("restore-entered", step=step)
        state = mgr.restore(step, target=target)
        record("restore-returned", step=step, restored=state["meta"]["step"])
        arrays = {name: np.asarray(value) for name, value in state["params"].items()}
        exact = all(isinstance(v, jax.Array) and v.sharding == target["params"][k].sharding
                    for k, v in state["params"].items())
    np.savez(os.path.join(args["out"], "restored.npz"), **arrays)
    with open(os.path.join(args["out"], "events.json"), "w") as f:
        json.dump({"events": _events, "stats": None if handle is None else handle.stats(),
                   "report": mgr.restore_report, "shardings_as_asked": exact}, f)


if __name__ == "__main__":
    main()
