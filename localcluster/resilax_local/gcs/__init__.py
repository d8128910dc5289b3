"""Google Cloud Storage, locally: fake-gcs-server as a process (`server.py`, `FakeGCS`) and a proxy in
front of it that counts requests and injects faults (`proxy.py`, `GcsProxy`)."""
