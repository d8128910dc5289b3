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
