"""resize.py: spec edits and grow-back move the generation to another shape.

Driven through the in-memory world (op_world), which checks at every decision that deciding twice
gives the same actions and that no generation is created while another one's pods exist; the
tables call the policy's functions directly."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from op_restart import KEEP, Driver, assert_survives_restarts
from op_samples import good_spec
from op_world import SETTINGS, fixed_spec, four_pools, running_world, tpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import (
    DeleteGeneration,
    RequestFinalSave,
)
from resilax_operator.policies import resize
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec


def test_spec_edit_resizes_with_final_save() -> None:
    w = running_world(fixed_spec(2), four_pools())
    w.spec["slices"]["count"] = 3
    actions = w.step()
    assert any(isinstance(a, RequestFinalSave) and a.reason == "resize" for a in actions)
    assert w.status.transition is not None and w.status.transition.kind == st.RESIZE
    w.exit_workers(75)
    w.settle()
    assert w.status.shape == Shape("4x4", 3) and w.status.phase == api.PHASE_RUNNING
    assert api.SPEC_RESIZED.name in w.reasons()


def test_unrelated_spec_edit_keeps_the_generation() -> None:
    w = running_world()
    w.spec["checkpoint"]["every"]["steps"] = 50
    w.spec["elastic"]["minCount"] = 1  # bounds changed, but the current shape is still the best
    assert not any(isinstance(a, (DeleteGeneration, RequestFinalSave)) for a in w.step())
    assert w.step() == []


def test_grow_back_when_capacity_returns() -> None:
    w = running_world(pools=[tpu_pool("pool-a", 4), tpu_pool("pool-b", 4)])
    assert w.status.shape == Shape("4x4", 2)
    w.nodes.update({n.name: n for n in tpu_pool("pool-c", 4)})
    w.advance(30)
    assert w.step() == []  # not settled yet
    w.advance(30)
    actions = w.step()
    assert any(isinstance(a, RequestFinalSave) and a.reason == "resize" for a in actions)
    assert w.status.transition is not None and w.status.transition.kind == st.GROW_BACK
    w.exit_workers(75)
    w.settle()
    assert w.status.shape == Shape("4x4", 3) and w.status.phase == api.PHASE_RUNNING


def test_no_grow_back_when_disabled() -> None:
    spec = good_spec()
    spec["elastic"]["growBack"] = False
    w = running_world(spec, [tpu_pool("pool-a", 4), tpu_pool("pool-b", 4)])
    w.nodes.update({n.name: n for n in tpu_pool("pool-c", 4)})
    w.advance(600)
    assert w.step_besides_goodput() == []


def test_accelerator_edit_resizes_without_reading_the_old_shape_with_the_new_spec() -> None:
    w = running_world()
    w.nodes.update({n.name: n for n in tpu_pool("v4-a", 2, accelerator="tpu-v4-podslice", topology="2x2x2")})
    w.spec["slices"].update(accelerator="tpu-v4-podslice", topology="2x2x2", count=1)
    w.spec["elastic"] = {"minCount": 1, "maxCount": 1}
    w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.RESIZE
    w.exit_workers(75)
    w.settle()
    assert w.status.shape == Shape("2x2x2", 1) and w.status.pools == ("v4-a",) and w.status.hosts == 2


# ---------------------------------------------------------------- the rule, as a table

def _pool_c() -> list[Any]:
    return tpu_pool("pool-c", 4)


RESIZE_CASES = {
    # id: (spec edit, extra pool, seconds since the generation started, expected kind)
    "nothing-changed": ({}, False, 600, None),
    "capacity-back-not-settled": ({}, True, 59, None),
    "capacity-back-settled": ({}, True, 60, st.GROW_BACK),
    "grow-back-off": ({"elastic": {"minCount": 2, "maxCount": 4, "topologies": ["4x4", "2x4"], "growBack": False}},
                      True, 600, None),
    "max-count-raised-and-capacity": ({"slices": {"accelerator": "tpu-v5-lite-podslice", "topology": "4x4", "count": 4},
                                       "elastic": {"minCount": 2, "maxCount": 4, "growBack": False}}, True, 0, st.RESIZE),
    "bounds-edited-no-larger-shape-fits": ({"elastic": {"minCount": 1, "maxCount": 4, "topologies": ["4x4", "2x4"],
                                                        "growBack": True}}, False, 0, None),
}


@pytest.mark.parametrize(("edit", "more", "seconds", "kind"), list(RESIZE_CASES.values()), ids=list(RESIZE_CASES))
def test_resize_table(edit: dict[str, Any], more: bool, seconds: int, kind: str | None) -> None:
    w = running_world(pools=[tpu_pool("pool-a", 4), tpu_pool("pool-b", 4)])
    assert w.status.shape == Shape("4x4", 2)
    w.spec.update(copy.deepcopy(edit))
    if more:
        w.nodes.update({n.name: n for n in _pool_c()})
    w.advance(seconds)
    spec, observed = validate_spec(w.spec), w.observed()
    assert resize.check_incompatible(spec, observed, w.status, SETTINGS) is None
    finding = resize.check(spec, observed, w.status, SETTINGS)
    if kind is None:
        assert finding is None
    else:
        assert finding is not None and finding.kind == kind and finding.event_type == "Normal"
        assert finding.message.startswith("capacity returned" if kind == st.GROW_BACK else "spec changed")


INCOMPATIBLE_CASES = {
    # id: (spec edit, incompatible?)
    "same-spec": ({}, False),
    "checkpoint-edit": ({"checkpoint": {**good_spec()["checkpoint"], "every": {"steps": 7}}}, False),
    "accelerator-changed": ({"slices": {"accelerator": "tpu-v4-podslice", "topology": "2x2x2", "count": 1},
                             "elastic": {"minCount": 1, "maxCount": 1}}, True),
    "bounds-exclude-the-running-count": ({"slices": {"accelerator": "tpu-v5-lite-podslice", "topology": "4x4", "count": 1},
                                          "elastic": {"minCount": 1, "maxCount": 1}}, True),
    "bounds-exclude-the-running-topology": ({"slices": {"accelerator": "tpu-v5-lite-podslice", "topology": "2x4", "count": 4},
                                             "elastic": {"minCount": 2, "maxCount": 4}}, True),
}


@pytest.mark.parametrize(("edit", "incompatible"), list(INCOMPATIBLE_CASES.values()), ids=list(INCOMPATIBLE_CASES))
def test_incompatible_spec_table(edit: dict[str, Any], incompatible: bool) -> None:
    w = running_world()
    w.spec.update(copy.deepcopy(edit))
    finding = resize.check_incompatible(validate_spec(w.spec), w.observed(), w.status, SETTINGS)
    assert (finding is not None) == incompatible
    if finding is not None:
        assert finding.kind == st.RESIZE and finding.reason == api.SPEC_RESIZED.name


# ---------------------------------------------------------------- operator restarts


def grow_back_flow(d: Driver) -> None:
    lost = [n for n in d.w.nodes.values() if n.pool == "pool-d"]
    for n in lost:
        d.w.nodes.pop(n.name)
    d.tick(6)
    d.w.nodes.update({n.name: n for n in lost})
    d.w.advance(60)
    d.tick(3)
    d.w.exit_workers(75, generation=d.w.status.generation)
    d.tick(10)


@pytest.mark.parametrize("keep", list(KEEP.values()), ids=list(KEEP))
def test_operator_dies_at_every_step_of_a_grow_back(keep: int) -> None:
    assert_survives_restarts(grow_back_flow, keep)
