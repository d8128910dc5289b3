"""The node agent: one process that plays the kubelet for every fake node of a local cluster.

`agent.py` (the nodes, their Leases, the pod watch; run as `python -m resilax_local.node.agent`) with
`node_status.py`, `node_faults.py`, `control_api.py`, `kubeletapi.py` and `kube_events.py`; one pod is
`pods.py` (its worker loop) with `podhost.py`, `podspec.py`, `volumes.py`, `containers.py`, `images.py`,
`waiting.py`, `probes.py`, `termination.py`, `pod_status.py` and `pod_network.py`; the nodes a cluster
gets are `profiles.py`."""
