"""Peer replicas between sidecars (the I/O; the rules are in `resilax_ckpt.incluster.peers`).

Protocol (HTTP, every call with the job's bearer token, like the sidecar's mutating API):
1. `GET /v1/peer/{origin}/newest` on the origin's sidecar: `{"step", "save"}` of its newest
   committed local step (`step` null when it has none).
2. `GET /v1/peer/{origin}/{step}/manifest`: `{"origin", "step", "save", "files": [{"path", "size",
   "crc32c"}]}` — the origin computes it from its own local step; a holder answers the manifest it
   stored with the replica (the origin's checksums, so a byte changed on the holder's disk since is
   caught).
3. `GET /v1/peer/{origin}/{step}/files/{path}`: one file, streamed.
The receiver streams each file to disk in `CHUNK_BYTES` pieces (memory bound: one piece per
transfer), paced to `RESILAX_PEER_BYTES_PER_SECOND`, computes its crc32c on the way and refuses the
copy on any mismatch of size or checksum; the copy becomes visible only when complete (renamed from a
`.tmp-` folder, `_REPLICA.json` or the commit marker last).

Two uses of the same transfer:
- replication: each holder (`resilax_ckpt.incluster.peers.plan_peers`) pulls the newest local step of each
  origin it holds for into `<local>/_peer/p<origin>/<step>/` and then drops that origin's older
  replicas (the `Replicator` thread);
- restore: the trainer of a replacement host asks its own sidecar (`POST /v1/peer/fetch`, body
  `{"origin", "step", "sources": ["host:port", ...]}`) to fetch its step from the holders in order
  into its local tier `<local>/<step>/`, the next source tried when one fails.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from resilax_ckpt import layout
from resilax_ckpt.chunks import checksums
from resilax_ckpt.incluster import peers as rules
from resilax_ckpt.incluster.peer_client import held_replicas

from resilax_sidecar.errors import SidecarError
from resilax_sidecar.peer_auth import credential_for
from resilax_sidecar.peer_list import current_peers

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Bytes read or written per piece of a transfer: the memory one transfer holds."""

TIMEOUT_SECONDS = 30.0
JSON_CAP = 64 << 20
"""The most bytes of a peer's JSON answer read (a manifest: about 100 bytes a file)."""


class PeerError(SidecarError, OSError):
    """A peer transfer failed: the source is unreachable, refused, or sent bytes that do not match."""


class FetchCancelled(PeerError):
    """A fetch whose caller gave up (`cancel` set): stopped between two pieces, nothing installed."""


def _check_cancel(cancel: threading.Event | None, what: str) -> None:
    if cancel is not None and cancel.is_set():
        raise FetchCancelled(f"{what}: cancelled, its caller gave up")


# ---- the files a sidecar serves -----------------------------------------------------------------


def replica_folder(local_dir: Path, origin: int, step: int) -> Path:
    return local_dir / rules.PEER_DIR / rules.origin_dir_name(origin) / layout.step_name(step)


def _commit_marker(folder: Path, process_id: int) -> Path | None:
    for name in (layout.commit_name(None), layout.commit_name(process_id)):
        if (folder / name).is_file():
            return folder / name
    return None


def save_identity(marker: Path) -> str:
    """The save's identity in a local `_COMMIT` (`""` when it has none)."""
    try:
        body = json.loads(marker.read_bytes())
    except (OSError, ValueError):
        return ""
    return str(body.get("save", "")) if isinstance(body, dict) else ""


def newest_own_step(local_dir: Path, process_id: int,
                    current: Collection[int] | None = None) -> tuple[int, str] | None:
    """(step, save identity) of this host's newest committed local step of `process_id`; with `current`
    (the uploader's view of the local tier: not bad, on the current branch), only one of those, so a
    node that missed a rollback never offers its peers the abandoned timeline's step."""
    try:
        names = os.listdir(local_dir)
    except FileNotFoundError:
        return None
    for step in sorted((s for s in map(layout.parse_step, names) if s is not None), reverse=True):
        if current is not None and step not in current:
            continue
        marker = _commit_marker(local_dir / layout.step_name(step), process_id)
        if marker is not None:
            return step, save_identity(marker)
    return None


def _files_of(folder: Path) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(folder):
        for name in files:
            out.append(os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/"))
    return sorted(out)


def file_crc32c(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while piece := f.read(CHUNK_BYTES):
            value = checksums.crc32c(piece, value)
    return value


def build_manifest(folder: Path, origin: int, step: int, save: str) -> dict[str, Any]:
    """The manifest of an origin's own local step (reads every file once)."""
    files = [{"path": rel, "size": (folder / rel).stat().st_size, "crc32c": file_crc32c(folder / rel)}
             for rel in _files_of(folder)]
    return {"origin": origin, "step": step, "save": save, "files": files}


def served_folder(local_dir: Path, process_id: int, origin: int, step: int) -> Path | None:
    """The folder this sidecar serves for (origin, step): its own committed local step when `origin`
    is its process, else a complete replica it holds; None when it has neither."""
    if origin == process_id:
        folder = local_dir / layout.step_name(step)
        return folder if _commit_marker(folder, process_id) is not None else None
    folder = replica_folder(local_dir, origin, step)
    return folder if (folder / rules.REPLICA_FILE).is_file() else None


def served_manifest(folder: Path, process_id: int, origin: int, step: int) -> dict[str, Any] | None:
    """The manifest of a served folder: computed for its own step, the stored one for a replica."""
    try:
        if origin == process_id:
            marker = _commit_marker(folder, process_id)
            return None if marker is None else build_manifest(folder, origin, step, save_identity(marker))
        return dict(json.loads((folder / rules.REPLICA_FILE).read_bytes()))
    except (OSError, ValueError):
        return None


def served_file(folder: Path, path: str) -> Path | None:
    """The file `path` of a served folder: a relative path to a regular file inside it (nothing else
    is served)."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return None
    target = folder.joinpath(*parts)
    return target if target.is_file() and not target.is_symlink() else None


# ---- the client side of a transfer --------------------------------------------------------------


class Pacer:
    """Paces a transfer to `bytes_per_second` (None: unpaced); `sleep` injectable for tests;
    `on_bytes` told every piece received (the metrics)."""

    def __init__(self, bytes_per_second: float | None, sleep: Callable[[float], object] = time.sleep,
                 clock: Callable[[], float] = time.monotonic,
                 on_bytes: Callable[[int], object] | None = None) -> None:
        self._rate = bytes_per_second
        self._sleep = sleep
        self._clock = clock
        self._start = clock()
        self._sent = 0
        self._lock = threading.Lock()
        self._on_bytes = on_bytes

    def account(self, n: int) -> None:
        if self._on_bytes is not None:
            self._on_bytes(n)
        with self._lock:
            self._sent += n
            sent = self._sent
        if not self._rate:
            return
        ahead = sent / self._rate - (self._clock() - self._start)
        if ahead > 0:
            self._sleep(ahead)


class _Connection:
    """One keep-alive HTTP connection to a peer sidecar (a step's files in one connection)."""

    def __init__(self, source: str, token: str | None) -> None:
        host, _, port = source.rpartition(":")
        if not host or not port.isdigit():
            raise PeerError(f"{source!r} is not host:port")
        self.source = source
        self._conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_SECONDS)
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}

    def get(self, path: str) -> http.client.HTTPResponse:
        """The response to GET `path` (read it whole before the next call)."""
        try:
            self._conn.request("GET", path, headers=self._headers)
            response = self._conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            self._conn.close()
            raise PeerError(f"{self.source}{path}: {e}") from e
        if response.status != 200:
            detail = response.read(500).decode("utf-8", "replace")  # bounded: never the whole body
            self._conn.close()  # the rest is never read: this connection is done
            raise PeerError(f"{self.source}{path}: HTTP {response.status}: {detail}")
        return response

    def get_json(self, path: str) -> Any:
        response = self.get(path)
        try:
            body = response.read(JSON_CAP + 1)
        except (OSError, http.client.HTTPException) as e:
            self._conn.close()
            raise PeerError(f"{self.source}{path}: {e}") from e
        if len(body) > JSON_CAP:
            self._conn.close()  # the rest is never read: this connection is done
            raise PeerError(f"{self.source}{path}: the answer is over {JSON_CAP} bytes; not read")
        try:
            return json.loads(body)
        except ValueError as e:
            raise PeerError(f"{self.source}{path}: not JSON: {e}") from e

    def close(self) -> None:
        self._conn.close()


def connect(source: str, token: str | None) -> _Connection:
    """A keep-alive connection to the sidecar at `source` (`host:port`); close it after use."""
    return _Connection(source, token)


def fetch_newest(source: str, origin: int, token: str | None) -> tuple[int, str, list[str] | None] | None:
    """(step, save, its data files or None from an older sidecar) of `origin`'s newest local step."""
    connection = _Connection(source, token)
    try:
        body = connection.get_json(f"/v1/peer/{origin}/newest")
    finally:
        connection.close()
    if body.get("step") is None:
        return None
    files = body.get("files")
    return int(body["step"]), str(body.get("save", "")), [str(f) for f in files] if isinstance(files, list) else None


def data_files(folder: Path) -> list[str]:
    """A step folder's data files (relative paths; not its markers or metadata: `_*` at its top)."""
    return [f for f in _files_of(folder) if "/" in f or not f.startswith("_")]


def _node_newest_step(local_dir: Path) -> int:
    """The newest step with a commit marker (any process's) on this node, -1 when none."""
    try:
        names = os.listdir(local_dir)
    except OSError:
        return -1
    for step in sorted((s for s in map(layout.parse_step, names) if s is not None), reverse=True):
        try:
            if any(n == layout.COMMIT_FILE or n.startswith(layout.COMMIT_FILE + ".")
                   for n in os.listdir(local_dir / layout.step_name(step))):
                return step
        except OSError:
            continue
    return -1


def _own_save_in_progress(local_dir: Path, step: int) -> bool:
    """Whether this node is writing its own save of `step` (its `.tmp-<step>-g<G>` folder, or a shared
    `<step>/` folder with no commit marker yet)."""
    try:
        names = os.listdir(local_dir)
    except OSError:
        return False
    if any(n.startswith(f"{layout.TMP_PREFIX}{step}-g") for n in names):
        return True
    if layout.step_name(step) not in names:
        return False
    try:
        inside = os.listdir(local_dir / layout.step_name(step))
    except OSError:
        return False
    return not any(n == layout.COMMIT_FILE or n.startswith(layout.COMMIT_FILE + ".") for n in inside)


def holds_identical(local_dir: Path, step: int, save: str, files: Sequence[str]) -> bool:
    """Whether this node's own local step `step` of save `save` (whichever process committed it) has
    every one of `files`: a data-parallel replica holding the same shards, so a replica would be a
    second copy on the same node."""
    folder = local_dir / layout.step_name(step)
    try:
        markers = [n for n in os.listdir(folder) if n == layout.COMMIT_FILE or n.startswith(layout.COMMIT_FILE + ".")]
    except OSError:
        return False
    if not any(save_identity(folder / m) == save for m in markers):
        return False
    return all((folder / f).is_file() for f in files)


def fetch_step(source: str, origin: int, step: int, token: str | None, dest: Path, pacer: Pacer,
               cancel: threading.Event | None = None, purpose: str = "replica") -> dict[str, Any]:
    """Copy (origin, step) from `source` into the new folder `dest`, checking every file's size and
    crc32c against the source's manifest; the manifest. On any failure `dest` is removed; `cancel`
    set stops it between two pieces (FetchCancelled)."""
    connection = _Connection(source, token)
    try:
        return _fetch_step(connection, origin, step, dest, pacer, cancel, purpose)
    finally:
        connection.close()


def _fetch_step(connection: _Connection, origin: int, step: int, dest: Path, pacer: Pacer,
                cancel: threading.Event | None, purpose: str) -> dict[str, Any]:
    source = connection.source
    manifest = connection.get_json(f"/v1/peer/{origin}/{step}/manifest")
    if manifest.get("origin") != origin or manifest.get("step") != step:
        raise PeerError(f"{source}: manifest of ({origin}, {step}) names ({manifest.get('origin')}, "
                        f"{manifest.get('step')})")
    dest.mkdir(parents=True)
    try:
        for entry in manifest["files"]:
            rel = str(entry["path"])
            if rel.startswith("/") or ".." in rel.split("/"):
                raise PeerError(f"{source}: manifest of step {step} names an unsafe path {rel!r}")
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            value, size = 0, 0
            quoted = urllib.parse.quote(rel)
            response = connection.get(f"/v1/peer/{origin}/{step}/files/{quoted}?purpose={purpose}")
            with open(target, "wb") as out:
                while piece := response.read(CHUNK_BYTES):
                    _check_cancel(cancel, f"{source}: step {step} of process {origin}")
                    out.write(piece)
                    value = checksums.crc32c(piece, value)
                    size += len(piece)
                    pacer.account(len(piece))
                out.flush()
                os.fsync(out.fileno())
            if size != entry["size"] or value != entry["crc32c"]:
                raise PeerError(f"{source}: step {step} of process {origin}: {rel}: got {size} bytes with crc32c "
                                f"0x{value:08x}, the manifest says {entry['size']} bytes with 0x{entry['crc32c']:08x}; "
                                "the copy is refused")
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return dict(manifest)


def _tmp(parent: Path, step: int) -> Path:
    return parent / f"{layout.TMP_PREFIX}peer-{step}-{uuid.uuid4().hex[:8]}"


def replicate_once(local_dir: Path, source: str, origin: int, token: str | None, pacer: Pacer) -> int | None:
    """Pull `origin`'s newest local step from `source` unless this host holds it already; then drop
    that origin's older replicas. The step now held (None when the origin has none)."""
    newest = fetch_newest(source, origin, token)
    if newest is None:
        return None
    step, save, files = newest
    base = local_dir / rules.PEER_DIR / rules.origin_dir_name(origin)
    final = base / layout.step_name(step)
    held = held_replicas(str(local_dir)).get(origin, {})
    if files and (_own_save_in_progress(local_dir, step) or -1 < _node_newest_step(local_dir) < step):
        # This node's own save of that step is on its way (written, or not yet begun while this node
        # saves too): decide once it is committed, so a data-parallel copy is never replicated early.
        log.debug("process %d's step %d: this node's own step not committed yet; deciding later", origin, step)
        return None
    if files and holds_identical(local_dir, step, save, files):
        # This node's own step holds the same shards (data parallel): no replica, none older kept.
        shutil.rmtree(base, ignore_errors=True)
        log.debug("process %d's step %d: this node holds its shards already; no replica", origin, step)
        return None
    if held.get(step) != save:
        base.mkdir(parents=True, exist_ok=True)
        if final.exists():
            shutil.rmtree(final)  # an older save of the same step number, or an incomplete copy
        tmp = _tmp(base, step)
        manifest = fetch_step(source, origin, step, token, tmp, pacer)
        (tmp / rules.REPLICA_FILE).write_text(json.dumps(manifest))
        os.replace(tmp, final)
        log.info("replica of process %d's step %d (%d files) taken from %s", origin, step,
                 len(manifest["files"]), source)
    for name in os.listdir(base):
        old = layout.parse_step(name)
        if (old is not None and old != step) or name.startswith(layout.TMP_PREFIX):
            shutil.rmtree(base / name, ignore_errors=True)
    return step


def fetch_for_restore(local_dir: Path, process_id: int, step: int, sources: Sequence[str], token: str | None,
                      pacer: Pacer, cancel: threading.Event | None = None) -> tuple[str, dict[str, Any]]:
    """Copy this process's replica of `step` from the first source that serves it whole into the
    local tier `<local>/<step>/` (committed: the marker is moved last). (source, manifest); raises
    PeerError naming every source's failure. `cancel` set (the caller gave up) stops the fetch between
    two pieces and before it installs anything: FetchCancelled, the partial copy removed."""
    failures = []
    for source in sources:
        _check_cancel(cancel, f"fetch of step {step} of process {process_id}")
        tmp = _tmp(local_dir, step)
        try:
            manifest = fetch_step(source, process_id, step, token, tmp, pacer, cancel, "restore")
        except FetchCancelled:
            raise
        except PeerError as e:
            log.warning("peer %s refused for step %d: %s", source, step, e)
            failures.append(str(e))
            continue
        try:
            _check_cancel(cancel, f"fetch of step {step} of process {process_id} from {source}")
        except FetchCancelled:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = local_dir / layout.step_name(step)
        if not final.exists():
            os.replace(tmp, final)
        else:  # a folder other processes of this host share: files first, commit markers last
            names = sorted(_files_of(tmp), key=lambda n: n.split("/")[-1].startswith(layout.COMMIT_FILE))
            for rel in names:
                (final / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp / rel, final / rel)
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("step %d of process %d restored into the local tier from peer %s", step, process_id, source)
        return source, manifest
    raise PeerError(f"no peer served step {step} of process {process_id}: " + "; ".join(failures)
                    if failures else f"no peer holds step {step} of process {process_id}")


# ---- the replicator thread ----------------------------------------------------------------------


class Replicator:
    """Keeps a replica of the newest local step of each origin this host holds for (the placement of
    `resilax_ckpt.incluster.peers`), polling the origins' sidecars every `poll_seconds`."""

    def __init__(self, local_dir: Path, control_dir: Path, read_token: Callable[[], str | None],
                 bytes_per_second: float | None, poll_seconds: float,
                 on_bytes: Callable[[int], object] | None = None,
                 generation: Callable[[], int] = lambda: 0) -> None:
        self.on_bytes = on_bytes
        self.generation = generation
        """This pod's current generation (a stop asked for a newer one counts): the token goes only to
        the peers of `peers.json` when it is that generation's."""
        self.local_dir = local_dir
        self.control_dir = control_dir
        self.read_token = read_token
        self.bytes_per_second = bytes_per_second
        self.poll_seconds = poll_seconds
        self.held: dict[int, int] = {}
        self.last_error: str | None = None

    def plan(self) -> Iterator[tuple[int, str]]:
        """(origin, its sidecar's address) for each origin this host holds for, from `peers.json` only
        while it is the current generation's: a stale file's addresses (a gone pod's IP, maybe another
        pod's by now) never get the token."""
        peers = current_peers(self.control_dir, self.generation())
        if peers is None:
            return
        me, hosts = peers
        placement = rules.plan_peers(hosts)
        addresses = {h.process: h.address for h in hosts}
        for origin in rules.origins_held_by(me, placement):
            if addresses.get(origin):
                yield origin, addresses[origin]

    def run_once(self) -> None:
        for origin, source in list(self.plan()):
            try:
                step = replicate_once(self.local_dir, source, origin,
                                      credential_for(self.read_token(), self.generation()),
                                      Pacer(self.bytes_per_second, on_bytes=self.on_bytes))
            except (PeerError, OSError) as e:
                self.last_error = str(e)
                log.warning("replica of process %d from %s: %s", origin, source, e)
                continue
            if step is not None:
                self.held[origin] = step

    def run_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
            except Exception:
                log.exception("peer replication failed; retrying")
            stop.wait(self.poll_seconds)
