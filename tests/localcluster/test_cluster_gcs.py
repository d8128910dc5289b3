"""fake-gcs-server started by the `fake_gcs` fixture answers the GCS JSON API, buckets included."""

from __future__ import annotations

import json

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
