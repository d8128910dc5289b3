"""The restore hidden under start-up (issue 38): a restarting trainer reads its checkpoint into host
memory while JAX starts (the imports, `jax.devices()` opening the chip, the executable's load from the
compile cache), so that little more than the host-to-device transfer is left when it restores
(docs/checkpointing.md, "Restore prefetch").

`start_prefetch()` (the trainer's first line; `initialize_distributed_from_env`, the first of the five
lines, calls it too) reads the environment the operator injects as `CheckpointManager.from_env` does
(options.TierDirectories), picks the step the restore will try first as far as this process alone can
tell (`restore_choice.decide_prefetch_step` over the listings the restore itself uses: commit.py's
visible steps, with the same fences, bad records and timelines), reads that step's metadata, and
reads its arrays with the restore's own reader (reader.read_leaves: the same aligned buffers, every
chunk's checksum verified) into host buffers, all on a background thread: the trainer's first line
waits for the choice only when every root is a local folder, never for an object store's listing (an
unreachable gs:// endpoint held it ~35-50 s in gcsfs's retries). What it reads: whole arrays in a
one-process job; with several processes, the chunks of this process's local-tier files (with an
unchanged mesh, what its restore reads); nothing otherwise (a shared folder or the persistent tier
with several processes: which chunks a process needs is unknown before its mesh exists). With
accelerators expected and the step on tmpfs it reads nothing and faults the restore's host ring in
instead (`PrefetchSettings.ring_only`). Its buffers are faulted in before any read into them
(host_ring.populate_pages).

The restore's choice of step is unchanged and stays fenced: `CheckpointManager.restore` picks its step
as before (agreement across processes, fallback to older steps, pinned steps). When it reads a step
folder, `claim` hands it the prefetched buffers of that very folder, leaf by leaf, where the leaf's
metadata is the one prefetched and its files are the ones read (device, inode, size and mtime
unchanged); every other leaf and box is read as before, and a prefetch of a folder the restore does
not read is dropped, never restored from, as is one that has not chosen its step when the restore
reads (the restore never waits for the prefetch's listing). Memory: at most
RESILAX_RESTORE_PREFETCH_MEMORY (a fraction of the host's available memory, default 0.5); the leaves
beyond are left to the restore. The buffers it hands over become the restored state (XLA:CPU aliases
them; an accelerator's transfer copies them and they are freed), so a used prefetch costs no memory
beyond the restore's own.

This module: the settings, the choice of step and the process's one prefetch; read_ahead.py: the reads
on their thread and the hand-over to the restore. JAX-free: neither imports anything that imports jax
(tests/ckpt/test_restore_prefetch.py checks).
Called on: each process by itself (no collective).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
import threading
from collections.abc import Callable, Mapping

import numpy as np

from resilax_ckpt import commit, layout
from resilax_ckpt.chunks import chunk_writer, file_reader, host_ring, reader
from resilax_ckpt.errors import MetadataError
from resilax_ckpt.metadata import StepMetadata
from resilax_ckpt.options import InvalidOptionsError, ManagerOptions, TierDirectories
from resilax_ckpt.restoring import read_ahead, restore_choice
from resilax_ckpt.storage import Storage, open_storage

__all__ = ["ENV", "MEMORY_ENV", "PrefetchSettings", "claim", "current", "plan_prefetch", "release",
           "start_prefetch", "stop"]

log = logging.getLogger(__name__)

ENV = "RESILAX_RESTORE_PREFETCH"
"""`0` (or false/no/off) turns the prefetch off; on by default; `read` reads ahead even where it
would only warm the host ring (`PrefetchSettings.ring_only`)."""
MEMORY_ENV = "RESILAX_RESTORE_PREFETCH_MEMORY"
"""The most host memory the prefetch takes, as a fraction of the memory available at start (0, 1]."""
DEFAULT_MEMORY_FRACTION = 0.5

_TRUE = ("", "1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class PrefetchSettings:
    """What a process prefetches, from the environment (`from_env`)."""

    dirs: TierDirectories
    """Where the manager built by `CheckpointManager.from_env` saves and restores."""
    options: ManagerOptions
    """Its I/O settings (io_concurrency, max_inflight_bytes, direct_io, fsync)."""
    process_index: int
    """JAX_PROCESS_ID with several processes (JAX_COORDINATOR_ADDRESS and JAX_NUM_PROCESSES > 1), else 0."""
    process_count: int
    asked_step: int | None
    """The step RESILAX_RESTORE_STEP names (None: `latest`)."""
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    """RESILAX_RESTORE_PREFETCH_MEMORY."""
    ring_only: bool = False
    """Accelerators expected (`accelerator_expected`) and RESILAX_RESTORE_PREFETCH not `read`: a step
    in a memory filesystem (tmpfs: the local tier) is not read ahead; the restore's host ring is
    faulted in instead, sized as the restore sizes it (`host_ring.plan_ring_bytes`). The restore then reads from
    memory into memory already faulted in (~18 GB/s on the TPU test host) while the transfers run,
    where reading ahead needs the whole state in fresh memory (~1 s per GiB to fault in there, under
    gVisor: longer than the chip's start-up for a 6.25 GiB state)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PrefetchSettings | None:
        """None when there is nothing to prefetch: RESILAX_RESTORE_PREFETCH=0, RESILAX_RESTORE_STEP=none,
        or neither RESILAX_CHECKPOINT_DIR nor RESILAX_LOCAL_DIR set (not configured as a JAXJob's
        worker). Raises InvalidOptionsError naming every malformed variable."""
        env = os.environ if env is None else env
        problems: list[str] = []
        enabled = env.get(ENV, "").strip().lower()
        if enabled not in (*_TRUE, *_FALSE, "read"):
            problems.append(f"{ENV}={enabled!r} is not a switch; allowed: 1, true, yes, on, 0, false, no, off, read")
        fraction = DEFAULT_MEMORY_FRACTION
        raw = env.get(MEMORY_ENV, "").strip()
        if raw:
            try:
                fraction = float(raw)
            except ValueError:
                fraction = -1.0
            if not 0 < fraction <= 1:
                problems.append(f"{MEMORY_ENV}={raw!r} is not a fraction of the available memory; allowed: "
                                "a number > 0 and <= 1")
        step_raw = env.get("RESILAX_RESTORE_STEP", "latest").strip().lower() or "latest"
        asked: int | None = None
        if step_raw not in ("latest", "none"):
            try:
                asked = int(step_raw)
            except ValueError:
                problems.append(f"RESILAX_RESTORE_STEP={step_raw!r} is not a step; allowed: latest, none or "
                                "a step number")
        count, index = 1, 0
        address = env.get("JAX_COORDINATOR_ADDRESS", "").strip()
        count_raw = env.get("JAX_NUM_PROCESSES", "").strip()
        if address and count_raw:
            try:
                count = max(1, int(count_raw))
                index = int(env.get("JAX_PROCESS_ID", "0").strip() or "0") if count > 1 else 0
            except ValueError:
                problems.append(f"JAX_NUM_PROCESSES={count_raw!r} and JAX_PROCESS_ID="
                                f"{env.get('JAX_PROCESS_ID', '')!r} must be integers")
        if problems:
            raise InvalidOptionsError("; ".join(problems))
        if enabled in _FALSE or step_raw == "none":
            return None
        if not env.get("RESILAX_CHECKPOINT_DIR", "").strip() and not env.get("RESILAX_LOCAL_DIR", "").strip():
            return None
        dirs = TierDirectories.from_env(env)
        # Only the I/O settings matter here: retention is left to the manager (and its own checks).
        options = ManagerOptions.from_env(env, local_tier=dirs.local_tier, keep_last=None, keep_every_steps=None,
                                          keep_every_seconds=None, keep_best=None, keep_best_metric=None,
                                          keep_best_mode=None)
        return cls(dirs, options, index, count, asked, fraction, enabled != "read" and accelerator_expected(env))

    @property
    def lists_locally(self) -> bool:
        """Whether every root the choice lists is a local folder (no object store: no network)."""
        roots = [self.dirs.directory, self.dirs.persistent_directory]
        return all("://" not in root for root in roots if root is not None)


def accelerator_expected(env: Mapping[str, str]) -> bool:
    """Whether JAX will most likely run on accelerators, told without importing it: JAX_PLATFORMS's
    first platform when set (not `cpu`), else whether a TPU or CUDA plugin is installed."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return platforms[0].lower() != "cpu"
    return any(importlib.util.find_spec(name) is not None for name in ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin"))


def _chunk_backend(storage: Storage, options: ManagerOptions) -> reader.ChunkBackendReads:
    """The reads of the storage's chunk backend: a local folder's without backends.py, whose
    tensorstore import (with ml_dtypes: seconds on a busy host) the trainer's first line should not
    wait for; an object store's through it (tensorstore)."""
    if storage.is_local:
        return file_reader.FileReads(storage, options.direct_io)
    from resilax_ckpt.chunks import backends

    return backends.for_storage(storage, options)


def _register_dtypes(meta: StepMetadata) -> None:
    """NumPy names JAX's own dtypes (bfloat16, float8_*, int4) only once ml_dtypes is imported, which
    `import jax` does; the prefetch runs before it: import ml_dtypes when the step has one."""
    for item in meta.items.values():
        for leaf in item.leaves:
            if leaf.kind != "array":
                continue
            try:
                np.dtype(leaf.dtype)
            except TypeError:
                import ml_dtypes  # noqa: F401  (registers its dtypes with NumPy)

                return


def plan_prefetch(settings: PrefetchSettings) -> read_ahead.ReadPlan | None:
    """Choose the step, read its metadata and plan the reads; None when there is nothing to read
    ahead. Lists the tiers: called on the prefetch's own thread (RestorePrefetch)."""
    dirs, options = settings.dirs, settings.options
    root = dirs.directory.rstrip("/") or "/"
    storage = open_storage(root, fsync=options.fsync)
    suffix = settings.process_index if dirs.local_tier and settings.process_count > 1 else None
    persistent: tuple[Storage, str] | None = None
    if dirs.persistent_directory is not None:
        proot = dirs.persistent_directory.rstrip("/")
        persistent = (open_storage(proot, fsync=options.fsync), proot)
        local_steps = commit.list_local_tier(storage, root, layout.commit_name(suffix), persistent)
        persistent_steps = commit.list_visible(*persistent)
    else:
        local_steps, persistent_steps = commit.list_visible(storage, root), []
    choice = restore_choice.decide_prefetch_step(local_steps, persistent_steps, settings.asked_step)
    if choice is None:
        return None
    step, tier = choice
    if tier == "local" and dirs.local_tier:
        step_storage, step_path, meta_name = storage, storage.join(root, layout.step_name(step)), layout.metadata_name(suffix)
    elif tier == "local":
        step_storage, step_path, meta_name = storage, commit.step_data_path(storage, root, step), layout.METADATA_FILE
    else:
        assert persistent is not None
        step_storage, step_path, meta_name = (persistent[0], commit.step_data_path(*persistent, step),
                                              layout.METADATA_FILE)
    whole = settings.process_count == 1
    own_files = tier == "local" and dirs.local_tier and step_storage.is_local
    if not whole and not own_files:
        log.info("restore prefetch: step %d is not in this host's local tier: which chunks process %d needs "
                 "is known only once its mesh exists; nothing read ahead", step, settings.process_index)
        return None
    where = step_storage.join(step_path, meta_name)
    try:
        meta = StepMetadata.from_bytes(step_storage.read_bytes(where), where)
    except FileNotFoundError:
        return None  # deleted since the listing: the restore will not pick it either
    except OSError as e:
        raise MetadataError(f"{where}: unreadable ({e})") from e
    _register_dtypes(meta)
    reads: list[read_ahead.BoxesRead] = []
    for name, item in meta.items.items():
        if item.kind != "pytree":
            continue
        for leaf in item.leaves:
            if leaf.kind != "array":
                continue
            folder = step_storage.join(step_path, name, str(leaf.dir))
            boxes = read_ahead.plan_leaf_boxes(leaf, whole, read_ahead.files_in(folder) if own_files else None)
            if boxes:
                reads.append(read_ahead.BoxesRead(name, leaf, boxes))
    limit = int(settings.memory_fraction * read_ahead.available_memory())
    fit = read_ahead.plan_within_memory((r.nbytes for r in reads), limit)
    if fit < len(reads):
        log.info("restore prefetch: %d of %d leaves of step %d fit in %.1f GiB (%s=%s of the available memory); "
                 "the restore reads the rest", fit, len(reads), step, limit / 2**30, MEMORY_ENV, settings.memory_fraction)
    ring_bytes = 0
    if (settings.ring_only and options.restore_host_buffer_bytes and step_storage.is_local
            and chunk_writer.filesystem_type(step_path) in ("tmpfs", "ramfs")):
        # Faulted in here, off the restore's path: room for the two largest leaves (read one while the
        # other transfers); the restore then uses it as it is.
        pieces = [-(-r.nbytes // host_ring.DIRECT_ALIGN) * host_ring.DIRECT_ALIGN for r in reads]
        ring_bytes = host_ring.plan_ring_bytes(pieces, options.restore_host_buffer_bytes, slots=2)
        log.info("restore prefetch: step %d is in memory (%s): the restore's host ring (%.0f MiB) is faulted "
                 "in instead of reading it ahead", step, step_path, ring_bytes / 2**20)
        fit = 0
    elif not fit:
        return None
    return read_ahead.ReadPlan(step_storage, _chunk_backend(step_storage, options), step, tier, step_path,
                               reads[:fit], len(reads) - fit, ring_bytes)


# ---------------------------------------------------------------------------- the process's prefetch

_lock = threading.Lock()
_active: read_ahead.RestorePrefetch | None = None
_started = False


def start_prefetch(env: Mapping[str, str] | None = None, *, on_event: read_ahead.EventHook | None = None) -> read_ahead.RestorePrefetch | None:
    """Start reading ahead the step this process's restore will most likely read (module docstring),
    from the RESILAX_* variables `CheckpointManager.from_env` reads. The step is chosen (the tiers
    listed, its metadata read) and read on a background thread. When every root is a local folder,
    returns once the step is chosen and its reads queued (a few file-system calls: the reads begin
    before JAX is imported), or None when there is nothing to read ahead or choosing failed (logged: the
    restore then reads as always). With an object store (gs://) it returns at once, the choice still
    under way: a listing over the network (gcsfs retries an unreachable endpoint for half a minute and
    more) never holds the trainer's start, and a restore that comes before the choice drops the
    prefetch rather than wait for it (RestorePrefetch.claim). None as well when off or not configured.
    Idempotent: later calls return the first call's answer. Never imports JAX: call it first, before
    `import jax`. Raises InvalidOptionsError for a malformed variable.
    Called on: each process by itself, before its restore."""
    global _active, _started
    with _lock:
        if _started:
            return _active
        _started = True
        settings = PrefetchSettings.from_env(env)
        if settings is None:
            return None
        handle = read_ahead.RestorePrefetch(functools.partial(plan_prefetch, settings), settings.options, on_event)
        handle.start()
        if settings.lists_locally:
            handle.wait_chosen()
            if handle.step is None:
                return None
        _active = handle
        return handle


def current() -> read_ahead.RestorePrefetch | None:
    """This process's prefetch (None when none was started or after `stop`)."""
    return _active


def reads_every_leaf() -> bool:
    """Whether this process's prefetch has chosen its step and is reading (or read) every leaf of it,
    none left to the restore for lack of memory, and has neither failed nor been dropped."""
    handle = _active
    if handle is None:
        return False
    stats = handle.stats()
    return stats["step"] is not None and not stats["left_to_restore"] and stats["error"] is None and stats["released"] is None


def claim(storage: Storage, step_path: str, step: int) -> Callable[[reader.LeafRead], bool] | None:
    """For a restore about to read `step` from `step_path`: the process prefetch's `fill` when it read
    that folder, else None (and a prefetch of another folder is dropped). See RestorePrefetch.claim."""
    handle = _active
    return None if handle is None else handle.claim(storage, step_path, step)


def release(reason: str = "the restore is done") -> None:
    """Drop what the restore did not take (the manager calls this after each restore and at close)."""
    handle = _active
    if handle is not None:
        handle.release(reason)


def stop() -> None:
    """Release the process's prefetch and forget it: a later `start_prefetch` starts anew."""
    global _active, _started
    with _lock:
        handle, _active, _started = _active, None, False
    if handle is not None:
        handle.release("stopped")


def _forget_in_child() -> None:
    """A forked child has none of the parent's threads: it has no prefetch (and starts none)."""
    global _active, _lock
    _active = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
