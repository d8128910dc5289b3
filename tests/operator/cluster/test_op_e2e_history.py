"""status.history end to end (issue 28), on the flow of a hard node loss and a grow-back with real JAX
workers (examples/train.py) on the local cluster: generation 1 (2 slices) loses a node and shrinks to
generation 2 (1 slice), which restores the newest committed step; the node comes back and generation 3
grows back to 2 slices through a final save. The flow also checks the recovery itself (steps lost,
redone steps' losses, goodput, the steps-lost metric); then `status.history` must tell the same story:
three generations with their shapes, why each ended, the steps they restored and where from.

Job shape, helpers and timing as in test_op_e2e_faults.py (2 slices of tpu-v5-lite-podslice 2x4, 2 hosts
each, a checkpoint every 4 steps into a folder: the persistent tier only, so each restore reads it). The
run itself is test_op_e2e_inplace.py's `run_shrink_and_grow_back`, made once a session for this test
and that module's shrink-and-grow-back test (each asserts its own), which record what each test reads
at the moment it read it."""

from __future__ import annotations

from typing import Any

import pytest
from op_cluster import committed_steps
from test_op_e2e_faults import EVERY, assert_redone_steps_match
from test_op_e2e_inplace import ShrinkGrowRun, shrink_and_grow_back


def assert_goodput_shows_the_fault(run: ShrinkGrowRun, lost: int) -> None:
    """Issue 19 item 3: after the hard loss, status.goodput and the metrics show goodput < 1, the pause
    (from the fault to generation 2's first step) in detection .. restore, the steps trained twice in
    lostStepsRedone; the buckets sum to the wall time."""
    g = run.goodput  # status.goodput once it had generation 2's first step
    b = g["breakdown"]
    print(f"goodput after the hard loss: {g}")
    assert 0 < g["ratio"] < 1 and b["productive"] > 0, g
    # issue 26 item 5: generation 2 runs on 1 of the 2 declared slices: its time counts half in deviceRatio
    assert g["ledger"]["current"]["devicesShare"] == 0.5 and g["deviceRatio"] <= g["ratio"], g
    assert sum(b.values()) == pytest.approx(g["wallSeconds"], abs=1.0), g
    first_step = run.goodput_first_step
    pause = sum(b[k] for k in ("detection", "teardown", "scheduling", "jaxStartup", "restore"))
    # the operator's pause runs from the last step it saw (before the fault) to generation 2's first step
    # (less one step): at least the fault's pause, less that step
    assert pause >= first_step - run.fault - 2.0, (pause, first_step - run.fault, g)
    assert b["detection"] > 0, g
    # exact (issue 26 item 5): the sidecars' last words told the trainers' last step
    assert g["lostSteps"] == lost and (b["lostStepsRedone"] > 0) == (lost > 0), (g, lost)
    m = run.goodput_metrics
    assert 0 < m["ratio"] < 1 and m["detection"] > 0 and m["productive"] > 0, m
    assert m["restore"] > 0, m  # generation 2's restore, from pod 0's trainer figures (the status rounds to 0.1 s)


@pytest.mark.cluster
def test_hard_node_loss_shrinks_then_grows_back_and_the_history_tells_it(shared_runs: dict[str, Any],
                                                                          request: pytest.FixtureRequest) -> None:
    """The flow is shared with test_op_e2e_inplace.py's shrink-and-grow-back test
    (`shrink_and_grow_back`: the first of the two to run makes it)."""
    run = shrink_and_grow_back(shared_runs, request)
    storage = run.storage
    gen1, gen2 = run.gen1, run.gen2
    restored = min(gen2) - 1
    assert restored in committed_steps(storage)
    assert restored >= run.committed_before
    lost = max(gen1) - restored
    redone = assert_redone_steps_match(gen1, gen2)
    assert all(r["devices"] == 4 for r in gen2.values())  # 1 slice x 2 hosts x 2 devices
    assert lost <= EVERY + 1, f"lost {lost} steps (restored {restored}, generation 1 reached {max(gen1)})"
    print(f"hard node loss: restored step {restored}, generation 1 reached {max(gen1)}: {lost} steps lost, "
          f"{redone} redone steps match")
    reasons = run.loss_reasons
    assert "NodeLost" in reasons, reasons
    # The operator measured the steps lost from the trainers' reports: once, and exactly (issue 26
    # item 5: its last look at generation 1 may predate its last step; the sidecars' last words do not).
    observed = run.observed
    assert observed == (1, lost), (observed, lost)
    assert_goodput_shows_the_fault(run, lost)

    # The node came back: growBack resized up to 2 slices through a final save (0 steps lost).
    gen2, gen3 = run.gen2_final, run.gen3
    saved = max(gen2)
    assert min(gen3) - 1 == saved, (saved, min(gen3))
    assert all(r["devices"] == 8 for r in gen3.values())
    assert "GrowBack" in run.grow_reasons
    assert "resilax_operator_generations_total 3.0" in run.metrics
    # The grow-back went through a final save: its recovery lost nothing.
    after = run.steps_lost_after
    assert after == (2, observed[1]), (after, observed)
    # the final save is recorded however fast the workers exited after it (issue 26 item 5)
    done = run.final_saves
    assert any(f"step {saved} committed" in m for m in done), done
    assert run.checkpoint["step"] >= saved, run.checkpoint
    assert_history_tells_it(run, restored=restored, saved=saved, lost=lost, reached=max(gen1))


def assert_history_tells_it(run: ShrinkGrowRun, *, restored: int, saved: int, lost: int, reached: int) -> None:
    """status.history: three generations, oldest first, with the shapes, the reasons that ended them,
    the steps they restored (the workers' own logs say which) and from where (the persistent tier: the
    job has no local tier), the steps lost, and goodput windows that add up to the wall time."""
    h = run.history  # once it had generation 3's restore
    print("status.history: " + "; ".join(
        f"g{e['generation']} {e['shape']['count']}x{e['shape']['topology']} {e.get('endReason')} "
        f"restored {e.get('restoredStep')} from {e.get('restoredFrom')} steps {e.get('firstStep')}-{e.get('lastStep')} "
        f"lost {e['lostSteps']}" for e in h))
    g1, g2, g3 = h
    assert [e["generation"] for e in h] == [1, 2, 3]
    assert [(e["shape"]["count"], e["shape"]["topology"], e["shape"]["hosts"]) for e in h] == [
        (2, "2x4", 4), (1, "2x4", 2), (2, "2x4", 4)]
    # recovery.inPlace is Auto by default: the shrink kept slice 0's pods, the grow-back kept them again
    assert [len(e["pools"]) for e in h] == [2, 1, 2] and [e["inPlace"] for e in h] == [False, True, True], h
    assert (g1.get("endReason"), g2.get("endReason"), g3.get("endReason")) == ("NodeLost", "GrowBack", None)
    assert "end" not in g3 and g1["end"] <= g2["start"] and g2["end"] <= g3["start"], h  # RFC 3339, UTC: ordered
    assert g1["start"] < g1["end"] and g2["start"] < g2["end"]
    # what each restored, and from where; generation 1 started fresh
    assert "restoredStep" not in g1 and "restoredFrom" not in g1
    assert (g2["restoredStep"], g2["restoredFrom"]) == (restored, "persistent"), g2
    assert (g3["restoredStep"], g3["restoredFrom"]) == (saved, "persistent"), g3
    assert g2["firstStep"] == restored + 1 and g3["firstStep"] == saved + 1
    # steps lost: generation 1's, exactly (its last step from the sidecars' last words), none at the grow-back
    assert g1["firstStep"] == 1 and g1["lastStep"] == reached and g1["lostSteps"] == lost, g1
    assert g1["lostSteps"] == g1["lastStep"] - restored and g2["lostSteps"] == 0 and g2["lastStep"] == saved, h
    assert all(restored >= s for s in g1.get("checkpoints", [])), g1
    # the goodput windows: generation 1's held the detection, generation 2's the redo of its lost steps,
    # and together they are the wall time
    status = run.final_status
    wall = status["goodput"]["wallSeconds"]
    # generation 2 trained on half the declared devices: the device-weighted figure is below the plain one
    assert status["goodput"]["deviceRatio"] < status["goodput"]["ratio"], status["goodput"]
    assert g1["goodput"]["detection"] > 0 and g1["goodput"]["productive"] > 0, g1
    assert (g2["goodput"]["lostStepsRedone"] > 0) == (g1["lostSteps"] > 0), h
    assert sum(sum(e["goodput"].values()) for e in h) == pytest.approx(wall, abs=2.0), (h, status["goodput"])
