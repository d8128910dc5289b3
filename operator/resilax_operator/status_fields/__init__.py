"""The parts of a JAXJob's status that have a shape of their own (pure): each is parsed from and rendered
to the status subresource here; status.py (one level up) assembles them into `JobStatus`.

- checkpoint.py: status.checkpoint, the newest checkpoint known and the rollback branch it is on.
- history.py: status.history, one entry per generation (docs/jaxjob-reference.md documents each field).
- goodput.py: status.goodput, the accounting of how much of a job's wall time trained the model.
- recovery_notice.py: status.recoveryNotice, the last "still recovering" Event emitted.
- unhealthy_nodes.py: status.unhealthyNodes, the nodes kept out after a failed health check.
- merge_patch.py: not a field: the JSON merge patch status.py sends so that only what changed is written.
"""
