"""End to end: `resilax sidecar` and a real training process (resilax_ckpt) sharing a control folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from resilax_sidecar.store import GcsStore, LocalFolderStore
from sidecar_harness import TOKEN, committed_attempt, wait_until

pytestmark = pytest.mark.slow

EXIT_CODE_STOPPED = 75


def wait_outcome(sidecar, request_id: str, timeout: float = 60) -> dict:
    def done():
        body = sidecar.get(f"/v1/save/{request_id}").body
        return body if body["status"] != "pending" else None

    return wait_until(done, timeout, f"the outcome of save {request_id}", interval=0.1)


def restore_w0(path: str, env: dict[str, str]) -> float:
    """Restore one step folder with resilax_ckpt in a fresh process; the first weight."""
    code = (
        "import sys, resilax_ckpt as rc; out = rc.restore(sys.argv[1]); "
        "print(float(out['params']['w'][0]), out['meta']['step'])"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, path],
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    w0, step = run.stdout.split()
    assert float(w0) == float(step)
    return float(w0)


def test_a_save_request_saves_one_agreed_step_and_reports_it(tmp_path, sidecar_env, start_sidecar, start_trainer):
    ckpt = tmp_path / "ckpt"
    env = {**sidecar_env, "RESILAX_CHECKPOINT_DIR": str(ckpt)}
    trainer = start_trainer(env)
    sidecar = start_sidecar(env)
    trainer.wait_for("trainer ready")
    time.sleep(0.3)
    assert not [p for p in ckpt.iterdir() if p.name.isdigit()], "saved without being asked"

    request_id = sidecar.post("/v1/save", {"reason": "manual"}, token=TOKEN).body["id"]
    outcome = wait_outcome(sidecar, request_id)
    assert outcome["status"] == "committed" and outcome["committed"] is True and outcome["error"] is None
    step = outcome["step"]
    assert (ckpt / str(step) / "_COMMIT").is_file()
    assert [p.name for p in ckpt.iterdir() if p.name.isdigit()] == [str(step)], "exactly one step saved"
    assert restore_w0(str(ckpt / str(step)), {}) == step
    wait_until(lambda: sidecar.metric("resilax_sidecar_save_request_seconds_count") == 1, 10, "latency")
    assert sidecar.get("/v1/state").body["newest_persisted_step"] == step

    # A stop request: one more step saved, then the trainer exits with EXIT_CODE_STOPPED.
    stop_id = sidecar.post("/v1/save", {"reason": "resize", "stop": True}, token=TOKEN).body["id"]
    stop_outcome = wait_outcome(sidecar, stop_id)
    assert stop_outcome["committed"] and stop_outcome["step"] > step
    assert trainer.proc.wait(60) == EXIT_CODE_STOPPED
    assert f"stopped at step {stop_outcome['step']}" in trainer.log()


def test_sigterm_gets_a_final_step_committed_and_uploaded_before_the_sidecar_exits(
    tmp_path, sidecar_env, start_sidecar, start_trainer, gcs_bucket, gcs_env
):
    persistent = f"{gcs_bucket}/jobs/llama"
    env = {
        **sidecar_env,
        **gcs_env,
        "RESILAX_LOCAL_DIR": str(tmp_path / "local"),
        "RESILAX_CHECKPOINT_DIR": persistent,
        "RESILAX_SIDECAR_GRACE_SECONDS": "90",
        "TRAINER_FLOATS": str(256 * 1024),  # 1 MiB of weights
    }
    trainer = start_trainer(env)
    sidecar = start_sidecar(env)
    trainer.wait_for("trainer ready")
    time.sleep(0.5)

    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait(120) == 0, sidecar.log()
    assert trainer.proc.wait(60) == EXIT_CODE_STOPPED, trainer.log()
    final_step = int(trainer.log().split("stopped at step ")[1].split()[0])

    # Before the sidecar exited, the final step was committed in the persistent tier, whole.
    store = GcsStore(persistent)
    assert store.stat(f"{final_step}/_COMMIT") is not None, sidecar.log()
    attempt = committed_attempt(store, final_step)
    remote = store.list_files(f"{final_step}/{attempt}")
    local = tmp_path / "local" / str(final_step)
    for path in local.rglob("*"):
        rel = path.relative_to(local).as_posix()
        if path.is_file() and rel != "_COMMIT":
            assert remote[rel].size == path.stat().st_size, rel
    assert json.loads(store.read_bytes(f"{final_step}/{attempt}/_UPLOADED.0"))["generation"] == 0
    assert "committed and uploaded" in sidecar.log()
    # ... and resilax_ckpt restores it from the emulator.
    assert restore_w0(f"{persistent}/{final_step}", gcs_env) == final_step
    assert Path(sidecar_env["RESILAX_CONTROL_DIR"], "requests").is_dir()


def test_two_hosts_local_tiers_combine_into_one_committed_persistent_step(
    tmp_path, sidecar_env, start_sidecar, start_trainer
):
    """Two JAX processes, each with its own local tier and sidecar; the weights are sharded across
    them, so each host holds half of them: only the combination of both uploads restores."""
    from sidecar_harness import free_port

    persistent = tmp_path / "persistent"
    coordinator = f"127.0.0.1:{free_port()}"
    floats = 64 * 1024
    hosts = []
    for pid in range(2):
        env = {
            **sidecar_env,
            "RESILAX_CONTROL_DIR": str(tmp_path / f"control{pid}"),
            "RESILAX_LOCAL_DIR": str(tmp_path / f"local{pid}"),
            "RESILAX_CHECKPOINT_DIR": str(persistent),
            "RESILAX_SIDECAR_PORT": str(free_port()),
            "JAX_COORDINATOR_ADDRESS": coordinator,
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(pid),
            "RESILAX_SAVE_EVERY_STEPS": "5",
            "TRAINER_MAX_STEPS": "10",
            "TRAINER_FLOATS": str(floats),
        }
        hosts.append((start_trainer(env), start_sidecar(env)))
    for trainer, _ in hosts:
        assert trainer.proc.wait(120) == 0, trainer.log()
    wait_until(lambda: (persistent / "10" / "_COMMIT").is_file(), 60, "step 10 to be committed")
    for pid, (_, sidecar) in enumerate(hosts):
        wait_until(lambda s=sidecar: s.get("/v1/state").body["newest_persisted_step"] == 10, 30, "state")
        attempt = committed_attempt(LocalFolderStore(persistent), 10)
        assert (persistent / "10" / attempt / f"_UPLOADED.{pid}").is_file()
    commits = sum(s.metric("resilax_sidecar_commits_total") for _, s in hosts)
    committed = [p for p in persistent.iterdir() if (p / "_COMMIT").is_file()]
    assert commits == len(committed), "a step was committed by both sidecars"  # step 5 too, if it was early
    # Each host's local tier holds only its half of the chunks; the persistent step holds both.
    code = (
        "import sys, numpy as np, resilax_ckpt as rc; w = rc.restore(sys.argv[1])['params']['w']; "
        f"assert np.array_equal(w, np.arange({floats}, dtype=np.float32) + 10), w; print('ok')"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(persistent / "10")],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.stdout.strip() == "ok", run.stderr


def test_a_request_to_one_host_saves_the_same_step_on_every_host_and_commits_it(
    tmp_path, sidecar_env, start_sidecar, start_trainer
):
    """resilax_ckpt agrees on requested steps across processes in local-tier mode too, so one pod's
    request makes every host save the same step, and the sidecars' uploads meet in it."""
    from sidecar_harness import free_port

    persistent = tmp_path / "persistent"
    coordinator = f"127.0.0.1:{free_port()}"
    hosts = []
    for pid in range(2):
        env = {
            **sidecar_env,
            "RESILAX_CONTROL_DIR": str(tmp_path / f"control{pid}"),
            "RESILAX_LOCAL_DIR": str(tmp_path / f"local{pid}"),
            "RESILAX_CHECKPOINT_DIR": str(persistent),
            "RESILAX_SIDECAR_PORT": str(free_port()),
            "JAX_COORDINATOR_ADDRESS": coordinator,
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(pid),
            "TRAINER_MAX_STEPS": "400",
        }
        hosts.append((start_trainer(env), start_sidecar(env)))
    for trainer, _ in hosts:
        trainer.wait_for("trainer ready", 120)
    sidecar0 = hosts[0][1]
    outcome = wait_outcome(sidecar0, sidecar0.post("/v1/save", {"reason": "resize"}, token=TOKEN).body["id"])
    step = outcome["step"]
    assert outcome["committed"]  # in host 0's local tier; `persisted` tells when it is in the persistent one
    wait_until(
        lambda: sidecar0.get(f"/v1/save/{outcome['id']}").body["persisted"], 30, f"step {step} persisted"
    )
    assert (persistent / str(step) / "_COMMIT").is_file()
