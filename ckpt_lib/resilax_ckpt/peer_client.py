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

from resilax_ckpt import layout
from resilax_ckpt import peers as rules
from resilax_ckpt.errors import ResilaxCkptError

log = logging.getLogger(__name__)

FETCH_TIMEOUT_SECONDS = 600.0


class PeerFetchError(ResilaxCkptError, OSError):
    """The sidecar could not fetch this process's step from any peer."""


def write_peers(control_dir: str, process: int, hosts: Sequence[rules.PeerHost]) -> None:
    """`$RESILAX_CONTROL_DIR/peers.json` (written to a temporary name and renamed)."""
    body = {"process": process, "hosts": [
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


def request_fetch(sidecar: str, token_file: str | None, process: int, step: int, sources: Sequence[str]) -> str:
    """Have this pod's sidecar fetch `step` of `process` from `sources` (in order) into the local tier;
    the source that served it. Raises PeerFetchError with the sidecar's reason."""
    token = ""
    if token_file:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise PeerFetchError(f"RESILAX_SIDECAR_TOKEN_FILE={token_file}: {e}") from e
    body = json.dumps({"origin": process, "step": step, "sources": list(sources)}).encode()
    request = urllib.request.Request(f"http://{sidecar}/v1/peer/fetch", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_SECONDS) as response:
            return str(json.loads(response.read())["source"])
    except urllib.error.HTTPError as e:
        raise PeerFetchError(f"sidecar {sidecar}: fetch of step {step} from {list(sources)}: HTTP {e.code}: "
                             f"{e.read()[:1000].decode('utf-8', 'replace')}") from e
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        raise PeerFetchError(f"sidecar {sidecar}: fetch of step {step} from {list(sources)}: {e}") from e
