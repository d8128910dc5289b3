"""policies/grow_back_probe.py and probes.py: after a Shrink under `capacity.provisioning: Autoscaled`,
probe pods of the missing slices give a cluster autoscaler the demand it scales up for; the grow-back
removes them.

Flows through the in-memory world (op_world: deciding twice gives the same actions at every step),
then a table of the cases where no probe exists."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from op_world import SETTINGS, World, tpu_pool
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import CreateProbes, DeleteProbes
from resilax_operator.pods.probes import parse_probe
from resilax_operator.policies import grow_back_probe
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec
from test_op_capacity_wait import SHRINK_AFTER, autoscaled_spec, pools

PERIOD = SETTINGS.grow_back_probe_seconds


def shrunk_world(spec: dict[str, Any] | None = None) -> World:
    """Declared 2 slices of 4x4, one pool: generation 1 waits, shrinks to 1 slice (generation 2, Running)."""
    w = World.make(spec or autoscaled_spec(), *pools("pool-a"))
    w.settle()
    w.advance(SHRINK_AFTER)
    w.settle()
    assert w.status.generation == 2 and w.status.shape == Shape("4x4", 1) and w.status.phase == api.PHASE_RUNNING
    return w


def probe_actions(actions: list[Any]) -> list[CreateProbes | DeleteProbes]:
    return [a for a in actions if isinstance(a, CreateProbes | DeleteProbes)]


def test_probes_of_the_missing_slice_after_the_settle_then_the_grow_back_removes_them() -> None:
    w = shrunk_world()
    assert w.probes == {}
    w.advance(SETTINGS.grow_back_settle_seconds - 1)
    assert probe_actions(w.step()) == []  # not settled yet
    w.advance(1)
    (create,) = probe_actions(w.step())
    assert isinstance(create, CreateProbes)
    assert sorted(w.probes) == [f"llama-probe-g2r0-s0-h{h}" for h in range(4)]  # 1 missing slice x 4 hosts
    pod = w.probe_manifests["llama-probe-g2r0-s0-h0"]
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"] == {api.LABEL_JOB: "llama", api.LABEL_ROLE: api.ROLE_PROBE, api.LABEL_PROBE_SET: "g2r0",
                              api.LABEL_PROBE_SLICE: "0"}
    assert api.LABEL_GENERATION not in meta["labels"]  # never taken for a worker
    assert meta["ownerReferences"] == [{"apiVersion": api.API_VERSION, "kind": api.KIND, "name": "llama",
                                        "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
    assert spec["nodeSelector"] == {api.TPU_ACCELERATOR_LABEL: "tpu-v5-lite-podslice", api.TPU_TOPOLOGY_LABEL: "4x4"}
    (container,) = spec["containers"]
    assert container["image"] == SETTINGS.probe_image
    assert container["resources"]["limits"][api.TPU_RESOURCE] == "4"
    assert container["resources"]["requests"][api.TPU_RESOURCE] == "4"
    assert {"key": api.TPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": api.NODE_POOL_LABEL, "operator": "NotIn", "values": ["pool-a"]} in term["matchExpressions"]
    (together,) = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert together["topologyKey"] == api.NODE_POOL_LABEL
    assert spec["terminationGracePeriodSeconds"] == 0 and "priorityClassName" not in spec
    assert parse_probe(pod, "uid-1") is not None and parse_probe(pod, "uid-other") is None

    for _ in range(3):  # nothing more while the round lasts
        w.advance(PERIOD / 4)
        assert probe_actions(w.step()) == []

    # The autoscaler adds the node pool: the nodes are Ready and free for this job: GrowBack, probes go.
    w.nodes.update({n.name: n for n in tpu_pool("pool-b", 4)})
    actions = w.step()
    assert w.status.transition is not None and w.status.transition.kind == st.GROW_BACK
    assert [type(a) for a in probe_actions(actions)] == [DeleteProbes] and w.probes == {}
    w.exit_workers(75)
    w.settle()
    assert w.status.shape == Shape("4x4", 2) and w.status.phase == api.PHASE_RUNNING
    w.advance(PERIOD * 3)
    w.settle(3)
    assert w.probes == {}  # at the declared shape: no probe


def test_an_unanswered_probe_set_is_replaced_each_period_a_bound_one_is_kept() -> None:
    w = shrunk_world()
    w.advance(SETTINGS.grow_back_settle_seconds)
    w.step()
    assert {p.probe_set for p in w.probes.values()} == {"g2r0"}
    w.advance(PERIOD)
    delete, create = probe_actions(w.step())
    assert isinstance(delete, DeleteProbes) and len(delete.names) == 4
    assert isinstance(create, CreateProbes) and {p.probe_set for p in w.probes.values()} == {"g2r1"}
    # One probe got a node (a node pool is coming up, not all its nodes Ready yet): kept past its round.
    name = "llama-probe-g2r1-s0-h0"
    w.probes[name] = replace(w.probes[name], node_name="pool-b-0")
    w.advance(PERIOD * 2)
    assert probe_actions(w.step()) == []
    assert {p.probe_set for p in w.probes.values()} == {"g2r1"}


def test_the_job_finishing_removes_the_probes() -> None:
    w = shrunk_world()
    w.advance(SETTINGS.grow_back_settle_seconds)
    w.step()
    assert w.probes
    w.exit_workers(0)
    w.settle()
    assert w.status.phase == api.PHASE_SUCCEEDED and w.probes == {}


def _spec(**changes: Any) -> dict[str, Any]:
    raw = autoscaled_spec()
    for key, value in changes.items():
        raw[key] = value
    return raw


@pytest.mark.parametrize(("case", "raw", "settings"), [
    ("probes off in the settings", autoscaled_spec(), replace(SETTINGS, grow_back_probe_seconds=0)),
    ("no growBack", _spec(elastic={"minCount": 1, "maxCount": 2, "topologies": ["4x4"], "growBack": False}), SETTINGS),
    ("a Kueue queue decides capacity", _spec(template={**autoscaled_spec()["template"], "metadata": {
        "labels": {api.KUEUE_QUEUE_LABEL: "team-a"}}}), SETTINGS),
])
def test_no_probe(case: str, raw: dict[str, Any], settings: Any) -> None:
    w = shrunk_world(autoscaled_spec())
    w.spec = raw
    w.advance(settings.grow_back_settle_seconds + 1)
    spec = validate_spec(raw, name="llama", settings=settings)
    assert grow_back_probe.decide(spec, w.observed(), w.status, settings) == [], case


def test_no_probe_with_ready_provisioning_or_at_the_declared_shape() -> None:
    w = shrunk_world()
    w.advance(SETTINGS.grow_back_settle_seconds + 1)
    ready = autoscaled_spec(provisioning="Ready")
    assert grow_back_probe.decide(validate_spec(ready, name="llama", settings=SETTINGS), w.observed(), w.status,
                                  SETTINGS) == []
    one = autoscaled_spec(count=1)
    assert grow_back_probe.missing_shape(validate_spec(one, name="llama", settings=SETTINGS), w.observed(), w.status,
                                         SETTINGS) is None
