"""Shape planning: the largest (count, topology) the spec allows that healthy node pools can host."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from op_samples import good_spec
from op_world import T0, cpu_pool, tpu_pool
from resilax_operator import api
from resilax_operator.capacity import fingerprint, plan_pools, plan_shape
from resilax_operator.observed.snapshot import ObservedNode, Taint
from resilax_operator.spec import Shape
from resilax_operator.topology import plan_geometry
from resilax_operator.validation import validate_spec


def _spec(**changes: Any) -> Any:
    raw = good_spec()
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if value is None:
            raw[section].pop(field, None) if field else raw.pop(section)
        elif field:
            raw[section][field] = value
        else:
            raw[section] = value
    return validate_spec(raw)


def _pools(*specs: tuple[str, int, str, int]) -> list[ObservedNode]:
    return [n for name, hosts, topo, chips in specs for n in tpu_pool(name, hosts, topology=topo, chips=chips)]


def _broken(nodes: list[ObservedNode], name: str, **changes: Any) -> list[ObservedNode]:
    return [replace(n, **changes) if n.name == name else n for n in nodes]


FOUR = _pools(("a", 4, "4x4", 4), ("b", 4, "4x4", 4), ("c", 4, "4x4", 4), ("d", 4, "4x4", 4))
SMALL = _pools(("s1", 1, "2x4", 8), ("s2", 1, "2x4", 8), ("s3", 1, "2x4", 8))

# id, spec changes, nodes, expected (topology, count, pools) or None
CASES = [
    ("all-capacity-max-count", {}, FOUR, ("4x4", 4, ("a", "b", "c", "d"))),
    ("one-pool-missing", {}, FOUR[:12], ("4x4", 3, ("a", "b", "c"))),
    ("pool-with-unready-node-skipped", {}, _broken(FOUR, "b-n2", ready="Unknown"), ("4x4", 3, ("a", "c", "d"))),
    ("pool-with-notice-skipped", {}, _broken(FOUR, "a-n0", taints=(Taint(api.IMPENDING_TERMINATION_TAINT),)),
     ("4x4", 3, ("b", "c", "d"))),
    ("cordoned-node-skipped", {}, _broken(FOUR, "c-n1", unschedulable=True), ("4x4", 3, ("a", "b", "d"))),
    ("tpus-used-by-others", {}, _broken(FOUR, "d-n3", in_use_by_others={api.TPU_RESOURCE: 4}),
     ("4x4", 3, ("a", "b", "c"))),
    ("below-min-falls-back-to-smaller-topology", {"slices__count": 2}, FOUR[:4] + SMALL, ("2x4", 3, ("s1", "s2", "s3"))),
    ("larger-topology-wins-on-chips", {"slices__count": 2}, FOUR[:8] + SMALL, ("4x4", 2, ("a", "b"))),
    ("nothing-fits", {}, FOUR[:4], None),
    ("fixed-shape-exact", {"elastic": None, "slices__count": 2}, FOUR, ("4x4", 2, ("a", "b"))),
    ("fixed-shape-no-capacity", {"elastic": None, "slices__count": 4}, FOUR[:12], None),
    ("wrong-topology-pools-ignored", {"elastic": None, "slices__count": 1}, SMALL, None),
]


@pytest.mark.parametrize(("changes", "nodes", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan_shape(changes: dict[str, Any], nodes: list[ObservedNode], expected: tuple[str, int, tuple[str, ...]] | None) -> None:
    plan = plan_shape(_spec(**changes), nodes, T0)
    if expected is None:
        assert plan is None
    else:
        assert plan is not None
        assert (plan.shape.topology, plan.shape.count, plan.pools) == expected


def test_cpu_pools_need_enough_nodes() -> None:
    geometry = plan_geometry("cpu", "2x4", chips_per_host=4)
    nodes = cpu_pool("x", 2) + cpu_pool("y", 1)
    assert plan_pools(geometry, nodes, T0) == ("x",)


def test_gpu_pools_match_the_accelerator_label() -> None:
    geometry = plan_geometry("nvidia-l4", "1x2")
    l4 = ObservedNode("g0", {api.NODE_POOL_LABEL: "g", api.GPU_ACCELERATOR_LABEL: "nvidia-l4"},
                      allocatable={api.GPU_RESOURCE: 2})
    a100 = ObservedNode("h0", {api.NODE_POOL_LABEL: "h", api.GPU_ACCELERATOR_LABEL: "nvidia-tesla-a100"},
                        allocatable={api.GPU_RESOURCE: 8})
    assert plan_pools(geometry, [l4, a100], T0) == ("g",)


def test_nodes_without_a_pool_label_are_ignored() -> None:
    geometry = plan_geometry("cpu", "1x1")
    assert plan_pools(geometry, [ObservedNode("lonely")], T0) == ()


def test_fingerprint_separates_hardware_from_bounds() -> None:
    base = fingerprint(_spec())
    assert fingerprint(_spec()) == base
    count = fingerprint(_spec(slices__count=3))
    assert count.split("/")[0] == base.split("/")[0] and count != base
    raw = good_spec()
    raw["slices"]["machineType"] = "ct5lp-hightpu-4t"
    assert fingerprint(validate_spec(raw)).split("/")[0] != base.split("/")[0]


def test_shape_str() -> None:
    assert str(Shape("4x4", 3)) == "3x[4x4]"
