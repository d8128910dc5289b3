"""SIGTERM without a live trainer: the sidecar persists what the local tier holds and exits 0, never
later than the grace period. (With a live trainer: test_trainer.py.)"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time
from pathlib import Path

from resilax_ckpt.control.health_verdict import HealthVerdict, write_verdict
from resilax_ckpt.control.requests import write_stop_record
from resilax_sidecar.store import LocalFolderStore
from sidecar_harness import step_files, wait_until, write_local_step


def _env(sidecar_env, tmp_path, grace):
    return {
        **sidecar_env,
        "RESILAX_LOCAL_DIR": str(tmp_path / "local"),
        "RESILAX_CHECKPOINT_DIR": str(tmp_path / "persistent"),
        "RESILAX_SIDECAR_GRACE_SECONDS": str(grace),
        # Poll rarely: the final wait itself must wake the uploader.
        "RESILAX_SIDECAR_POLL_SECONDS": "30",
    }


def test_a_gone_trainer_is_not_waited_for_and_its_last_local_step_is_persisted(
    tmp_path, sidecar_env, start_sidecar
):
    env = _env(sidecar_env, tmp_path, grace=60)
    control = Path(env["RESILAX_CONTROL_DIR"])
    control.mkdir()
    (control / "trainer.lock").touch()  # the trainer announced itself, and has exited (no lock held)
    sidecar = start_sidecar(env)
    # The trainer's own SIGTERM save landed in the local tier just before it exited.
    write_local_step(tmp_path / "local", 30, step_files(3, 1000))
    started = time.monotonic()
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(30) == 0
    assert time.monotonic() - started < 20, "waited for an answer from a trainer that is gone"
    assert LocalFolderStore(tmp_path / "persistent").stat("30/_COMMIT") is not None
    assert "the trainer has exited" in sidecar.log()
    assert not list((control / "requests").iterdir()), "left a stop request for the next trainer"


def test_the_final_save_a_trainer_stopped_after_is_persisted_whatever_persist_every_steps_says(
    tmp_path, sidecar_env, start_sidecar
):
    """Graceful node shutdown: the trainer saved step 31 on its own SIGTERM (no request file), recorded
    it in `stopped.json` and exited; with `persistEverySteps: 10` the sidecar still uploads it."""
    env = {**_env(sidecar_env, tmp_path, grace=60), "RESILAX_PERSIST_EVERY_STEPS": "10"}
    control = Path(env["RESILAX_CONTROL_DIR"])
    control.mkdir()
    (control / "trainer.lock").touch()
    write_stop_record(str(control), 31, sigterm=True)
    sidecar = start_sidecar(env)
    write_local_step(tmp_path / "local", 30, step_files(3, 1000))
    write_local_step(tmp_path / "local", 31, step_files(3, 1000))
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(30) == 0
    persistent = LocalFolderStore(tmp_path / "persistent")
    assert persistent.stat("31/_COMMIT") is not None, sidecar.log()[-3000:]
    assert "persisting its newest local step 31" in sidecar.log()


def test_a_live_trainer_is_waited_for_until_the_grace_period_ends(tmp_path, sidecar_env, start_sidecar):
    env = _env(sidecar_env, tmp_path, grace=3)
    control = Path(env["RESILAX_CONTROL_DIR"])
    control.mkdir()
    fd = os.open(control / "trainer.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a live trainer that never answers
    try:
        sidecar = start_sidecar(env)
        started = time.monotonic()
        sidecar.signal(signal.SIGTERM)
        wait_until(lambda: sidecar.get("/readyz").status == 503, 2, "/readyz to turn 503 while stopping")
        assert sidecar.wait(30) == 0
        assert 2.5 < time.monotonic() - started < 15
        assert "no answer from the trainer within 3 s" in sidecar.log()
        assert not list((control / "requests").iterdir())
    finally:
        os.close(fd)


def test_an_answered_stop_request_is_the_final_save(tmp_path, sidecar_env, start_sidecar):
    """The operator's final save (stop) came first; the trainer stopped after it. SIGTERM then must
    not ask a stopped trainer again: it waits only for that step's upload."""
    from sidecar_harness import TOKEN

    env = _env(sidecar_env, tmp_path, grace=60)
    control = Path(env["RESILAX_CONTROL_DIR"])
    sidecar = start_sidecar(env)
    request_id = sidecar.post("/v1/save", {"reason": "resize", "stop": True}, token=TOKEN).body["id"]
    # The trainer's side: the step lands in the local tier, the answer in results/, the request goes.
    write_local_step(tmp_path / "local", 7, step_files(2, 100))
    (control / "results").mkdir()
    (control / "results" / f"{request_id}.json").write_text(
        json.dumps({"id": request_id, "step": 7, "committed": True, "error": None})
    )
    (control / "requests" / f"{request_id}.json").unlink()
    started = time.monotonic()
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(30) == 0
    assert time.monotonic() - started < 20
    assert not list((control / "requests").iterdir()), "asked the stopped trainer again"
    assert LocalFolderStore(tmp_path / "persistent").stat("7/_COMMIT") is not None
    assert f"final save {request_id}: step 7 committed and uploaded" in sidecar.log()


# ---- a pod whose health check failed (issue 39, "Health-checked starts") --------------------------------


def _write_verdict(control: Path, verdict: HealthVerdict) -> None:
    write_verdict(str(control), verdict)


def test_a_pod_whose_health_check_failed_exits_at_once_without_asking_for_a_final_save(
    tmp_path, sidecar_env, start_sidecar
):
    """The check (an init container after the sidecar) failed: the trainer never started, nothing was
    trained here. The kubelet SIGTERMs the sidecar with the pod's whole grace; it must not wait it out
    (300 s here: `wait` below gives it 60 and raises past them)."""
    env = {**_env(sidecar_env, tmp_path, grace=300), "RESILAX_SIDECAR_TERMINATION_LOG": str(tmp_path / "last-words")}
    control = Path(env["RESILAX_CONTROL_DIR"])
    control.mkdir()
    _write_verdict(control, HealthVerdict(False, "matmul", "wrong checksum on local device 0"))
    sidecar = start_sidecar(env)
    assert sidecar.get("/v1/state").body["health_check"] == {
        "passed": False, "failed_part": "matmul", "reason": "wrong checksum on local device 0"}
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(60) == 0
    assert ("SIGTERM: no final save: the health check failed (matmul: wrong checksum on local device 0) and no "
            "trainer ran in this pod: nothing to save") in sidecar.log()
    assert "waiting up to" not in sidecar.log()
    assert not (control / "requests").exists() or not list((control / "requests").iterdir()), \
        "left a stop request in a pod that will never run a trainer"
    words = json.loads((tmp_path / "last-words").read_text())
    assert words["health_check"]["passed"] is False and "final_save" not in words


def test_a_passed_health_check_still_waits_for_a_trainer_that_does_not_announce_itself(
    tmp_path, sidecar_env, start_sidecar
):
    """No trainer.lock after a passed check: the trainer may run without announcing itself (not a
    resilax trainer); the sidecar cannot tell, so it waits the grace period as before."""
    env = _env(sidecar_env, tmp_path, grace=3)
    control = Path(env["RESILAX_CONTROL_DIR"])
    control.mkdir()
    _write_verdict(control, HealthVerdict(True))
    sidecar = start_sidecar(env)
    assert sidecar.get("/v1/state").body["health_check"] == {"passed": True, "failed_part": None, "reason": None}
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(30) == 0
    assert "no answer from the trainer within 3 s" in sidecar.log()
    assert "no final save" not in sidecar.log()


# ---- a peer the operator proved lost (issue 39: a lost slice's survivor held the next generation) -------


def _two_process_env(sidecar_env, tmp_path, grace):
    """Process 0 of 2, generation 3; its trainer announced itself and has exited (exit 76: a peer is gone)."""
    env = {**_env(sidecar_env, tmp_path, grace=grace), "JAX_PROCESS_ID": "0", "JAX_NUM_PROCESSES": "2",
           "RESILAX_GENERATION": "3"}
    control = Path(env["RESILAX_CONTROL_DIR"])
    control.mkdir()
    (control / "trainer.lock").touch()
    return env


def test_a_final_upload_stops_waiting_for_a_process_the_operator_says_is_lost(tmp_path, sidecar_env, start_sidecar):
    """Goodput run of 2026-12-07, seed 1: the other host of this slice died after both saved step 30
    locally, before its upload. The commit needs its marker, which never comes; the sidecar used to wait
    for it until SIGKILL (60 s here: `wait` gives it 30 and raises past them). Once the operator says
    process 1 of generation 3 is lost, it stops waiting: the step stays uncommitted (its own upload is
    there, nothing deleted), the local step untouched."""
    from sidecar_harness import TOKEN

    env = _two_process_env(sidecar_env, tmp_path, grace=60)
    sidecar = start_sidecar(env)
    write_local_step(tmp_path / "local", 30, step_files(3, 1000), generation=3, process_id=0)
    sidecar.signal(signal.SIGTERM)
    wait_until(lambda: "step 30: waiting for the uploads of processes [1]" in sidecar.log(), 20,
               "the final upload waiting for process 1")
    assert sidecar.proc.poll() is None, "exited before it was told anything"
    told = sidecar.post("/v1/peers/lost", {"generation": 3, "processes": [1]}, token=TOKEN)
    assert (told.status, told.body) == (200, {"generation": 3, "processes": [1]})
    assert sidecar.wait(30) == 0
    log = sidecar.log()
    assert "step 30 can never be committed: processes [1] of its generation are lost" in log, log[-3000:]
    assert "not persisted within the grace period" not in log
    persistent = LocalFolderStore(tmp_path / "persistent")
    assert persistent.stat("30/_COMMIT") is None
    attempts = persistent.list_dir("30")
    assert len(attempts) == 1 and persistent.stat(f"30/{attempts[0]}/_UPLOADED.0") is not None, attempts
    assert (tmp_path / "local" / "30" / "_COMMIT.0").exists()


def test_a_lost_process_that_uploaded_before_it_died_does_not_end_the_wait(tmp_path, sidecar_env, start_sidecar):
    """Process 1 uploaded its part of step 30 before its node died: this sidecar's upload completes the
    step, so being told that process 1 is lost (before SIGTERM, as the operator may) changes nothing."""
    from resilax_sidecar.config import SidecarConfig
    from resilax_sidecar.metrics import SidecarMetrics
    from resilax_sidecar.uploader import Uploader
    from sidecar_harness import TOKEN

    env = _two_process_env(sidecar_env, tmp_path, grace=60)
    sidecar = start_sidecar(env)
    assert sidecar.post("/v1/peers/lost", {"generation": 3, "processes": [1]}, token=TOKEN).status == 200
    files = step_files(3, 1000)
    peer = SidecarConfig(control_dir=tmp_path / "peer-control", checkpoint_dir=str(tmp_path / "persistent"),
                         local_dir=tmp_path / "peer-local", process_id=1, num_processes=2, generation=3)
    write_local_step(tmp_path / "peer-local", 30, files, generation=3, process_id=1)
    persistent = LocalFolderStore(tmp_path / "persistent")
    Uploader(peer, persistent, SidecarMetrics()).run_once()  # process 1's part, then its node died
    assert persistent.stat("30/_COMMIT") is None
    write_local_step(tmp_path / "local", 30, files, generation=3, process_id=0)
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(30) == 0
    log = sidecar.log()
    assert "step 30 committed and uploaded" in log and "can never be committed" not in log, log[-3000:]
    assert persistent.stat("30/_COMMIT") is not None


def test_lost_peers_need_the_token_and_a_body_naming_generation_and_processes(tmp_path, sidecar_env, start_sidecar):
    from sidecar_harness import TOKEN

    sidecar = start_sidecar(_two_process_env(sidecar_env, tmp_path, grace=60))
    assert sidecar.post("/v1/peers/lost", {"generation": 3, "processes": [1]}).status == 401
    assert sidecar.post("/v1/peers/lost", {"generation": 3, "processes": [1]}, token="wrong").status == 403
    for body, said in [({"generation": 0, "processes": [1]}, "generation: 0 must be an integer >= 1"),
                       ({"generation": 3, "processes": []}, "processes: [] must be a list of 1 to"),
                       ({"generation": 3, "processes": [-1]}, "processes: [-1] must be a list"),
                       ({"generation": 3, "processes": "1"}, "processes: '1' must be a list"),
                       ({"generation": 3, "processes": [1], "why": "x"}, "unknown fields ['why']")]:
        answer = sidecar.post("/v1/peers/lost", body, token=TOKEN)
        assert answer.status == 400 and said in answer.body["error"]["message"], (body, answer.body)
    assert sidecar.post("/v1/peers/lost", {"generation": 3, "processes": [2, 1]}, token=TOKEN).body == {
        "generation": 3, "processes": [1, 2]}
    assert sidecar.post("/v1/peers/lost", {"generation": 3, "processes": [1]}, token=TOKEN).body == {
        "generation": 3, "processes": [1, 2]}  # what was said before stays
