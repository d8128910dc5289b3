"""A rollback is told truly (issue 40, item 6): status.checkpoint keeps the newer rollback's branch, so
it never shows a step a rollback superseded once the rollback is seen (checkpoint_status.py), whatever
the sidecars' last words from before it say."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pytest
from op_world import running_world
from resilax_operator import status as st
from resilax_operator.checkpoint_status import (
    CheckpointBranch,
    CheckpointInfo,
    newer_checkpoint,
    parse_branch,
)
from resilax_operator.observe import observe_sidecars
from resilax_operator.observed_sidecar import LastWords, parse_sidecar_state
from resilax_operator.settings import OperatorSettings

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
