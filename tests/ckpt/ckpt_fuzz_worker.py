"""One life of the kill -9 fuzz's training job (test_kill_fuzz.py): a real JAX process of 2 (jax.distributed on
127.0.0.1, 4 fake CPU devices each), forked from a server that imported JAX, NumPy, tensorstore and
resilax_ckpt once, so a life costs its own work only (no interpreter start-up or import).

A life opens the checkpoint root as generation `generation` of one job, checks what it finds (the step
folders are exactly the visible steps; nothing is marked bad; every older visible step restores bit-exact
by number; the newest visible step restores bit-exact without falling back), then saves the next
`saves` steps (asynchronously, like a training loop) until the harness SIGKILLs it or it is done.
Every array of step s is a pure function of s, so a check needs no record of what was saved.

It reports to the append-only file `args["out"]`, one JSON object a line (os.write: a line is whole or
absent after a SIGKILL): open, verified, ready, saving <s>, committed <s>, done, error.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any

import numpy as np

MESH = (4, 2)
SPECS: dict[str, tuple[Any, ...]] = {"w": ("a", "b"), "e": ("b", None), "r": ()}


def expected(step: int) -> dict[str, np.ndarray]:
    """The arrays of step `step`: exact in float32, different in every element from any other step's."""
    w = (np.arange(256 * 64, dtype=np.int64).reshape(256, 64) * 3 + step * 100_003) % (1 << 24)
    return {
        "w": w.astype(np.float32),
        "e": (np.arange(16 * 24, dtype=np.int32).reshape(16, 24) - 7 * step),
        "r": (np.arange(40, dtype=np.float32) + 0.5 * step),
    }


def life(args: dict[str, Any]) -> None:
    """The target of one forked worker process; never returns normally (os._exit)."""
    out = os.open(args["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    log = os.open(args["out"] + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)  # JAX's and the library's own output (a peer's death aborts a process loudly)
    os.dup2(log, 2)

    def say(kind: str, **fields: Any) -> None:
        os.write(out, (json.dumps({"kind": kind, "t": time.monotonic(), **fields}) + "\n").encode())

    code = 0
    say("start")
    try:
        os.environ.update(args["env"])
        _run(args, say)
    except BaseException:
        say("error", traceback=traceback.format_exc())
        code = 1
    os._exit(code)  # skip interpreter and multiprocessing clean-up: a life ends like a killed one


def _run(args: dict[str, Any], say: Any) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args['devices']}"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args["coordinator"], args["num_processes"], args["process_id"],
                               initialization_timeout=60, heartbeat_timeout_seconds=10)
    say("initialized")
    import resilax_ckpt as rc
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from resilax_ckpt import layout
    from resilax_ckpt.storage import open_storage

    pid = jax.process_index()
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(MESH), ("a", "b"))
    shardings = {k: NamedSharding(mesh, P(*spec)) for k, spec in SPECS.items()}
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k])
                         for k, v in expected(0).items()}}

    def state(step: int) -> dict[str, Any]:
        params = {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
                  for k, v in expected(step).items()}
        return {"params": params, "meta": {"step": step}, "data": rc.PerProcess({"process": pid, "step": step})}

    def check(out: dict[str, Any], step: int, how: str) -> None:
        assert out["meta"] == {"step": step}, f"{how}: meta {out['meta']} is not step {step}'s"
        assert out["data"] == {"process": pid, "step": step}, f"{how}: per-process item {out['data']}"
        for name, want in expected(step).items():
            arr = out["params"][name]
            for shard in arr.addressable_shards:
                got = np.asarray(shard.data)
                if not np.array_equal(got, want[shard.index]):
                    raise AssertionError(f"{how}: step {step}'s {name}{shard.index} is not what step {step} saved "
                                         f"({int((got != want[shard.index]).sum())} elements differ)")

    options = rc.ManagerOptions(generation=args["generation"], job_uid="fuzz-job", keep_last=args["keep_last"],
                                keep_every_steps=None, recycle_pool=args["recycle_pool"],
                                barrier_timeout_seconds=60)
    mgr = rc.CheckpointManager(args["root"], options)
    steps = mgr.steps()
    say("open", steps=steps)
    if pid == 0:  # the start cleaned every leftover: the step folders are the visible steps, none bad
        storage = open_storage(args["root"])
        found = sorted(s for n in storage.list_dir(args["root"]) if (s := layout.parse_step(n.rstrip("/"))) is not None)
        assert found == steps, f"step folders {found} after the start, but visible steps {steps}"
        assert not storage.list_dir(storage.join(args["root"], layout.BAD_DIR)), "a step was marked bad"
    if steps:
        for step in steps[:-1]:
            check(mgr.restore(step, target=target), step, f"restore({step})")
        # Last, so the step this manager protects from retention is the newest (the older ones may go).
        check(mgr.restore(target=target), steps[-1], "restore() of the newest step")
        report = mgr.restore_report
        assert report is not None and (report["step"], report["skipped"]) == (steps[-1], []), report
    say("verified", steps=steps)
    first = (steps[-1] if steps else 0) + 1
    say("ready")
    for step in range(first, first + args["saves"]):
        say("saving", step=step)
        mgr.save(step, state(step), force=True)
        if step > first:  # save() waited for the previous save: it committed
            say("committed", step=step - 1)
    mgr.wait()
    say("committed", step=first + args["saves"] - 1)
    mgr.close()
    say("done")
    jax.distributed.shutdown()
