"""The node sweep: removes the `checkpoint.local.scope: Node` folders of JAXJobs that no longer exist.

With scope Node a job's local tier is `<root>/<namespace>_<job>_<job uid>` on each node it ran on
(a hostPath; with `medium: Memory` under a tmpfs root, i.e. host RAM), and it outlives the pods on
purpose. Once the job is deleted, nothing else removes it. `resilax node-sweep`, run on every node by
the chart's DaemonSet (`nodeSweeper`), does:
1. list each root's entries (`--root`, the operator's `localTier.root` and `localTier.memoryRoot`);
2. keep every entry that is not provably a Resilax local tier: a directory (not a link) holding the
   ownership marker `.resilax-owner.json` that the job's sidecar writes at start-up
   (`write_owner_marker`), whose namespace, job and uid spell the folder's own name;
3. ask the API server for each such job (`GET` of the JAXJob by namespace and name: the only right
   the sweeper's ServiceAccount has, besides the discovery every authenticated user may read). The
   job counts as gone only on a definite answer: a Kubernetes `Status` body with `reason: NotFound`
   naming the `jaxjobs` of `resilax.dev` and this name, while discovery says the API server serves
   `resilax.dev/v1alpha1` `jaxjobs` (a CRD not yet synced after a restart, a version no longer
   served or a proxy that misroutes answers a bare 404), or a JAXJob of the same name with another
   uid. On anything else (a bare 404, a 404 for another kind, an error, no access) the folder is kept;
4. remove a folder only when its job was said gone twice, at least `--confirm-after` seconds apart
   (`GoneSightings`): one odd answer never deletes. Any other answer in between starts it again;
5. remove by renaming into `<root>/.resilax-trash-<name>-<nonce>` first (one rename), then deleting
   it, so a half-removed folder never looks like a job's. Leftover trash is removed the next time.
The marker is read through the folder's descriptor with `O_NOFOLLOW | O_NONBLOCK`, only when it is a
regular file, and only up to `MARKER_CAP` bytes: a job owns its folder and could put a link, a FIFO
or a huge sparse file there; none of them blocks, is followed or fills the sweeper's memory. A step
that fails for one folder is logged and the sweep goes on with the next.
Another job's folder is never touched (a folder is matched to one job by its uid), and neither is
anything Resilax did not write (no marker, or a marker that does not spell the folder's name).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import ssl
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from resilax_sidecar.log_format import LOG_FORMATS, configure_logging

log = logging.getLogger(__name__)

OWNER_MARKER = ".resilax-owner.json"
"""The ownership marker in a job's node folder: {"kind", "namespace", "job", "uid"}."""
MARKER_KIND = "resilax.dev/local-tier"
TRASH_PREFIX = ".resilax-trash-"
GROUP, VERSION, RESOURCE = "resilax.dev", "v1alpha1", "jaxjobs"
JAXJOBS = f"/apis/{GROUP}/{VERSION}/namespaces/{{namespace}}/{RESOURCE}/{{name}}"
DISCOVERY = f"/apis/{GROUP}/{VERSION}"
MARKER_CAP = 4096
"""The most bytes of a marker read; a longer marker is not Resilax's (ours is about 150 bytes)."""
ANSWER_CAP = 1 << 20
"""The most bytes of an API server answer read."""
CONFIRM_AFTER = 60.0
"""Default seconds between the two "gone" answers that remove a folder (`--confirm-after`)."""
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class Owner:
    """The job a node folder belongs to, as its marker says."""

    namespace: str
    job: str
    uid: str

    @property
    def folder_name(self) -> str:
        return f"{self.namespace}_{self.job}_{self.uid}"


class JobState(Enum):
    EXISTS = "exists"
    GONE = "gone"
    """No JAXJob of that namespace and name, or one of another uid (deleted and created again)."""
    UNKNOWN = "unknown"
    """The API server could not say (an error, no access): the folder is kept."""


def write_owner_marker(local_dir: Path, namespace: str, job: str, uid: str) -> bool:
    """Write the ownership marker in this job's node folder unless it is there (the sidecar, at
    start-up, with scope Node). True when written. Called on: every sidecar of the job."""
    path = local_dir / OWNER_MARKER
    if path.is_file():
        return False
    body = json.dumps({"kind": MARKER_KIND, "namespace": namespace, "job": job, "uid": uid}).encode()
    tmp = local_dir / f"{OWNER_MARKER}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.write_bytes(body)
    os.replace(tmp, path)
    return True


def parse_owner(folder_name: str, marker: bytes | None) -> Owner | None:
    """The owner of a node folder, or None unless its marker is Resilax's and spells the folder's
    name exactly (pure)."""
    if marker is None:
        return None
    try:
        body = json.loads(marker)
        owner = Owner(str(body["namespace"]), str(body["job"]), str(body["uid"]))
        kind = body["kind"]
    except (ValueError, KeyError, TypeError):
        return None
    if kind != MARKER_KIND or not owner.uid or owner.folder_name != folder_name:
        return None
    return owner


def decide_remove(owner: Owner | None, state: JobState) -> bool:
    """Whether this answer says a folder's job is gone: only a marked Resilax folder whose job the API
    server definitely said is gone (pure). The sweep removes it on the second such answer, some time
    later (`GoneSightings`)."""
    return owner is not None and state is JobState.GONE


def is_not_found_status(body: bytes, name: str) -> bool:
    """Whether a 404's body is the API server's own `Status` saying that this JAXJob does not exist
    (pure): `kind: Status`, `reason: NotFound`, `details` naming `jaxjobs` of `resilax.dev` and `name`.
    A bare `404 page not found` (the resource type is not served, or a proxy's) is not."""
    try:
        answer = json.loads(body)
        details = answer["details"]
        return bool(answer["kind"] == "Status" and answer["reason"] == "NotFound"
                    and str(details["kind"]).lower() == RESOURCE and details.get("group") == GROUP
                    and details["name"] == name)
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


def job_state_from_answer(status: int, body: bytes, owner: Owner) -> JobState:
    """What a GET of the JAXJob says about the folder's job (pure): a NotFound `Status` for this
    JAXJob = gone; 200 with another uid = gone (a new job of the same name); 200 with the uid =
    exists; anything else (a bare 404, another kind's 404, an error) = unknown."""
    if status == 404:
        return JobState.GONE if is_not_found_status(body, owner.job) else JobState.UNKNOWN
    if status != 200:
        return JobState.UNKNOWN
    try:
        found = json.loads(body)["metadata"]["uid"]
    except (ValueError, KeyError, TypeError):
        return JobState.UNKNOWN
    return JobState.EXISTS if found == owner.uid else JobState.GONE


def is_served(status: int, body: bytes) -> bool:
    """Whether the discovery answer for `resilax.dev/v1alpha1` lists `jaxjobs` (pure)."""
    if status != 200:
        return False
    try:
        return any(r.get("name") == RESOURCE for r in json.loads(body)["resources"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return False


class GoneSightings:
    """The folders whose job was last said to be gone, and since when: a folder is removed on a
    "gone" answer at least `apart` seconds after the first one. Any other answer forgets it. Time
    is passed in (`now`), never read here."""

    def __init__(self, apart: float = CONFIRM_AFTER) -> None:
        self.apart = apart
        self.first_seen: dict[str, float] = {}

    def confirm(self, key: str, gone: bool, now: float) -> bool:
        """Record one answer for `key`; True when its job is now confirmed gone."""
        if not gone:
            self.first_seen.pop(key, None)
            return False
        first = self.first_seen.setdefault(key, now)
        return now - first >= self.apart

    def forget(self, key: str) -> None:
        self.first_seen.pop(key, None)


class ApiJobLookup:
    """Asks the API server for one JAXJob (GET only) with a ServiceAccount token."""

    def __init__(self, server: str, token_file: Path, ca_file: Path | None, timeout: float = 10.0) -> None:
        self.server = server.rstrip("/")
        self.token_file = token_file
        self.context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else None
        self.timeout = timeout

    @classmethod
    def in_cluster(cls) -> ApiJobLookup:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise SystemExit("resilax node-sweep: KUBERNETES_SERVICE_HOST is not set (not in a pod?); pass --api-server")
        return cls(f"https://{host}:{port}", SERVICE_ACCOUNT_DIR / "token", SERVICE_ACCOUNT_DIR / "ca.crt")

    def _get(self, path: str) -> tuple[int, bytes]:
        """One GET: the status and at most ANSWER_CAP bytes of the body (an HTTP error's too)."""
        token = self.token_file.read_text().strip()  # re-read: the kubelet rotates it
        request = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.context) as response:
                return int(response.status), bytes(response.read(ANSWER_CAP))
        except urllib.error.HTTPError as e:
            with e:
                return e.code, bytes(e.read(ANSWER_CAP))

    def __call__(self, owner: Owner) -> JobState:
        path = JAXJOBS.format(namespace=urllib.parse.quote(owner.namespace, safe=""),
                              name=urllib.parse.quote(owner.job, safe=""))
        try:
            status, body = self._get(path)
            state = job_state_from_answer(status, body, owner)
            if state is JobState.GONE and status == 404 and not is_served(*self._get(DISCOVERY)):
                log.warning("node sweep: GET %s: NotFound, but %s does not list %s; keeping its folder",
                            path, DISCOVERY, RESOURCE)
                return JobState.UNKNOWN
        except (OSError, ValueError) as e:
            log.warning("node sweep: GET %s: %s; keeping its folder", path, e)
            return JobState.UNKNOWN
        if state is JobState.UNKNOWN:
            log.warning("node sweep: GET %s: HTTP %d %r; keeping its folder", path, status, body[:200])
        return state


def read_marker(root_fd: int, name: str) -> bytes | None:
    """The marker of folder `name` under the root open as `root_fd`, or None: neither the folder nor
    the marker may be a link (O_NOFOLLOW), opening never waits (O_NONBLOCK: a FIFO), the marker must
    be a regular file (fstat), and a marker over MARKER_CAP bytes is not ours (never read further)."""
    folder = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
    try:
        fd = os.open(OWNER_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return None
    finally:
        os.close(folder)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: list[bytes] = []
        size = 0
        while size <= MARKER_CAP:
            chunk = os.read(fd, MARKER_CAP + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks) if size <= MARKER_CAP else None
    finally:
        os.close(fd)


def sweep_root(root: Path, lookup: Callable[[Owner], JobState], sightings: GoneSightings,
               now: float) -> list[str]:
    """One pass over one root at time `now` (seconds, any monotonic clock); the folders removed: those
    whose job was said gone now and at least `sightings.apart` seconds before."""
    removed: list[str] = []
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return removed
    try:
        names = sorted(os.listdir(root_fd))
        for name in names:
            try:
                if _sweep_entry(root, root_fd, name, lookup, sightings, now):
                    removed.append(name)
            except Exception:  # one folder's trouble never stops the sweep of the others
                log.exception("node sweep: %s/%s: skipped", root, name)
        prefix, seen = f"{root}/", {f"{root}/{name}" for name in names}
        for key in [k for k in sightings.first_seen if k.startswith(prefix) and k not in seen]:
            sightings.forget(key)
    finally:
        os.close(root_fd)
    return removed


def _sweep_entry(root: Path, root_fd: int, name: str, lookup: Callable[[Owner], JobState],
                 sightings: GoneSightings, now: float) -> bool:
    """Sweep one entry of a root; True when its folder was removed."""
    entry = root / name
    if name.startswith(TRASH_PREFIX):
        shutil.rmtree(entry, ignore_errors=True)  # a pass that stopped between rename and delete
        return False
    if name.startswith(".") or not stat.S_ISDIR(os.stat(name, dir_fd=root_fd, follow_symlinks=False).st_mode):
        return False
    owner = parse_owner(name, read_marker(root_fd, name))
    if owner is None:
        return False
    key = f"{root}/{name}"
    state = lookup(owner)
    if not sightings.confirm(key, decide_remove(owner, state), now):
        if state is JobState.GONE:
            log.info("node sweep: %s: JAXJob %s/%s (uid %s) said gone; removed if still gone in %.0f s",
                     entry, owner.namespace, owner.job, owner.uid, sightings.apart)
        return False
    sightings.forget(key)
    trash = root / f"{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(entry, trash)
    except FileNotFoundError:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    log.info("node sweep: removed %s: JAXJob %s/%s (uid %s) no longer exists",
             entry, owner.namespace, owner.job, owner.uid)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `resilax node-sweep` (the chart's `nodeSweeper` DaemonSet)."""
    parser = argparse.ArgumentParser(
        prog="resilax node-sweep",
        description="Remove the node folders (checkpoint.local.scope: Node) of JAXJobs that no longer exist.")
    parser.add_argument("--root", action="append", required=True, help="a local-tier root (repeat for each)")
    parser.add_argument("--every", type=float, default=0,
                        help="seconds between passes (0: one pass, a second after --confirm-after if a job "
                             "was said gone, then exit)")
    parser.add_argument("--confirm-after", type=float, default=CONFIRM_AFTER,
                        help="seconds between the two 'gone' answers that remove a folder")
    parser.add_argument("--api-server", help="the API server's URL (default: in-cluster)")
    parser.add_argument("--token-file", type=Path, help="the bearer token's file (with --api-server)")
    parser.add_argument("--ca-file", type=Path, help="the API server's CA (with --api-server)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="json (one object per line with a severity; the chart's default) or text")
    args = parser.parse_args(list(argv) if argv is not None else None)
    configure_logging(logging.INFO, args.log_format)
    if args.api_server:
        if args.token_file is None:
            parser.error("--api-server needs --token-file")
        lookup = ApiJobLookup(args.api_server, args.token_file, args.ca_file)
    else:
        lookup = ApiJobLookup.in_cluster()
    sightings = GoneSightings(args.confirm_after)
    stop = threading.Event()
    passes = 0
    while True:
        for root in args.root:
            removed = sweep_root(Path(root), lookup, sightings, time.monotonic())
            log.info("node sweep of %s: %d folder(s) of deleted jobs removed", root, len(removed))
        passes += 1
        wait = args.every if args.every > 0 else (args.confirm_after if passes == 1 and sightings.first_seen else 0)
        if wait <= 0 or stop.wait(wait):
            return 0
