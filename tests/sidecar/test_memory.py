"""The sidecar's memory does not grow with the size of the files it uploads (issue 25, item 11): an
upload holds at most one piece of a file at a time, on a folder and on gs:// (fake-gcs-server), and
the uploads in flight together hold at most the uploader's byte budget.

Measured with tracemalloc around one real `upload_file` of a file many pieces long: the peak of the
Python allocations (the pieces read, gcsfs's and aiohttp's copies of them) stays within a few pieces,
not the file. The peak RSS of a whole sidecar uploading a 256 MiB file is a benchmark figure
(bench/sidecar_memory.py, docs/sidecar.md "Memory"), not asserted here."""

from __future__ import annotations

import hashlib
import os
import threading
import tracemalloc
from pathlib import Path

import pytest
from resilax_sidecar.metrics import SidecarMetrics
from resilax_sidecar.store import UPLOAD_PIECE_BYTES, BlobStore, GcsStore, LocalFolderStore
from resilax_sidecar.upload_copy import ByteBudget
from resilax_sidecar.uploader import Uploader
from sidecar_harness import attempt_files, step_files, write_local_step
from test_uploader import make_config

PIECE = 1 << 20
FILE_BYTES = 24 * PIECE + 12345


def peak_python_bytes_during(fn) -> int:  # type: ignore[no-untyped-def]
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(params=["folder", pytest.param("gcs", marks=pytest.mark.gcs)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "folder":
        return LocalFolderStore(tmp_path / "persistent")
    request.getfixturevalue("gcs_env")
    return GcsStore(f"{request.getfixturevalue('gcs_bucket')}/runs/job", piece_bytes=PIECE)


def test_an_upload_holds_at_most_a_few_pieces_of_its_file(store: BlobStore, tmp_path: Path) -> None:
    path = tmp_path / "big"
    data = os.urandom(FILE_BYTES)
    path.write_bytes(data)
    want = hashlib.md5(data, usedforsecurity=False).hexdigest()
    del data
    store.upload_file(path, "warm-up/0")  # imports, connection pools and tensorstore's context first
    peak = peak_python_bytes_during(lambda: store.upload_file(path, "1/a-e0-g0-x/state/w/0"))
    assert peak <= 3 * PIECE, f"{store.url}: an upload of {FILE_BYTES} bytes held {peak} bytes at its peak"
    info = store.stat("1/a-e0-g0-x/state/w/0")
    assert info is not None and info.size == FILE_BYTES
    assert store.md5("1/a-e0-g0-x/state/w/0") == want


@pytest.mark.gcs
def test_gcs_sends_only_files_of_at_most_one_piece_whole(tmp_path: Path, gcs_env: dict[str, str],
                                                         gcs_bucket: str) -> None:
    """The piece is what the default upload holds; one piece and one byte more is streamed."""
    store = GcsStore(f"{gcs_bucket}/runs/job", piece_bytes=PIECE)
    for size in (PIECE, PIECE + 1, 3 * PIECE):
        path = tmp_path / f"f{size}"
        path.write_bytes(os.urandom(size))
        store.upload_file(path, f"2/f{size}")
        assert store.md5(f"2/f{size}") == hashlib.md5(path.read_bytes(), usedforsecurity=False).hexdigest()
    assert UPLOAD_PIECE_BYTES % (256 << 10) == 0
    with pytest.raises(ValueError, match="piece_bytes: 1000 is not a positive multiple of 256 KiB"):
        GcsStore(f"{gcs_bucket}/runs/job", piece_bytes=1000)


class HoldingStore:
    """A real folder store whose uploads say they hold their whole file (as a gs:// upload of one piece
    does) and wait a moment for others to pile up, recording the most bytes held at once."""

    def __init__(self, inner: LocalFolderStore) -> None:
        self._inner = inner
        self.url = inner.url
        self.holding = 0
        self.most = 0
        self._lock = threading.Lock()
        self._piled = threading.Event()

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._inner, name)

    def upload_buffer_bytes(self, size: int) -> int:
        return size

    def upload_file(self, local_path: Path, key: str) -> None:
        size = local_path.stat().st_size
        with self._lock:
            self.holding += size
            self.most = max(self.most, self.holding)
        self._piled.wait(0.3)  # long enough for every free worker to start its own upload
        try:
            self._inner.upload_file(local_path, key)
        finally:
            with self._lock:
                self.holding -= size


def test_the_copies_in_flight_hold_at_most_the_uploaders_byte_budget(tmp_path: Path) -> None:
    """Eight workers, eight files of 1,000 bytes, a budget of 3,000: at most three uploads at once,
    and every file still arrives."""
    config = make_config(tmp_path, upload_concurrency=8)
    files = step_files(8, 1000)
    write_local_step(config.local_dir, 5, files)
    store = HoldingStore(LocalFolderStore(tmp_path / "persistent"))
    uploader = Uploader(config, store, SidecarMetrics())  # type: ignore[arg-type]
    uploader.copier.budget = ByteBudget(3000)
    uploader.run_once()
    assert uploader.state.newest_persisted == 5
    assert set(files) <= set(attempt_files(store, 5))  # type: ignore[arg-type]
    assert 0 < store.most <= 3000 and uploader.copier.budget.peak <= 3000, store.most
    assert uploader.copier.budget.reserved == 0


def test_a_reservation_above_the_budget_runs_alone() -> None:
    budget = ByteBudget(100)
    with budget.reserve(10**9):
        assert budget.reserved == 100
    with budget.reserve(30), budget.reserve(70):
        assert budget.reserved == 100
    assert budget.reserved == 0 and budget.peak == 100
