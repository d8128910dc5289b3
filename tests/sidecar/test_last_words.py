"""The sidecar's last words (issue 26, item 5): what it leaves in its container's termination message
so the operator can still read the trainer's last step and the final save once the pod's containers
are gone (resilax_sidecar/last_words.py). A real sidecar process; the trainer's side is played with the
checkpoint library's own request watcher and figures writer."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from resilax_ckpt.control.requests import RequestWatcher
from resilax_ckpt.control.trainer_metrics import TrainerMetrics
from resilax_sidecar.last_words import MAX_BYTES, build_last_words
from sidecar_harness import TOKEN, wait_until

FIGURES = {"generation": 3, "step": 12, "step_time": 1000.5, "first_step": 9, "first_step_time": 990.0,
           "save_blocking_seconds": 0.25, "restores": 1, "last_restore_seconds": 2.0, "restored_time": 988.0,
           "heartbeat": 1001.0, "phase": "train", "steps_per_second": 3.0, "compilation_cache_hits": 4}


@pytest.mark.parametrize(("state", "save", "expected"), [
    ({"generation": 3, "process_id": 0, "newest_persisted_step": 12, "newest_local_step": None, "trainer": FIGURES},
     {"id": "resize-1", "status": "committed", "step": 12, "committed": True, "error": None, "persisted": True},
     {"generation": 3, "process_id": 0, "newest_persisted_step": 12,
      "trainer": {k: v for k, v in FIGURES.items() if k not in ("steps_per_second", "compilation_cache_hits")},
      "final_save": {"id": "resize-1", "status": "committed", "step": 12, "committed": True, "error": None}}),
    ({"generation": 1, "trainer": None}, None, {"generation": 1}),
    ({"generation": 1, "trainer": {"step": 5, "phase": "x" * 5000}},
     {"id": "r", "status": "failed", "step": None, "committed": False, "error": "e" * 5000},
     {"generation": 1, "final_save": {"id": "r", "status": "failed", "step": None, "committed": False,
                                      "error": "e" * 500}}),
], ids=["trainer-and-final-save", "nothing-to-tell", "too-long-drops-the-figures-first"])
def test_build_last_words_keeps_what_the_operator_reads_within_the_kubelets_limit(
        state: dict, save: dict | None, expected: dict) -> None:
    text = build_last_words(state, save)
    assert len(text.encode()) <= MAX_BYTES
    assert json.loads(text) == expected


def test_the_sidecar_leaves_the_trainers_last_step_and_the_final_save_when_it_exits(
        tmp_path: Path, sidecar_env: dict[str, str], start_sidecar) -> None:
    """The operator asks for a final save; the trainer commits step 12 and exits; the sidecar, stopped
    next, leaves the step the trainer reached and the committed final save in its termination log."""
    log = tmp_path / "termination-log"
    log.write_text("")  # the kubelet's file
    env = {**sidecar_env, "RESILAX_SIDECAR_TERMINATION_LOG": str(log), "RESILAX_CHECKPOINT_DIR": str(tmp_path / "p"),
           "RESILAX_GENERATION": "3"}
    control = Path(env["RESILAX_CONTROL_DIR"])
    control.mkdir()
    (tmp_path / "p").mkdir()
    watcher = RequestWatcher(str(control))
    watcher.hold_trainer_lock()
    figures = TrainerMetrics(str(control), generation=3)
    for step in range(9, 13):
        figures.step(step)
    sidecar = start_sidecar(env)
    asked = sidecar.post("/v1/save", {"reason": "resize", "stop": True}, token=TOKEN)
    assert asked.status == 202, asked
    request_id = asked.body["id"]
    request = wait_until(lambda: next(iter(watcher.poll()), None), 10, "the save request")
    figures.saved(0.1)  # writes the figures at once: step 12 reached
    watcher.write_result(request, 12, True, None)
    watcher.release()  # the trainer exits
    assert log.read_text() == ""  # nothing before it stops
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(30) == 0
    words = json.loads(log.read_text())
    assert words["generation"] == 3 and words["trainer"]["step"] == 12 and words["trainer"]["generation"] == 3
    assert words["final_save"] == {"id": request_id, "status": "committed", "step": 12, "committed": True,
                                   "error": None}


def test_without_a_termination_log_nothing_is_written(tmp_path: Path, sidecar_env: dict[str, str],
                                                      start_sidecar) -> None:
    control = Path(sidecar_env["RESILAX_CONTROL_DIR"])
    control.mkdir()
    (control / "trainer.lock").touch()  # a trainer that has exited
    sidecar = start_sidecar({**sidecar_env, "RESILAX_CHECKPOINT_DIR": str(tmp_path / "p")})
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(30) == 0
    assert "termination message" not in sidecar.log() and not list(tmp_path.glob("*termination*"))
