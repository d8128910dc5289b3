"""Settings of a CheckpointManager: one frozen dataclass, built once (`ManagerOptions.from_env()`)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping

from resilax_ckpt.errors import ResilaxCkptError
from resilax_ckpt.saving import retention


class InvalidOptionsError(ResilaxCkptError, ValueError):
    """An option (or the environment variable it came from) has an invalid value."""


DEVICE_COPY_MODES = ("auto", "on_device", "host_transfer")
"""The values of `ManagerOptions.device_copy`."""


@dataclasses.dataclass(frozen=True)
class ManagerOptions:
    """How a CheckpointManager saves, keeps and coordinates checkpoints."""

    save_every_steps: int | None = None
    """Save when `step % save_every_steps == 0` (None: no step policy)."""

    save_every_seconds: float | None = None
    """Save when this many seconds passed since the last save (None: no time policy)."""

    keep_last: int | None = None
    """Keep the newest N committed steps (None: keep all)."""

    keep_every_steps: int | None = None
    """Also keep every step that is a multiple of this, whatever `keep_last` says (Orbax's
    `keep_period`)."""

    keep_every_seconds: float | None = None
    """Also keep one step per this many seconds of save time: the oldest, then each saved at least
    this long after the previous one kept (Orbax's `keep_time_interval`; retention.py)."""

    keep_best: int | None = None
    """Keep the N steps with the best `keep_best_metric` (passed to `save(..., metrics=)`), on top of
    `keep_last`; steps saved without that metric are kept by `keep_last` (all of them without it).
    Needs `keep_best_metric` and `keep_best_mode` (Orbax's `best_fn`, `best_mode`; retention.py)."""

    keep_best_metric: str | None = None
    """The metric `keep_best` ranks steps by (a key of `save(..., metrics=)`)."""

    keep_best_mode: str | None = None
    """"max" (higher is better, e.g. accuracy) or "min" (lower is better, e.g. loss)."""

    async_save: bool = True
    """`save()` returns after the device-to-host snapshot; writes and commit run in the background."""

    generation: int = 0
    """The worker generation (RESILAX_GENERATION); a newer generation fences older ones out."""

    job_uid: str | None = None
    """The JAXJob's uid (RESILAX_JOB_UID): a job re-created on storage an earlier job used gets a
    newer era (fencing.py), so its generations, which restart at 1, outrank the old job's."""

    job_name: str | None = None
    """`<namespace>/<name>` of the JAXJob (RESILAX_NAMESPACE, RESILAX_JOB_NAME), recorded with its era
    claim so that another job refused the storage is told which job holds it."""

    live_job_uids: tuple[str, ...] = ()
    """The uids of the other live JAXJobs with the same storage (RESILAX_LIVE_JOB_UIDS, comma-separated,
    set by the operator): when one of them holds the storage (the newest era claim), this job does not
    take it over but raises StorageInUseError (fencing.decide_claim), unless `take_over`."""

    take_over: bool = False
    """Take the storage over from a live job that holds it (RESILAX_TAKE_OVER=true, from
    spec.checkpoint.takeOver): that job's workers can no longer commit there."""

    local_tier: bool = False
    """The directory is per host (the local fast tier): every process writes every shard it holds,
    its own metadata and its own `_COMMIT`; no cross-process barrier is needed."""

    control_dir: str | None = None
    """Folder of save requests and results shared with the sidecar (RESILAX_CONTROL_DIR)."""

    handle_sigterm: bool = True
    """Treat SIGTERM as a save request with stop, in every mode (one process or several, with or
    without a local tier): a Python handler sets a flag, the processes agree at the next request
    check on one step, save it, and `should_stop` turns True once it is committed. The handler
    replaces any earlier one (with several processes, JAX's preemption notifier)."""

    request_check_every_steps: int = 1
    """With several processes, agree on pending save requests every this many steps (a barrier on
    the coordination service, no device work)."""

    recycle_pool: int = 1
    """How many steps retired by retention are kept as `<root>/.recycle-<step>/` folders for the next
    saves to rewrite in place (local shared folders only; not gs:// or the local tier). 0: delete
    retired steps."""

    write_threads: int = 8
    """Threads writing chunk files on local paths (chunk_writer.py)."""

    max_inflight_bytes: int = 128 << 20
    """Upper bound of bytes being written or read at once (bounds the host memory of I/O)."""

    io_concurrency: int = 32
    """tensorstore's `data_copy_concurrency` and `file_io_concurrency` limits."""

    restore_host_buffer_bytes: int = 512 << 20
    """A restore onto accelerators reads into one region of host memory of up to this many bytes,
    kept by the process and reused by every restore (reader.py, "host ring"): each leaf's piece is
    reused once its transfer to the devices is done, so no restore faults the state's size of fresh
    memory in; where the largest leaf is bigger than this, the ring holds it, and where the restore
    prefetch faults the ring in ahead, it holds the two largest leaves (one is read while the other is
    transferred; host_ring.plan_ring_bytes), never more than the state. 0: fresh buffers for every leaf."""

    restore_reuse_host_buffers: bool | None = None
    """Whether restores read into the host ring: None (auto) for leaves going to accelerators (on
    CPU devices `device_put` aliases the read buffer: the restored array keeps it); True forces it
    on CPU devices too, a device-side copy standing for the transfer (for tests: the accelerator's
    path on CPU); False never."""

    gcs_retries: int | None = None
    """How often tensorstore retries a failed gs:// request (None: tensorstore's default, 32)."""

    direct_io: bool = True
    """Local disks (not tmpfs): write chunk files of 64 KiB and more with O_DIRECT through a few
    reused aligned buffers, and read them back with O_DIRECT into the restored arrays, so neither a
    save nor a restore fills the page cache (chunk_writer.py, reader.py). A filesystem that refuses
    O_DIRECT gets buffered I/O either way."""

    shard_files: bool = True
    """Local shared folders: store each array as zarr3 shards, one file per array and process (each
    process's chunks back to back, `sharding_indexed`; chunk_format.ArrayFiles), instead of one file
    per chunk: a step has several times fewer files (a job's first save creates fewer), and a
    restore reads a shard's chunks in runs (file_reader.RUN_BYTES). Not on gs:// or in the local tier,
    and only where the processes' shards form a regular grid (planning.plan_shard_shape)."""

    device_copy: str = "auto"
    """How a save takes its shards off the devices (docs/checkpointing.md §4; RESILAX_DEVICE_COPY):
    "on_device": one jitted copy on the devices (costs the saved shards' size in device memory until
    drained), `save()` returns after the dispatch and a background thread drains the copy to the host
    a few shards in flight at a time (on an accelerator a save before the jitted copy is compiled
    takes a runtime copy, `jax.device_put`); "host_transfer": batched device-to-host transfers that `save()` waits for (no device
    memory); "auto": the on-device copy on CPU devices, and on accelerators where every device's
    memory statistics leave room for it (with a margin), else a host transfer. Forcing either on CPU
    devices runs the same code as on an accelerator (the tests do; on CPU a host transfer also copies
    each shard into reused host buffers, since NumPy views of CPU arrays alias the device buffers)."""

    fsync: bool = True
    """Make every written file durable (local chunk files: writeback started per file, one syncfs at
    the end; tensorstore: `file_io_sync`) and fsync the step folder before commit."""

    barrier_timeout_seconds: float = 900.0
    """How long a process waits for the others at a save's barriers before it fails the save."""

    sidecar_address: str | None = None
    """`host:port` of this pod's sidecar (RESILAX_SIDECAR_HOST, RESILAX_SIDECAR_PORT): with a local tier
    and several processes, the processes exchange these at start (`$RESILAX_CONTROL_DIR/peers.json`,
    for the sidecars' peer replicas) and a restore asks the sidecar to fetch this process's step from
    the peers holding it (peers.py)."""

    sidecar_token_file: str | None = None
    """RESILAX_SIDECAR_TOKEN_FILE: the bearer token of the sidecars' API (peer fetches)."""

    slice_id: int = 0
    """RESILAX_SLICE_ID: this process's slice (the placement of peer replicas)."""

    node_name: str = ""
    """RESILAX_NODE_NAME: this process's node (peer replicas go to another node)."""

    clock: Callable[[], float] = time.monotonic
    """The time source of `save_every_seconds` (injectable for tests)."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("save_every_steps", "keep_last", "keep_every_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name}: {value!r} must be >= 1 or None")
        for name in ("save_every_seconds", "keep_every_seconds"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                problems.append(f"{name}: {value!r} must be > 0 or None")
        if self.keep_best is not None:
            problems.extend(retention.KeepBest(self.keep_best, self.keep_best_metric or "",
                                               self.keep_best_mode or "").problems())
        else:
            problems.extend(f"{name}: {getattr(self, name)!r} needs keep_best (the number of best steps to keep)"
                            for name in ("keep_best_metric", "keep_best_mode") if getattr(self, name) is not None)
        if self.request_check_every_steps < 1:
            problems.append(f"request_check_every_steps: {self.request_check_every_steps!r} must be >= 1")
        if self.recycle_pool < 0:
            problems.append(f"recycle_pool: {self.recycle_pool!r} must be >= 0 (0 disables recycling)")
        if self.write_threads < 1:
            problems.append(f"write_threads: {self.write_threads!r} must be >= 1")
        if self.restore_host_buffer_bytes < 0:
            problems.append(f"restore_host_buffer_bytes: {self.restore_host_buffer_bytes!r} must be >= 0 "
                            "(0: no host ring)")
        if self.device_copy not in DEVICE_COPY_MODES:
            problems.append(f"device_copy: {self.device_copy!r} must be one of {', '.join(map(repr, DEVICE_COPY_MODES))}")
        if self.max_inflight_bytes < 1:
            problems.append(f"max_inflight_bytes: {self.max_inflight_bytes!r} must be >= 1")
        if problems:
            raise InvalidOptionsError("; ".join(problems))

    @property
    def retention_rule(self) -> retention.RetentionRule:
        """What retention keeps (retention.py)."""
        best = (retention.KeepBest(self.keep_best, self.keep_best_metric or "", self.keep_best_mode or "")
                if self.keep_best is not None else None)
        return retention.RetentionRule(self.keep_last, self.keep_every_steps, self.keep_every_seconds, best)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> ManagerOptions:
        """Build from the RESILAX_* variables of docs/architecture.md; `overrides` win."""
        env = os.environ if env is None else env
        problems: list[str] = []

        def number(name: str, kind: type[int] | type[float]) -> int | float | None:
            raw = env.get(name, "").strip()
            if not raw:
                return None
            try:
                return kind(raw)
            except ValueError:
                problems.append(f"{name}: {raw!r} is not a{'n integer' if kind is int else ' number'}")
                return None

        values: dict[str, object] = {
            "save_every_steps": number("RESILAX_SAVE_EVERY_STEPS", int),
            "save_every_seconds": number("RESILAX_SAVE_EVERY_SECONDS", float),
            "keep_last": number("RESILAX_KEEP_LAST", int),
            "keep_every_steps": number("RESILAX_KEEP_EVERY_STEPS", int),
            "keep_every_seconds": number("RESILAX_KEEP_EVERY_SECONDS", float),
            "keep_best": number("RESILAX_KEEP_BEST", int),
            "keep_best_metric": env.get("RESILAX_KEEP_BEST_METRIC", "").strip() or None,
            "keep_best_mode": env.get("RESILAX_KEEP_BEST_MODE", "").strip() or None,
            "generation": number("RESILAX_GENERATION", int) or 0,
            "control_dir": env.get("RESILAX_CONTROL_DIR") or None,
            "job_uid": env.get("RESILAX_JOB_UID") or None,
            "job_name": (f"{env.get('RESILAX_NAMESPACE', '').strip()}/{env['RESILAX_JOB_NAME'].strip()}"
                         if env.get("RESILAX_JOB_NAME", "").strip() else None),
            "live_job_uids": tuple(u.strip() for u in env.get("RESILAX_LIVE_JOB_UIDS", "").split(",") if u.strip()),
            "take_over": env.get("RESILAX_TAKE_OVER", "").strip().lower() in ("1", "true", "yes"),
            "slice_id": number("RESILAX_SLICE_ID", int) or 0,
            "node_name": env.get("RESILAX_NODE_NAME", "").strip(),
            "sidecar_token_file": env.get("RESILAX_SIDECAR_TOKEN_FILE", "").strip() or None,
            "device_copy": env.get("RESILAX_DEVICE_COPY", "").strip().lower() or "auto",
        }
        host, port = env.get("RESILAX_SIDECAR_HOST", "").strip(), env.get("RESILAX_SIDECAR_PORT", "").strip()
        if host and port:
            values["sidecar_address"] = f"{host}:{port}"
        if problems:
            raise InvalidOptionsError("; ".join(problems))
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


DEFAULT_LOCAL_DIRECTORY = "resilax-checkpoints"
"""Where `CheckpointManager.from_env` saves outside a pod (relative to the working directory)."""


@dataclasses.dataclass(frozen=True)
class TierDirectories:
    """Where a worker's manager saves and restores, from the RESILAX_* variables (`from_env`)."""

    directory: str
    """Where saves go: RESILAX_LOCAL_DIR (the per-host local tier) when set, else RESILAX_CHECKPOINT_DIR,
    else DEFAULT_LOCAL_DIRECTORY under the working directory (outside a pod)."""
    persistent_directory: str | None
    """With a local tier: RESILAX_CHECKPOINT_DIR (or its default), where restore falls back to."""
    in_pod: bool
    """Whether RESILAX_CHECKPOINT_DIR is set (else the default folder is used)."""

    @property
    def local_tier(self) -> bool:
        return self.persistent_directory is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TierDirectories:
        env = os.environ if env is None else env
        directory = env.get("RESILAX_CHECKPOINT_DIR", "").strip()
        in_pod = bool(directory)
        if not directory:
            directory = os.path.abspath(DEFAULT_LOCAL_DIRECTORY)
        local = env.get("RESILAX_LOCAL_DIR", "").strip()
        if local:
            return cls(local, directory, in_pod)
        return cls(directory, None, in_pod)
