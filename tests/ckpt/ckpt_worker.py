"""A checkpointing worker run as a subprocess by the tests (crash and multi-process scenarios).

Usage: python ckpt_worker.py '<json args>'; prints one JSON line prefixed with RESULT.
Args: scenario (save|restore|requests), root, devices (local device count), mesh ([rows, cols]),
and for several processes: coordinator, num_processes, process_id.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main() -> None:
    args = json.loads(sys.argv[1])
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.get('devices', 8)}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    if args.get("prefetch"):  # a restarting trainer's first line (resilax_ckpt.restoring.prefetch), before JAX
        from resilax_ckpt.restoring import prefetch

        pid = args.get("process_id", 0)
        prefetch.start_prefetch({
            "RESILAX_LOCAL_DIR": args["root"].format(pid=pid), "RESILAX_CHECKPOINT_DIR": args["persistent"],
            "JAX_COORDINATOR_ADDRESS": args.get("coordinator", ""), "JAX_PROCESS_ID": str(pid),
            "JAX_NUM_PROCESSES": str(args.get("num_processes", 1))})
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if args.get("num_processes", 1) > 1:
        jax.distributed.initialize(args["coordinator"], args["num_processes"], args["process_id"],
                                   initialization_timeout=60, heartbeat_timeout_seconds=10)
    result = SCENARIOS[args["scenario"]](args)
    # One write on a fresh line: Gloo's C++ logging shares stdout (see resilax_ckpt.trainer.health_check)
    sys.stdout.write("\nRESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    if args.get("num_processes", 1) > 1:
        jax.distributed.shutdown()


def global_mesh(shape):
    import jax
    import numpy as np

    return jax.sharding.Mesh(np.array(jax.devices()).reshape(shape), ("a", "b"))


def expected(step):
    import numpy as np

    return {
        "w": (np.arange(32 * 16, dtype=np.float32).reshape(32, 16) + step),
        "b": (np.arange(16, dtype=np.float32) * 2 + step),
        "e": (np.arange(8 * 24, dtype=np.int32).reshape(8, 24) - step),
    }


SPECS = {"w": ("a", "b"), "b": (), "e": ("b", None)}


def make_state(step, mesh, specs=None):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    specs = specs or SPECS
    out = {}
    for name, value in expected(step).items():
        sharding = NamedSharding(mesh, P(*specs[name]))
        out[name] = jax.make_array_from_callback(value.shape, sharding, lambda idx, v=value: v[idx])
    return out


def options(args, **extra):
    import resilax_ckpt as rc

    fields = dict(args.get("options", {}))
    fields.update(extra)
    return rc.ManagerOptions(**fields)


def scenario_save(args):
    import jax
    import resilax_ckpt as rc

    mesh = global_mesh(args["mesh"])
    pid = jax.process_index()
    with rc.CheckpointManager(args["root"].format(pid=pid), options(args)) as mgr:
        for step in args["steps"]:
            # data_offset: other values under the same step number (a zombie writer's, in the tests)
            mgr.save(step, {"params": make_state(step + args.get("data_offset", 0), mesh), "meta": {"step": step},
                            "data": rc.PerProcess({"process": pid, "step": step})},
                     metrics=args.get("metrics", {}).get(str(step)))
        mgr.wait()
        deleted = []
        for step in args.get("delete", []):  # every process calls delete(); the primary deletes
            mgr.delete(step)
            deleted.append(mgr.steps())
        refused = []
        for step in args.get("delete_missing", []):  # every process raises the primary's error
            try:
                mgr.delete(step)
            except rc.ResilaxCkptError as e:
                refused.append(type(e).__name__)
        return {"steps": mgr.steps(), "process": pid, "after_deletes": deleted, "refused": refused,
                "metrics": {s: dict(mgr.metadata(s).metrics) for s in mgr.steps()}}


def scenario_restore(args):
    import jax
    import numpy as np
    import resilax_ckpt as rc
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = global_mesh(args["mesh"])
    specs = {k: tuple(v) if v is not None else () for k, v in args.get("specs", {}).items()} or SPECS
    pid = jax.process_index()
    # roots / process_options: each process's own folder (a node's local tier) and options (its sidecar)
    root = args["roots"][pid] if "roots" in args else args["root"].format(pid=pid)
    mgr = rc.CheckpointManager(root, options(args, **args.get("process_options", [{}] * (pid + 1))[pid]),
                               persistent_directory=args.get("persistent"))
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P(*specs[k])))
                         for k, v in expected(0).items()}}
    own_latest = mgr.latest_step()
    step_arg = args.get("step")
    if args.get("latest_from_env"):  # what examples/train.py does
        step_arg = mgr.restore_step_from_env({"RESILAX_RESTORE_STEP": "latest"}, target=target)
    out = mgr.restore(step_arg, target=target)
    step = out["meta"]["step"]
    want = expected(step + out["meta"].get("offset", 0))  # offset: which timeline saved it (test_timelines)
    for name, value in want.items():
        arr = out["params"][name]
        assert arr.sharding == target["params"][name].sharding, (name, arr.sharding)
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
    mgr.close()
    from resilax_ckpt.restoring import prefetch

    handle = prefetch.current()
    return {"prefetch": handle.stats() if handle is not None else None,
            "step": step, "steps": mgr.steps(), "meta": out["meta"], "data": out["data"],
            "process": jax.process_index(), "restored_from": mgr.restored_from, "own_latest": own_latest,
            "agreed": step_arg, "report": mgr.restore_report}


def scenario_requests(args):
    """Loop over steps with a policy that never saves; process `requester` drops a save request
    into its control folder before step `request_at`. Reports the steps each process saved."""
    import jax
    import resilax_ckpt as rc
    from resilax_ckpt.control.requests import read_stop_record

    mesh = global_mesh(args["mesh"])
    pid = jax.process_index()
    control = os.path.join(args["control"], str(pid))
    os.makedirs(os.path.join(control, "requests"), exist_ok=True)
    saved = []
    stopped_at = None
    with rc.CheckpointManager(args["root"], options(args, control_dir=control, save_every_steps=10_000)) as mgr:
        for step in range(1, args["steps"] + 1):
            if pid == args["requester"] and step == args["request_at"] and args.get("sigterm"):
                os.kill(os.getpid(), signal.SIGTERM)
            elif pid == args["requester"] and step == args["request_at"]:
                tmp = os.path.join(control, "requests", "r1.json.tmp")
                with open(tmp, "w") as f:
                    json.dump({"id": "r1", "reason": "manual", "stop": args.get("stop", False)}, f)
                os.rename(tmp, os.path.join(control, "requests", "r1.json"))
            if mgr.save(step, {"params": make_state(step, mesh)}):
                saved.append(step)
            if mgr.should_stop:
                stopped_at = step
                break
            time.sleep(args.get("step_seconds", 0))
        mgr.wait()
        results = {}
        results_dir = os.path.join(control, "results")
        if os.path.isdir(results_dir):
            for name in os.listdir(results_dir):
                with open(os.path.join(results_dir, name)) as f:
                    results[name] = json.load(f)
        return {"saved": saved, "steps": mgr.steps(), "results": results, "stopped_at": stopped_at,
                "process": pid, "stop_record": read_stop_record(control) if stopped_at else None}


def scenario_orbax_restore(args):
    """rc.restore_orbax of an Orbax checkpoint (params.w = arange(64).reshape(8, 8)) onto this
    generation's global mesh: each process checks its addressable shards."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import resilax_ckpt as rc
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = global_mesh(args["mesh"])
    target = {"params": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("a", "b")))}}
    w = rc.restore_orbax(args["root"], target=target)["params"]["w"]
    want = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    for shard in w.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    return {"process": jax.process_index(), "shards": len(w.addressable_shards)}


def scenario_timeline(args):
    """One generation of a job (test_timelines.py): restore per `restore_step` (RESILAX_RESTORE_STEP:
    `latest`, `none` or a number; checking every shard against the values its timeline saved), then
    save `steps` with values `step + offset`. With `persistent` (two tiers, the sidecars upload) and
    `wait_persisted`, wait after each save until the persistent tier holds that very save (its marker
    names the attempt of this save's identity)."""
    import jax
    import numpy as np
    import resilax_ckpt as rc
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from resilax_ckpt import commit, layout
    from resilax_ckpt.storage import open_storage

    mesh = global_mesh(args["mesh"])
    pid = jax.process_index()
    persistent = args.get("persistent")
    mgr = rc.CheckpointManager(args["root"].format(pid=pid), options(args), persistent_directory=persistent)
    target = {"params": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P(*SPECS[k])))
                         for k, v in expected(0).items()}}
    restored = None
    asked = mgr.restore_step_from_env({"RESILAX_RESTORE_STEP": str(args.get("restore_step", "latest"))},
                                      target=target)
    if asked is not None:
        out = mgr.restore(asked, target=target)
        restored = dict(out["meta"])
        want = expected(restored["step"] + restored.get("offset", 0))
        for name, value in want.items():
            for shard in out["params"][name].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
    storage = open_storage(persistent) if persistent else None
    for step in args.get("steps", []):
        mgr.save(step, {"params": make_state(step + args.get("offset", 0), mesh),
                        "meta": {"step": step, "offset": args.get("offset", 0)}}, force=True)
        mgr.wait()
        if storage is not None and args.get("wait_persisted"):
            folder = os.path.join(args["root"].format(pid=pid), str(step))
            marker = next(os.path.join(folder, n) for n in (layout.COMMIT_FILE, layout.commit_name(pid))
                          if os.path.exists(os.path.join(folder, n)))
            with open(marker) as f:
                body = json.load(f)
            want_attempt = layout.upload_attempt_name(body["era"], body["generation"], step, body["save"])
            deadline = time.monotonic() + 120
            while True:
                if step in commit.list_visible(storage, persistent) and commit.step_data_path(
                        storage, persistent, step).endswith("/" + want_attempt):
                    break
                assert time.monotonic() < deadline, f"step {step} was not uploaded within 120 s"
                time.sleep(0.1)
    mgr.close()
    return {"process": pid, "restored": restored, "steps": mgr.steps(), "superseded": mgr.superseded_steps(),
            "persistent_steps": mgr.persistent_steps(), "restored_from": mgr.restored_from,
            "report": mgr.restore_report}


SCENARIOS = {"save": scenario_save, "timeline": scenario_timeline, "restore": scenario_restore, "requests": scenario_requests,
             "orbax_restore": scenario_orbax_restore}

if __name__ == "__main__":
    main()
