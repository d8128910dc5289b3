"""The sidecar's errors: one base, leaves that also subclass the built-in they mean."""

from __future__ import annotations


class SidecarError(Exception):
    """Base of every error the sidecar raises on purpose."""


class ConfigError(SidecarError, ValueError):
    """The environment holds settings the sidecar cannot run with; the message lists every problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("invalid sidecar configuration:\n  " + "\n  ".join(self.problems))


class StoreError(SidecarError, OSError):
    """A storage call failed; the message names the store, the key and the cause."""


class VerifyError(StoreError):
    """A copied file does not match its source (size or checksum)."""
