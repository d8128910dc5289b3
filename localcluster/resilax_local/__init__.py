"""A local Kubernetes cluster: the upstream control plane as processes, and a node agent that runs pods as processes."""
