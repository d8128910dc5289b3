"""policies/finished.py: the Completed and Failed conditions follow the phase in the same write, and
spec.ttlSecondsAfterFinished deletes a finished job (through the in-memory world, which decides twice)."""

from __future__ import annotations

from op_samples import good_spec
from op_world import running_world
from resilax_operator import api
from resilax_operator.actions import DeleteJob, RequeueAfter, SetStatus


def test_succeeded_sets_completed_in_the_same_write_and_ttl_deletes_later() -> None:
    spec = good_spec()
    spec["ttlSecondsAfterFinished"] = 30
    w = running_world(spec)
    assert w.status.condition(api.COND_COMPLETED) is None and w.status.condition(api.COND_FAILED) is None
    w.exit_workers(0)
    actions = w.step()
    written = [a.status for a in actions if isinstance(a, SetStatus)]
    assert written and written[-1].phase == api.PHASE_SUCCEEDED
    completed = written[-1].condition(api.COND_COMPLETED)
    assert completed is not None and completed.status == "True" and completed.reason == api.COMPLETED.name
    assert w.status.condition(api.COND_FAILED) is None
    w.advance(10)
    later = w.step()
    assert not any(isinstance(a, DeleteJob) for a in later)
    assert any(isinstance(a, RequeueAfter) and 19 <= a.seconds <= 21 for a in later), later
    w.advance(21)
    gone = w.step()
    deletes = [a for a in gone if isinstance(a, DeleteJob)]
    assert len(deletes) == 1 and deletes[0].uid == w.job.uid and "ttlSecondsAfterFinished=30" in deletes[0].reason
    assert api.TTL_EXPIRED.name in w.reasons()


def test_failed_sets_failed_with_the_reason_and_no_ttl_keeps_it() -> None:
    spec = good_spec()
    spec["recovery"]["maxRestarts"] = 0
    w = running_world(spec)
    w.exit_workers(1, names=["llama-g1-s0-h0"])
    w.settle()
    failed = w.status.condition(api.COND_FAILED)
    assert w.status.phase == api.PHASE_FAILED and failed is not None and failed.status == "True"
    assert failed.reason == api.MAX_RESTARTS_EXCEEDED.name and w.status.condition(api.COND_COMPLETED) is None
    w.advance(10 ** 6)
    assert not any(isinstance(a, DeleteJob) for a in w.step())
