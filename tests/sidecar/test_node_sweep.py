"""The node sweep (resilax_sidecar.node_sweep, issue 25 item 10): the `scope: Node` folders of deleted
JAXJobs are removed, never another job's folder nor anything Resilax did not write. The decisions in
tables; the sweep on real folders; the marker written by a real sidecar. Against the real API server
with the chart's least-privilege ServiceAccount: tests/chart/test_chart_install.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from resilax_sidecar.node_sweep import (
    MARKER_KIND,
    OWNER_MARKER,
    TRASH_PREFIX,
    JobState,
    Owner,
    decide_remove,
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


@pytest.mark.parametrize(("status", "body", "state"), [
    (404, b"", JobState.GONE),
    (200, json.dumps({"metadata": {"uid": UID_A}}).encode(), JobState.EXISTS),
    (200, json.dumps({"metadata": {"uid": UID_B}}).encode(), JobState.GONE),  # deleted and created again
    (403, b"", JobState.UNKNOWN),
    (500, b"", JobState.UNKNOWN),
    (200, b"<html>", JobState.UNKNOWN),
], ids=["deleted", "exists", "recreated", "forbidden", "server-error", "garbage"])
def test_job_state_from_answer(status: int, body: bytes, state: JobState) -> None:
    assert job_state_from_answer(status, body, UID_A) is state


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

    removed = sweep_root(root, lookup)
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
    assert sweep_root(tmp_path / "missing-root", lookup) == []


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
