"""The process around the user's trainer: the supervisor that runs it (`resilax run`), keeping its
process across generations, and the host's health check before it starts. Only `kept_trainer` (the
trainer's own entry point) and the health check's device probe import JAX, inside functions.

- `supervisor`: `resilax run -- CMD`, the child replaced in place; `supervisor_rules` (pure): its
  settings, records and decisions.
- `kept` (pure): when a trainer's process may serve the next incarnation; `kept_channel`: the socket
  between `resilax run` and its child; `kept_trainer`: `rc.run_kept(main)`, the trainer's side.
- `health_check`: `resilax health-check`, is this host fit to run a generation's trainer.
"""
