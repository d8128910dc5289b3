"""The restore side: which step a restore reads and from where, one step folder read onto a target,
and the read hidden under a restarting trainer's start-up.

- `restorer`: the restore path of a manager (newest good step, fallback, the two tiers, peer fetches,
  the cross-process agreement); `restore_choice` (pure): its choices.
- `step_reader`: one committed step folder read onto a target; `step_info`: what a committed step
  holds, from its metadata and marker alone (`CheckpointManager.metadata`).
- `prefetch` and `read_ahead` (JAX-free): the restore prefetch, its choice of step and its reads on a
  background thread, handed over to the restore that reads the same folder.
- `orbax_import`: reading a checkpoint Orbax wrote (`resilax_ckpt.restore_orbax`).

The restores from other hosts' copies are in `resilax_ckpt.incluster`. The package is not named
`restore`: `resilax_ckpt.restore` is the public one-shot function.
"""
