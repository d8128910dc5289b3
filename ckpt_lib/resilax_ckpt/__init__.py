"""resilax_ckpt: distributed checkpoints for JAX on tensorstore."""
