"""Topology math: accelerator + topology (+ machine type / chips per host) → chips, hosts, keys."""

from __future__ import annotations

import pytest
from resilax_operator import api
from resilax_operator.errors import UnknownTopologyError
from resilax_operator.topology import describe_valid_topologies, is_valid_topology, plan_geometry

# accelerator, topology, chipsPerHost, machineType → chips, chips/host, hosts, resource
GEOMETRY = [
    ("v4-2x2x1-one-host", "tpu-v4-podslice", "2x2x1", None, None, 4, 4, 1, api.TPU_RESOURCE),
    ("v4-2x2x2", "tpu-v4-podslice", "2x2x2", None, None, 8, 4, 2, api.TPU_RESOURCE),
    ("v4-2x4x4", "tpu-v4-podslice", "2x4x4", None, None, 32, 4, 8, api.TPU_RESOURCE),
    ("v4-4x4x8", "tpu-v4-podslice", "4x4x8", None, None, 128, 4, 32, api.TPU_RESOURCE),
    ("v5p-8x8x8", "tpu-v5p-slice", "8x8x8", None, "ct5p-hightpu-4t", 512, 4, 128, api.TPU_RESOURCE),
    ("v5e-1x1", "tpu-v5-lite-podslice", "1x1", None, None, 1, 1, 1, api.TPU_RESOURCE),
    ("v5e-2x2-single-host", "tpu-v5-lite-podslice", "2x2", None, None, 4, 4, 1, api.TPU_RESOURCE),
    ("v5e-2x4-8t-default", "tpu-v5-lite-podslice", "2x4", None, None, 8, 8, 1, api.TPU_RESOURCE),
    ("v5e-2x4-4t-two-hosts", "tpu-v5-lite-podslice", "2x4", None, "ct5lp-hightpu-4t", 8, 4, 2, api.TPU_RESOURCE),
    ("v5e-4x4", "tpu-v5-lite-podslice", "4x4", None, None, 16, 4, 4, api.TPU_RESOURCE),
    ("v5e-16x16", "tpu-v5-lite-podslice", "16x16", None, None, 256, 4, 64, api.TPU_RESOURCE),
    ("v6e-8x8", "tpu-v6e-slice", "8x8", 4, None, 64, 4, 16, api.TPU_RESOURCE),
    # tpu7x (Ironwood, issue 27): xpk's system_characteristics (tpu7x-standard-1t: 1x1x1; tpu7x-standard-4t:
    # 4 chips per VM, generate_tpu_topologies(max_cubes=144)) and GKE's "About Ironwood (TPU7x) in GKE".
    ("tpu7x-1x1x1-1t", "tpu7x", "1x1x1", None, "tpu7x-standard-1t", 1, 1, 1, api.TPU_RESOURCE),
    ("tpu7x-1x1x1-default", "tpu7x", "1x1x1", None, None, 1, 1, 1, api.TPU_RESOURCE),
    ("tpu7x-2x2x1-one-host", "tpu7x", "2x2x1", None, "tpu7x-standard-4t", 4, 4, 1, api.TPU_RESOURCE),
    ("tpu7x-2x2x2", "tpu7x", "2x2x2", None, "tpu7x-standard-4t", 8, 4, 2, api.TPU_RESOURCE),
    ("tpu7x-2x2x4", "tpu7x", "2x2x4", None, None, 16, 4, 4, api.TPU_RESOURCE),
    ("tpu7x-2x4x4", "tpu7x", "2x4x4", None, None, 32, 4, 8, api.TPU_RESOURCE),
    ("tpu7x-4x4x4-cube", "tpu7x", "4x4x4", None, "tpu7x-standard-4t", 64, 4, 16, api.TPU_RESOURCE),
    ("tpu7x-4x4x8", "tpu7x", "4x4x8", 4, None, 128, 4, 32, api.TPU_RESOURCE),
    ("tpu7x-8x8x8", "tpu7x", "8x8x8", None, None, 512, 4, 128, api.TPU_RESOURCE),
    ("tpu7x-12x12x16", "tpu7x", "12x12x16", None, None, 2304, 4, 576, api.TPU_RESOURCE),
    ("tpu7x-4x4x244-long", "tpu7x", "4x4x244", None, None, 3904, 4, 976, api.TPU_RESOURCE),
    ("tpu7x-largest-16x24x24", "tpu7x", "16x24x24", None, "tpu7x-standard-4t", 9216, 4, 2304, api.TPU_RESOURCE),
    ("tpu7x-largest-8x8x144", "tpu7x", "8x8x144", None, None, 9216, 4, 2304, api.TPU_RESOURCE),
    ("gpu-1x8-one-host", "nvidia-h100-80gb", "1x8", None, None, 8, 8, 1, api.GPU_RESOURCE),
    ("gpu-2x8-two-hosts", "nvidia-h100-80gb", "2x8", 8, None, 16, 8, 2, api.GPU_RESOURCE),
    ("cpu-2x4-two-hosts", "cpu", "2x4", 4, None, 8, 4, 2, None),
    ("cpu-1x4-one-host", "cpu", "1x4", None, None, 4, 4, 1, None),
]


@pytest.mark.parametrize(("accel", "topo", "cph", "machine", "chips", "per_host", "hosts", "resource"),
                         [g[1:] for g in GEOMETRY], ids=[g[0] for g in GEOMETRY])
def test_geometry(accel: str, topo: str, cph: int | None, machine: str | None, chips: int, per_host: int,
                  hosts: int, resource: str | None) -> None:
    g = plan_geometry(accel, topo, chips_per_host=cph, machine_type=machine)
    assert (g.chips, g.chips_per_host, g.hosts, g.resource) == (chips, per_host, hosts, resource)
    if resource:
        assert g.resource_requests() == {resource: str(per_host)}
    else:
        assert g.resource_requests() == {}


def test_tpu_scheduling_keys() -> None:
    g = plan_geometry("tpu-v5-lite-podslice", "4x4")
    assert dict(g.node_selector) == {api.TPU_ACCELERATOR_LABEL: "tpu-v5-lite-podslice",
                                     api.TPU_TOPOLOGY_LABEL: "4x4"}
    assert g.toleration_keys == (api.TPU_TAINT_KEY,)


def test_gpu_and_cpu_scheduling_keys() -> None:
    gpu = plan_geometry("nvidia-l4", "1x1")
    assert dict(gpu.node_selector) == {api.GPU_ACCELERATOR_LABEL: "nvidia-l4"}
    assert gpu.toleration_keys == (api.GPU_TAINT_KEY,)
    cpu = plan_geometry("cpu", "1x2")
    assert cpu.node_selector == () and cpu.toleration_keys == ()


VALIDITY = [
    ("v4-small-explicit", "tpu-v4-podslice", "2x2x4", True),
    ("v4-multiples-of-4", "tpu-v4-podslice", "4x8x8", True),
    ("v4-not-sorted", "tpu-v4-podslice", "8x4x4", False),
    ("v4-not-multiple", "tpu-v4-podslice", "4x4x6", False),
    ("v4-2d", "tpu-v4-podslice", "4x4", False),
    ("v4-too-big", "tpu-v4-podslice", "16x16x32", False),
    ("v5p-bigger-than-v4", "tpu-v5p-slice", "16x16x32", True),
    ("v5e-3d", "tpu-v5-lite-podslice", "2x2x1", False),
    ("tpu7x-one-chip", "tpu7x", "1x1x1", True),
    ("v5p-no-one-chip-3d", "tpu-v5p-slice", "1x1x1", False),
    ("tpu7x-144-cubes", "tpu7x", "12x16x48", True),
    ("tpu7x-145-cubes", "tpu7x", "4x20x116", False),
    ("tpu7x-dimension-256", "tpu7x", "4x4x256", True),
    ("tpu7x-dimension-over-256", "tpu7x", "4x4x260", False),
    ("tpu7x-not-sorted", "tpu7x", "8x4x4", False),
    ("tpu7x-not-multiple", "tpu7x", "4x4x6", False),
    ("tpu7x-2d", "tpu7x", "2x2", False),
    ("v5e-4x3", "tpu-v5-lite-podslice", "4x3", False),
    ("v6e-16x16", "tpu-v6e-slice", "16x16", True),
    ("cpu-grid", "cpu", "3x5", True),
    ("cpu-3d", "cpu", "1x2x2", False),
    ("garbage", "cpu", "axb", False),
    ("zero-dim", "cpu", "0x4", False),
]


@pytest.mark.parametrize(("accel", "topo", "valid"), [v[1:] for v in VALIDITY], ids=[v[0] for v in VALIDITY])
def test_validity(accel: str, topo: str, valid: bool) -> None:
    assert is_valid_topology(accel, topo) is valid


ERRORS = [
    ("unknown-accelerator", "tpu-v9", "2x2", None, None, "unknown accelerator 'tpu-v9'; valid: tpu-v4-podslice"),
    ("bad-topology-lists-valid", "tpu-v5-lite-podslice", "4x3", None, None,
     "'4x3' is not a valid tpu-v5-lite-podslice topology; valid: 1x1, 2x2, 2x4, 4x4"),
    ("bad-machine-type", "tpu-v5-lite-podslice", "4x4", None, "ct5p-hightpu-4t", "valid: ct5lp-hightpu-1t"),
    ("chips-per-host-contradicts-machine", "tpu-v5-lite-podslice", "2x4", 4, "ct5lp-hightpu-8t", "contradicts"),
    ("chips-per-host-not-allowed", "tpu-v4-podslice", "2x2x2", 8, None, "valid: 4"),
    ("tpu7x-1t-on-multi-chip", "tpu7x", "2x2x2", None, "tpu7x-standard-1t", "1 chips per host does not fit tpu7x 2x2x2; valid: 4"),
    ("tpu7x-4t-on-one-chip", "tpu7x", "1x1x1", None, "tpu7x-standard-4t", "4 chips per host does not fit tpu7x 1x1x1; valid: 1"),
    ("tpu7x-bad-machine-type", "tpu7x", "2x2x1", None, "ct5p-hightpu-4t", "valid: tpu7x-standard-1t, tpu7x-standard-4t"),
    ("tpu7x-too-big-lists-rule", "tpu7x", "16x24x28", None, None, "1x1x1, 2x2x1, 2x2x2, 2x2x4, 2x4x4, then AxBxC"),
    ("cpu-chips-per-host-not-divisor", "cpu", "2x3", 4, None, "valid: 1, 2, 3, 6"),
]


@pytest.mark.parametrize(("accel", "topo", "cph", "machine", "message"), [e[1:] for e in ERRORS],
                         ids=[e[0] for e in ERRORS])
def test_errors_say_what_is_valid(accel: str, topo: str, cph: int | None, machine: str | None, message: str) -> None:
    with pytest.raises(UnknownTopologyError) as info:
        plan_geometry(accel, topo, chips_per_host=cph, machine_type=machine)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_describe_3d_mentions_rule_and_limit() -> None:
    text = describe_valid_topologies("tpu-v4-podslice")
    assert "2x2x1" in text and "multiples of 4" in text and "4096" in text


def _xpk_tpu7x_topologies() -> set[str]:
    """xpk's tpu7x list (src/xpk/core/system_characteristics.py): 1x1x1 (tpu7x-standard-1t) and
    generate_tpu_topologies(max_cubes=144) (tpu7x-standard-4t), re-derived here from its rule."""
    out = {"1x1x1", "2x2x1", "2x2x2", "2x2x4", "2x4x4"}
    for x in range(4, 257, 4):
        for y in range(x, 257, 4):
            for z in range(y, 257, 4):
                if (x // 4) * (y // 4) * (z // 4) <= 144:
                    out.add(f"{x}x{y}x{z}")
    return out


def test_tpu7x_topologies_are_exactly_xpks() -> None:
    """Every AxBxC up to 260 per dimension: valid for tpu7x exactly when xpk lists it."""
    xpk = _xpk_tpu7x_topologies()
    candidates = {f"{a}x{b}x{c}" for a in range(1, 9) for b in range(1, 9) for c in range(1, 9)}
    candidates |= {f"{a}x{b}x{c}" for a in range(4, 261, 4) for b in range(4, 261, 4) for c in range(4, 261, 4)
                   if a * b * c <= 4 * 9216}
    mismatched = sorted(t for t in candidates if is_valid_topology("tpu7x", t) != (t in xpk))
    assert not mismatched, mismatched[:10]
    assert len(xpk) == 433


def test_describe_tpu7x_names_the_one_chip_topology_and_the_limits() -> None:
    text = describe_valid_topologies("tpu7x")
    assert text.startswith("1x1x1, 2x2x1") and "at most 256" in text and "9216 chips" in text
