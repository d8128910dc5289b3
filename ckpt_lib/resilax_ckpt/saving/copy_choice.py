"""Which way a save takes its shards off the devices (docs/checkpointing.md §4, issue 37): the
decision (`choose_device_copy`, `plan_runtime_copy`) from the devices' memory statistics
(`device_room`) and what the copy needs (`copy_need`), and the save's `CopyReport`. Pure but for
reading the statistics; device_snapshot.py acts on the choice.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.extend.backend import register_backend_cache

ON_DEVICE, HOST_TRANSFER = "on_device", "host_transfer"
"""The paths of `ManagerOptions.device_copy` (options.DEVICE_COPY_MODES, with "auto")."""

NOT_COMPILED = "copy not compiled yet"
"""The reason of an automatic host transfer before the on-device copy was compiled."""

RUNTIME_COPY_FAILED = "runtime copy failed"
"""The reason of a host transfer after `jax.device_put`'s copy raised (e.g. a sharding it cannot copy
as is); the saver still compiles the jitted copy for the next save."""

HBM_MARGIN_FRACTION = 0.05
HBM_MARGIN_MIN_BYTES = 256 << 20
"""What an on-device copy leaves free of a device's memory, at least (beside its peak use so far)."""

@dataclasses.dataclass
class CopyReport:
    """How a save took its shards off the devices (`CheckpointManager.save_report`)."""

    path: str = ""
    """"on_device" (a jitted copy on the devices, drained to the host in the background), "host_transfer"
    (device-to-host transfers the loop waits for) or "" (nothing on devices)."""
    reason: str = ""
    """Why this path: "forced" (the option), "cpu" (CPU devices: the copy is host memory), "room"
    (the devices' memory statistics leave room), "no room", "no memory statistics", "copy not
    compiled yet" (a first save: the copy compiles in the background for the next), "out of memory"
    (the on-device copy failed to allocate: this save fell back to a host transfer)."""
    platform: str = ""
    device_bytes: int = 0
    """Device memory (HBM on an accelerator) the on-device copy holds until drained, all devices
    together; 0 for a host transfer."""
    host_bytes: int = 0
    """Bytes of the shards taken off the devices."""
    runtime_copy: bool = False
    """The on-device copy was a runtime copy (`jax.device_put(..., may_alias=False)`: no compile)
    because the jitted copy was not compiled yet on an accelerator (a first save); the saver compiles
    the jitted one in the background for the next save."""
    transfer_seconds: float | None = None
    """Seconds from the start of the snapshot until every shard was on the host (None until then)."""
    drain_held_peak_bytes: int = 0
    """An on-device copy's drain: the most host bytes it held at once (shards in flight or landed and
    not yet written; drain.DRAIN_HOST_BYTES bounds it, or one larger shard), once drained."""

    def as_dict(self, step: int, blocked_seconds: float) -> dict[str, Any]:
        """`CheckpointManager.save_report`: this report, the step and how long save() blocked the loop."""
        return {"step": step, "device_copy": self.path, "reason": self.reason, "platform": self.platform,
                "device_bytes": self.device_bytes, "host_bytes": self.host_bytes, "runtime_copy": self.runtime_copy,
                "blocked_seconds": blocked_seconds, "transfer_seconds": self.transfer_seconds,
                "drain_held_peak_bytes": self.drain_held_peak_bytes}


@dataclasses.dataclass(frozen=True)
class DeviceRoom:
    """One device's memory as `Device.memory_stats()` reports it (bytes)."""

    limit: int
    in_use: int
    peak: int = 0
    largest_free_block: int | None = None


def choose_device_copy(option: str, platform: str, room: dict[Any, DeviceRoom | None],
                       need: dict[Any, int], largest: dict[Any, int], compiled: bool = True) -> tuple[str, str]:
    """(path, reason) of a save: `option` forced, else on CPU devices the on-device copy (it is host
    memory either way), else the on-device copy where every device's statistics leave room for its
    copies (`need`, the largest one `largest`) beside the larger of its current and peak use, with a
    margin: reason "room", or NOT_COMPILED while the jitted copy is not `compiled` yet (the save then
    takes a runtime copy, `plan_runtime_copy`, and the saver compiles the jitted one in the
    background for the next save); a host transfer where they do not or where a device gives no
    statistics."""
    if option != "auto":
        return option, "forced"
    if platform == "cpu":
        return ON_DEVICE, "cpu"
    for device, nbytes in need.items():
        stats = room.get(device)
        if stats is None:
            return HOST_TRANSFER, "no memory statistics"
        margin = max(HBM_MARGIN_MIN_BYTES, int(stats.limit * HBM_MARGIN_FRACTION))
        if nbytes + margin > stats.limit - max(stats.in_use, stats.peak):
            return HOST_TRANSFER, "no room"
        if stats.largest_free_block is not None and largest.get(device, 0) > stats.largest_free_block:
            return HOST_TRANSFER, "no room"
    return ON_DEVICE, "room" if compiled else NOT_COMPILED


def plan_runtime_copy(path: str, platform: str, compiled: bool) -> bool:
    """Whether an on-device copy is a runtime copy (`jax.device_put(..., may_alias=False)`) instead
    of the jitted one: on an accelerator while the jitted copy is not compiled yet. Measured on a TPU
    v5e (1.74 GiB in 154 leaves): compiling the jitted copy costs 1.85 s in the loop (2.53 s ahead
    of time cold, 0.79 s with a warm persistent compile cache), a blocking host transfer 0.6 s,
    while the runtime copy compiles nothing, dispatches in 0.006 s and survives the donation; the
    donating step after it waits ~0.25 s for the copy (a DMA at ~7 GB/s), against 0.001 s for the
    compiled jitted copy, so later saves take that."""
    return path == ON_DEVICE and platform != "cpu" and not compiled


def device_room(device: Any) -> DeviceRoom | None:
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None
    if not stats or not stats.get("bytes_limit"):
        return None
    largest = int(stats.get("largest_free_block_bytes", 0) or 0)
    return DeviceRoom(limit=int(stats["bytes_limit"]), in_use=int(stats.get("bytes_in_use", 0)),
                      peak=int(stats.get("peak_bytes_in_use", 0)),
                      largest_free_block=largest if largest > 0 else None)  # 0: not reported


def copy_need(groups: list[list[jax.Array]]) -> tuple[dict[Any, int], dict[Any, int]]:
    """Bytes an on-device copy of `groups` allocates per device, and its largest buffer per device."""
    need: dict[Any, int] = {}
    largest: dict[Any, int] = {}
    for group in groups:
        for array in group:
            nbytes, devices = _shard_bytes(array.sharding, tuple(array.shape), array.dtype.itemsize)
            for device in devices:
                need[device] = need.get(device, 0) + nbytes
                largest[device] = max(largest.get(device, 0), nbytes)
    return need, largest


@functools.lru_cache(maxsize=4096)
def _shard_bytes(sharding: Any, shape: tuple[int, ...], itemsize: int) -> tuple[int, tuple[Any, ...]]:
    """The bytes of one shard of an array of `shape` and `sharding`, and the devices here holding one."""
    return int(np.prod(sharding.shard_shape(shape))) * itemsize, tuple(sharding.addressable_devices)


# Its keys hold shardings, so devices: emptied with the backends (jax.extend.backend.clear_backends).
register_backend_cache(_shard_bytes, "resilax_ckpt shard sizes")
