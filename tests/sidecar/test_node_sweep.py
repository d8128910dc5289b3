"""The node sweep (resilax_sidecar.node_sweep, issue 25 item 10, issue 40 items 1 and 2): the
`scope: Node` folders of deleted JAXJobs are removed, never another job's folder nor anything Resilax
did not write, and only on a real NotFound seen twice some time apart while the JAXJob type is served.
A job's own folder (a FIFO, a link or a huge marker) never blocks or crashes the sweep. The decisions
in tables; the sweep on real folders, asking a small HTTP server on 127.0.0.1 that answers as the API
server would (and as it would not); the marker written by a real sidecar. Against the real API server
with the chart's least-privilege ServiceAccount: tests/chart/test_chart_install.py."""

from __future__ import annotations

import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from resilax_sidecar.node_sweep import (
    MARKER_CAP,
    MARKER_KIND,
    OWNER_MARKER,
    TRASH_PREFIX,
    ApiJobLookup,
    GoneSightings,
    JobState,
    Owner,
    decide_remove,
    is_served,
    job_state_from_answer,
    parse_owner,
    sweep_root,
    write_owner_marker,
)
from sidecar_harness import wait_until

UID_A = "0b6c2f0e-1111-4c1e-9d53-6f4b8f3f0a01"
UID_B = "7d1e5a9c-2222-4b8a-a0c4-1c2d3e4f5a6b"


def marker(namespace: str = "ml", job: str = "llama", uid: str = UID_A, kind: str = MARKER_KIND) -> bytes:
    return json.dumps({"kind": kind, "namespace": namespace, "job": job, "uid": uid}).encode()


@pytest.mark.parametrize(("folder", "body", "owner"), [
    (f"ml_llama_{UID_A}", marker(), Owner("ml", "llama", UID_A)),
    (f"ml_my_job_{UID_A}", marker(job="my_job"), Owner("ml", "my_job", UID_A)),
    (f"ml_llama_{UID_A}", None, None),
    (f"ml_llama_{UID_B}", marker(), None),  # a marker copied into another job's folder
    ("scratch", marker(), None),
    (f"ml_llama_{UID_A}", marker(kind="someone-else"), None),
    (f"ml_llama_{UID_A}", b"{not json", None),
    (f"ml_llama_{UID_A}", json.dumps({"namespace": "ml"}).encode(), None),
    ("ml_llama_", marker(uid=""), None),
], ids=["ours", "underscores-in-the-name", "no-marker", "marker-of-another-folder", "foreign-folder",
        "foreign-marker", "bad-json", "incomplete", "no-uid"])
def test_parse_owner(folder: str, body: bytes | None, owner: Owner | None) -> None:
    assert parse_owner(folder, body) == owner


def not_found(name: str = "llama", kind: str = "jaxjobs", group: str = "resilax.dev") -> bytes:
    """The API server's own answer to a GET of an object that does not exist."""
    return json.dumps({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                       "message": f'{kind}.{group} "{name}" not found', "reason": "NotFound",
                       "details": {"name": name, "group": group, "kind": kind}, "code": 404}).encode()


BARE_404 = b"404 page not found\n"
SERVED = json.dumps({"kind": "APIResourceList", "groupVersion": "resilax.dev/v1alpha1",
                     "resources": [{"name": "jaxjobs", "kind": "JAXJob", "namespaced": True}]}).encode()


@pytest.mark.parametrize(("status", "body", "state"), [
    (404, not_found(), JobState.GONE),
    (200, json.dumps({"metadata": {"uid": UID_A}}).encode(), JobState.EXISTS),
    (200, json.dumps({"metadata": {"uid": UID_B}}).encode(), JobState.GONE),  # deleted and created again
    (404, b"", JobState.UNKNOWN),
    (404, BARE_404, JobState.UNKNOWN),
    (404, not_found(kind="pods", group=""), JobState.UNKNOWN),
    (404, not_found(kind="jaxjobs", group="other.dev"), JobState.UNKNOWN),
    (404, not_found(name="other"), JobState.UNKNOWN),
    (404, json.dumps({"kind": "Status", "reason": "Gone", "details": {"name": "llama", "group": "resilax.dev",
                                                                    "kind": "jaxjobs"}}).encode(), JobState.UNKNOWN),
    (403, b"", JobState.UNKNOWN),
    (500, b"", JobState.UNKNOWN),
    (503, not_found(), JobState.UNKNOWN),
    (200, b"<html>", JobState.UNKNOWN),
], ids=["not-found", "exists", "recreated", "empty-404", "bare-404", "another-kinds-404", "another-groups-404",
        "another-names-404", "another-reason", "forbidden", "server-error", "unavailable", "garbage"])
def test_job_state_from_answer(status: int, body: bytes, state: JobState) -> None:
    assert job_state_from_answer(status, body, Owner("ml", "llama", UID_A)) is state


@pytest.mark.parametrize(("status", "body", "served"), [
    (200, SERVED, True),
    (200, json.dumps({"kind": "APIResourceList", "resources": [{"name": "other"}]}).encode(), False),
    (404, BARE_404, False),
    (503, SERVED, False),
    (200, b"[]", False),
], ids=["served", "not-listed", "group-version-missing", "unavailable", "garbage"])
def test_is_served(status: int, body: bytes, served: bool) -> None:
    assert is_served(status, body) is served


def test_gone_is_confirmed_only_by_a_second_answer_some_time_apart() -> None:
    sightings = GoneSightings(apart=60)
    assert not sightings.confirm("a", True, now=1000)
    assert not sightings.confirm("a", True, now=1059)
    assert sightings.confirm("a", True, now=1060)
    # Any other answer in between starts it again.
    sightings = GoneSightings(apart=60)
    assert not sightings.confirm("a", True, now=0)
    assert not sightings.confirm("a", False, now=30)
    assert not sightings.confirm("a", True, now=61)
    assert sightings.confirm("a", True, now=121)


@pytest.mark.parametrize(("state", "removed"), [
    (JobState.GONE, True), (JobState.EXISTS, False), (JobState.UNKNOWN, False)])
def test_decide_remove(state: JobState, removed: bool) -> None:
    assert decide_remove(Owner("ml", "llama", UID_A), state) is removed
    assert decide_remove(None, state) is False


def make_folder(root: Path, name: str, body: bytes | None) -> Path:
    folder = root / name
    (folder / "120").mkdir(parents=True)
    (folder / "120" / "_COMMIT").write_text("{}")
    if body is not None:
        (folder / OWNER_MARKER).write_bytes(body)
    return folder


def test_the_sweep_removes_only_marked_folders_of_jobs_that_are_gone(tmp_path: Path) -> None:
    root = tmp_path / "local"
    live = make_folder(root, f"ml_live_{UID_A}", marker(job="live"))
    gone = make_folder(root, f"ml_gone_{UID_A}", marker(job="gone"))
    recreated = make_folder(root, f"ml_live_{UID_B}", marker(job="live", uid=UID_B))
    unmarked = make_folder(root, f"ml_old_{UID_A}", None)
    unsure = make_folder(root, f"ml_unsure_{UID_A}", marker(job="unsure"))
    foreign = make_folder(root, "scratch", marker(job="gone"))  # a marker that does not spell its name
    (root / "notes.txt").write_text("keep me")
    elsewhere = make_folder(tmp_path / "elsewhere", f"ml_gone_{UID_B}", marker(job="gone", uid=UID_B))
    os.symlink(elsewhere, root / f"ml_gone_{UID_B}")
    (root / f"{TRASH_PREFIX}x-1234").mkdir()  # a pass that stopped between its rename and its delete

    asked: list[Owner] = []

    def lookup(owner: Owner) -> JobState:
        asked.append(owner)
        if owner.job == "unsure":
            return JobState.UNKNOWN
        return JobState.EXISTS if (owner.job, owner.uid) == ("live", UID_A) else JobState.GONE

    sightings = GoneSightings(apart=60)
    assert sweep_root(root, lookup, sightings, now=0) == []  # said gone once: nothing removed yet
    asked.clear()
    removed = sweep_root(root, lookup, sightings, now=60)
    assert sorted(removed) == sorted([gone.name, recreated.name])
    assert not gone.exists() and not recreated.exists()
    for kept in (live, unmarked, unsure, foreign, elsewhere):
        assert (kept / "120" / "_COMMIT").is_file(), kept
    assert (root / "notes.txt").read_text() == "keep me" and (root / f"ml_gone_{UID_B}").is_symlink()
    assert sorted(os.listdir(root)) == sorted([live.name, unmarked.name, unsure.name, "scratch", "notes.txt",
                                               f"ml_gone_{UID_B}"])
    # Only marked folders whose marker spells their name are asked about: nothing of anyone else's.
    assert sorted((o.job, o.uid) for o in asked) == sorted([("live", UID_A), ("gone", UID_A), ("live", UID_B),
                                                            ("unsure", UID_A)])
    assert sweep_root(tmp_path / "missing-root", lookup, sightings, now=120) == []


def test_the_marker_is_written_once(tmp_path: Path) -> None:
    assert write_owner_marker(tmp_path, "ml", "llama", UID_A)
    assert not write_owner_marker(tmp_path, "ml", "other", UID_B)
    assert parse_owner(f"ml_llama_{UID_A}", (tmp_path / OWNER_MARKER).read_bytes()) == Owner("ml", "llama", UID_A)


def test_a_sidecar_marks_its_jobs_local_tier(tmp_path: Path, sidecar_env: dict[str, str], start_sidecar: Any) -> None:
    """The real `resilax sidecar` with the operator's job variables writes the marker at start-up; the
    library and the uploader ignore it (a dot-file)."""
    local = tmp_path / f"ml_llama_{UID_A}"
    local.mkdir()
    env = {**sidecar_env, "RESILAX_LOCAL_DIR": str(local), "RESILAX_CHECKPOINT_DIR": str(tmp_path / "persistent"),
           "RESILAX_NAMESPACE": "ml", "RESILAX_JOB_NAME": "llama", "RESILAX_JOB_UID": UID_A}
    sidecar = start_sidecar(env)
    wait_until(lambda: (local / OWNER_MARKER).is_file(), 30, "the ownership marker")
    assert parse_owner(local.name, (local / OWNER_MARKER).read_bytes()) == Owner("ml", "llama", UID_A)
    assert sidecar.get("/v1/state").body["newest_local_step"] is None


class FakeApiServer:
    """An HTTP server on 127.0.0.1 that answers GETs from a table of path -> (status, body) and
    records the paths asked; unknown paths get a bare 404, as the API server's mux does."""

    def __init__(self) -> None:
        self.answers: dict[str, tuple[int, bytes]] = {}
        self.asked: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.asked.append(self.path)
                status, body = server.answers.get(self.path, (404, BARE_404))
                self.send_response(status)
                self.send_header("Content-Type", "application/json" if body.startswith(b"{") else "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    yield server
    server.close()


JOB_PATH = "/apis/resilax.dev/v1alpha1/namespaces/ml/jaxjobs/llama"
DISCOVERY_PATH = "/apis/resilax.dev/v1alpha1"


@pytest.mark.parametrize(("job_answer", "discovery"), [
    ((404, BARE_404), (200, SERVED)),
    ((404, not_found(kind="pods", group="")), (200, SERVED)),
    ((404, not_found(name="other")), (200, SERVED)),
    ((503, b'{"kind":"Status","code":503}'), (200, SERVED)),
    ((404, not_found()), (404, BARE_404)),  # a NotFound while jaxjobs are not served (CRD not synced)
    ((404, not_found()), (200, json.dumps({"resources": [{"name": "other"}]}).encode())),
], ids=["bare-404", "another-kinds-404", "another-names-404", "503", "type-not-served", "type-not-listed"])
def test_no_definite_not_found_deletes_nothing(api: FakeApiServer, tmp_path: Path, job_answer: tuple[int, bytes],
                                               discovery: tuple[int, bytes]) -> None:
    """The real lookup against answers that are not "this JAXJob does not exist": however many
    passes, however far apart, the folder stays."""
    api.answers = {JOB_PATH: job_answer, DISCOVERY_PATH: discovery}
    token = tmp_path / "token"
    token.write_text("t")
    folder = make_folder(tmp_path / "root", f"ml_llama_{UID_A}", marker())
    lookup, sightings = ApiJobLookup(api.url, token, None), GoneSightings(apart=60)
    for now in (0, 60, 120, 10_000):
        assert sweep_root(tmp_path / "root", lookup, sightings, now) == []
    assert (folder / "120" / "_COMMIT").is_file()
    assert JOB_PATH in api.asked


def test_only_a_real_not_found_seen_twice_apart_deletes(api: FakeApiServer, tmp_path: Path) -> None:
    api.answers = {JOB_PATH: (404, not_found()), DISCOVERY_PATH: (200, SERVED)}
    token = tmp_path / "token"
    token.write_text("t")
    root = tmp_path / "root"
    folder = make_folder(root, f"ml_llama_{UID_A}", marker())
    lookup, sightings = ApiJobLookup(api.url, token, None), GoneSightings(apart=60)
    assert sweep_root(root, lookup, sightings, now=0) == []
    assert sweep_root(root, lookup, sightings, now=59) == []  # twice, but not yet far enough apart
    assert folder.is_dir()
    # The job answers again in between (a NotFound from a lagging cache, then the job): start again.
    api.answers[JOB_PATH] = (200, json.dumps({"metadata": {"uid": UID_A}}).encode())
    assert sweep_root(root, lookup, sightings, now=60) == []
    api.answers[JOB_PATH] = (404, not_found())
    assert sweep_root(root, lookup, sightings, now=61) == []
    assert sweep_root(root, lookup, sightings, now=121) == [folder.name]
    assert not folder.exists() and os.listdir(root) == []
    assert DISCOVERY_PATH in api.asked


def test_a_fifo_a_link_and_a_huge_marker_neither_block_nor_crash_the_sweep(tmp_path: Path) -> None:
    """A job owns its folder: its marker may be a FIFO (opening it for reading would wait for a
    writer forever), a link to a file elsewhere (a marker that is not in the folder), or a huge
    sparse file (reading it whole fills the sweeper's memory). None is taken as a marker; the sweep
    goes on to the next folder and removes the gone job's folder after them."""
    root = tmp_path / "root"
    fifo = make_folder(root, f"ml_fifo_{UID_A}", None)
    os.mkfifo(fifo / OWNER_MARKER)
    link = make_folder(root, f"ml_link_{UID_A}", None)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(marker(job="link"))
    os.symlink(elsewhere, link / OWNER_MARKER)
    huge = make_folder(root, f"ml_huge_{UID_A}", None)
    with open(huge / OWNER_MARKER, "wb") as f:
        f.write(marker(job="huge"))
        f.truncate(64 << 30)  # 64 GiB, sparse
    padded = make_folder(root, f"ml_padded_{UID_A}", marker(job="padded") + b" " * MARKER_CAP)
    gone = make_folder(root, f"ml_zgone_{UID_A}", marker(job="zgone"))
    asked: list[str] = []

    def lookup(owner: Owner) -> JobState:
        asked.append(owner.job)
        return JobState.GONE

    def sweep() -> None:
        sightings = GoneSightings(apart=1)
        assert sweep_root(root, lookup, sightings, now=0) == []
        result.extend(sweep_root(root, lookup, sightings, now=1))

    result: list[str] = []
    worker = threading.Thread(target=sweep, daemon=True)
    worker.start()
    worker.join(60)  # a liveness guard, not a timing: the sweep takes milliseconds, a blocked one forever
    assert not worker.is_alive(), "the sweep blocked"
    assert result == [gone.name]
    assert asked == ["zgone", "zgone"]
    for kept in (fifo, link, huge, padded):
        assert (kept / "120" / "_COMMIT").is_file()


def test_a_failing_folder_does_not_stop_the_sweep(tmp_path: Path) -> None:
    root = tmp_path / "root"
    first = make_folder(root, f"ml_a_{UID_A}", marker(job="a"))
    second = make_folder(root, f"ml_b_{UID_A}", marker(job="b"))

    def lookup(owner: Owner) -> JobState:
        if owner.job == "a":
            raise RuntimeError("boom")
        return JobState.GONE

    sightings = GoneSightings(apart=0)
    assert sweep_root(root, lookup, sightings, now=0) == [second.name]
    assert (first / "120" / "_COMMIT").is_file()
