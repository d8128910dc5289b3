"""Accelerator + topology → chips, hosts and the scheduling keys of a slice (pure).

The TPU table follows GKE (DESIGN §7):

| accelerator | chips/host | topology | hosts per slice |
|---|---|---|---|
| tpu-v4-podslice, tpu-v5p-slice | 4 | 3-D `AxBxC`: 2x2x1, 2x2x2, 2x2x4, 2x4x4, then A≤B≤C all multiples of 4 | chips / 4 |
| tpu7x (Ironwood) | 1 (1x1x1, tpu7x-standard-1t), 4 (tpu7x-standard-4t) | 3-D `AxBxC`: 1x1x1, 2x2x1, 2x2x2, 2x2x4, 2x4x4, then A≤B≤C multiples of 4, each ≤ 256, at most 144 cubes of 4x4x4 (9,216 chips) | chips / chips per host |
| tpu-v5-lite-podslice, tpu-v6e-slice | 1 (1x1), 4 (2x2, multi-host), 8 (2x4) | 2-D `AxB` | chips / chips per host |

tpu7x's rows come from AI-Hypercomputer/xpk `src/xpk/core/system_characteristics.py` (gke_accelerator
`tpu7x`, machine types `tpu7x-standard-1t` with topology 1x1x1 and `tpu7x-standard-4t` with
`generate_tpu_topologies(max_cubes=144)`; chips per VM 1 for one chip, else 4) and GKE's "About
Ironwood (TPU7x) in GKE" (https://docs.cloud.google.com/kubernetes-engine/docs/concepts/tpu-ironwood:
four chips per VM; multi-host node pools are placed by a workload policy instead of `--tpu-topology`).

GPU (`nvidia-*`) and `cpu` slices use a 2-D `AxB` device grid per slice; `chipsPerHost` (default: the
whole slice on one host) spreads it over several hosts. GPU pods request `nvidia.com/gpu`; CPU pods
request nothing special and get one pod per node through anti-affinity (see builders).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Final

from . import api
from .errors import UnknownTopologyError

TPU_3D: Final = ("tpu-v4-podslice", "tpu-v5p-slice", "tpu7x")
TPU_2D: Final = ("tpu-v5-lite-podslice", "tpu-v6e-slice")
TPU_ACCELERATORS: Final = TPU_3D + TPU_2D
CPU: Final = "cpu"
GPU_PATTERN: Final = re.compile(r"^nvidia-[a-z0-9]+(-[a-z0-9]+)*$")

#: Largest slice (chips) per 3-D family.
MAX_CHIPS_3D: Final = {"tpu-v4-podslice": 4096, "tpu-v5p-slice": 8960, "tpu7x": 144 * 64}
#: Largest dimension of a 3-D topology, where bounded (xpk's generate_tpu_topologies: 4..256).
MAX_DIM_3D: Final = {"tpu7x": 256}
SMALL_3D: Final = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")
#: 3-D single-chip topologies (one host of one chip).
ONE_CHIP_3D: Final = {"tpu7x": "1x1x1"}
TOPOLOGIES_2D: Final = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
#: GKE machine types → chips per host.
MACHINE_TYPES: Final = {
    "tpu-v4-podslice": {"ct4p-hightpu-4t": 4},
    "tpu-v5p-slice": {"ct5p-hightpu-4t": 4},
    "tpu7x": {"tpu7x-standard-1t": 1, "tpu7x-standard-4t": 4},
    "tpu-v5-lite-podslice": {"ct5lp-hightpu-1t": 1, "ct5lp-hightpu-4t": 4, "ct5lp-hightpu-8t": 8},
    "tpu-v6e-slice": {"ct6e-standard-1t": 1, "ct6e-standard-4t": 4, "ct6e-standard-8t": 8},
}
#: 2-D TPU: the chips per host each topology allows; the first is the default.
CHIPS_PER_HOST_2D: Final = {"1x1": (1,), "2x2": (4,), "2x4": (8, 4)}
#: GPU/CPU device grids: at most this many devices per slice.
MAX_DEVICES_GENERIC: Final = 4096

_DIMS = re.compile(r"^[1-9][0-9]{0,3}(x[1-9][0-9]{0,3}){1,2}$")


def accelerator_family(accelerator: str) -> str:
    """`tpu-3d`, `tpu-2d`, `gpu`, `cpu` or `unknown`."""
    if accelerator in TPU_3D:
        return "tpu-3d"
    if accelerator in TPU_2D:
        return "tpu-2d"
    if accelerator == CPU:
        return "cpu"
    if GPU_PATTERN.match(accelerator):
        return "gpu"
    return "unknown"


def is_known_accelerator(accelerator: str) -> bool:
    return accelerator_family(accelerator) != "unknown"


def parse_dims(topology: str) -> tuple[int, ...] | None:
    """`'2x4'` → (2, 4); None if it is not `AxB` or `AxBxC` of positive integers."""
    if not _DIMS.match(topology):
        return None
    return tuple(int(d) for d in topology.split("x"))


def describe_valid_topologies(accelerator: str) -> str:
    """The valid topologies of an accelerator, for error messages."""
    family = accelerator_family(accelerator)
    if family == "tpu-3d":
        one = [ONE_CHIP_3D[accelerator]] if accelerator in ONE_CHIP_3D else []
        dim = f", each at most {MAX_DIM_3D[accelerator]}" if accelerator in MAX_DIM_3D else ""
        return (", ".join([*one, *SMALL_3D]) + ", then AxBxC with A<=B<=C all multiples of 4 "
                f"(4x4x4, 4x4x8, 4x8x8, 8x8x8, ...{dim}; at most {MAX_CHIPS_3D[accelerator]} chips)")
    if family == "tpu-2d":
        return ", ".join(TOPOLOGIES_2D)
    if family in ("gpu", "cpu"):
        return f"AxB (a device grid per slice, at most {MAX_DEVICES_GENERIC} devices), e.g. 1x1, 1x8, 2x4"
    return "none (unknown accelerator)"


def is_valid_topology(accelerator: str, topology: str) -> bool:
    family = accelerator_family(accelerator)
    dims = parse_dims(topology)
    if dims is None:
        return False
    if family == "tpu-3d":
        if len(dims) != 3:
            return False
        if topology in SMALL_3D or topology == ONE_CHIP_3D.get(accelerator):
            return True
        return (list(dims) == sorted(dims) and all(d % 4 == 0 for d in dims)
                and all(d <= MAX_DIM_3D.get(accelerator, d) for d in dims)
                and math.prod(dims) <= MAX_CHIPS_3D[accelerator])
    if family == "tpu-2d":
        return topology in TOPOLOGIES_2D
    if family in ("gpu", "cpu"):
        return len(dims) == 2 and math.prod(dims) <= MAX_DEVICES_GENERIC
    return False


@dataclass(frozen=True)
class SliceGeometry:
    """What one slice of `accelerator` with `topology` needs; everything the builders and the planner use."""

    accelerator: str
    topology: str
    chips: int
    chips_per_host: int
    hosts: int
    #: The extended resource each worker pod requests (`google.com/tpu`, `nvidia.com/gpu`) or None for cpu.
    resource: str | None
    #: Node labels every host of the slice must carry (besides the node pool the operator picks).
    node_selector: tuple[tuple[str, str], ...]
    #: Taint keys to tolerate (NoSchedule, Exists).
    toleration_keys: tuple[str, ...]

    @property
    def family(self) -> str:
        return accelerator_family(self.accelerator)

    @property
    def is_tpu(self) -> bool:
        return self.family in ("tpu-2d", "tpu-3d")

    def resource_requests(self) -> dict[str, str]:
        """Requests (= limits) of one worker pod's trainer container."""
        return {self.resource: str(self.chips_per_host)} if self.resource else {}


def allowed_chips_per_host(accelerator: str, topology: str) -> tuple[int, ...]:
    """Chips per host this accelerator/topology allows; the first is the default. Assumes a valid pair."""
    family = accelerator_family(accelerator)
    chips = math.prod(parse_dims(topology) or (1,))
    if family == "tpu-3d":
        return (1,) if topology == ONE_CHIP_3D.get(accelerator) else (4,)
    if family == "tpu-2d":
        return CHIPS_PER_HOST_2D.get(topology, (4,))
    # gpu/cpu: any divisor of the slice, default the whole slice on one host
    return (chips, *(d for d in range(1, chips) if chips % d == 0))


def largest_tpu_slice_hosts() -> int:
    """Hosts of the largest TPU slice the table allows (tpu7x: 9216 chips, 4 per host: 2304)."""
    three_d = max(chips // min(allowed_chips_per_host(a, "4x4x4")) for a, chips in MAX_CHIPS_3D.items())
    two_d = max(math.prod(parse_dims(t) or (1,)) // min(allowed_chips_per_host(a, t))
                for a in TPU_2D for t in TOPOLOGIES_2D)
    return max(three_d, two_d)


def chips_per_host_for_machine_type(accelerator: str, machine_type: str) -> int | None:
    return MACHINE_TYPES.get(accelerator, {}).get(machine_type)


def plan_geometry(accelerator: str, topology: str, *, chips_per_host: int | None = None,
                  machine_type: str | None = None) -> SliceGeometry:
    """The geometry of one slice. Raises UnknownTopologyError (listing the valid values) when the
    accelerator, the topology, the machine type or chips per host do not fit together."""
    family = accelerator_family(accelerator)
    if family == "unknown":
        raise UnknownTopologyError(
            f"unknown accelerator {accelerator!r}; valid: {', '.join(TPU_ACCELERATORS)}, nvidia-*, cpu")
    if not is_valid_topology(accelerator, topology):
        raise UnknownTopologyError(
            f"{topology!r} is not a valid {accelerator} topology; valid: {describe_valid_topologies(accelerator)}")
    allowed = allowed_chips_per_host(accelerator, topology)
    if machine_type is not None and family in ("tpu-2d", "tpu-3d"):
        from_type = chips_per_host_for_machine_type(accelerator, machine_type)
        if from_type is None:
            raise UnknownTopologyError(
                f"{machine_type!r} is not a {accelerator} machine type; valid: {', '.join(MACHINE_TYPES[accelerator])}")
        if chips_per_host is not None and chips_per_host != from_type:
            raise UnknownTopologyError(
                f"chipsPerHost {chips_per_host} contradicts machine type {machine_type} ({from_type} chips per host)")
        chips_per_host = from_type
    cph = allowed[0] if chips_per_host is None else chips_per_host
    if cph not in allowed:
        raise UnknownTopologyError(
            f"{cph} chips per host does not fit {accelerator} {topology}; valid: {', '.join(map(str, sorted(allowed)))}")
    chips = math.prod(parse_dims(topology) or (1,))
    if family in ("tpu-2d", "tpu-3d"):
        selector: tuple[tuple[str, str], ...] = (
            (api.TPU_ACCELERATOR_LABEL, accelerator), (api.TPU_TOPOLOGY_LABEL, topology))
        return SliceGeometry(accelerator, topology, chips, cph, chips // cph, api.TPU_RESOURCE, selector,
                             (api.TPU_TAINT_KEY,))
    if family == "gpu":
        return SliceGeometry(accelerator, topology, chips, cph, chips // cph, api.GPU_RESOURCE,
                             ((api.GPU_ACCELERATOR_LABEL, accelerator),), (api.GPU_TAINT_KEY,))
    return SliceGeometry(accelerator, topology, chips, cph, chips // cph, None, (), ())
