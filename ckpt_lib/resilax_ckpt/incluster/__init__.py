"""The in-cluster tiers beyond this host's own local tier: peer replicas of each host's newest local
step, and restores assembled from what the cluster's nodes hold, onto any mesh (docs/checkpointing.md
§9, "Restores from the in-cluster tiers").

- `peers` (pure): where each host's replica goes (the sidecar's replicator uses the same placement)
  and which source each process restores from after a hard loss; `peer_client`: the trainer's side
  (`peers.json` for the sidecar, the replicas this host holds, the fetch request).
- `chunk_sources` (pure): which host serves each file a process's restore needs; `chunk_fetch`: the
  I/O of it (what this node holds, the step folder assembled from the node, the peers' sidecars and
  the persistent tier).
"""
