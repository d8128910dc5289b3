"""Fixtures of the sidecar tests (defined in sidecar_harness.py, next to the helpers they use)."""

from sidecar_harness import gcs_env, sidecar_env, start_sidecar, start_trainer

__all__ = ["gcs_env", "sidecar_env", "start_sidecar", "start_trainer"]
