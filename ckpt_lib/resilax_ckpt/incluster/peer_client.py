"""The trainer's side of peer replicas (I/O; the rules are in peers.py, the transfers in the sidecar):
`peers.json` for the sidecar, the replicas this host holds, and the request that has the sidecar
fetch this process's step from the peers holding it."""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from resilax_ckpt import layout
from resilax_ckpt.errors import ResilaxCkptError
from resilax_ckpt.incluster import peers as rules

log = logging.getLogger(__name__)

FETCH_TIMEOUT_SECONDS = 600.0
ANSWER_CAP = 16 << 20
"""The most bytes of the sidecar's answer read (a fetch-chunks answer lists refused and missing files)."""


class PeerFetchError(ResilaxCkptError, OSError):
    """The sidecar could not fetch this process's step from any peer."""


def write_peers(control_dir: str, process: int, hosts: Sequence[rules.PeerHost], generation: int) -> None:
    """`$RESILAX_CONTROL_DIR/peers.json` (written to a temporary name and renamed). `generation`: the
    generation these hosts are of; the sidecar calls them (with the job's token) only while it is its own."""
    body = {"process": process, "generation": generation, "hosts": [
        {"process": h.process, "slice": h.slice, "node": h.node, "address": h.address} for h in hosts]}
    os.makedirs(control_dir, exist_ok=True)
    path = os.path.join(control_dir, rules.PEERS_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(body, f)
    os.replace(path + ".tmp", path)


def held_replicas(local_dir: str) -> dict[int, dict[int, str]]:
    """origin -> step -> save identity of the complete replicas (`_REPLICA.json` present) in
    `<local>/_peer/`."""
    base = os.path.join(local_dir, rules.PEER_DIR)
    out: dict[int, dict[int, str]] = {}
    for origin_name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        origin = rules.parse_origin_dir(origin_name)
        if origin is None:
            continue
        for step_name in os.listdir(os.path.join(base, origin_name)):
            step = layout.parse_step(step_name)
            if step is None:
                continue
            try:
                with open(os.path.join(base, origin_name, step_name, rules.REPLICA_FILE), "rb") as f:
                    out.setdefault(origin, {})[step] = str(json.load(f).get("save", ""))
            except (OSError, ValueError):
                continue
    return out


def _token(token_file: str | None) -> str:
    if not token_file:
        return ""
    try:
        with open(token_file) as f:
            return f.read().strip()
    except OSError as e:
        raise PeerFetchError(f"RESILAX_SIDECAR_TOKEN_FILE={token_file}: {e}") from e


def _post(sidecar: str, token_file: str | None, path: str, body: dict[str, Any], what: str) -> Any:
    request = urllib.request.Request(f"http://{sidecar}{path}", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {_token(token_file)}"})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_SECONDS) as response:
            data = response.read(ANSWER_CAP + 1)
    except urllib.error.HTTPError as e:
        raise PeerFetchError(f"sidecar {sidecar}: {what}: HTTP {e.code}: "
                             f"{e.read(1000).decode('utf-8', 'replace')}") from e
    except (urllib.error.URLError, OSError) as e:
        raise PeerFetchError(f"sidecar {sidecar}: {what}: {e}") from e
    if len(data) > ANSWER_CAP:
        raise PeerFetchError(f"sidecar {sidecar}: {what}: the answer is over {ANSWER_CAP} bytes; not read")
    try:
        return json.loads(data)
    except ValueError as e:
        raise PeerFetchError(f"sidecar {sidecar}: {what}: not JSON: {e}") from e


def request_fetch_chunks(sidecar: str, token_file: str | None, step: int, save: str, dest: str,
                         files: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Have this pod's sidecar fetch `files` (`{"path", "size", "to", "sources": [{"address",
    "folder"}]}`) of (step, save) from the other hosts into `<local>/<dest>/` (docs/sidecar.md,
    `POST /v1/peer/fetch-chunks`); its answer `{"files", "bytes", "refused", "missing"}`."""
    body = {"step": step, "save": save, "dest": dest, "files": list(files)}
    answer = _post(sidecar, token_file, "/v1/peer/fetch-chunks", body, f"fetch of {len(files)} files of step {step}")
    if not isinstance(answer, dict):
        raise PeerFetchError(f"sidecar {sidecar}: fetch of step {step}: not a JSON object: {answer!r}"[:1000])
    return answer


def request_fetch(sidecar: str, token_file: str | None, process: int, step: int, sources: Sequence[str]) -> str:
    """Have this pod's sidecar fetch `step` of `process` from `sources` (in order) into the local tier;
    the source that served it. Raises PeerFetchError with the sidecar's reason."""
    body = {"origin": process, "step": step, "sources": list(sources)}
    answer = _post(sidecar, token_file, "/v1/peer/fetch", body, f"fetch of step {step} from {list(sources)}")
    try:
        return str(answer["source"])
    except (KeyError, TypeError) as e:
        raise PeerFetchError(f"sidecar {sidecar}: fetch of step {step} from {list(sources)}: {e}") from e
