"""A local Kubernetes cluster: the upstream control plane as processes, and a node agent that runs pods as processes.

`LocalCluster` is the Python API (start, stop, faults); `resilax local ...` the CLI; the pytest
fixtures live in `resilax_local.pytest_plugin`.
"""

from .cluster import LocalCluster
from .controlplane.plane import ControlPlaneSettings
from .errors import BinaryError, KubeAPIError, LocalClusterError, NotRunningError, StartError
from .node.profiles import NodeSpec, build_cpu_node, build_profile, build_tpu_slice

__all__ = [
    "BinaryError",
    "ControlPlaneSettings",
    "KubeAPIError",
    "LocalCluster",
    "LocalClusterError",
    "NodeSpec",
    "NotRunningError",
    "StartError",
    "build_cpu_node",
    "build_profile",
    "build_tpu_slice",
]
