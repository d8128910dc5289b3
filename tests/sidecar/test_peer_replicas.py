"""Peer replicas between real `resilax sidecar` processes (sidecar/resilax_sidecar/peers.py): the
holder pulls its origin's newest local step, a replica with a flipped byte is refused on fetch (the
origin's crc32c) and the next source is used, a fetch whose caller gave up is cancelled, and the peer
endpoints refuse calls without the token.

The trainers' side is played by writing what resilax_ckpt writes: local steps and `peers.json`."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from resilax_ckpt.incluster.peers import PEERS_FILE, REPLICA_FILE
from sidecar_harness import TOKEN, build_sidecar_env, http, step_files, wait_until, write_local_step

FILES = step_files(3, 300_000)


def peer_env(tmp_path: Path, process: int, count: int) -> dict[str, str]:
    base = tmp_path / f"host{process}"
    base.mkdir()
    env = build_sidecar_env(base)
    env.update({"RESILAX_LOCAL_DIR": str(base / "local"), "RESILAX_CHECKPOINT_DIR": str(tmp_path / "persistent"),
                "JAX_PROCESS_ID": str(process), "JAX_NUM_PROCESSES": str(count),
                "RESILAX_PEER_BYTES_PER_SECOND": "0"})
    (base / "local").mkdir()
    return env


def write_peers(envs: list[dict[str, str]], generation: int = 0) -> None:
    """What each trainer writes at start: its process, its generation and every process's slice, node
    and sidecar (the sidecars here are of generation 0: RESILAX_GENERATION unset)."""
    hosts = [{"process": p, "slice": 0, "node": f"node-{p}", "address": f"127.0.0.1:{e['RESILAX_SIDECAR_PORT']}"}
             for p, e in enumerate(envs)]
    for p, env in enumerate(envs):
        control = Path(env["RESILAX_CONTROL_DIR"])
        control.mkdir(parents=True, exist_ok=True)
        (control / PEERS_FILE).write_text(json.dumps({"process": p, "generation": generation, "hosts": hosts}))


def replica(env: dict[str, str], origin: int, step: int) -> Path:
    return Path(env["RESILAX_LOCAL_DIR"]) / "_peer" / f"p{origin}" / str(step)


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_replica_with_a_flipped_byte_is_refused_and_the_next_source_is_used(
        tmp_path: Path, start_sidecar: Any) -> None:
    # One slice of three processes on three nodes: the placement is 0 -> 1, 1 -> 2, 2 -> 0.
    envs = [peer_env(tmp_path, p, 3) for p in range(3)]
    write_peers(envs)
    origin_step = write_local_step(Path(envs[0]["RESILAX_LOCAL_DIR"]), 12, FILES)
    saved = tree(origin_step)
    sidecars = [start_sidecar(env) for env in envs]
    held = wait_until(lambda: (replica(envs[1], 0, 12) / REPLICA_FILE).is_file(), 60,
                      "process 1 holding process 0's step 12")
    assert held
    assert {k: v for k, v in tree(replica(envs[1], 0, 12)).items() if k != REPLICA_FILE} == saved
    manifest = json.loads((replica(envs[1], 0, 12) / REPLICA_FILE).read_text())
    assert manifest["origin"] == 0 and manifest["step"] == 12 and len(manifest["files"]) == len(saved)
    assert not replica(envs[2], 0, 12).exists()  # process 2 holds process 1's replicas, not 0's

    # A newer local step replaces the older replica.
    write_local_step(Path(envs[0]["RESILAX_LOCAL_DIR"]), 14, FILES)
    wait_until(lambda: (replica(envs[1], 0, 14) / REPLICA_FILE).is_file() and not replica(envs[1], 0, 12).exists(),
               60, "process 1 holding step 14 only")
    newest = tree(Path(envs[0]["RESILAX_LOCAL_DIR"]) / "14")
    state = wait_until(lambda: (b := sidecars[1].get("/v1/state").body)["peer_replicas"] == {"0": 14} and b, 30,
                       "/v1/state reporting the replica")
    assert state["peer_last_error"] is None

    # Process 0's node is lost; a second copy of its replica sits on process 2's node (as a holder
    # under another placement would have it), and one byte of process 1's copy flips on its disk.
    sidecars[0].close()
    second = replica(envs[2], 0, 14)
    second.parent.mkdir(parents=True)
    second.mkdir()
    for rel, data in tree(replica(envs[1], 0, 14)).items():
        (second / rel).parent.mkdir(parents=True, exist_ok=True)
        (second / rel).write_bytes(data)
    victim = replica(envs[1], 0, 14) / "state" / "leaf1" / "c" / "0"
    data = bytearray(victim.read_bytes())
    data[1000] ^= 0x01
    victim.write_bytes(bytes(data))

    # The replacement host (process 0, an empty local tier) fetches from the holders in order.
    fresh = tmp_path / "replacement"
    fresh.mkdir()
    env0 = peer_env(fresh, 0, 3)
    write_peers([env0, *envs[1:]])  # the new generation's trainers exchange their addresses first
    replacement = start_sidecar(env0)
    sources = [f"127.0.0.1:{envs[1]['RESILAX_SIDECAR_PORT']}", f"127.0.0.1:{envs[2]['RESILAX_SIDECAR_PORT']}"]
    answer = replacement.post("/v1/peer/fetch", {"origin": 0, "step": 14, "sources": sources}, token=TOKEN)
    assert answer.status == 200, answer.body
    assert answer.body["source"] == sources[1]  # the first was refused
    assert "crc32c" in replacement.log() and "refused" in replacement.log()
    restored = Path(env0["RESILAX_LOCAL_DIR"]) / "14"
    assert tree(restored) == newest  # the step, committed (its _COMMIT last), byte for byte
    assert not [p for p in Path(env0["RESILAX_LOCAL_DIR"]).iterdir() if p.name.startswith(".tmp-")]

    # With the flipped copy as the only source: refused, nothing left behind, a JSON error naming it.
    (restored / "_COMMIT").unlink()
    for p in sorted(restored.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    restored.rmdir()
    refused = replacement.post("/v1/peer/fetch", {"origin": 0, "step": 14, "sources": sources[:1]}, token=TOKEN)
    assert refused.status == 409, refused.body
    assert refused.body["error"]["code"] == "peer_failed"
    assert "state/leaf1/c/0" in refused.body["error"]["message"]
    assert not restored.exists()
    for s in sidecars[1:]:
        s.close()


def test_peer_endpoints_refuse_a_call_without_the_token(tmp_path: Path, start_sidecar: Any) -> None:
    env = peer_env(tmp_path, 0, 2)
    write_local_step(Path(env["RESILAX_LOCAL_DIR"]), 8, FILES)
    sidecar = start_sidecar(env)
    url = sidecar.url
    calls = [("GET", "/v1/peer/0/newest", None), ("GET", "/v1/peer/0/8/manifest", None),
             ("GET", "/v1/peer/0/8/files/state/leaf0/c/0", None),
             ("POST", "/v1/peer/fetch", {"origin": 0, "step": 8, "sources": ["127.0.0.1:1"]})]
    for method, path, body in calls:
        none = http(method, url + path, body)
        assert none.status == 401, (path, none.body)
        assert none.body["error"]["code"] == "unauthorized"
        wrong = http(method, url + path, body, token="not-the-token")
        assert wrong.status == 403, (path, wrong.body)
    # with the token the same calls are served
    assert http("GET", url + "/v1/peer/0/newest", token=TOKEN).body["step"] == 8
    assert len(http("GET", url + "/v1/peer/0/8/manifest", token=TOKEN).body["files"]) == len(FILES) + 2
    assert http("GET", url + "/v1/peer/0/8/files/state/leaf0/c/0", token=TOKEN).status == 200
    # only files of the step's manifest are served
    assert http("GET", url + "/v1/peer/0/8/files/..%2F..%2Ftoken", token=TOKEN).status == 404
    assert http("GET", url + "/v1/peer/0/9/manifest", token=TOKEN).status == 404


def test_a_transfer_is_paced_to_its_byte_rate() -> None:
    """RESILAX_PEER_BYTES_PER_SECOND: the pacer sleeps whenever the bytes sent run ahead of the rate
    (time injected: a clock that advances only by the sleeps)."""
    from resilax_sidecar.peers import CHUNK_BYTES, Pacer

    now = [0.0]
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    pacer = Pacer(4 * CHUNK_BYTES, sleep=sleep, clock=lambda: now[0])
    for _ in range(8):
        pacer.account(CHUNK_BYTES)
    assert abs(now[0] - 2.0) < 1e-9  # 8 pieces at 4 pieces per second
    assert all(abs(s - 0.25) < 1e-9 for s in sleeps)
    unpaced = Pacer(None, sleep=sleep, clock=lambda: now[0])
    count = len(sleeps)
    unpaced.account(100 * CHUNK_BYTES)
    assert len(sleeps) == count


def test_a_fetch_whose_caller_gave_up_is_cancelled_and_installs_nothing(tmp_path: Path, start_sidecar: Any) -> None:
    """The trainer's request times out and closes the connection: the sidecar stops the fetch between
    two pieces, removes the partial copy and never installs the step later; its uploads go on."""
    origin_env = peer_env(tmp_path, 0, 1)
    write_local_step(Path(origin_env["RESILAX_LOCAL_DIR"]), 20, FILES)
    origin = start_sidecar(origin_env)
    fresh = tmp_path / "replacement"
    fresh.mkdir()
    env = peer_env(fresh, 0, 1)
    env["RESILAX_PEER_BYTES_PER_SECOND"] = "100000"  # 900 KB of files: ~9 s, far longer than the caller waits
    write_peers([env, origin_env])
    replacement = start_sidecar(env)
    local = Path(env["RESILAX_LOCAL_DIR"])
    body = json.dumps({"origin": 0, "step": 20, "sources": [f"127.0.0.1:{origin.port}"]}).encode()
    request = urllib.request.Request(f"{replacement.url}/v1/peer/fetch", data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        urllib.request.urlopen(request, timeout=1.0)  # gives up, closing its connection
    wait_until(lambda: "cancelled, nothing installed" in replacement.log(), 60, "the fetch to be cancelled")
    assert not (local / "20").exists()
    assert not [p for p in local.iterdir() if p.name.startswith(".tmp-")]
    assert replacement.proc.poll() is None
    # The uploader was never held up: a new local step reaches the persistent tier.
    write_local_step(local, 21, FILES)
    wait_until(lambda: replacement.get("/v1/state").body["newest_persisted_step"] == 21, 60, "step 21 uploaded")
    assert not (local / "20").exists()


class RecordingPeer:
    """An HTTP server on 127.0.0.1 standing for whatever now answers at a peer's old address (a pod IP
    is reused): it records each request and the Authorization it carried, and answers no step."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.seen: list[tuple[str, str | None]] = []
        seen = self.seen

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                seen.append((self.path, self.headers.get("Authorization")))
                body = b'{"step": null}'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_POST = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_peer_sources_outside_the_current_peers_are_refused(tmp_path: Path, start_sidecar: Any) -> None:
    """Issue 40, item 5: `POST /v1/peer/fetch` reads only from the sidecars that this generation's
    peers.json lists; a source of the caller's choosing, or any source while peers.json is another
    generation's, is a 400 naming it, and that address never hears from the sidecar (nor the token)."""
    stranger = RecordingPeer()
    try:
        env = peer_env(tmp_path, 0, 2)
        env["RESILAX_GENERATION"] = "3"
        peer = peer_env(tmp_path, 1, 2)
        write_peers([env, peer], generation=3)
        sidecar = start_sidecar(env)
        known = f"127.0.0.1:{peer['RESILAX_SIDECAR_PORT']}"
        refused = sidecar.post("/v1/peer/fetch", {"origin": 0, "step": 8, "sources": [known, stranger.address]},
                               token=TOKEN)
        assert refused.status == 400, refused.body
        message = refused.body["error"]["message"]
        assert f"sources: '{stranger.address}' are not peers of generation 3; allowed: " in message
        assert known in message.split("allowed: ")[1]
        # peers.json of an older generation (the trainer of generation 3 has not written its own yet)
        write_peers([env, peer], generation=2)
        stale = sidecar.post("/v1/peer/fetch", {"origin": 0, "step": 8, "sources": [known]}, token=TOKEN)
        assert stale.status == 400 and "no peers are known for generation 3" in stale.body["error"]["message"]
        assert stranger.seen == []
        sidecar.close()
    finally:
        stranger.close()


def test_the_replicator_sends_the_token_only_to_peers_of_the_current_generation(tmp_path: Path) -> None:
    """Issue 40, item 5: the Replicator calls the addresses of peers.json only while it is this pod's
    generation's (a stop asked for a newer one counts): a stale file's address, maybe another pod's by
    now, never gets `Authorization: Bearer`."""
    from resilax_sidecar.peer_auth import derive_peer_credential
    from resilax_sidecar.peers import Replicator

    holder = RecordingPeer()
    try:
        local, control = tmp_path / "local", tmp_path / "control"
        local.mkdir()
        control.mkdir()
        hosts = [{"process": 0, "slice": 0, "node": "node-0", "address": holder.address},
                 {"process": 1, "slice": 0, "node": "node-1", "address": "127.0.0.1:1"}]
        generation = [5]
        replicator = Replicator(local, control, lambda: "the-job-token", None, 0.01, generation=lambda: generation[0])

        def peers_of(gen: int | None) -> None:
            body: dict[str, Any] = {"process": 1, "hosts": hosts}
            if gen is not None:
                body["generation"] = gen
            (control / PEERS_FILE).write_text(json.dumps(body))

        for stale in (4, None):  # an older generation's file; a file that names none
            peers_of(stale)
            replicator.run_once()
            assert holder.seen == [], stale
        peers_of(5)
        replicator.run_once()
        # not the job's token: generation 5's peer credential (peer_auth.py), good for peer reads only
        assert holder.seen == [("/v1/peer/0/newest", f"Bearer {derive_peer_credential('the-job-token', 5)}")]
        generation[0] = 6  # a stop for generation 6 was asked: generation 5's peers are on their way out
        replicator.run_once()
        assert len(holder.seen) == 1
    finally:
        holder.close()


def test_the_newest_step_offered_to_peers_is_on_the_current_branch_and_not_bad(tmp_path: Path,
                                                                                start_sidecar: Any) -> None:
    """A host that missed a rollback (issue 40, item 6): its local tier still holds the old timeline's
    step 12, which generation 1's branch record (restored 8) supersedes; and a step a restore marked
    bad. Neither is offered as this host's newest to the peers that replicate it: step 8 is."""
    from resilax_ckpt import layout
    from resilax_ckpt.history import timelines
    from resilax_ckpt.storage import open_storage

    env = peer_env(tmp_path, 0, 2)
    local = Path(env["RESILAX_LOCAL_DIR"])
    for step in (8, 12):
        write_local_step(local, step, FILES, generation=0)
    persistent = tmp_path / "persistent"
    persistent.mkdir()
    timelines.write_branch(open_storage(str(persistent)), str(persistent), timelines.Branch((0, 1), 8, 12))
    env["RESILAX_GENERATION"] = "1"
    sidecar = start_sidecar(env)
    wait_until(lambda: sidecar.get("/v1/state").body.get("branch") is not None, 60, "the branch record read")
    assert http("GET", sidecar.url + "/v1/peer/0/newest", token=TOKEN).body["step"] == 8

    write_local_step(local, 16, FILES, generation=1)  # the new branch's step, then marked bad by a restore
    (local / layout.BAD_DIR).mkdir(exist_ok=True)
    (local / layout.BAD_DIR / "16.json").write_text(json.dumps({"step": 16, "reason": "a restore could not read it"}))
    assert http("GET", sidecar.url + "/v1/peer/0/newest", token=TOKEN).body["step"] == 8


def test_the_peer_credential_opens_the_peer_reads_of_its_generation_only(tmp_path: Path, start_sidecar: Any) -> None:
    """Issue 40: what the sidecars send one another (peer_auth.py) reads this sidecar's peer endpoints
    for its generation (and the next or previous: an in-place restart moves the sidecars a moment
    apart), and nothing else: no save, no trainer stop, no peer fetch that would make this sidecar call
    out; another generation's credential is refused like a wrong token."""
    from resilax_sidecar.peer_auth import derive_peer_credential

    env = peer_env(tmp_path, 0, 2)
    env["RESILAX_GENERATION"] = "5"
    write_local_step(Path(env["RESILAX_LOCAL_DIR"]), 8, FILES, generation=5)
    sidecar = start_sidecar(env)
    url = sidecar.url
    reads = ["/v1/peer/0/newest", "/v1/peer/0/8/manifest", "/v1/peer/0/8/files/state/leaf0/c/0"]
    for generation in (4, 5, 6):
        credential = derive_peer_credential(TOKEN, generation)
        for path in reads:
            assert http("GET", url + path, token=credential).status == 200, (generation, path)
    credential = derive_peer_credential(TOKEN, 5)
    for method, path, body in [("POST", "/v1/save", {"reason": "manual"}), ("POST", "/v1/trainer/stop", {}),
                               ("POST", "/v1/peer/fetch", {"origin": 0, "step": 8, "sources": ["127.0.0.1:1"]})]:
        refused = http(method, url + path, body, token=credential)
        assert refused.status == 403, (path, refused.body)
    for generation in (3, 7):
        stale = http("GET", url + "/v1/peer/0/newest", token=derive_peer_credential(TOKEN, generation))
        assert stale.status == 403, generation
    assert http("GET", url + "/v1/peer/0/newest", token=derive_peer_credential("another-token", 5)).status == 403
