"""fake-gcs-server started by the `fake_gcs` fixture answers the GCS JSON API, buckets included."""

from __future__ import annotations

import json

import pytest
import urllib3


def test_fake_gcs_serves_a_fresh_bucket(fake_gcs, gcs_bucket):
    assert gcs_bucket.startswith("gs://")
    bucket = gcs_bucket.removeprefix("gs://")
    http = urllib3.PoolManager()
    upload = http.request("POST", f"{fake_gcs.url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name=a/b.txt",
                          body=b"hello", headers={"Content-Type": "text/plain"})
    assert upload.status == 200
    listing = json.loads(http.request("GET", f"{fake_gcs.url}/storage/v1/b/{bucket}/o?prefix=a/").data)
    assert [o["name"] for o in listing["items"]] == ["a/b.txt"]
    assert fake_gcs.env["STORAGE_EMULATOR_HOST"] == fake_gcs.url


@pytest.mark.gcs
def test_fake_gcs_starts_on_another_port_when_its_first_was_taken(monkeypatch, tmp_path):
    """The race of a free port taken by another program before fake-gcs-server binds it: retried."""
    import socket

    from resilax_local import processes
    from resilax_local.gcs.server import FakeGCS

    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        real = processes.free_port
        ports = iter([taken])
        monkeypatch.setattr(processes, "free_port", lambda: next(ports, None) or real())
        with FakeGCS(log_dir=tmp_path).start() as gcs:
            assert gcs.port != taken
            assert gcs.create_bucket().startswith("bucket-")
        assert "address already in use" in (tmp_path / "fake-gcs-server.log").read_text()
