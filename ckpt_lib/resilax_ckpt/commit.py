"""Commit and visibility of steps: rename-commit on local disk, marker-commit on object stores.

Local (shared) folder: 1. every process writes into `<root>/.tmp-<step>-g<gen>/`, 2. the primary
writes `_METADATA.json` and `_COMMIT` inside it and fsyncs, 3. checks the fences, 4. renames the folder
to `<root>/<step>/` and fsyncs `<root>`. gs://: 1. everything is written under `<root>/<step>/`,
2. the primary writes `_METADATA.json`, 3. checks the fences, 4. writes `_COMMIT` create-only
(`ifGenerationMatch=0`). Readers trust only steps with `_COMMIT` that the fences leave visible.
"""

from __future__ import annotations

import json
import logging
import time

from resilax_ckpt import fencing, layout
from resilax_ckpt.errors import StepExistsError, StorageError
from resilax_ckpt.storage import Storage

log = logging.getLogger(__name__)


def build_marker(step: int, generation: int) -> bytes:
    return json.dumps({"step": step, "generation": generation, "time": time.time()}).encode()


def read_marker_generation(storage: Storage, step_path: str, marker: str = layout.COMMIT_FILE) -> int:
    try:
        raw = json.loads(storage.read_bytes(storage.join(step_path, marker)))
        return int(raw["generation"])
    except (ValueError, KeyError, TypeError):
        return -1  # an unreadable marker (e.g. written by the sidecar as empty) counts as oldest


def list_committed(storage: Storage, root: str, marker: str = layout.COMMIT_FILE) -> list[int]:
    """Steps with a commit marker, ignoring fences."""
    steps = []
    for name in storage.list_dir(root):
        step = layout.parse_step(name)
        if step is not None and storage.exists(storage.join(root, name, marker)):
            steps.append(step)
    return sorted(steps)


def list_visible(storage: Storage, root: str, marker: str = layout.COMMIT_FILE,
                 use_fences: bool = True) -> list[int]:
    """Committed steps the fences leave visible: what steps() and restore() see."""
    committed = list_committed(storage, root, marker)
    if not use_fences:
        return committed
    fences = fencing.read_fences(storage, root)
    lowest = fencing.min_fenceable_step(fences)
    if lowest is None:
        return committed
    visible = []
    for step in committed:
        if step <= lowest:
            visible.append(step)
            continue
        gen = read_marker_generation(storage, storage.join(root, layout.step_name(step)), marker)
        if fencing.decide_visible(step, gen, fences):
            visible.append(step)
    return visible


def commit_local(storage: Storage, root: str, tmp_path: str, final_path: str, step: int,
                 marker: bytes, generation: int | None, marker_name: str = layout.COMMIT_FILE) -> None:
    """Write the marker into the temporary folder, check the fences, rename into place.
    Called on: primary only (or each process of the local tier)."""
    storage.write_bytes(storage.join(tmp_path, marker_name), marker)
    storage.sync_dir(tmp_path)
    if generation is not None:
        fencing.check_not_fenced(fencing.read_fences(storage, root), generation, f"step {step}")
    if storage.exists(final_path):
        if generation is not None and step in list_visible(storage, root, marker_name):
            raise StepExistsError(f"step {step}: a committed checkpoint already exists at {final_path}")
        trash = storage.join(root, f"{layout.TRASH_PREFIX}{step}-{time.time_ns()}")
        storage.rename_dir(final_path, trash)
        storage.delete_tree(trash)
    storage.rename_dir(tmp_path, final_path)
    storage.sync_dir(root)


def commit_object(storage: Storage, root: str, final_path: str, step: int, marker: bytes,
                  generation: int) -> None:
    """Check the fences, then write the marker create-only. Called on: primary only."""
    fencing.check_not_fenced(fencing.read_fences(storage, root), generation, f"step {step}")
    path = storage.join(final_path, layout.COMMIT_FILE)
    try:
        storage.write_bytes(path, marker, create_only=True)
    except FileExistsError:
        if step in list_visible(storage, root):
            raise StepExistsError(f"step {step}: a committed checkpoint already exists at {final_path}") from None
        # A fenced-out commit of an older generation: ours replaces it.
        storage.write_bytes(path, marker)


def _upload_in_progress(storage: Storage, step_path: str) -> bool:
    """A sidecar is moving a local-tier step here (it has `_UPLOADED.*` markers): leave it."""
    return any(n.startswith(layout.UPLOADED_PREFIX) for n in storage.list_dir(step_path))


def clean_leftovers(storage: Storage, root: str, generation: int) -> list[str]:
    """Delete what interrupted or fenced-out saves left: temporary folders of this or older
    generations, trash, step folders without a marker, steps the fences hide.
    Called on: primary only, at manager start (before any save of this generation)."""
    deleted = []
    try:
        visible = set(list_visible(storage, root))
        for name in storage.list_dir(root):
            tmp_gen = layout.parse_tmp_generation(name)
            step = layout.parse_step(name)
            doomed = (
                (tmp_gen is not None and tmp_gen <= generation)
                or name.startswith(layout.TRASH_PREFIX)
                or (step is not None and step not in visible
                    and not _upload_in_progress(storage, storage.join(root, name)))
            )
            if doomed:
                storage.delete_tree(storage.join(root, name))
                deleted.append(name)
    except StorageError:
        raise
    except OSError as e:
        raise StorageError(f"cleaning leftovers in {root}: {e}") from e
    if deleted:
        log.info("deleted leftovers of interrupted saves in %s: %s", root, ", ".join(sorted(deleted)))
    return deleted
