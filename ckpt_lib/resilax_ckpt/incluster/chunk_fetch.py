"""The I/O of a restore from the in-cluster tiers (the rules are in chunk_sources.py): what this node
holds (`scan_node`), and one step's files assembled for this process's target from this node, the
other hosts' sidecars and, for what no host holds, the persistent tier (`assemble_step`).

The assembled folder `<local>/.tmp-fetch-<step>-g<generation>-p<process>/` is an ordinary step folder
(`_METADATA.json` and the files this process's restore reads) which step_reader.py reads like any
other; the restorer deletes it after the read (and `tiers.clean_local_tier` any left by a crash: its
name starts with `.tmp-`). Files of this node are hard-linked in (no copy); the sidecar fetches the
others (`POST /v1/peer/fetch-chunks`, docs/sidecar.md): each chunk file's own crc32c (the zarr3
codec written with it, checksums.py) is checked on arrival and a holder whose copy fails it is
refused and the next holder tried; the reader verifies every chunk again as it reads.
Called on: each process, during a two-tier restore.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from resilax_ckpt import layout
from resilax_ckpt.chunks import chunk_format
from resilax_ckpt.errors import IncompleteStepError, MetadataError
from resilax_ckpt.incluster import peer_client, peers
from resilax_ckpt.incluster.chunk_sources import LOCAL_FOLDER, Copy, Source, other_files, plan_file_sources
from resilax_ckpt.metadata import StepMetadata
from resilax_ckpt.restoring import step_reader
from resilax_ckpt.storage import Storage

log = logging.getLogger(__name__)

FETCH_PREFIX = f"{layout.TMP_PREFIX}fetch-"


def _marker_save(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            body = json.load(f)
    except (OSError, ValueError):
        return None
    return str(body.get("save", "")) if isinstance(body, dict) else None


def _files_under(folder: str) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(folder):
        rel_root = os.path.relpath(root, folder)
        for name in files:
            rel = name if rel_root == "." else f"{rel_root}/{name}".replace(os.sep, "/")
            if "/" in rel or not rel.startswith("_"):  # not the markers, metadata, _REPLICA.json
                out.append(rel)
    return out


def _copy_of(folder: str, step: int, save: str, name: str, metadata: str) -> Copy | None:
    try:
        with open(os.path.join(folder, metadata), "rb") as f:
            meta = StepMetadata.from_bytes(f.read(), os.path.join(folder, metadata))
    except (OSError, MetadataError):
        return None
    expected = set(step_reader.all_chunk_files(meta))
    files = _files_under(folder)
    return Copy(step, save, name, frozenset(f for f in files if f in expected),
                frozenset(f for f in files if f not in expected), len(expected), metadata)


def scan_node(local_dir: str, floor: int | None, usable: Iterable[int]) -> list[Copy]:
    """The copies this node holds of the steps in `usable` (committed, on the current branch, not
    marked bad) no older than `floor`: each committed local step folder (whatever process wrote it)
    and each complete peer replica."""
    wanted = {s for s in usable if floor is None or s >= floor}
    out: list[Copy] = []
    for step in sorted(wanted):
        folder = os.path.join(local_dir, layout.step_name(step))
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for marker in (n for n in names if n == layout.COMMIT_FILE or n.startswith(layout.COMMIT_FILE + ".")):
            suffix = marker[len(layout.COMMIT_FILE) + 1:]
            metadata = layout.metadata_name(int(suffix) if suffix.isdigit() else None)
            save = _marker_save(os.path.join(folder, marker))
            if save is not None and metadata in names:
                copy = _copy_of(folder, step, save, LOCAL_FOLDER, metadata)
                if copy is not None:
                    out.append(copy)
                    break  # several processes' markers in one shared folder: one copy
    for origin, got in peer_client.held_replicas(local_dir).items():
        for step, save in got.items():
            if step in wanted:
                folder = os.path.join(local_dir, peers.PEER_DIR, peers.origin_dir_name(origin), layout.step_name(step))
                copy = _copy_of(folder, step, save, peers.origin_dir_name(origin), layout.metadata_name(origin))
                if copy is not None:
                    out.append(copy)
    return out


def node_folder(local_dir: str, step: int, folder: str) -> str:
    """The folder on this node that a `Copy.folder` names."""
    if folder == LOCAL_FOLDER:
        return os.path.join(local_dir, layout.step_name(step))
    return os.path.join(local_dir, peers.PEER_DIR, folder, layout.step_name(step))


def fetch_folder_name(step: int, generation: int, process: int) -> str:
    return f"{FETCH_PREFIX}{step}-g{generation}-p{process}"


def _link(src: str, dst: str) -> int:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
    return os.path.getsize(dst)


def assemble_step(local_dir: str, views: Mapping[int, Sequence[Copy]], me: int, generation: int, step: int,
                  save: str, target: Mapping[str, Any] | None, items: Iterable[str] | None,
                  addresses: Mapping[int, str], sidecar: str | None, token_file: str | None,
                  persistent: tuple[Storage, str] | None) -> tuple[str, dict[str, Any]]:
    """Assemble (step, save) for this process's restore in a fresh fetch folder (module docstring);
    (its path, the report: {"local"|"peer"|"persistent": {"files", "bytes"}, "refused": [...]}).
    `persistent`: (storage, the step's data path) when the persistent tier has the step. Raises
    IncompleteStepError when a needed file has no source left."""
    dest = os.path.join(local_dir, fetch_folder_name(step, generation, me))
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    report: dict[str, Any] = {k: {"files": 0, "bytes": 0} for k in ("local", "peer", "persistent")}
    report["refused"] = []
    try:
        own = [c for c in views.get(me, ()) if c.step == step and c.save == save]
        remote = [(p, c) for p, cs in sorted(views.items()) if p != me for c in cs if c.step == step and c.save == save]
        # 1. The metadata (identical in every copy of a local-tier save).
        if own:
            _link(os.path.join(node_folder(local_dir, step, own[0].folder), own[0].metadata),
                  os.path.join(dest, layout.METADATA_FILE))
        elif remote:
            p, c = remote[0]
            _fetch(sidecar, token_file, step, save, dest, [(c.metadata, [Source(p, c.folder)], 0)], addresses,
                   report, rename={c.metadata: layout.METADATA_FILE})
        elif persistent is not None:
            _from_persistent(persistent, layout.METADATA_FILE, dest, report)
        meta = _read_metadata(os.path.join(dest, layout.METADATA_FILE))
        # 2. The files this process's target needs, and where each is.
        needed = step_reader.needed_chunk_files(meta, step, target, items) + other_files(views, step, save, me)
        plan = plan_file_sources(views, me, step, save, needed)
        sizes = _chunk_sizes(meta)
        fetch: list[tuple[str, list[Source], int]] = []
        for path, sources in plan.items():
            if sources and sources[0].process == me:
                nbytes = _link(os.path.join(node_folder(local_dir, step, sources[0].folder), *path.split("/")),
                               os.path.join(dest, *path.split("/")))
                report["local"]["files"] += 1
                report["local"]["bytes"] += nbytes
            elif sources:
                fetch.append((path, sources, sizes.get(path, 0)))
        missing = [p for p, s in plan.items() if not s]
        # 3. The other hosts' files through this pod's sidecar; what none serves, from the persistent tier.
        if fetch:
            missing += _fetch(sidecar, token_file, step, save, dest, fetch, addresses, report)
        for path in missing:
            if persistent is None:
                raise IncompleteStepError(f"step {step}: {path}: no host serves it and the persistent tier does "
                                          "not have the step")
            _from_persistent(persistent, path, dest, report)
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    log.info("step %d assembled for process %d from the in-cluster tiers: %s", step, me, report)
    return dest, report


def _read_metadata(path: str) -> StepMetadata:
    try:
        with open(path, "rb") as f:
            return StepMetadata.from_bytes(f.read(), path)
    except OSError as e:
        raise MetadataError(f"{path}: unreadable ({e})") from e


def _chunk_sizes(meta: StepMetadata) -> dict[str, int]:
    """chunk file -> its size (checked by the sidecar with its crc32c)."""
    out = {}
    for name, item in meta.items.items():
        if item.kind != "pytree":
            continue
        for leaf in item.leaves:
            if leaf.kind == "array":
                files = chunk_format.ArrayFiles.of(leaf)
                if files.checksum:
                    for key in files.file_keys():
                        out["/".join((name, str(leaf.dir), *key))] = files.file_size()
    return out


def _fetch(sidecar: str | None, token_file: str | None, step: int, save: str, dest: str,
           files: list[tuple[str, list[Source], int]], addresses: Mapping[int, str], report: dict[str, Any],
           rename: Mapping[str, str] | None = None) -> list[str]:
    """Have the sidecar fetch `files` (path, sources, checked size or 0) into `dest`; the paths no
    source served."""
    body: list[dict[str, Any]] = [{"path": path, "size": size, "to": (rename or {}).get(path, path),
             "sources": [{"address": addresses[s.process], "folder": s.folder}
                         for s in sources if addresses.get(s.process)]} for path, sources, size in files]
    if not sidecar:
        return [path for path, _, _ in files]
    answer = peer_client.request_fetch_chunks(sidecar, token_file, step, save, os.path.basename(dest), body)
    report["peer"]["files"] += int(answer.get("files", 0))
    report["peer"]["bytes"] += int(answer.get("bytes", 0))
    report["refused"] += list(answer.get("refused", []))
    return [str(p) for p in answer.get("missing", [])]


def _from_persistent(persistent: tuple[Storage, str], path: str, dest: str, report: dict[str, Any]) -> None:
    storage, data_path = persistent
    data = storage.read_bytes(storage.join(data_path, *path.split("/")))
    target = os.path.join(dest, *path.split("/"))
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "wb") as f:
        f.write(data)
    report["persistent"]["files"] += 1
    report["persistent"]["bytes"] += len(data)
