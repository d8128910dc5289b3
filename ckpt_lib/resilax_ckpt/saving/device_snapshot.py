"""How a save takes its shards off the devices (docs/checkpointing.md §4, issue 37): the choice between an
on-device copy drained in the background and a host transfer the loop waits for
(`ManagerOptions.device_copy`, `choose_device_copy`), and the `Transfer` that lands every shard on
the host into its write's `sources.Landing`. The training step may donate the saved arrays as soon
as `save()` returns: nothing here reads one after that.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.backend import register_backend_cache

from resilax_ckpt.chunks import staging
from resilax_ckpt.chunks.sources import HostBudget, Landing
from resilax_ckpt.saving import drain
from resilax_ckpt.saving.copy_choice import (
    HOST_TRANSFER,
    ON_DEVICE,
    RUNTIME_COPY_FAILED,
    CopyReport,
    choose_device_copy,
    copy_need,
    device_room,
    plan_runtime_copy,
)
from resilax_ckpt.saving.host_layout import FORCE_COLUMN_MAJOR_ENV as FORCE_COLUMN_MAJOR_ENV
from resilax_ckpt.saving.host_layout import ROW_MAJOR_ENV as ROW_MAJOR_ENV
from resilax_ckpt.saving.host_layout import as_landed, row_major_formats

log = logging.getLogger(__name__)


@jax.jit
def _device_copy(arrays: list[jax.Array]) -> list[jax.Array]:
    # Outputs of a jitted program never alias inputs it was not given to donate: each is a new buffer.
    return [jnp.copy(a) for a in arrays]


@functools.lru_cache(maxsize=256)
def _row_major_copy(formats: tuple[Any, ...]) -> Any:
    return jax.jit(lambda arrays: [jnp.copy(a) for a in arrays], out_shardings=list(formats))


def _copy(originals: list[jax.Array], runtime: bool, accelerator: bool) -> tuple[list[jax.Array], bool]:
    """The on-device copy of one device set: the runtime's or the jitted one, row major where asked
    (ROW_MAJOR_ENV); a row-major copy that fails falls back to the plain one (logged). With it,
    whether it was the runtime's: also when, on an `accelerator`, the executable compiled ahead
    refuses the arrays (`_jitted_copy`), rather than compiling in the loop."""
    formats = row_major_formats(originals)
    if formats is not None:
        try:
            if runtime:
                made: list[jax.Array] = jax.device_put(originals, formats, may_alias=False)
                return made, True
            made = _row_major_copy(tuple(formats))(originals)
            return made, False
        except Exception as e:
            log.warning("a row-major on-device copy failed (%s: %s); taking the plain copy", type(e).__name__, e)
    if not runtime:
        jitted = _jitted_copy(originals, accelerator)
        if jitted is not None:
            return jitted, False
    return _runtime_copy(originals), True


def _jitted_copy(originals: list[jax.Array], accelerator: bool) -> list[jax.Array] | None:
    """The jitted copy: the executable `compile_copies` made for this signature when there is one (it
    takes arrays whose shardings are equivalent to the ones it was compiled for, as a restore
    target's `P(None)` is to a step's `P()`, which jit's own cache would compile again), else jit.
    An executable that refuses the arrays (e.g. other device layouts) is forgotten, and on an
    `accelerator` None is returned (the save takes the runtime copy and the saver compiles the copy
    of these very arrays for the next), where jit would compile in the loop."""
    key = _group_key(originals)
    exe = _COMPILED.get(key)
    if exe is not None:
        try:
            made: list[jax.Array] = exe(originals)
            return made
        except ValueError as e:  # compiled for other shardings or layouts than these arrays have
            log.warning("the snapshot copy compiled ahead does not take these arrays (%s); %s", e,
                        "taking a runtime copy" if accelerator else "compiling it again")
            del _COMPILED[key]
            if accelerator:
                return None
    made = _device_copy(originals)
    return made


FORCE_ACCELERATOR_ENV = "RESILAX_CKPT_FORCE_ACCELERATOR_PATH"
"""For tests only: `1` makes `device_copy="auto"` decide for CPU devices as for an accelerator (the
copy's compile state, then the devices' memory statistics, which CPU devices do not give: a host
transfer) and drain an on-device copy on a thread (drain.DRAIN_WINDOW) as on an accelerator, so CI runs the
accelerator's choices and ordering code on CPU. Never set it in a job."""
def _runtime_copy(arrays: list[jax.Array]) -> list[jax.Array]:
    """A copy of `arrays` into new buffers on the same devices, made by the runtime (nothing to
    compile): it survives the donation of `arrays` (`plan_runtime_copy`)."""
    copies: list[jax.Array] = jax.device_put(arrays, [a.sharding for a in arrays], may_alias=False)
    return copies


class Transfer:
    """Takes a save's device shards to the host, each into its write's `Landing`, which the writing
    thread waits for (so a shard is written as soon as it lands). `start()` is called by the saver
    once the writes are handed off: a host transfer returns once every shard landed (the loop waits
    for that: a donating step may delete the arrays next); an on-device copy returns at once and
    drains on a thread of its own, except on CPU devices (`lazy`), where the copy already is host
    memory: there the writing thread takes each shard's NumPy view (zero-copy) when it needs it, and
    no thread competes with the loop."""

    def __init__(self, path: str, pieces: list[tuple[Landing, Any]], copies: list[jax.Array],
                 arena: staging.HostArena | None, report: CopyReport, started: float, lazy: bool = False) -> None:
        self._path = path
        self._lazy = lazy
        if lazy:  # wired now: after the hand-off the writing thread may already want a shard
            views = _views(pieces, copies, report, started)
            pull = _Puller(views, [landing for landing, _ in pieces])
            for landing, _ in pieces:
                landing.pull = pull
            pieces, copies = [], []
        self._pieces = pieces  # (landing, shard data: a single-device jax.Array, or a global copy and device)
        self._copies = copies
        self._arena = arena
        self.report = report
        self._started = started
        self.budget = HostBudget(drain.DRAIN_HOST_BYTES)
        """The drain's back-pressure: the writer gives a shard's bytes back once written."""

    def close(self) -> None:
        """The save's writes ended (written or failed): the drain no longer waits for them."""
        self.budget.close()

    def start(self) -> None:
        if self._path == HOST_TRANSFER:
            self._run()
            return
        if self._lazy:
            return
        threading.Thread(target=self._run, name="resilax-drain", daemon=True).start()

    def _run(self) -> None:
        pieces, self._pieces = self._pieces, []
        landings = [landing for landing, _ in pieces]
        try:
            if self._path == HOST_TRANSFER:
                _land_all(pieces, self._arena)
            else:
                copies, self._copies = self._copies, []
                shards = _shards_of(copies)
                del copies  # each shard's device buffer is now freed once it landed
                drain.drain(pieces, shards, self.budget)
                self.report.drain_held_peak_bytes = self.budget.peak
            self.report.transfer_seconds = time.perf_counter() - self._started
        except BaseException as e:
            for landing in landings:
                landing.fail(e)
            if self._path == HOST_TRANSFER:
                raise
            log.warning("draining a save's on-device copy to the host failed: %s", e)


class _Puller:
    """Lands the shards of a lazy transfer on the thread that waits for one, up to that one."""

    def __init__(self, steps: Iterator[None], landings: list[Landing]) -> None:
        self._steps = steps
        self._landings = landings
        self._lock = threading.Lock()

    def __call__(self, wanted: Landing) -> None:
        with self._lock:
            try:
                while not wanted.landed and next(self._steps, False) is not False:
                    pass
                if not wanted.landed:
                    raise RuntimeError("a write's shard is not among its save's on-device copies")
            except BaseException as e:
                for landing in self._landings:
                    landing.fail(e)
                raise


def _views(pieces: list[tuple[Landing, Any]], copies: list[jax.Array], report: CopyReport,
           started: float) -> Iterator[None]:
    """CPU devices: each shard's NumPy view of its copy, in write order, one per step; a copy's
    shards are looked up when its first piece is wanted (that waits for the copy to be computed) and
    forgotten after its last."""
    remaining: dict[int, int] = {}
    for _, (n, _) in pieces:
        remaining[n] = remaining.get(n, 0) + 1
    shards: dict[int, dict[Any, Any]] = {}
    for i, (landing, (n, device)) in enumerate(pieces):
        if n not in shards:
            shards[n] = {shard.device: shard.data for shard in copies[n].addressable_shards}
        landing.set(as_landed(np.asarray(shards[n][device])))
        pieces[i] = (landing, (n, None))
        remaining[n] -= 1
        if remaining[n] == 0:
            del shards[n]
            copies[n] = None  # type: ignore[call-overload]
        if i == len(pieces) - 1:
            report.transfer_seconds = time.perf_counter() - started
        yield None


def _shards_of(copies: list[jax.Array]) -> dict[tuple[int, Any], Any]:
    """The single-device shards of the on-device copies, by (index of the copy, device) (waits for
    the copies to be computed)."""
    return {(n, shard.device): shard.data for n, copy in enumerate(copies) for shard in copy.addressable_shards}


def _land_all(pieces: list[tuple[Landing, Any]], arena: staging.HostArena | None) -> None:
    """Host transfer: every shard's transfer started first, then each consumed as it lands. CPU
    devices (`arena` given): NumPy views alias the device buffers, which a donating step may reuse,
    so each shard is copied into the arena (reused by the next save)."""
    for _, data in pieces:
        data.copy_to_host_async()
    if arena is not None:
        arena.reset(staging.HostArena.size_of([(tuple(d.shape), np.dtype(d.dtype)) for _, d in pieces]))
    for n, (landing, data) in enumerate(pieces):
        host = np.asarray(data)
        if arena is not None:
            private = arena.take(tuple(host.shape), host.dtype)
            np.copyto(private, host)
            host = private
        landing.set(as_landed(host))
        pieces[n] = (landing, None)  # the shard itself is no longer needed here


def snapshot_devices(writes: list[Any], sources: list[tuple[int, jax.Array, Any]], device_copy: str,
                      arena: staging.HostArena | None) -> Transfer | None:
    """Choose the path (`choose_device_copy`) and set up the private copies of the shards to write:
    each write's source becomes a `Landing`, filled by the returned Transfer once started. The
    on-device copy is dispatched here (the loop waits only for the dispatch). `sources` holds
    (index into writes: items.ArrayWrite, global array, its shard)."""
    if not sources:
        return None
    started = time.perf_counter()
    platform = _platform(sources)
    deciding = _deciding_platform(platform)
    groups = copy_groups(sources)
    need, largest = copy_need(groups)
    room = {} if device_copy != "auto" or deciding == "cpu" else {d: device_room(d) for d in need}
    compiled = deciding == "cpu" or all(_group_key(group) in _COMPILED for group in groups)
    path, reason = choose_device_copy(device_copy, deciding, room, need, largest, compiled)
    report = CopyReport(path=path, reason=reason, platform=platform)
    landed = threading.Condition()
    landings = []
    host_bytes = 0
    for w, _, _ in sources:
        landing = Landing(landed)
        writes[w].source = landing
        landings.append(landing)
        host_bytes += writes[w].nbytes
    report.host_bytes = host_bytes
    if path == ON_DEVICE:
        copies: list[jax.Array] = []
        index: dict[int, int] = {}
        report.runtime_copy = plan_runtime_copy(path, deciding, compiled)
        try:
            for originals in groups:
                made, runtime = _copy(originals, report.runtime_copy, deciding != "cpu")
                for original, copy in zip(originals, made, strict=True):
                    index[id(original)] = len(copies)
                    copies.append(copy)
                if deciding != "cpu" and not runtime:
                    _COMPILED.setdefault(_group_key(originals), None)
                report.runtime_copy = report.runtime_copy or runtime
        except Exception as e:  # an allocation failure falls back, and so does any runtime copy's
            oom = "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()
            if not oom and not report.runtime_copy:
                raise
            log.warning("the on-device copy of a save failed (%s: %s); taking a host transfer instead",
                        type(e).__name__, e)
            copies = []
            path, report.path = HOST_TRANSFER, HOST_TRANSFER
            report.reason = "out of memory" if oom else RUNTIME_COPY_FAILED
        if path == ON_DEVICE:
            report.device_bytes = sum(need.values())
            pieces = [(landing, (index[id(array)], shard.device))
                      for landing, (_, array, shard) in zip(landings, sources, strict=True)]
            return Transfer(ON_DEVICE, pieces, copies, None, report, started, lazy=deciding == "cpu")
    pieces = [(landing, shard.data) for landing, (_, _, shard) in zip(landings, sources, strict=True)]
    return Transfer(HOST_TRANSFER, pieces, [], arena if platform == "cpu" else None, report, started)


def _deciding_platform(platform: str) -> str:
    """The platform `auto` decides for: CPU devices count as an accelerator under FORCE_ACCELERATOR_ENV."""
    return "accelerator" if platform == "cpu" and os.environ.get(FORCE_ACCELERATOR_ENV) == "1" else platform


def decides_as_accelerator(signature: list[list[jax.ShapeDtypeStruct]]) -> bool:
    """Whether `auto` decides for the devices of a `copy_signature` as for an accelerator (then a
    save takes a runtime copy until the jitted copy is compiled, instead of waiting for the compile)."""
    for group in signature:
        for struct in group:
            sharding = struct.sharding
            if sharding is not None:
                return _deciding_platform(str(next(iter(sharding.device_set)).platform)) != "cpu"
    return False


def _platform(sources: list[tuple[int, jax.Array, Any]]) -> str:
    return str(next(iter(sources[0][1].devices())).platform)


def copy_groups(sources: list[tuple[int, jax.Array, Any]]) -> list[list[jax.Array]]:
    """The arrays of `sources`, each once, grouped by device set: the arguments of the on-device
    copies, in the order a save dispatches them."""
    groups: dict[frozenset[Any], dict[int, jax.Array]] = {}
    last = None
    for _, array, _ in sources:
        if array is not last:
            groups.setdefault(frozenset(array.sharding.device_set), {})[id(array)] = array
            last = array
    return [list(group.values()) for group in groups.values()]


def compile_copies(signature: list[list[jax.ShapeDtypeStruct]]) -> None:
    """Compile, without running, the copies of `copy_signature`, so that a job's first save blocks
    the loop only for the dispatch, as later saves do (jit's caches keep the result)."""
    for group in signature:
        _COMPILED[_group_key(group)] = _device_copy.lower(group).compile()


def compile_copies_quietly(signature: list[list[jax.ShapeDtypeStruct]]) -> None:
    """`compile_copies` on a background thread: a failure is logged (the first save compiles then)."""
    try:
        compile_copies(signature)
    except Exception as e:
        log.warning("compiling the snapshot copy ahead failed (the first save will compile it): %s", e)


class _Executables(dict[tuple[Any, ...], Any]):
    """A dict JAX empties with its backends (`cache_clear`, registered below; hashable by identity, as
    JAX's registry of caches is a WeakKeyDictionary)."""

    __hash__ = object.__hash__  # type: ignore[assignment]

    def cache_clear(self) -> None:
        self.clear()


_COMPILED: _Executables = _Executables()
"""The argument signatures (`_group_key`) of the on-device copies compiled in this process: to the
executable `compile_copies` made ahead, or None (compiled by jit at a save). Emptied, with the other
caches here that hold devices (through shardings), by `jax.extend.backend.clear_backends()`: an
executable of the old backend must never take the new one's arrays, nor keep its client alive (a
trainer kept across a generation drops its backends: kept_trainer.py)."""
register_backend_cache(_COMPILED, "resilax_ckpt on-device copies compiled ahead")


def _group_key(group: list[Any]) -> tuple[Any, ...]:
    """A copy's signature: shapes, dtypes, weak types and the shardings as the compiler sees them
    (`_sharding_key`), so that equivalent shardings written differently share one executable."""
    return tuple((tuple(a.shape), np.dtype(a.dtype).name, _sharding_key(a.sharding, len(a.shape)),
                  bool(a.weak_type)) for a in group)


@functools.lru_cache(maxsize=4096)
def _sharding_key(sharding: Any, ndim: int) -> Any:
    """The HLO sharding, device order and memory kind of `sharding` (jax's own view, through its
    private `_to_xla_hlo_sharding`; the sharding object itself where that is missing). Cached: a
    save asks for every leaf's."""
    try:
        devices = tuple(d.id for d in sharding._device_assignment)
        return (str(sharding._to_xla_hlo_sharding(ndim)), devices, sharding.memory_kind)
    except Exception:
        return sharding


register_backend_cache(_row_major_copy, "resilax_ckpt row-major copies")
register_backend_cache(_sharding_key, "resilax_ckpt sharding keys")
