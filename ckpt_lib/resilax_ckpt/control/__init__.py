"""The pod's control folder (`$RESILAX_CONTROL_DIR`): the small files a trainer, its supervisor and
its pod's sidecar exchange. JAX-free: the sidecar and `resilax run` import them.

- `control_files`: the bounded, non-blocking reader every one of these files goes through.
- `requests`: save requests from outside the loop, their results, `stopped.json`, `restore.json`.
- `trainer_control`: the supervisor's `incarnation.json`, the sidecar's orders to stop its child
  (`trainer-stop.json`) and to start the next (`assignment.json`).
- `trainer_metrics`: the trainer's figures in `trainer.json` (saves, restores, step rate, compile cache).
- `health_verdict`: the pod's health check verdict in `health.json`, for the sidecar.
"""
