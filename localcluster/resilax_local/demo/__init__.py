"""`resilax demo`: a training job on the local cluster, the operator, faults injected on a schedule,
and what the run leaves behind. `runner.py` (the demo itself, `main`), `examples.py` (which training
example runs), `timeline.py` (pure: the losses, events and faults as one timeline), `outputs.py` (the
picture and the files it writes) and `files/` (package data: links to the job, the CRDs, the
operator's rules and the examples in the checkout; a wheel carries the files themselves)."""
