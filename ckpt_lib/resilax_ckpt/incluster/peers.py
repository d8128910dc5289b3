"""Peer replicas of the local tier: where each host's newest local step is copied, and which source
each process restores from after a hard loss. Pure: no I/O (the sidecar moves the bytes, the manager
exchanges what each process holds through the coordination service).

**Placement** (`plan_peers`). Processes are numbered `slice * hosts_per_slice + host` (N processes,
H hosts per slice). The replica of process p's newest local step is held by the first process q,
in this order, whose node is not p's: the processes of other slices before those of p's slice; among
them the same host index first (q = p + H, p + 2H, ...), then the others; ties by ring distance
(q - p) mod N. So with several slices every replica lives in another slice (a slice failing whole
loses no replica of its own hosts' shards) and the replicas form rings p -> p + H; with one slice
they go to the next process on another node. With one node (or one process) there is no peer and
no replica.

**Two simultaneous losses.** A step is restorable from peers when every process's shards of it
survive somewhere: its own node or the holder of its replica. Losing a process's node and its
holder's node together (with two slices, p and p + H hold each other's replicas) loses the only two
copies of p's shards of the newest local step: the restore then takes the newest step that is
complete elsewhere, normally the persistent tier's newest, and loses no more than without peers.
Two losses that are not each other's holders (other hosts, or with 3+ slices p and p + 2H) are
served by peers.

**Decision** (`decide_sources`). Each process reports its own local steps (those whose chunks its
restore needs are all on its host) and the replicas it holds, each with the save's identity (the
`"save"` of the local `_COMMIT`: the same on every process for one save). A step qualifies when,
for one identity, every process has it in its own tier or some other process holds its replica;
the sources of a process are its own tier if it has the step, else the holders in process order
(the next is tried when one is refused, e.g. a checksum mismatch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

PEER_DIR = "_peer"
"""`<local>/_peer/p<origin>/<step>/`: the replicas a host holds, one folder per origin process."""

REPLICA_FILE = "_REPLICA.json"
"""Written last into a replica folder: `{"origin", "step", "save", "files": [{"path", "size", "crc32c"}]}`
(the origin's checksums, checked again whenever the replica is fetched)."""

PEERS_FILE = "peers.json"
"""`$RESILAX_CONTROL_DIR/peers.json`, written by the trainer at start for its sidecar:
`{"process", "generation", "hosts": [{"process", "slice", "node", "address"}]}`. The sidecar calls
these addresses, and accepts them as fetch sources, only while `generation` is its own."""


@dataclasses.dataclass(frozen=True)
class PeerHost:
    """One process of the generation as the placement sees it."""

    process: int
    slice: int
    node: str
    address: str = ""
    """`host:port` of its sidecar."""


def origin_dir_name(origin: int) -> str:
    return f"p{origin}"


def parse_origin_dir(name: str) -> int | None:
    return int(name[1:]) if name.startswith("p") and name[1:].isdigit() else None


def plan_peers(hosts: Sequence[PeerHost]) -> dict[int, int]:
    """origin process -> the process holding its replica (module docstring). Processes without a
    peer on another node are left out."""
    by_id = {h.process: h for h in hosts}
    count = len(by_id)
    if count < 2:
        return {}
    slices = len({h.slice for h in hosts})
    per_slice = max(1, count // max(1, slices))
    out: dict[int, int] = {}
    ids = sorted(by_id)
    for p, host in sorted(by_id.items()):
        def rank(q: int, p: int = p, host: PeerHost = host) -> tuple[bool, bool, int]:
            distance = (ids.index(q) - ids.index(p)) % count
            return by_id[q].slice == host.slice, distance % per_slice != 0, distance
        order = sorted((q for q in ids if q != p), key=rank)
        holder = next((q for q in order if by_id[q].node != host.node), None)
        if holder is not None:
            out[p] = holder
    return out


def origins_held_by(holder: int, placement: Mapping[int, int]) -> list[int]:
    """The origins whose replicas `holder` keeps."""
    return sorted(p for p, q in placement.items() if q == holder)


@dataclasses.dataclass(frozen=True)
class Holdings:
    """What one process can offer for a restore."""

    own: Mapping[int, str]
    """Its own local steps that cover its restore: step -> save identity."""
    held: Mapping[int, Mapping[int, str]] = dataclasses.field(default_factory=dict)
    """The replicas on its host: origin process -> step -> save identity."""

    def to_json(self) -> dict[str, object]:
        return {"own": {str(s): v for s, v in self.own.items()},
                "held": {str(p): {str(s): v for s, v in steps.items()} for p, steps in self.held.items()}}

    @classmethod
    def from_json(cls, raw: Mapping[str, object]) -> Holdings:
        own = raw.get("own") or {}
        held = raw.get("held") or {}
        assert isinstance(own, Mapping) and isinstance(held, Mapping)
        return cls({int(s): str(v) for s, v in own.items()},
                   {int(p): {int(s): str(v) for s, v in steps.items()} for p, steps in held.items()})


def decide_sources(views: Mapping[int, Holdings]) -> dict[int, dict[int, list[int]]]:
    """step -> process -> where that process gets the step: [] for its own local tier, else the
    processes holding its replica, in order. Only steps every process (the keys of `views`) can get,
    all copies of one save (module docstring)."""
    steps = {s for v in views.values() for s in v.own} | {
        s for v in views.values() for held in v.held.values() for s in held}
    out: dict[int, dict[int, list[int]]] = {}
    for step in sorted(steps):
        identities = sorted({v.own[step] for v in views.values() if step in v.own} | {
            held[step] for v in views.values() for held in v.held.values() if step in held})
        for save in identities:
            plan: dict[int, list[int]] = {}
            for p in sorted(views):
                if views[p].own.get(step) == save:
                    plan[p] = []
                    continue
                holders = [q for q in sorted(views) if q != p and views[q].held.get(p, {}).get(step) == save]
                if not holders:
                    break
                plan[p] = holders
            else:
                out[step] = plan
                break
    return out
