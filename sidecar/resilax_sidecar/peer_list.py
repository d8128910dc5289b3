"""The job's current peers as this pod knows them: `peers.json`, which the generation's trainers
write at their start barrier (resilax_ckpt.incluster.peer_client.write_peers), naming each process's sidecar
address and the generation. The sidecar sends the job's token to these addresses, and fetches a
restore from them, only while the file is its own generation's (issue 40, item 5): a stale file's
address is a gone pod's IP, which another pod may have by now."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from resilax_ckpt.incluster import peers as rules

PEERS_CAP = 16 << 20
"""The most bytes of `peers.json` read (about 100 bytes a host)."""


def read_peers(control_dir: Path) -> tuple[int, list[rules.PeerHost], int | None] | None:
    """`peers.json` written by this pod's trainer: (its process, the generation's hosts, the
    generation they are of: None from a trainer that does not name it)."""
    try:
        with open(control_dir / rules.PEERS_FILE, "rb") as f:
            body = json.loads(f.read(PEERS_CAP))
        hosts = [rules.PeerHost(int(h["process"]), int(h["slice"]), str(h["node"]), str(h["address"]))
                 for h in body["hosts"]]
        generation = body.get("generation")
        return int(body["process"]), hosts, generation if isinstance(generation, int) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def current_peers(control_dir: Path, generation: int) -> tuple[int, list[rules.PeerHost]] | None:
    """(this process, the hosts) of `peers.json` when it is `generation`'s; None when there is none, it
    names no generation or another one (a stale file: its addresses may be other pods' by now)."""
    peers = read_peers(control_dir)
    if peers is None or peers[2] != generation:
        return None
    return peers[0], peers[1]


def refuse_sources(sources: Sequence[str], control_dir: Path, generation: int) -> str | None:
    """Why a fetch may not read from `sources` (None: it may): each must be the sidecar of one of the
    job's current peers, as this generation's `peers.json` lists them. A caller that holds the token
    can then neither point a restore at a host of its choosing nor have the token sent there."""
    peers = current_peers(control_dir, generation)
    if peers is None:
        return (f"sources: no peers are known for generation {generation} ({rules.PEERS_FILE} is missing or "
                "of another generation); a fetch reads only from the job's current peers")
    known = {h.address for h in peers[1] if h.address}
    unknown = [s for s in sources if s not in known]
    if unknown:
        return (f"sources: {', '.join(map(repr, unknown[:10]))} are not peers of generation {generation}; "
                f"allowed: {', '.join(sorted(known)) or 'none'}")
    return None
