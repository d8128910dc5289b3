"""The local cluster's errors: one base, leaves that also subclass the built-in they mean."""

from __future__ import annotations


class LocalClusterError(Exception):
    """Base of every error raised by resilax_local."""


class BinaryError(LocalClusterError, FileNotFoundError):
    """A binary is missing and cannot be built (or its build failed)."""


class StartError(LocalClusterError, RuntimeError):
    """A control-plane process or the node agent did not become healthy."""


class NotRunningError(LocalClusterError, FileNotFoundError):
    """No running local cluster in the given folder."""


class KubeAPIError(LocalClusterError, RuntimeError):
    """The API server answered with an error status."""

    def __init__(self, status: int, message: str, body: dict | None = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.body = body or {}


class FastTierError(LocalClusterError, RuntimeError):
    """A local cluster or fake-gcs-server started in the fast test tier (`scripts/test --fast`)."""
