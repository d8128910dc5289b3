"""Chunk files between real `resilax sidecar` processes for a restore onto any mesh
(sidecar/resilax_sidecar/peer_chunks.py): a holder's copy with a flipped byte fails the chunk's own
crc32c and is refused, the next holder serves it; the bytes are counted per purpose and direction;
a holder whose own local step already has the origin's shards keeps no replica of them.

The trainers' side is played by writing what resilax_ckpt writes: local steps (chunk files ending
with their crc32c, as the zarr3 `crc32c` codec writes them) and `peers.json`."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from resilax_ckpt.chunks import checksums
from resilax_ckpt.incluster.peers import PEERS_FILE
from sidecar_harness import TOKEN, build_sidecar_env, wait_until, write_local_step


def chunk(seed: int, size: int = 200_000) -> bytes:
    """A chunk file as the local tier stores it: the chunk's bytes, then their crc32c."""
    data = bytes((seed + i) % 251 for i in range(size))
    return data + checksums.encode(checksums.crc32c(data))


FILES = {f"params/w/c/{i}/0": chunk(i) for i in range(3)}
SIZE = len(FILES["params/w/c/0/0"])


def host_env(tmp_path: Path, name: str, process: int, count: int) -> dict[str, str]:
    base = tmp_path / name
    base.mkdir()
    env = build_sidecar_env(base)
    env.update({"RESILAX_LOCAL_DIR": str(base / "local"), "RESILAX_CHECKPOINT_DIR": str(tmp_path / "persistent"),
                "JAX_PROCESS_ID": str(process), "JAX_NUM_PROCESSES": str(count),
                "RESILAX_PEER_BYTES_PER_SECOND": "0", "RESILAX_PERSIST_EVERY_STEPS": "1000"})
    (base / "local").mkdir()
    return env


def write_peers(envs: list[dict[str, str]], generation: int = 0) -> None:
    """What each trainer writes at start (peers.json): the generation's hosts, one node each."""
    hosts = [{"process": p, "slice": 0, "node": f"node-{p}", "address": f"127.0.0.1:{e['RESILAX_SIDECAR_PORT']}"}
             for p, e in enumerate(envs)]
    for p, env in enumerate(envs):
        control = Path(env["RESILAX_CONTROL_DIR"])
        control.mkdir(parents=True, exist_ok=True)
        (control / PEERS_FILE).write_text(json.dumps({"process": p, "generation": generation, "hosts": hosts}))


def metric(text: str, purpose: str, direction: str) -> float:
    m = re.search(rf'resilax_sidecar_peer_bytes_total{{direction="{direction}",purpose="{purpose}"}} (\S+)', text)
    assert m, text[-2000:]
    return float(m.group(1))


def test_a_chunk_with_a_flipped_byte_is_refused_and_the_next_holder_serves_it(
        tmp_path: Path, start_sidecar: Any) -> None:
    # Two holders of step 30 (nodes that old processes 0 and 1 wrote), one fetcher (a new process).
    envs = [host_env(tmp_path, f"node{p}", p, 3) for p in range(3)]
    for p in (0, 1):
        write_local_step(Path(envs[p]["RESILAX_LOCAL_DIR"]), 30, FILES, process_id=p)
    victim = Path(envs[0]["RESILAX_LOCAL_DIR"]) / "30" / "params" / "w" / "c" / "1" / "0"
    flipped = bytearray(victim.read_bytes())
    flipped[1234] ^= 0x01
    victim.write_bytes(bytes(flipped))
    write_peers(envs)
    holders = [start_sidecar(envs[0]), start_sidecar(envs[1])]
    fetcher = start_sidecar(envs[2])
    sources = [{"address": f"127.0.0.1:{h.port}", "folder": "local"} for h in holders]
    files = [{"path": p, "to": p, "size": SIZE, "sources": sources} for p in sorted(FILES)]
    files.append({"path": "params/w/c/9/0", "to": "params/w/c/9/0", "size": SIZE, "sources": sources})
    dest = ".tmp-fetch-30-g2-p0"
    answer = fetcher.post("/v1/peer/fetch-chunks", {"step": 30, "save": "", "dest": dest, "files": files},
                          token=TOKEN)
    assert answer.status == 200, answer.body
    body = answer.body
    assert body["files"] == 3 and body["bytes"] == 3 * SIZE
    assert body["missing"] == ["params/w/c/9/0"]  # no holder has it: the persistent tier's part
    refused = [r for r in body["refused"] if r["path"] == "params/w/c/1/0"]
    assert [r["source"] for r in refused] == [sources[0]["address"]], body["refused"]
    assert "crc32c mismatch" in refused[0]["reason"]
    got = Path(envs[2]["RESILAX_LOCAL_DIR"]) / dest
    assert {p: (got / p).read_bytes() for p in FILES} == FILES  # the good copies, byte for byte
    assert not [p for p in got.rglob("*.part-*")]
    assert "refused, trying the next holder" in fetcher.log()
    # The bytes per purpose and direction, on both sides.
    # received: what came over the wire, the refused copy too
    assert metric(fetcher.get("/metrics").body, "restore", "received") == 4 * SIZE
    sent = [metric(h.get("/metrics").body, "restore", "sent") for h in holders]
    assert sent[0] == 3 * SIZE  # every file tried on holder 0 first (one refused by the fetcher)
    assert sent[1] == SIZE  # only the one holder 0's copy failed

    # A request naming a folder outside the local tier's fetch folders is refused, naming the field.
    bad = fetcher.post("/v1/peer/fetch-chunks", {"step": 30, "save": "", "dest": "../x", "files": files}, token=TOKEN)
    assert bad.status == 400 and "dest" in bad.body["error"]["message"]
    assert fetcher.post("/v1/peer/fetch-chunks", {"step": 30, "save": "", "dest": dest, "files": []}).status == 401
    # A source that is not one of the generation's peers (peers.json) is refused, naming it: a caller
    # with the token can neither poison the restore nor have the token sent elsewhere.
    stranger = [{"path": "params/w/c/0/0", "to": "params/w/c/0/0", "size": SIZE,
                 "sources": [{"address": "127.0.0.1:9", "folder": "local"}]}]
    bad = fetcher.post("/v1/peer/fetch-chunks", {"step": 30, "save": "", "dest": dest, "files": stranger}, token=TOKEN)
    assert bad.status == 400 and "'127.0.0.1:9' are not peers of generation 0" in bad.body["error"]["message"]
    for s in [*holders, fetcher]:
        s.close()


def test_no_replica_where_the_holders_own_step_has_the_same_shards(tmp_path: Path, start_sidecar: Any) -> None:
    """Data parallel across slices: process 2 (slice 1) holds the replica of process 0 (slice 0) and
    its own step has the same files of the same save: no replica is taken, no byte is sent; a step
    with other shards is replicated as before."""
    envs = [host_env(tmp_path, f"node{p}", p, 4) for p in range(4)]
    hosts = [{"process": p, "slice": p // 2, "node": f"node-{p}", "address": f"127.0.0.1:{e['RESILAX_SIDECAR_PORT']}"}
             for p, e in enumerate(envs)]
    for p, env in enumerate(envs):
        control = Path(env["RESILAX_CONTROL_DIR"])
        control.mkdir(parents=True, exist_ok=True)
        (control / PEERS_FILE).write_text(json.dumps({"process": p, "generation": 0, "hosts": hosts}))
    for p in (0, 2):  # the same shards (data-parallel replicas)
        write_local_step(Path(envs[p]["RESILAX_LOCAL_DIR"]), 40, FILES, process_id=p)
    other = {f"params/w/c/{i}/1": chunk(10 + i) for i in range(2)}
    write_local_step(Path(envs[1]["RESILAX_LOCAL_DIR"]), 40, other, process_id=1)
    write_local_step(Path(envs[3]["RESILAX_LOCAL_DIR"]), 40, FILES, process_id=3)
    sidecars = [start_sidecar(env) for env in envs]
    # process 3 holds process 1's replica (other shards than its own): taken
    wait_until(lambda: (Path(envs[3]["RESILAX_LOCAL_DIR"]) / "_peer" / "p1" / "40" / "_REPLICA.json").is_file(),
               60, "process 3 holding process 1's step 40")
    # process 2 holds process 0's (the same shards as its own): none, after several passes
    wait_until(lambda: "no replica" in sidecars[2].log(), 60, "process 2 deciding on process 0's step")
    assert not (Path(envs[2]["RESILAX_LOCAL_DIR"]) / "_peer").exists()
    assert metric(sidecars[2].get("/metrics").body, "replica", "received") == 0
    assert metric(sidecars[3].get("/metrics").body, "replica", "received") >= sum(map(len, other.values()))
    assert metric(sidecars[0].get("/metrics").body, "replica", "sent") == 0
    for s in sidecars:
        s.close()
