"""`kubectl resilax` (the `kubectl-resilax` executable, and `resilax job`): what a user sees of a JAXJob.

The plugin runs on the user's machine with kubectl's kubeconfig and the user's own RBAC; it needs only
the `cli` extra (the kubernetes client, PyYAML), never kopf or JAX, so nothing here imports the
operator's I/O side. One module a role:

- plugin.py: the commands and their screens (`status`, `goodput`, `timeline`, `save`, `web`, ...),
  the entry points `main` and `complete_main` (pyproject's `[project.scripts]`).
- client.py: the API calls, the only module of the plugin that talks to the cluster.
- output.py: what the read commands print for a program (`-o json|yaml`, `list`, `version`; pure).
- logs.py: `kubectl resilax logs NAME`: a trainer's log across generations.
- rollback.py: `kubectl resilax rollback NAME --step N`.
- timeline.py: a job's generations on a time axis, from status.history (pure).
- timeline_page.py: `kubectl resilax web FILE`, one static HTML page of every job's timeline (pure).
- timeline_plot.py: `kubectl resilax timeline --png FILE`, drawn with matplotlib (the `plot` extra).
"""
