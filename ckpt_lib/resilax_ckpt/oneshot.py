"""One-shot save and restore of one step folder, without a manager (`resilax_ckpt.save` and
`resilax_ckpt.restore`). Called on: all processes."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from resilax_ckpt import commit, layout, pytrees
from resilax_ckpt import items as items_lib
from resilax_ckpt.chunks import backends
from resilax_ckpt.errors import StepNotCommittedError, StepNotFoundError
from resilax_ckpt.multihost import current_coordinator
from resilax_ckpt.options import ManagerOptions
from resilax_ckpt.restoring.step_reader import restore_step
from resilax_ckpt.saving.saver import write_step_files
from resilax_ckpt.storage import open_storage


def save(path: str, items: Any) -> None:
    """Save `items` (named items or any pytree, as CheckpointManager.save) into the folder `path`
    (one step, no manager), synchronously and atomically. Called on: all processes."""
    items, _ = pytrees.as_items(items)
    path = path.rstrip("/")
    storage = open_storage(path)
    coord = current_coordinator()
    root, name = path.rsplit("/", 1) if "/" in path else (".", path)
    plan = items_lib.snapshot_items(items, step=0, generation=0, process_index=coord.process_index,
                                    process_count=coord.process_count, local_tier=False, time_now=time.time(),
                                    shard_files=storage.is_local)
    if plan.transfer is not None:
        plan.transfer.start()  # an on-device copy drains while the writes run
    work = storage.join(root, f"{layout.TMP_PREFIX}{name}") if storage.is_local else path
    write_step_files(storage, backends.for_storage(storage, ManagerOptions()), work, plan, coord.process_index == 0,
                      coord.process_index)
    key = f"resilax_ckpt/oneshot/{name}/{time.time_ns() if coord.process_count == 1 else 0}"
    coord.barrier(f"{key}/written", 900)
    if coord.process_index == 0:
        storage.write_bytes(storage.join(work, layout.METADATA_FILE), plan.metadata.to_bytes())
        marker = commit.build_marker(0, 0)
        if storage.is_local:
            commit.commit_local(storage, root, work, path, 0, marker, None)
        else:
            storage.write_bytes(storage.join(path, layout.COMMIT_FILE), marker)
    coord.barrier(f"{key}/committed", 900)


def restore(path: str, target: Any = None, items: Iterable[str] | None = None) -> Any:
    """Restore from a folder written by `save` (or one step folder of a manager); a target that is
    not a mapping of named items returns the item "state" as that pytree."""
    named, unwrap = pytrees.as_target(target)
    if unwrap:
        return restore(path, named, [pytrees.STATE_ITEM])[pytrees.STATE_ITEM]
    path = path.rstrip("/")
    storage = open_storage(path)
    if not storage.exists(storage.join(path, layout.COMMIT_FILE)):
        if storage.exists(path):
            raise StepNotCommittedError(f"{path}: not committed (no {layout.COMMIT_FILE})")
        raise StepNotFoundError(f"{path}: does not exist")
    coord = current_coordinator()
    return restore_step(storage, backends.for_storage(storage, ManagerOptions()), commit.data_path(storage, path),
                        layout.parse_step(path.rsplit("/", 1)[-1]) or 0, target, items,
                        ManagerOptions.max_inflight_bytes, coord.process_index)
