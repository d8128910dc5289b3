"""The peer credential: what sidecars send one another in place of the job's token (issue 40).

A sidecar's peer calls (the Replicator's, a restore's peer fetch, the chunk fetch) go to addresses the
trainers wrote in `peers.json`: pod IPs, which a gone pod leaves for another pod to take. Those calls
carry no longer the job's token (which opens every endpoint: saves, stop and start of the trainer) but
a credential derived from it for one generation, HMAC-SHA256(token, "resilax-peer/<generation>"),
which the sidecars accept only on the read-only peer endpoints (`/v1/peer/{origin}/...`,
`/v1/chunks/...`) and only for their own generation or the next or previous one (an in-place restart
moves the pods' sidecars to the new generation a moment apart). A leaked credential so reads the
job's checkpoints of those generations at most, and is worthless on every other endpoint and once
the job moved on. Pure.
"""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "peer-g"


def derive_peer_credential(token: str, generation: int) -> str:
    """The credential of `generation` for the job token `token`."""
    mac = hmac.new(token.encode(), f"resilax-peer/{generation}".encode(), hashlib.sha256).hexdigest()
    return f"{PREFIX}{generation}-{mac}"


def accepts_peer_credential(presented: str, token: str, generation: int) -> bool:
    """`presented` is the peer credential of `generation`, or of the one before or after it
    (constant-time comparisons)."""
    return any(hmac.compare_digest(presented.encode(), derive_peer_credential(token, g).encode())
               for g in range(max(0, generation - 1), generation + 2))


def credential_for(token: str | None, generation: int) -> str | None:
    """What a sidecar of `generation` sends its peers (None without a token)."""
    return None if token is None else derive_peer_credential(token, generation)
