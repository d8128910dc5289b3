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
   the sweeper's ServiceAccount has) and remove the folder when the job is gone (404) or is another
   job of the same name (another uid). On any other answer (an error, no access), the folder is kept;
4. remove by renaming into `<root>/.resilax-trash-<name>-<nonce>` first (one rename), then deleting
   it, so a half-removed folder never looks like a job's. Leftover trash is removed the next time.
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
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

log = logging.getLogger(__name__)

OWNER_MARKER = ".resilax-owner.json"
"""The ownership marker in a job's node folder: {"kind", "namespace", "job", "uid"}."""
MARKER_KIND = "resilax.dev/local-tier"
TRASH_PREFIX = ".resilax-trash-"
JAXJOBS = "/apis/resilax.dev/v1alpha1/namespaces/{namespace}/jaxjobs/{name}"
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
    """Whether the sweep removes a folder: only a marked Resilax folder whose job is gone (pure)."""
    return owner is not None and state is JobState.GONE


def job_state_from_answer(status: int, body: bytes, uid: str) -> JobState:
    """What a GET of the JAXJob says about the folder's job (pure): 404 = gone; 200 with another uid =
    gone (a new job of the same name); 200 with the uid = exists; anything else = unknown."""
    if status == 404:
        return JobState.GONE
    if status != 200:
        return JobState.UNKNOWN
    try:
        found = json.loads(body)["metadata"]["uid"]
    except (ValueError, KeyError, TypeError):
        return JobState.UNKNOWN
    return JobState.EXISTS if found == uid else JobState.GONE


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

    def __call__(self, owner: Owner) -> JobState:
        path = JAXJOBS.format(namespace=urllib.parse.quote(owner.namespace, safe=""),
                              name=urllib.parse.quote(owner.job, safe=""))
        try:
            token = self.token_file.read_text().strip()  # re-read: the kubelet rotates it
            request = urllib.request.Request(self.server + path, headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=self.timeout, context=self.context) as response:
                return job_state_from_answer(response.status, response.read(1 << 20), owner.uid)
        except urllib.error.HTTPError as e:
            state = job_state_from_answer(e.code, b"", owner.uid)
            if state is JobState.UNKNOWN:
                log.warning("node sweep: GET %s: HTTP %d; keeping its folder", path, e.code)
            return state
        except (OSError, ValueError) as e:
            log.warning("node sweep: GET %s: %s; keeping its folder", path, e)
            return JobState.UNKNOWN


def _read_marker(folder: Path) -> bytes | None:
    try:
        return (folder / OWNER_MARKER).read_bytes()
    except OSError:
        return None


def sweep_root(root: Path, lookup: Callable[[Owner], JobState]) -> list[str]:
    """One pass over one root; the folders removed."""
    removed: list[str] = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return removed
    for name in names:
        entry = root / name
        if name.startswith(TRASH_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)  # a pass that stopped between rename and delete
            continue
        if name.startswith(".") or entry.is_symlink() or not entry.is_dir():
            continue
        owner = parse_owner(name, _read_marker(entry))
        if owner is None or not decide_remove(owner, lookup(owner)):
            continue
        trash = root / f"{TRASH_PREFIX}{name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(entry, trash)
        except FileNotFoundError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(name)
        log.info("node sweep: removed %s/%s: JAXJob %s/%s (uid %s) no longer exists",
                 root, name, owner.namespace, owner.job, owner.uid)
    return removed


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `resilax node-sweep` (the chart's `nodeSweeper` DaemonSet)."""
    parser = argparse.ArgumentParser(
        prog="resilax node-sweep",
        description="Remove the node folders (checkpoint.local.scope: Node) of JAXJobs that no longer exist.")
    parser.add_argument("--root", action="append", required=True, help="a local-tier root (repeat for each)")
    parser.add_argument("--every", type=float, default=0, help="seconds between passes (0: one pass and exit)")
    parser.add_argument("--api-server", help="the API server's URL (default: in-cluster)")
    parser.add_argument("--token-file", type=Path, help="the bearer token's file (with --api-server)")
    parser.add_argument("--ca-file", type=Path, help="the API server's CA (with --api-server)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.api_server:
        if args.token_file is None:
            parser.error("--api-server needs --token-file")
        lookup = ApiJobLookup(args.api_server, args.token_file, args.ca_file)
    else:
        lookup = ApiJobLookup.in_cluster()
    stop = threading.Event()
    while True:
        for root in args.root:
            removed = sweep_root(Path(root), lookup)
            log.info("node sweep of %s: %d folder(s) of deleted jobs removed", root, len(removed))
        if args.every <= 0 or stop.wait(args.every):
            return 0
