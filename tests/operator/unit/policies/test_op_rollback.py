"""A rollback is told truly (issue 40, item 6): status.checkpoint keeps the newer rollback's branch, so
it never shows a step a rollback superseded once the rollback is seen (status_fields/checkpoint.py), whatever
the sidecars' last words from before it say."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
from op_restart import KEEP, Driver
from op_samples import good_spec
from op_world import running_world
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.actions import (
    CreateGeneration,
    DeleteGeneration,
    RequestFinalSave,
    SetStatus,
    StartTrainers,
)
from resilax_operator.observed.observe import observe_sidecars
from resilax_operator.observed.sidecar import LastWords, TrainerReport, parse_sidecar_state
from resilax_operator.observed.snapshot import RestoreReport, SaveOutcome
from resilax_operator.policies import rollback
from resilax_operator.settings import OperatorSettings
from resilax_operator.status_fields.checkpoint import (
    CheckpointBranch,
    CheckpointInfo,
    newer_checkpoint,
    parse_branch,
)
from resilax_operator.validation import validate_spec

T0 = datetime(2026, 1, 1, tzinfo=UTC)
G2 = CheckpointBranch(era=1, generation=2, parent=8)   # generation 2 restored step 8
G3 = CheckpointBranch(era=1, generation=3, parent=12)  # then generation 3 restored 12
NEXT_ERA = CheckpointBranch(era=2, generation=1, parent=4)  # the job re-created, its generation 1 restored 4


def ck(step: int, branch: CheckpointBranch | None = None, tier: str = "persistent") -> CheckpointInfo:
    return CheckpointInfo(step, T0, True, tier, branch)


@pytest.mark.parametrize(("current", "seen", "newer"), [
    (ck(100), ck(200), ck(200)),
    (ck(100), ck(50), ck(100)),
    (ck(100, tier="local"), ck(100), ck(100)),
    (None, ck(8, G2), ck(8, G2)),
    (ck(44), ck(8, G2), ck(8, G2)),            # the rollback seen: its step, however low
    (ck(12, G2), ck(44), ck(12, G2)),          # words from before it: superseded, never shown again
    (ck(12, G2), ck(16, G2), ck(16, G2)),      # the new branch goes on
    (ck(16, G2), ck(12, G3), ck(12, G3)),      # a second rollback
    (ck(40, G3), ck(44, G2), ck(40, G3)),      # an older rollback's branch, even at a higher step
    (ck(40, G3), ck(4, NEXT_ERA), ck(4, NEXT_ERA)),  # a newer era (a re-created job) outranks every generation
    (ck(12, G2), None, ck(12, G2)),
], ids=["higher-step", "lower-step", "persistent-beats-local", "first-sighting", "rollback-seen",
        "old-words-after-rollback", "same-branch-on", "second-rollback", "older-branch-higher-step", "newer-era",
        "nothing-seen"])
def test_the_newer_checkpoint_is_the_newer_rollbacks_then_the_higher_step(
        current: CheckpointInfo | None, seen: CheckpointInfo | None, newer: CheckpointInfo) -> None:
    assert newer_checkpoint(current, seen) == newer


@pytest.mark.parametrize(("raw", "want"), [
    ({"era": 1, "generation": 2, "parent": 8}, G2),
    (None, None),
    ({"era": 1, "generation": 2}, None),
    ({"era": 1, "generation": "2", "parent": 8}, None),
    ({"era": True, "generation": 2, "parent": 8}, None),
    ({"era": -1, "generation": 2, "parent": 8}, None),
    ([1, 2, 8], None),
], ids=["branch", "absent", "missing-parent", "string", "bool", "negative", "not-an-object"])
def test_parse_branch(raw: Any, want: CheckpointBranch | None) -> None:
    assert parse_branch(raw) == want


def test_the_sidecars_state_and_the_status_carry_the_branch() -> None:
    seen = parse_sidecar_state({"newest_persisted_step": 8, "branch": {"era": 1, "generation": 2, "parent": 8}}, T0)
    assert seen == ck(8, G2)
    assert parse_sidecar_state({"newest_local_step": 9, "branch": None}, T0) == ck(9, None, "local")
    built = st.build_status(st.JobStatus(checkpoint=seen))
    assert built["checkpoint"]["branch"] == {"era": 1, "generation": 2, "parent": 8}
    assert st.parse_status(built).checkpoint == seen
    assert st.build_status(st.JobStatus(checkpoint=ck(8)))["checkpoint"]["branch"] is None  # merge patch: removed


class _Sidecars:
    """Pod 0's sidecar of generation 2 answers `state`; nothing else is asked."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.state = state

    def sidecar(self, method: str, ip: str, port: int, path: str, body: Mapping[str, Any] | None = None,
                token: str | None = None) -> dict[str, Any]:
        return dict(self.state)


def test_words_left_before_a_rollback_never_raise_the_checkpoint_above_it() -> None:
    """Generation 1 reached 44 and its sidecars' last words say so; generation 2 restored 8 (its sidecar
    names the branch record): the observed checkpoint is 8, then the status follows it down from 44
    and stays on the new branch while the old words are still in the cache."""
    w = running_world()
    w.checkpoint = ck(44)
    w.step()
    assert w.status.checkpoint is not None and w.status.checkpoint.step == 44
    old_words = [LastWords(f"llama-g1-s0-h{h}", 1, {"generation": 1, "newest_persisted_step": 44}, "", "u1")
                 for h in range(2)]
    state = {"generation": 2, "newest_persisted_step": 12, "branch": {"era": 1, "generation": 2, "parent": 8}}
    observed = observe_sidecars(_Sidecars(state), w.observed(), OperatorSettings(),  # type: ignore[arg-type]
                                logging.getLogger("t"), old_words)
    assert observed.checkpoint is not None and (observed.checkpoint.step, observed.checkpoint.branch) == (12, G2)

    w.checkpoint = observed.checkpoint
    w.step()
    assert w.status.checkpoint is not None and (w.status.checkpoint.step, w.status.checkpoint.branch) == (12, G2)
    w.checkpoint = ck(44)  # the old generation's words alone (pod 0 not answering)
    w.advance(5)
    w.step()
    assert w.status.checkpoint is not None and w.status.checkpoint.step == 12


# ---- rollback of a running job: spec.checkpoint.restore.step edited (policies/rollback.py) -------------

def _settle(w: Any, steps: int = 12) -> list[Any]:
    """`World.settle`, keeping the actions."""
    out: list[Any] = []
    for _ in range(steps):
        out += w.step()
        w.schedule()
        w.kubelets()
    return out


def _restore_of(actions: list[Any], generation: int) -> set[str]:
    """The restore step each pod created for `generation` was told (its annotation and its env)."""
    told = set()
    for a in actions:
        if isinstance(a, CreateGeneration) and a.generation == generation:
            for pod in a.pods:
                told.add(pod["metadata"]["annotations"][api.ANNOTATION_RESTORE_STEP])
                for c in pod["spec"]["containers"]:
                    told |= {e["value"] for e in c.get("env") or [] if e["name"] == "RESILAX_RESTORE_STEP"}
    return told


def _edit(w: Any, step: Any) -> None:
    w.spec["checkpoint"].setdefault("restore", {})["step"] = step
    w.spec_generation += 1


def test_editing_restore_step_on_a_running_job_saves_then_restores_that_step_in_the_next_generation() -> None:
    w = running_world()
    assert w.status.restore_asked == "latest"  # what generation 1 was started with
    w.checkpoint = ck(44)
    w.step()
    _edit(w, 8)
    actions = w.step()
    t = w.status.transition
    assert t is not None and t.kind == st.ROLLBACK and t.saving, w.status  # the current step saved first
    assert any(isinstance(a, RequestFinalSave) for a in actions)
    assert api.ROLLBACK_ASKED.name in w.reasons()
    w.outcomes.append(SaveOutcome(t.save_request_id or "", 50, True, None))  # the final save commits 50
    w.exit_workers(75)
    actions = _settle(w)
    assert w.status.generation == 2 and w.status.phase == api.PHASE_RUNNING, w.status
    assert _restore_of(actions, 2) == {"8"}
    assert (w.status.restore_step, w.status.restore_asked) == ("8", "8")
    assert w.status.checkpoint is not None and w.status.checkpoint.step == 50  # saved, on the old branch
    # Generation 2 restored 8 and reached 12; its sidecar's listing from before the branch record still
    # names 50: no step of generation 2 (it never reached it), kept out of its history.
    w.restore = RestoreReport(8, (), generation=2, source="persistent")
    t = w.now.timestamp()
    w.trainer = TrainerReport(2, step=12, step_time=t + 8, first_step=9, first_step_time=t + 5, restores=1,
                              restored_time=t + 3, last_restore_seconds=1.0)
    w.checkpoint = ck(50)
    w.advance(400)  # a status write (the goodput's refresh) that records what was seen
    assert any(isinstance(a, SetStatus) for a in w.step())
    assert w.status.history[-1].restored_step == 8 and w.status.history[-1].checkpoints == ()
    # Then its sidecar names the branch record: status follows it, history carries the restored step
    # and its source, and the old generation ended for the rollback.
    w.checkpoint = ck(12, CheckpointBranch(0, 2, 8))
    w.advance(5)
    assert not any(isinstance(a, (RequestFinalSave, DeleteGeneration)) for a in _settle(w, 3))  # acted on once
    assert w.status.checkpoint is not None and w.status.checkpoint.step == 12
    e1, e2 = w.status.history[-2:]
    assert e1.end_reason == api.ROLLBACK_ASKED.name
    assert (e2.generation, e2.restored_step, e2.restored_from, e2.checkpoints) == (2, 8, "persistent", (12,))


@pytest.mark.parametrize(("edit", "event"), [
    (100, api.ROLLBACK_REFUSED.name),  # above the newest committed step 44
    ("latest", None),
    ("none", None),
    (44, None),  # the newest step itself: a rollback to it (nothing after it to supersede but the final save)
], ids=["above-newest-refused", "latest", "none", "the-newest"])
def test_what_an_edit_that_is_no_rollback_does(edit: Any, event: str | None) -> None:
    w = running_world()
    w.checkpoint = ck(44)
    w.step()
    _edit(w, edit)
    w.step()
    if edit == 44:
        assert w.status.transition is not None and w.status.transition.kind == st.ROLLBACK
        return
    assert w.status.transition is None and w.status.generation == 1
    assert w.status.restore_asked == str(edit)  # recorded: never acted on again
    assert (event in w.reasons()) if event else api.ROLLBACK_REFUSED.name not in w.reasons()
    if event:
        assert "44" in next(e.message for e in w.events if e.reason == event)
    assert not any(isinstance(a, (RequestFinalSave, DeleteGeneration)) for a in w.step())


def test_a_status_from_before_restore_asked_records_the_spec_and_rolls_nothing_back() -> None:
    w = running_world()
    w.status = replace(w.status, restore_asked="")
    _edit(w, 8)
    w.step()
    assert w.status.transition is None and w.status.restore_asked == "8"


@pytest.mark.parametrize(("asked", "spec_step", "generation", "checkpoint", "want"), [
    ("latest", "latest", 1, None, "latest"),
    ("", "12", 1, None, "12"),           # the first generation: the spec's, as always
    ("latest", "latest", 3, 44, "latest"),
    ("latest", "8", 3, 44, "8"),         # an edit waiting while another transition started the generation
    ("8", "8", 3, 44, "latest"),         # acted on already
    ("latest", "100", 3, 44, "latest"),  # refused: above the newest
    ("", "8", 3, 44, "latest"),          # unknown before: not an edit
], ids=["first-latest", "first-pinned", "later", "pending-edit", "done", "refused", "unknown"])
def test_plan_restore(asked: str, spec_step: str, generation: int, checkpoint: int | None, want: str) -> None:
    raw = good_spec()
    raw["checkpoint"]["restore"] = {"step": spec_step}
    spec = validate_spec(raw, name="llama", settings=OperatorSettings())
    s = st.JobStatus(restore_asked=asked, checkpoint=None if checkpoint is None else ck(checkpoint))
    assert rollback.plan_restore(spec, s, generation) == want


def test_a_failure_while_a_rollback_waits_starts_the_next_generation_on_the_step_asked() -> None:
    w = running_world()
    w.checkpoint = ck(44)
    w.step()
    _edit(w, 8)
    w.exit_workers(1)  # a worker fails in the same instant: the failure decides first
    actions = _settle(w, 3)
    assert w.status.transition is not None and w.status.transition.kind == st.WORKER_FAILURE
    w.advance(60)  # past the failure's backoff
    actions += _settle(w)
    assert w.status.generation == 2, w.status
    assert _restore_of(actions, 2) == {"8"} and w.status.restore_asked == "8"


def test_an_in_place_restart_while_a_rollback_waits_restores_the_step_asked() -> None:
    """recovery.inPlace Auto: a node lost while an edit of restore.step waits (the loss decides first);
    the survivors' trainers are started again with the step asked, and the edit is then acted on."""
    from test_op_inplace import _lose_node, _world, tick

    w = _world()
    w.checkpoint = ck(44)
    tick(w)
    _edit(w, 8)
    _lose_node(w, "llama-g1-s1-h1")
    actions = [a for _ in range(15) for a in tick(w)]
    assert w.status.generation == 2 and w.status.in_place is None and w.status.in_place_restarts == 1, w.status
    assert (w.status.restore_step, w.status.restore_asked) == ("8", "8")
    started = [dict(env) for a in actions if isinstance(a, StartTrainers) for _, env in a.pods]
    assert started and all(env.get("RESILAX_RESTORE_STEP") == "8" for env in started), started
    assert _restore_of(actions, 2) == {"8"}  # the pod created for the lost one
    assert w.status.transition is None and w.status.phase == api.PHASE_RUNNING  # acted on once


def _rollback_flow(d: Any) -> None:
    d.tick(8)  # generation 1 Running
    d.w.checkpoint = ck(44)
    d.tick()
    _edit(d.w, 8)
    d.tick(2)  # the Rollback transition and its final save asked
    d.w.exit_workers(75)  # the workers saved and stopped
    d.tick(10)


@pytest.mark.parametrize("keep", list(KEEP.values()), ids=list(KEEP))
def test_operator_dies_at_every_step_of_a_rollback(keep: int) -> None:
    """The operator dies at any decision of the flow (after none or the first of its actions): it resumes
    from the status and ends the same, the rollback done once, generation 2 restoring step 8."""
    clean = Driver(None, 0)
    _rollback_flow(clean)
    want = (api.PHASE_RUNNING, 2, 1, "8", "8", None)

    def end(d: Driver) -> tuple[object, ...]:
        s = d.w.status
        return (s.phase, s.generation, s.restarts, s.restore_step, s.restore_asked, s.transition)

    assert end(clean) == want, clean.w.status
    for crash_at in range(clean.n):
        d = Driver(crash_at, keep)
        _rollback_flow(d)
        assert end(d) == want, f"crash at decision {crash_at}: {d.w.status}"
