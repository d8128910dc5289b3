"""Random fault sequences: at every decision the world checks that deciding twice gives the same actions
and that no generation is created while another one's pods exist; nothing raises; once the faults stop
the job runs again."""

from __future__ import annotations

import random

import pytest
from op_samples import good_spec
from op_world import World, cpu_pool
from resilax_operator import api
from resilax_operator.observed.snapshot import SaveOutcome, Taint


def _world() -> World:
    spec = good_spec()
    spec["slices"] = {"accelerator": "cpu", "topology": "2x4", "chipsPerHost": 4, "count": 3}
    spec["elastic"] = {"minCount": 1, "maxCount": 3, "topologies": ["1x4"]}
    spec["recovery"]["maxRestarts"] = 1000
    return World.make(spec, *[cpu_pool(f"pool-{c}", 2) for c in "abc"])


def _fault(w: World, rng: random.Random) -> None:
    nodes = sorted(w.nodes)
    node = rng.choice(nodes)
    pods = sorted(w.pods)
    kind = rng.randrange(10)
    if kind == 0:
        w.set_node(node, taints=(Taint(api.IMPENDING_TERMINATION_TAINT),))
    elif kind == 1:
        w.set_node(node, ready=rng.choice(["Unknown", "False"]), ready_since=w.now)
    elif kind == 2:
        w.set_node(node, ready="True", ready_since=w.now, taints=())
    elif kind == 3 and pods:
        w.exit_workers(rng.choice([1, 75]), names=[rng.choice(pods)])
    elif kind == 4 and w.status.transition is not None and w.status.transition.save_request_id:
        w.outcomes.append(SaveOutcome(w.status.transition.save_request_id, rng.randrange(100), True))
    elif kind == 5:
        w.spec["slices"]["count"] = rng.randint(1, 3)
    elif kind == 6:
        w.kubelets()
    elif kind == 7:
        w.schedule()
    elif kind == 8:
        w.spec["slices"]["topology"] = rng.choice(["2x4", "1x4"])
    w.advance(rng.choice([0, 1, 5, 31, 61, 301]))


@pytest.mark.parametrize("seed", range(16))
def test_random_faults_keep_the_rules(seed: int) -> None:
    rng = random.Random(seed)
    w = _world()
    for _ in range(80):
        if rng.random() < 0.4:
            _fault(w, rng)
        w.step(only=rng.choice([None, None, None, 0, 1]))
        if rng.random() < 0.7:
            w.schedule()
        if rng.random() < 0.7:
            w.kubelets()
    # the faults stop: every node healthy, stopped workers exit, time passes
    for name in list(w.nodes):
        w.set_node(name, ready="True", ready_since=w.now, taints=())
    for _ in range(4):
        w.advance(400)
        if w.status.transition is not None:
            w.exit_workers(75, generation=w.status.transition.generation)
        w.settle(12)
    assert w.status.phase == api.PHASE_RUNNING, (seed, w.status)
    assert len(w.gen_pods()) == w.status.hosts
    assert {p.generation for p in w.pods.values()} == {w.status.generation}
