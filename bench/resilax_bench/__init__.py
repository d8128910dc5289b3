"""The resilax_ckpt benchmark against Orbax, PyTorch DCP, np.save and the disk (see docs/benchmarks.md)."""
