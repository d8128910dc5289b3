"""The save side of a manager: when to save, how the shards leave the devices, the background write
and commit, and which steps retention deletes afterwards.

- `saver`: save decisions (policy, requests, SIGTERM) agreed across processes, the hand-off to the
  writing thread and the commit; `policy` (pure): the periodic policy.
- `copy_choice` (pure but for reading device statistics): which way the shards leave the devices;
  `device_snapshot`: doing it (on-device copy drained in the background, or a host transfer);
  `host_layout`: the order a device's layout lands a leaf in on the host.
- `retention` (pure, JAX-free; the sidecar applies it too): which steps to keep; `pruning`: applies it
  after each commit and deletes a step on request.

Not here: what a save writes (`resilax_ckpt.items`), the chunk files (`resilax_ckpt.chunks`), the
commit protocol (`resilax_ckpt.commit`). The package is not named `save`: `resilax_ckpt.save` is the
public one-shot function.
"""
