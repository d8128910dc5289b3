"""Fixtures of the sidecar tests (defined in sidecar_harness.py, next to the helpers they use)."""

from sidecar_harness import fake_gcs, gcs_env, sidecar_env, start_sidecar, start_trainer

__all__ = ["fake_gcs", "gcs_env", "sidecar_env", "start_sidecar", "start_trainer"]
