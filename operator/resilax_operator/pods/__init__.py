"""What goes into the pods the operator makes (pure). builders.py (one level up) assembles a generation's
worker pods and Service from these; the slice holders are the other pods a job owns.

The worker pod:
- worker_env.py: the worker environment, what a pod keeps for life and what each generation sets.
- podtemplate.py: the user's worker template against Kubernetes' PodTemplateSpec schema
  (podtemplate_schema.json, written by scripts/gen-template-schema; package data).
- podsecurity.py: the template held to the restricted Pod Security profile.
- ports.py: the ports left to the TPU runtime and the ones Resilax uses instead (the sidecar's config
  checks its port against the same list).

Pods that hold a slice's hosts without training:
- slice_holders.py: their shared pod spec.
- probes.py: grow-back probe pods (policies/grow_back_probe.py decides when they exist).
- spares.py: spare slices' placeholder pods and status.spares (policies/spares.py decides).
"""
