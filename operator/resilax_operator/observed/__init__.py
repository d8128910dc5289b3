"""What the operator sees of the world: the watch cache, its parsed indexes, and the snapshot one decision
reads (`Observed`).

Two modules do I/O; the rest are pure types and the parsers that build them from raw API bodies and the
sidecars' answers. Read in this order:

- cache.py (I/O): the watches held in memory (`WorldCache`), so a reconcile issues no LIST.
- indexes.py: what the cache keeps parsed between reconciles, updated per watch event.
- observe.py (I/O): the I/O side, part 1: gather the world one decision sees (`observe` -> `World`);
  execute.py is part 2.
- snapshot.py: the `Observed` snapshot a decision reads, assembled from the parts below.
- nodes.py: `ObservedNode` (readiness, taints, notices, the Lease, the devices others hold).
- pods.py: `ObservedPod` (phase, node, the trainer's state and exit, waiting reasons, gates, owner).
- sidecar.py: what the sidecars report (a final save's outcome, the restore report, the trainer's
  figures, the newest checkpoint, their last words).
- trainer_process.py: a supervised trainer as its pod's sidecar reports it.
- devices.py: the accelerators pods hold, as capacity accounting counts them per node.
- spare_jobs.py: the lower-priority JAXJobs that consent to serve as a job's spare.
"""
