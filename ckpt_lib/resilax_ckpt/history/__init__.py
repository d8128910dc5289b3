"""A checkpoint root's history: which generation may still commit, the branches rollbacks start, and
so which committed steps a reader sees. JAX-free: the sidecar reads them too.

- `fencing`: each generation's epoch (era, generation) and its fence; a replaced generation never
  commits once a newer one exists.
- `timelines`: the branch a rollback starts, the steps of the abandoned timeline hidden and kept.
- `visibility`: the committed steps sorted into visible, bad, superseded and fenced out.

The commit protocol that writes the markers these read is `resilax_ckpt.commit`.
"""
