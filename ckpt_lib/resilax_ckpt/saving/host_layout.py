"""How a device's layout lands on the host (issue 37), for a save: the order a leaf's shards land in
(`landing_order`: a TPU lays some leaves out column major, their host copies then have Fortran
strides, and chunk_format stores them so), the opt-in row-major copy that has the device transpose
them instead (ROW_MAJOR_ENV), and the test-only option that makes CPU devices land column major
(FORCE_COLUMN_MAJOR_ENV). device_snapshot.py takes the shards off the devices.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from resilax_ckpt.chunks.chunk_format import plan_transpose

ROW_MAJOR_ENV = "RESILAX_CKPT_ROW_MAJOR_COPY"
"""Opt-in (`1`), to be measured on a chip before it becomes the default (issue 37): the on-device copy
(jitted or runtime) of a device set holding a leaf whose device layout is not row major asks for
row-major outputs, so that the device transposes it and the leaf lands on the host C-contiguous (on
a TPU v5e the bench's (52992, 1472) float32 leaves land with strides (4, 211968):
bench/tpu/probes/layout.py). Since such leaves are stored in the order they land (`landing_order`),
the writer copies nothing without it either; it is kept to compare. Not compiled ahead
(compile_copies knows no layouts): the first jitted copy with it compiles in the loop."""


def row_major_formats(group: list[jax.Array]) -> list[Any] | None:
    """With ROW_MAJOR_ENV set: row-major output formats for `group` when one of its arrays' device
    layouts is not row major; else None (the plain copy)."""
    if os.environ.get(ROW_MAJOR_ENV, "").strip() != "1":
        return None
    from jax.experimental.layout import Format, Layout

    def row_major(a: jax.Array) -> bool:
        layout = getattr(getattr(a, "format", None), "layout", None)
        order = getattr(layout, "major_to_minor", None)
        return order is None or tuple(order) == tuple(range(a.ndim))

    if all(row_major(a) for a in group):
        return None
    return [Format(Layout(major_to_minor=tuple(range(a.ndim))), a.sharding) for a in group]


FORCE_COLUMN_MAJOR_ENV = "RESILAX_CKPT_FORCE_COLUMN_MAJOR"
"""For tests only: `1` makes CPU devices hand their shards over as a TPU hands over a column-major
leaf: every device leaf of 2 or more dimensions is planned transposed (`landing_order`: reversed
dimensions) and its host copies land in Fortran order (a copy made by `as_landed`), so CI runs the
writer's and the readers' transposed paths on CPU. Never set it in a job."""


def _forced_column_major() -> bool:
    return os.environ.get(FORCE_COLUMN_MAJOR_ENV, "").strip() == "1"


def landing_order(array: jax.Array) -> tuple[int, ...]:
    """The order in which `array`'s shards land on the host, as a leaf's `transpose`
    (chunk_format.plan_transpose of its device layout's major_to_minor): on a TPU a leaf the compiler
    laid out column major lands with Fortran strides, and is then stored in that order, written
    without a copy. None on CPU devices (their copies land row major; FORCE_COLUMN_MAJOR_ENV aside)
    and with ROW_MAJOR_ENV (the device transposes). The same on every process: one program laid the
    array out."""
    if array.ndim < 2:
        return ()
    try:
        device: Any = next(iter(array.sharding.device_set))
        if str(device.platform) == "cpu":
            return tuple(range(array.ndim - 1, -1, -1)) if _forced_column_major() else ()
        if os.environ.get(ROW_MAJOR_ENV, "").strip() == "1":
            return ()
        layout = getattr(getattr(array, "format", None), "layout", None)
        order = getattr(layout, "major_to_minor", None)
    except Exception:  # no layout known (an older jax, a deleted array): stored row major
        return ()
    return plan_transpose(array.ndim, order)


def as_landed(host: np.ndarray) -> np.ndarray:
    """A shard's host copy as it lands: itself, or (FORCE_COLUMN_MAJOR_ENV, 2 or more dimensions) a
    Fortran-order copy of it, as from a column-major TPU leaf."""
    if host.ndim >= 2 and _forced_column_major():
        return np.asfortranarray(host)
    return host
