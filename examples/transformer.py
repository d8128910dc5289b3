"""A decoder-only transformer training job that survives preemption, node loss and resizing.

Run by the JAXJob operator (one process per host), or by hand:
    python examples/transformer.py --steps 50                          # small, f32, on CPU
    python examples/transformer.py --preset tpu-v5e --steps 20         # 0.67B parameters, bf16, one v5e chip

Plain JAX (no flax or optax): parameters stacked over the layers and scanned (compile time does not grow
with depth, as in MaxText's `scan_layers`), each layer rematerialized, Adam with float32 moments. The
mesh is every device of this generation on one axis, `data`: the global batch is split over it and each
weight is sharded over it where its largest dimension allows (FSDP), so a step at half the devices takes
about twice as long when the step is compute-bound, and a restore onto another mesh really reshards.

Everything Resilax-specific is the five marked lines, as in examples/train.py: join the job's
processes, build the checkpoint manager from the environment the operator injects, restore onto
whatever mesh this generation has, save each step (the manager decides when), and stop when asked.
One more, line 0, is optional: it starts the restore's reads before JAX is imported (the restore
prefetch; line 1 starts it too, a little later), and the compile runs while the restore reads.
The data is a pure function of the step, so the loss curve continues across generations and any lost
step would show. `rc.run_kept(main)` runs it: under `resilax run`, a restart that changes nothing but the
generation (one process, the same world) runs in this same process (docs/architecture.md, "Keep what can
be kept"); elsewhere it is a plain call.

`--report-startup` prints one more JSON line, {"startup": ...}, after the first step: the wall-clock
time of each part of the start (interpreter, imports, opening the devices, trace and lower, compile or
compilation-cache load, restore, host-to-device, first step), which bench/resilax_bench/restart.py
collects; in a kept process, the kept restart's parts instead of the interpreter's and the imports'.
"""

from __future__ import annotations

import time

SCRIPT_START = time.time()  # before the heavy imports

import resilax_ckpt as rc  # noqa: E402  (JAX-free until a JAX part of it is used)

# 0. Start reading the checkpoint the restore will most likely want while JAX imports and opens the
# devices (RESILAX_RESTORE_PREFETCH=0: off). Line 1 would start it too, after `import jax`.
PREFETCH = rc.start_prefetch()
PREFETCH_STARTED = time.time()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

IMPORTS_DONE = time.time()


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab: int
    width: int
    layers: int
    heads: int
    ff: int
    seq_len: int
    batch: int
    """The global batch (sequences per step), split over the mesh's data axis."""
    dtype: str
    """The parameters' and activations' dtype; Adam's moments are always float32."""

    def parameter_count(self) -> int:
        d = self.width
        per_layer = 4 * d * d + 2 * d * self.ff + 2 * d
        return self.vocab * d + self.layers * per_layer + d

    def state_bytes(self) -> int:
        """Parameters in `dtype` plus Adam's two float32 moments."""
        return self.parameter_count() * (jnp.dtype(self.dtype).itemsize + 8)


PRESETS: dict[str, ModelConfig] = {
    # Seconds per process on 2 CPU cores: what the tests and the CPU smoke of the restart bench run.
    "cpu-tiny": ModelConfig(vocab=128, width=64, layers=2, heads=4, ff=256, seq_len=32, batch=16, dtype="float32"),
    "cpu-small": ModelConfig(vocab=1024, width=256, layers=4, heads=8, ff=1024, seq_len=128, batch=16,
                             dtype="float32"),
    # One TPU v5e chip (15.7 GiB HBM): 0.67B parameters, bf16 parameters + float32 Adam moments = 6.25 GiB
    # (40% of HBM). The step's own buffers come on top (XLA's memory analysis of this step compiled for
    # CPU: 5.9 GiB of temporaries, the bf16 gradients and the logits mostly; the chip reports its own in
    # the startup line), and a save's device-side copy of the state needs the state's size again while
    # it drains: 16 layers (8.1 GiB of state) would not leave room for both. Width 2048 with head dim
    # 128 (the MXU's size); the layers are scanned, so the compile is one layer's whatever the depth
    # (the compile-time reference, 16 unrolled layers at width 1024, compiled in 36 s).
    "tpu-v5e": ModelConfig(vocab=32768, width=2048, layers=12, heads=16, ff=8192, seq_len=1024, batch=4,
                           dtype="bfloat16"),
}


class Marks:
    """Wall-clock times (time.time()) of the start's parts, by name; `--report-startup` prints them."""

    def __init__(self) -> None:
        from resilax_ckpt.trainer.kept_trainer import last_restart

        self.kept = last_restart()  # in a kept process, this incarnation starts at the resume
        if self.kept is not None:
            self.times: dict[str, float] = {**self.kept, "process_start": self.kept["resume_received"]}
        else:
            self.times = {"process_start": process_start_time(), "script_start": SCRIPT_START,
                          "line0_done": PREFETCH_STARTED, "imports_done": IMPORTS_DONE}
            launched = os.environ.get("RESILAX_BENCH_LAUNCH_TIME", "").strip()
            if launched:
                self.times["launch"] = float(launched)
        self._lock = threading.Lock()

    def mark(self, name: str) -> None:
        with self._lock:
            self.times[name] = time.time()


def process_start_time() -> float:
    """This process's start as a wall-clock time: /proc/self/stat's starttime (clock ticks since boot)
    against /proc/uptime (10 ms resolution). The script's own start where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - (uptime - started_after_boot)
    except (OSError, ValueError, IndexError):
        return SCRIPT_START


# ---------------------------------------------------------------------------- model


def make_mesh() -> Mesh:
    """All devices of this generation on one axis, `data`."""
    return Mesh(np.array(jax.devices()), ("data",))


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    d, L = cfg.width, cfg.layers
    return {
        "embed": (cfg.vocab, d),
        "layers": {"ln1": (L, d), "wqkv": (L, d, 3 * d), "wo": (L, d, d), "ln2": (L, d),
                   "w1": (L, d, cfg.ff), "w2": (L, cfg.ff, d)},
        "ln_f": (d,),
    }


def fsdp_spec(shape: tuple[int, ...], devices: int, stacked: bool) -> P:
    """Shard the largest dimension that the device count divides over `data` (never the layer axis of
    a stacked weight); replicate a weight no dimension of which divides."""
    dims = list(range(1 if stacked else 0, len(shape)))
    for dim in sorted(dims, key=lambda i: -shape[i]):
        if shape[dim] % devices == 0 and shape[dim] >= devices:
            spec: list[str | None] = [None] * len(shape)
            spec[dim] = "data"
            return P(*spec)
    return P()


def state_shardings(cfg: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """The training state's shardings: the parameters and both moments alike, the step count replicated."""
    n = mesh.devices.size

    def shard(shape: tuple[int, ...], stacked: bool) -> NamedSharding:
        return NamedSharding(mesh, fsdp_spec(shape, n, stacked))

    shapes = param_shapes(cfg)
    params = {"embed": shard(shapes["embed"], False), "ln_f": shard(shapes["ln_f"], False),
              "layers": {k: shard(v, True) for k, v in shapes["layers"].items()}}
    return {"params": params, "opt": {"mu": params, "nu": params, "count": NamedSharding(mesh, P())}}


def abstract_state(cfg: ModelConfig, mesh: Mesh) -> dict[str, Any]:
    """The state as jax.ShapeDtypeStructs with their shardings: the restore's target and what the
    step is compiled for, without allocating anything."""
    shardings = state_shardings(cfg, mesh)
    dtype = jnp.dtype(cfg.dtype)
    shapes = param_shapes(cfg)

    def leaf(shape: tuple[int, ...], sharding: NamedSharding, dt: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    def tree(dt: Any, which: str) -> Any:
        return jax.tree.map(lambda s, sh: leaf(s, sh, dt), shapes, shardings["opt"][which],
                            is_leaf=lambda x: isinstance(x, tuple))

    return {"params": tree(dtype, "mu"), "opt": {"mu": tree(jnp.float32, "mu"), "nu": tree(jnp.float32, "nu"),
                                                 "count": leaf((), shardings["opt"]["count"], jnp.int32)}}


def init_state(cfg: ModelConfig) -> dict[str, Any]:
    """Fresh parameters (the same for every mesh: a pure function of the config) and zero moments."""
    dtype = jnp.dtype(cfg.dtype)
    shapes = param_shapes(cfg)
    paths, treedef = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.key(0), len(paths))
    leaves = []
    for key, (path, shape) in zip(keys, paths, strict=True):
        if jax.tree_util.keystr(path[-1:]).strip("[']").startswith("ln"):
            leaves.append(jnp.ones(shape, dtype))  # a norm's scale
        else:
            leaves.append((jax.random.normal(key, shape, jnp.float32) / np.sqrt(shape[-2])).astype(dtype))
    params = jax.tree.unflatten(treedef, leaves)
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    return {"params": params, "opt": {"mu": zeros, "nu": zeros, "count": jnp.zeros((), jnp.int32)}}


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype) * scale


def forward(cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    """Logits for every position of `tokens` (batch, seq)."""
    b, s = tokens.shape
    h, dh = cfg.heads, cfg.width // cfg.heads

    def block(x: jax.Array, p: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        y = rms_norm(x, p["ln1"])
        q, k, v = jnp.split((y @ p["wqkv"]).reshape(b, s, 3 * h, dh), 3, axis=2)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + a.reshape(b, s, cfg.width) @ p["wo"]
        y = rms_norm(x, p["ln2"])
        return x + jax.nn.gelu(y @ p["w1"]) @ p["w2"], None

    x = params["embed"][tokens]
    x, _ = jax.lax.scan(jax.checkpoint(block), x, params["layers"])
    return rms_norm(x, params["ln_f"]) @ params["embed"].T


def loss_fn(cfg: ModelConfig, params: dict[str, Any], tokens: jax.Array) -> jax.Array:
    logits = forward(cfg, params, tokens[:, :-1]).astype(jnp.float32)
    targets = tokens[:, 1:]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def adam(state: dict[str, Any], grads: dict[str, Any], lr: float,
         b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8) -> dict[str, Any]:
    """One Adam update in float32; the parameters keep their dtype."""
    opt = state["opt"]
    count = opt["count"] + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g.astype(jnp.float32), opt["mu"], grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g.astype(jnp.float32)), opt["nu"], grads)
    c1 = 1 - b1 ** count.astype(jnp.float32)
    c2 = 1 - b2 ** count.astype(jnp.float32)
    params = jax.tree.map(
        lambda p, m, v: (p.astype(jnp.float32) - lr * (m / c1) / (jnp.sqrt(v / c2) + eps)).astype(p.dtype),
        state["params"], mu, nu)
    return {"params": params, "opt": {"mu": mu, "nu": nu, "count": count}}


def batch(cfg: ModelConfig, step: jax.Array) -> jax.Array:
    """The same sequences for a step in every generation, whatever the mesh: each row counts up from a
    random token by a random stride (mod vocab), so the next token is learnable from the two before."""
    k1, k2 = jax.random.split(jax.random.fold_in(jax.random.key(1), step))
    start = jax.random.randint(k1, (cfg.batch, 1), 0, cfg.vocab)
    stride = jax.random.randint(k2, (cfg.batch, 1), 1, 8)
    return (start + stride * jnp.arange(cfg.seq_len + 1)[None, :]) % cfg.vocab


class Programs:
    """The jitted programs of one mesh: init, the batch of a step and the (donating) train step."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, lr: float) -> None:
        shardings = state_shardings(cfg, mesh)
        data = NamedSharding(mesh, P("data", None))
        replicated = NamedSharding(mesh, P())

        def step_fn(state: dict[str, Any], tokens: jax.Array) -> tuple[dict[str, Any], jax.Array]:
            loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, tokens))(state["params"])
            return adam(state, grads, lr), loss

        self.init = jax.jit(lambda: init_state(cfg), out_shardings=shardings)
        self.batch = jax.jit(lambda step: batch(cfg, step), out_shardings=data)
        self.step = jax.jit(step_fn, donate_argnums=0, out_shardings=(shardings, replicated))
        self.abstract = abstract_state(cfg, mesh)
        self.tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq_len + 1), jnp.int32, sharding=data)
        self.step_number = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)

    def compile(self, marks: Marks) -> dict[str, Any]:
        """Trace, lower and compile the step and the batch ahead of time (a persistent-cache load when
        the cache has them): only shapes are needed, so it can run before the state exists."""
        marks.mark("lower_start")
        lowered = {"step": self.step.lower(self.abstract, self.tokens),
                   "batch": self.batch.lower(self.step_number)}
        marks.mark("lower_done")
        compiled = {name: low.compile() for name, low in lowered.items()}
        marks.mark("compile_done")
        return compiled


class Background:
    """A function run on a thread; `join` returns its result or raises its error."""

    def __init__(self, fn: Any) -> None:
        self._result: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._result = fn()
            except BaseException as e:  # re-raised on the caller's thread by join()
                self._error = e

        self._thread = threading.Thread(target=run, name="compile", daemon=True)
        self._thread.start()

    def join(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


def config_from_args(args: argparse.Namespace) -> ModelConfig:
    cfg = PRESETS[args.preset]
    overrides = {name: getattr(args, name) for name in ("vocab", "width", "layers", "heads", "ff", "seq_len",
                                                         "batch", "dtype") if getattr(args, name) is not None}
    cfg = dataclasses.replace(cfg, **overrides)
    problems = []
    if cfg.width % cfg.heads:
        problems.append(f"--width {cfg.width} is not a multiple of --heads {cfg.heads}")
    if cfg.dtype not in ("float32", "bfloat16"):
        problems.append(f"--dtype {cfg.dtype!r}; allowed: float32, bfloat16")
    for name in ("vocab", "width", "layers", "heads", "ff", "seq_len", "batch"):
        if getattr(cfg, name) < 1:
            problems.append(f"--{name.replace('_', '-')} {getattr(cfg, name)}; allowed: >= 1")
    if problems:
        raise SystemExit("examples/transformer.py: " + "; ".join(problems))
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny",
                        help="model and batch size (flags below override its fields)")
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--ff", type=int, help="the MLP's hidden width")
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--batch", type=int, help="the global batch, split over the devices")
    parser.add_argument("--dtype", help="float32 or bfloat16 (parameters and activations)")
    parser.add_argument("--steps", type=int, default=200, help="train until this step")
    parser.add_argument("--extra-steps", type=int, metavar="N",
                        help="train N steps past the restored one (instead of until --steps)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (to watch faults)")
    parser.add_argument("--no-final-save", action="store_true", help="do not force a save after the last step")
    parser.add_argument("--serial-start", action="store_true",
                        help="restore (or make the fresh state), then compile (default: the compile runs in a "
                             "thread from the moment the devices are open)")
    parser.add_argument("--compile-cache", metavar="DIR",
                        help="JAX's persistent compilation cache here, every program cached "
                             "(default: JAX_COMPILATION_CACHE_DIR, if set)")
    parser.add_argument("--report-startup", action="store_true",
                        help="print the start's parts as one JSON line {\"startup\": ...} after the first step")
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    marks = Marks()
    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

    rc.initialize_distributed_from_env()  # 1. join this generation's processes
    marks.mark("devices_start")
    mesh = make_mesh()  # opens the devices (the TPU runtime's start)
    marks.mark("devices_done")
    if cfg.batch % mesh.devices.size:
        raise SystemExit(f"examples/transformer.py: --batch {cfg.batch} does not split over this generation's "
                         f"{mesh.devices.size} devices; allowed: a multiple of the device count")
    programs = Programs(cfg, mesh, args.lr)
    # The step's compile (or cache load) needs only shapes: it runs while the manager starts and the
    # restore reads (or the fresh state is made), unless --serial-start.
    compiling = None if args.serial_start else Background(lambda: programs.compile(marks))

    generation = int(os.environ.get("RESILAX_GENERATION", "0"))
    restored: int | None = None
    with rc.CheckpointManager.from_env() as mgr:  # 2. policy, storage and generation from the env
        marks.mark("manager_done")
        target = {**programs.abstract, "meta": {"step": 0}}
        restore_step = mgr.restore_step_from_env(target=target)  # the step all processes can read
        if restore_step is not None:  # 3. restore onto this generation's mesh
            began = time.time()
            marks.mark("restore_start")
            state = mgr.restore(restore_step, target=target)
            marks.mark("restore_returned")
            jax.block_until_ready(state)
            marks.mark("restore_on_device")
            restored = int(state["meta"]["step"])
            report = mgr.restore_report or {}
            print(json.dumps({"restored": restore_step, "from": mgr.restored_from, "sources": report.get("sources"),
                              "generation": generation,
                              "process": jax.process_index(), "node": os.environ.get("RESILAX_NODE_NAME", ""),
                              "began": began, "time": time.time()}),
                  flush=True)
        else:
            marks.mark("init_start")
            state = {**programs.init.lower().compile()(), "meta": {"step": 0}}  # its own compile or cache load
            jax.block_until_ready(state)
            marks.mark("init_done")
        compiled = programs.compile(marks) if compiling is None else compiling.join()
        start = int(state["meta"]["step"])
        train_step, make_batch = compiled["step"], compiled["batch"]
        train = {"params": state["params"], "opt": state["opt"]}

        last = start + args.extra_steps if args.extra_steps is not None else args.steps
        for step in range(start + 1, last + 1):
            tokens = make_batch(np.int32(step))
            train, loss = train_step(train, tokens)
            state = {**train, "meta": {"step": step}}
            if jax.process_index() == 0:
                record = {"step": step, "loss": float(loss), "generation": generation,
                          "devices": jax.device_count(), "time": time.time()}
                print(json.dumps(record), flush=True)
            if step == start + 1:
                marks.mark("first_step_done")
                if args.report_startup and jax.process_index() == 0:
                    print(json.dumps({"startup": startup_report(cfg, marks, restored, compiled["step"])}), flush=True)
            saving = time.time()
            mgr.save(step, state)  # 4. saves when the policy or a save request says so
            if mgr.should_stop:  # 5. a preemption or resize asked us to stop after a final save
                mgr.wait()
                if args.report_startup and jax.process_index() == 0:
                    print(json.dumps({"stopped": {"step": step, "save_start": saving, "done": time.time()}}),
                          flush=True)
                return rc.EXIT_CODE_STOPPED
            if args.step_seconds:
                time.sleep(args.step_seconds)
        if not args.no_final_save and last > start:
            marks.mark("final_save_start")
            mgr.save(last, state, force=True)
            mgr.wait()
            marks.mark("final_save_done")
            if args.report_startup and jax.process_index() == 0:
                print(json.dumps({"final_save": {"start": marks.times["final_save_start"],
                                                 "done": marks.times["final_save_done"],
                                                 "step": last}}), flush=True)
    return 0


def startup_report(cfg: ModelConfig, marks: Marks, restored: int | None, compiled_step: Any) -> dict[str, Any]:
    """The start's parts for `--report-startup`: wall-clock marks plus what ran where."""
    from resilax_ckpt.control.trainer_metrics import COMPILATION_CACHE

    device = jax.devices()[0]
    memory: dict[str, int] = {}
    try:
        analysis = compiled_step.memory_analysis()
        for name in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                     "generated_code_size_in_bytes"):
            memory[name] = int(getattr(analysis, name))
    except Exception:  # not every backend reports it
        memory = {}
    return {
        "marks": marks.times,
        "restored_step": restored,
        "config": dataclasses.asdict(cfg),
        "parameters": cfg.parameter_count(),
        "state_bytes": cfg.state_bytes(),
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "jax": jax.__version__,
        "compilation_cache": {"dir": getattr(jax.config, "jax_compilation_cache_dir", None),
                              "requests": COMPILATION_CACHE.requests, "hits": COMPILATION_CACHE.hits},
        "step_memory": memory,
        "prefetch": prefetch_report(marks),
        "kept": marks.kept is not None, "pid": os.getpid(),
    }


def prefetch_report(marks: Marks) -> dict[str, Any] | None:
    """The restore prefetch's own account (what it read, when, what the restore took), its read added
    to the marks as prefetch_read_start / prefetch_read_done. None when none ran (line 0's; in a kept
    process, the one rc.run_kept started)."""
    from resilax_ckpt.restoring import prefetch

    handle = prefetch.current()
    if handle is None:
        return None
    stats = handle.stats()
    if stats.get("started") is not None:
        marks.times["prefetch_read_start"] = float(stats["started"])
        if stats.get("read_seconds") is not None:
            marks.times["prefetch_read_done"] = float(stats["started"]) + float(stats["read_seconds"])
    return {k: v for k, v in stats.items() if k != "path"}


if __name__ == "__main__":
    sys.exit(rc.run_kept(main))  # under `resilax run`, this process may run the next generation too
