"""Chunk files between sidecars for a restore onto any mesh (the rules are in
`resilax_ckpt.incluster.chunk_sources`, the trainer's side in `resilax_ckpt.incluster.chunk_fetch`).

1. `GET /v1/chunks/{step}/{folder}/{path}?save=<identity>` on a holder: one file of what its node
   holds of (step, save): `folder` `local` is the node's committed local step `<local>/<step>/`
   (whichever process committed it), `p<origin>` a complete peer replica.
2. `POST /v1/peer/fetch-chunks` on the trainer's own sidecar, body `{"step", "save", "dest", "files":
   [{"path", "to", "size", "sources": [{"address", "folder"}]}]}`: each file is fetched from its
   sources in order into `<local>/<dest>/<to>` (`dest` a `.tmp-fetch-` folder of the local tier).
   A chunk file (`size` > 0: a checksummed chunk's stored size) must have that size and end with the
   crc32c of the bytes before it (zarr3's `crc32c` codec, written with the chunk): a holder whose
   copy fails is refused (logged, in the answer) and the next source tried. Answer: `{"files",
   "bytes", "refused": [{"path", "source", "reason"}], "missing": [paths no source served]}`.
Files are streamed in `peers.CHUNK_BYTES` pieces, a few at a time (`THREADS`), paced like replicas.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import threading
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from resilax_ckpt import layout
from resilax_ckpt.chunks import checksums
from resilax_ckpt.errors import ChecksumMismatchError
from resilax_ckpt.incluster import peers as rules

from resilax_sidecar import peers

log = logging.getLogger(__name__)

THREADS = 4
"""Files fetched at once by one request."""

FETCH_PREFIX = f"{layout.TMP_PREFIX}fetch-"


def _has_save(marker: Path, save: str) -> bool:
    return peers.save_identity(marker) == save


def served_chunk_folder(local_dir: Path, step: int, folder: str, save: str) -> Path | None:
    """The folder of this node's copy (step, save) that `folder` names, or None when it holds none."""
    if folder == "local":
        base = local_dir / layout.step_name(step)
        try:
            names = os.listdir(base)
        except OSError:
            return None
        markers = [n for n in names if n == layout.COMMIT_FILE or n.startswith(layout.COMMIT_FILE + ".")]
        return base if any(_has_save(base / n, save) for n in markers) else None
    origin = rules.parse_origin_dir(folder)
    if origin is None:
        return None
    base = peers.replica_folder(local_dir, origin, step)
    try:
        body = json.loads((base / rules.REPLICA_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return base if isinstance(body, dict) and str(body.get("save", "")) == save else None


def check_request(body: Mapping[str, Any]) -> list[str]:
    """The problems of a fetch-chunks body, each naming its field."""
    problems = []
    step, save, dest, files = body.get("step"), body.get("save"), body.get("dest"), body.get("files")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        problems.append(f"step: {step!r} must be a non-negative integer")
    if not isinstance(save, str):
        problems.append(f"save: {save!r} must be a string")
    if not isinstance(dest, str) or not dest.startswith(FETCH_PREFIX) or "/" in dest or ".." in dest:
        problems.append(f"dest: {dest!r} must be a folder name starting with {FETCH_PREFIX!r}")
    if not isinstance(files, list):
        problems.append(f"files: {files!r} must be a list")
        return problems
    for i, f in enumerate(files):
        ok = (isinstance(f, dict) and all(_safe(f.get(k)) for k in ("path", "to"))
              and isinstance(f.get("size"), int) and isinstance(f.get("sources"), list)
              and all(isinstance(s, dict) and isinstance(s.get("address"), str)
                      and isinstance(s.get("folder"), str) for s in f["sources"]))
        if not ok:
            problems.append(f"files[{i}]: {f!r} must be {{'path', 'to': relative paths, 'size': int, "
                            "'sources': [{'address', 'folder'}]}")
    return problems


def _safe(path: Any) -> bool:
    return isinstance(path, str) and bool(path) and not path.startswith("/") and all(
        p not in ("", ".", "..") for p in path.split("/"))


class _Refused(peers.PeerError):
    """A source's copy of a file failed its size or checksum."""


def _fetch_file(connection: Any, step: int, save: str, entry: Mapping[str, Any], folder: str, target: Path,
                pacer: peers.Pacer, cancel: threading.Event | None) -> int:
    """One file from one source into `target` (checked, renamed into place); its bytes."""
    path, size = str(entry["path"]), int(entry["size"])
    query = urllib.parse.urlencode({"save": save})
    response = connection.get(f"/v1/chunks/{step}/{folder}/{urllib.parse.quote(path)}?{query}")
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(f"{target.name}.part-{uuid.uuid4().hex[:8]}")
    value, got, tail = 0, 0, b""
    try:
        with open(part, "wb") as out:
            while piece := response.read(peers.CHUNK_BYTES):
                if cancel is not None and cancel.is_set():
                    raise peers.FetchCancelled(f"step {step}: {path}: cancelled, its caller gave up")
                out.write(piece)
                if size > 0:  # the crc32c covers all but the last CRC_BYTES bytes
                    data = tail + piece
                    body, tail = data[:-checksums.CRC_BYTES], data[-checksums.CRC_BYTES:]
                    value = checksums.crc32c(body, value)
                got += len(piece)
                pacer.account(len(piece))
        if size > 0:
            if got != size:
                raise _Refused(f"{path}: {got} bytes, a chunk file of this array has {size}")
            checksums.verify(value, tail, path)
        os.replace(part, target)
    except BaseException:
        part.unlink(missing_ok=True)
        raise
    return got


def fetch_chunks(local_dir: Path, body: Mapping[str, Any], token: str | None, pacer: peers.Pacer,
                 cancel: threading.Event | None = None) -> dict[str, Any]:
    """Carry out a checked fetch-chunks body (module docstring); the answer."""
    step, save = int(body["step"]), str(body["save"])
    dest = local_dir / str(body["dest"])
    dest.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()
    answer: dict[str, Any] = {"files": 0, "bytes": 0, "refused": [], "missing": []}
    local = threading.local()
    opened: list[Any] = []

    def connection(address: str) -> Any:
        pool = getattr(local, "pool", None)
        if pool is None:
            pool = local.pool = {}
        if address not in pool:
            pool[address] = peers.connect(address, token)
            with lock:
                opened.append(pool[address])
        return pool[address]

    def one(entry: Mapping[str, Any]) -> None:
        target = dest.joinpath(*str(entry["to"]).split("/"))
        for source in entry["sources"]:
            address, folder = str(source["address"]), str(source["folder"])
            try:
                got = _fetch_file(connection(address), step, save, entry, folder, target, pacer, cancel)
            except peers.FetchCancelled:
                raise
            except (peers.PeerError, OSError, ChecksumMismatchError) as e:
                log.warning("step %d: %s from %s (%s) refused, trying the next holder: %s", step, entry["path"],
                            address, folder, e)
                with lock:
                    answer["refused"].append({"path": entry["path"], "source": address, "reason": str(e)})
                continue
            with lock:
                answer["files"] += 1
                answer["bytes"] += got
            return
        with lock:
            answer["missing"].append(entry["path"])

    files: Sequence[Mapping[str, Any]] = body["files"]
    try:
        with concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix=f"fetch-chunks-{step}") as pool:
            for future in [pool.submit(one, entry) for entry in files]:
                future.result()
    finally:
        for c in opened:
            c.close()
    log.info("step %d: %d files (%d bytes) fetched from peers into %s; %d refused, %d missing", step,
             answer["files"], answer["bytes"], dest, len(answer["refused"]), len(answer["missing"]))
    return answer
