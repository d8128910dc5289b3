"""straggler.py: a worker >= 1.5x slower (its own step time) than the generation's median for the
window gets StragglerSuspected (the Straggler condition, the memory) and then one StragglerDetected
event. Driven through the in-memory world (every decision made twice gives the same actions)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from op_samples import good_spec
from op_world import SETTINGS, World, cpu_pool
from resilax_operator import api
from resilax_operator.observed.snapshot import HostFigures
from resilax_operator.policies import straggler

PODS = [f"llama-g1-s0-h{h}" for h in range(4)]


def _world() -> World:
    """1 slice x 4 hosts on CPU; generation 1 running."""
    spec = good_spec()
    spec["slices"] = {"accelerator": "cpu", "topology": "4x4", "chipsPerHost": 4, "count": 1}
    spec.pop("elastic", None)
    w = World.make(spec, cpu_pool("pool-a", 4))
    for _ in range(12):
        w.step()
        w.schedule()
        w.kubelets()
    assert w.status.phase == api.PHASE_RUNNING and len(w.gen_pods()) == 4, w.status
    return w


def _sample(w: World, times: list[float | None]) -> None:
    now = w.now.timestamp()
    w.hosts = {pod: HostFigures(generation=w.status.generation, step=100, step_time=now - 0.5, heartbeat=now,
                                phase="train", step_seconds=t, step_seconds_p99=0.5)
               for pod, t in zip(PODS, times, strict=True) if t is not None}


# (id, own step times of the 4 workers, who is named or None)
CASES = [
    ("even", [0.4, 0.41, 0.39, 0.4], None),
    ("one-1.5x-the-median", [0.4, 0.4, 0.6, 0.4], PODS[2]),
    ("just-under-1.5x", [0.4, 0.4, 0.59, 0.4], None),
    ("not-every-worker-reported", [0.4, None, 0.9, 0.4], None),
    ("still-in-warm-up", [0.4, 0.0, 0.9, 0.4], None),
]


@pytest.mark.parametrize(("times", "named"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_slowest(times: list[float | None], named: str | None) -> None:
    w = _world()
    _sample(w, times)
    sample = straggler.slowest(w.observed(), w.status)
    found = sample.pod if sample is not None and sample.straggles else None
    assert found == named, sample


def _condition(w: World) -> Any:
    return w.status.condition(api.COND_STRAGGLER)


def test_suspected_then_detected_once_after_the_window_then_cleared() -> None:
    w = _world()
    window = SETTINGS.straggler_window_seconds
    _sample(w, [0.4, 0.4, 0.4, 1.2])
    w.step()
    c = _condition(w)
    assert c is not None and c.reason == api.STRAGGLER_SUSPECTED.name and straggler.named_pod(c) == PODS[3]
    assert "3x the median 0.4s of the 4 hosts" in c.message.replace("3.00x", "3x")
    for _ in range(4):  # samples within the window; between them no sample (pod 0 only): kept
        w.advance(window / 5)
        _sample(w, [0.4, 0.4, 0.4, 1.2])
        w.hosts = {PODS[0]: w.hosts[PODS[0]]}
        w.step()
        assert api.STRAGGLER_DETECTED.name not in w.reasons()
        _sample(w, [0.4, 0.4, 0.4, 1.2])
        w.step()
        assert _condition(w).reason == api.STRAGGLER_SUSPECTED.name
    w.advance(window / 5)
    _sample(w, [0.4, 0.4, 0.4, 1.2])
    w.step()
    detected = [e for e in w.events if e.reason == api.STRAGGLER_DETECTED.name]
    assert len(detected) == 1 and detected[0].type == "Warning"
    node = w.pods[PODS[3]].node_name
    assert detected[0].message.startswith(f"worker {PODS[3]} (process 3, node {node}) of generation 1 is a straggler")
    assert f"for {window / 60:g} min" in detected[0].message
    w.advance(60)
    _sample(w, [0.4, 0.4, 0.4, 1.2])
    w.step()
    assert len([e for e in w.events if e.reason == api.STRAGGLER_DETECTED.name]) == 1  # once
    _sample(w, [0.4, 0.4, 0.4, 0.45])  # it caught up
    w.step()
    assert _condition(w) is None
    assert w.status.generation == 1  # never a restart


def test_another_worker_slowest_starts_the_window_again() -> None:
    w = _world()
    _sample(w, [0.4, 0.4, 0.4, 1.2])
    w.step()
    w.advance(SETTINGS.straggler_window_seconds - 10)
    _sample(w, [1.2, 0.4, 0.4, 0.4])
    w.step()
    c = _condition(w)
    assert straggler.named_pod(c) == PODS[0] and c.reason == api.STRAGGLER_SUSPECTED.name
    w.advance(20)
    _sample(w, [1.2, 0.4, 0.4, 0.4])
    w.step()
    assert api.STRAGGLER_DETECTED.name not in w.reasons()  # 20 s of pod 0, not the window


def test_a_shorter_window_from_the_settings_and_off() -> None:
    w = _world()
    settings = replace(SETTINGS, straggler_window_seconds=30)
    _sample(w, [0.4, 0.4, 0.4, 1.2])
    s, events = straggler.record(w.observed(), w.status, settings)
    w.status = s
    w.advance(30)
    s, events = straggler.record(w.observed(), w.status, settings)
    assert [e.reason for e in events] == [api.STRAGGLER_DETECTED.name] and "for 0.5 min" in events[0].message
    s, events = straggler.record(w.observed(), s, replace(SETTINGS, straggler_sample_seconds=0))
    assert s.condition(api.COND_STRAGGLER) is None and not events
