"""Node profiles: which fake nodes a local cluster registers (pure data, no I/O).

A TPU slice is one GKE node pool: every host of the slice carries the pool's name
(`cloud.google.com/gke-nodepool`), the accelerator and topology labels, the `google.com/tpu` taint and
`google.com/tpu` capacity. Each pool also gets its own zone label, so that losing a whole slice is a
full disruption of one zone only and the node lifecycle controller keeps tainting (it stops when every
zone is down).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
ZONE_LABEL = "topology.kubernetes.io/zone"
TPU_RESOURCE = "google.com/tpu"
TPU_TAINT = {"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}

# accelerator -> chips per host (multi-host machine types; DESIGN §7)
CHIPS_PER_HOST = {
    "tpu-v4-podslice": 4,
    "tpu-v5p-slice": 4,
    "tpu-v5-lite-podslice": 4,
    "tpu-v6e-slice": 4,
    "tpu7x": 4,
}
#: accelerator -> the GKE machine type of its multi-host node pools (the nodes' instance-type label)
MACHINE_TYPES = {
    "tpu-v4-podslice": "ct4p-hightpu-4t",
    "tpu-v5p-slice": "ct5p-hightpu-4t",
    "tpu-v5-lite-podslice": "ct5lp-hightpu-4t",
    "tpu-v6e-slice": "ct6e-standard-4t",
    "tpu7x": "tpu7x-standard-4t",
}


@dataclass(frozen=True)
class NodeSpec:
    """One fake node: its name, labels, taints and capacity; `run_pods=False` fakes pods without processes."""

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[dict[str, str], ...] = ()
    capacity: dict[str, str] = field(default_factory=dict)
    run_pods: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "labels": self.labels, "taints": list(self.taints),
                "capacity": self.capacity, "run_pods": self.run_pods}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NodeSpec:
        return cls(name=data["name"], labels=dict(data.get("labels", {})),
                   taints=tuple(data.get("taints", ())), capacity=dict(data.get("capacity", {})),
                   run_pods=bool(data.get("run_pods", True)))


def hosts_per_slice(accelerator: str, topology: str) -> int:
    """`tpu-v5-lite-podslice`, `2x4` -> 2 (8 chips, 4 per host)."""
    if accelerator not in CHIPS_PER_HOST:
        raise ValueError(f"accelerator {accelerator!r} is not known; valid: {', '.join(CHIPS_PER_HOST)}")
    try:
        chips = math.prod(int(d) for d in topology.split("x"))
    except ValueError as e:
        raise ValueError(f"topology {topology!r} is not of the form AxB or AxBxC") from e
    return max(1, chips // CHIPS_PER_HOST[accelerator])


def build_tpu_slice(pool: str, accelerator: str, topology: str, run_pods: bool = True) -> list[NodeSpec]:
    """The hosts of one TPU slice, named `<pool>-h<i>`."""
    chips = CHIPS_PER_HOST[accelerator]
    nodes = []
    for host in range(hosts_per_slice(accelerator, topology)):
        name = f"{pool}-h{host}"
        nodes.append(NodeSpec(
            name=name,
            labels={
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                NODEPOOL_LABEL: pool, ACCELERATOR_LABEL: accelerator, TOPOLOGY_LABEL: topology,
                ZONE_LABEL: f"local-{pool}", "node.kubernetes.io/instance-type": MACHINE_TYPES[accelerator],
            },
            taints=(dict(TPU_TAINT),),
            capacity={"cpu": "8", "memory": "64Gi", "pods": "110", "ephemeral-storage": "100Gi",
                      TPU_RESOURCE: str(chips)},
            run_pods=run_pods,
        ))
    return nodes


def build_cpu_node(name: str, run_pods: bool = True) -> NodeSpec:
    """A plain CPU node (pool `cpu-pool`): where the operator and other services run."""
    return NodeSpec(
        name=name,
        labels={"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                NODEPOOL_LABEL: "cpu-pool", ZONE_LABEL: "local-cpu", "node.kubernetes.io/instance-type": "n2-standard-8"},
        capacity={"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi"},
        run_pods=run_pods,
    )


def build_profile(name: str) -> list[NodeSpec]:
    """The nodes of a named profile.

    - `default`: 2 slices of tpu-v5-lite-podslice 2x4 (2 hosts each, 4 chips per host) + 1 CPU node.
    - `small`: 1 such slice + 1 CPU node.
    - `cpu`: 1 CPU node.
    - `scale200`: 1 CPU node running pods + 200 TPU hosts (100 slices of 2x4) in no-process mode.
    - `tpu7x`: 2 slices of tpu7x (Ironwood) 2x2x2 (2 hosts each, tpu7x-standard-4t) + 1 CPU node.
    """
    accel = "tpu-v5-lite-podslice"
    if name == "default":
        return [*build_tpu_slice("tpu-slice-0", accel, "2x4"), *build_tpu_slice("tpu-slice-1", accel, "2x4"),
                build_cpu_node("cpu-0")]
    if name == "small":
        return [*build_tpu_slice("tpu-slice-0", accel, "2x4"), build_cpu_node("cpu-0")]
    if name == "cpu":
        return [build_cpu_node("cpu-0")]
    if name == "tpu7x":
        return [*build_tpu_slice("tpu7x-slice-0", "tpu7x", "2x2x2"), *build_tpu_slice("tpu7x-slice-1", "tpu7x", "2x2x2"),
                build_cpu_node("cpu-0")]
    if name == "scale200":
        nodes = [build_cpu_node("cpu-0")]
        for i in range(100):
            nodes += build_tpu_slice(f"scale-slice-{i}", accel, "2x4", run_pods=False)
        return nodes
    raise ValueError(f"profile {name!r} is not known; valid: {', '.join(PROFILES)}")


PROFILES = ("default", "small", "cpu", "scale200", "tpu7x")
