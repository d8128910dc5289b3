"""The JAXJob operator (kopf).

The core, at this level (shared/STYLE.md, "Layout"): api.py (names), spec.py and validation.py (the
boundary), topology.py, builders.py (pure manifests), reconcile.py (pure: spec + observed world to
actions, dispatching to policies/), status.py (pure), k8s.py (the only module that talks to the API),
handlers.py (thin kopf handlers) and main.py (`resilax operator`). Beside them the vocabulary they share
(errors.py, settings.py, generation.py, ownership.py, actions.py, capacity.py), the I/O loop's second
half (execute.py), metrics.py and the console script (cli.py).

By concern, one level down (each folder's __init__ says what its modules do):
- policies/: the decisions, one policy a file.
- observed/: what the operator sees of the world (watch cache, indexes, the snapshot a decision reads).
- pods/: what goes into the pods it makes (environment, template checks, ports, slice holders).
- status_fields/: the parts of the status with a shape of their own (history, goodput, checkpoint, ...).
- kubectl/: `kubectl resilax`, the user's side.
"""
