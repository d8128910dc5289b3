"""`CheckpointManager.metadata(step)`: what a committed step holds and how it was saved, from its
`_METADATA.json` and its commit marker only (no array data is read)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping

from resilax_ckpt import commit, layout
from resilax_ckpt.errors import MetadataError
from resilax_ckpt.history import fencing
from resilax_ckpt.metadata import ItemMetadata, StepMetadata
from resilax_ckpt.storage import Storage


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """A committed step's metadata (Orbax's `CheckpointManager.item_metadata` and `metrics`, together)."""

    step: int
    items: Mapping[str, ItemMetadata]
    """Each item's kind ("pytree", "json", "per_process") and, for pytrees, its leaves: `keystr`,
    `shape`, `dtype` (arrays) or `value` (scalars)."""
    metrics: Mapping[str, float]
    """What `save(..., metrics=)` was given (empty without)."""
    time: float
    """When the step was saved or committed (epoch seconds)."""
    era: int
    """The era of the JAXJob that committed it (fencing.py; 0 without a job uid)."""
    generation: int
    """The worker generation that committed it."""
    process_count: int
    """How many processes saved it."""

    def shapes(self) -> dict[str, dict[str, tuple[tuple[int, ...], str]]]:
        """item -> leaf keystr -> (shape, dtype), for the array leaves of every pytree item."""
        return {name: {leaf.keystr: (leaf.shape, leaf.dtype) for leaf in item.leaves if leaf.kind == "array"}
                for name, item in self.items.items() if item.kind == "pytree"}


def read_step_info(storage: Storage, root: str, step: int, suffix: int | None = None) -> StepInfo:
    """The StepInfo of committed `step` under `root` (`suffix`: a local tier folder shared by several
    processes, whose markers and metadata carry the process id). Raises MetadataError when the
    metadata is missing or unreadable."""
    folder = storage.join(root, layout.step_name(step))
    marker_name = layout.commit_name(suffix)
    raw = storage.read_bytes(storage.join(folder, marker_name))
    try:
        marker = json.loads(raw)
    except ValueError:
        marker = {}
    where = storage.join(commit.data_path(storage, folder, marker_name), layout.metadata_name(suffix))
    try:
        meta = StepMetadata.from_bytes(storage.read_bytes(where), where)
    except FileNotFoundError as e:
        raise MetadataError(f"{where}: missing") from e
    era, generation = fencing.parse_marker_epoch(raw)
    return StepInfo(step=step, items=meta.items, metrics=dict(meta.metrics),
                    time=meta.time or float(marker.get("time", 0.0) if isinstance(marker, dict) else 0.0), era=era, generation=generation,
                    process_count=meta.process_count)
