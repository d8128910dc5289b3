"""`kubectl resilax rollback NAME --step N` (issue 40, item 6): the edit of spec.checkpoint.restore.step
it makes, and what it refuses before sending anything, naming the steps there are."""

from __future__ import annotations

import pytest
from resilax_operator.kubectl import plugin as kubectl_plugin
from resilax_operator.kubectl.client import PluginError
from resilax_operator.kubectl.rollback import build_rollback_patch, known_steps, plan_rollback, run_rollback

# Generation 1 committed 4..44; generation 2 rolled back to 8 and committed 12, 16.
HISTORY = [{"generation": 1, "start": "2026-01-01T00:00:00Z", "checkpoints": [4, 8, 40, 44]},
           {"generation": 2, "start": "2026-01-01T01:00:00Z", "restoredStep": 8, "restoredFrom": "persistent", "checkpoints": [12, 16]}]
STATUS = {"generation": 2, "checkpoint": {"step": 16}, "history": HISTORY}


def test_known_steps_are_the_current_timelines() -> None:
    assert known_steps(STATUS) == [4, 8, 12, 16]  # 40 and 44 superseded by the rollback to 8
    assert known_steps({}) == []


@pytest.mark.parametrize(("status", "step", "error"), [
    (STATUS, 17, "step 17 is above the newest committed step 16; committed steps seen on this timeline: [4, 8, 12, 16]"),
    ({"generation": 0}, 8, "no committed step known yet"),
    ({"generation": 1, "checkpoint": None}, 8, "no committed step known yet"),
    (STATUS, -1, "--step must be >= 0, found -1"),
], ids=["above-newest", "never-ran", "nothing-committed", "negative"])
def test_a_rollback_that_cannot_be_is_refused_naming_the_steps(status: dict, step: int, error: str) -> None:
    with pytest.raises(PluginError, match=error.replace("[", r"\[").replace("]", r"\]")):
        plan_rollback("ml/llama", status, step)


def test_a_step_the_history_never_saw_is_sent_with_a_warning() -> None:
    assert plan_rollback("ml/llama", STATUS, 12) is None
    assert plan_rollback("ml/llama", STATUS, 16) is None
    warning = plan_rollback("ml/llama", STATUS, 10)  # never committed: the restore refuses it, naming the steps
    assert warning is not None and "[4, 8, 12, 16]" in warning
    with pytest.raises(PluginError, match="above the newest committed step 16"):
        plan_rollback("ml/llama", STATUS, 40)  # superseded by the rollback to 8


class _Kube:
    def __init__(self, status: dict) -> None:
        self.status, self.patches = status, []  # type: list[Any]

    def get_job(self, namespace: str, name: str) -> dict:
        return {"metadata": {"name": name, "namespace": namespace}, "status": self.status}

    def patch_job(self, namespace: str, name: str, patch: dict) -> dict:
        self.patches.append((namespace, name, patch))
        return {}


def test_rollback_patches_restore_step_and_nothing_when_refused() -> None:
    kube = _Kube(STATUS)
    line = run_rollback(kube, "ml", "llama", 12)  # type: ignore[arg-type]
    assert kube.patches == [("ml", "llama", {"spec": {"checkpoint": {"restore": {"step": 12}}}})]
    assert build_rollback_patch(12) == kube.patches[0][2]
    assert "restores step 12" in line
    with pytest.raises(PluginError):
        run_rollback(kube, "ml", "llama", 100)  # type: ignore[arg-type]
    assert len(kube.patches) == 1


@pytest.mark.parametrize("argv", [["rollback", "llama"], ["status", "llama", "--step", "3"]],
                         ids=["rollback-without-step", "step-on-status"])
def test_step_goes_with_rollback_only(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        kubectl_plugin.parse_args(argv)
    assert info.value.code == 2 and "--step" in capsys.readouterr().err
    assert kubectl_plugin.parse_args(["rollback", "llama", "--step", "8"]).step == 8
