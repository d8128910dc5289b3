"""A kept trainer process (issue 38): `rc.run_kept(main)` under `resilax run` runs the next incarnation in
the same process where resilax_ckpt.trainer.kept allows it, and a fresh process (the reason logged and counted)
everywhere else.

The decisions are tables; the processes are real: the console script `resilax run` and a trainer
stand-in without JAX (kept_child.py), driven only through the control files, as the sidecar does. The
JAX trainer itself (examples/transformer.py kept on CPU devices, bit-exact restore, the same loss
curve) is tests/examples/test_transformer_kept.py. Waits are on conditions, never on time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ckpt_procs import pid_exists, read_json
from resilax_ckpt.control import trainer_control as tc
from resilax_ckpt.trainer import kept

CHILD = Path(__file__).with_name("kept_child.py")
RESILAX = Path(sys.executable).with_name("resilax")
DEADLINE = 60.0  # a bound on hangs under load, not a timing claim

BASE = {"RESILAX_GENERATION": "3", "RESILAX_INCARNATION": "1", "TPU_WORKER_ID": "0", "PATH": "/bin"}


def parked(**changes: Any) -> kept.Parked:
    fields: dict[str, Any] = {"pid": 10, "incarnation": 1, "generation": 3, "exit_code": 75, "processes": 1,
                              "env": BASE}
    fields.update(changes)
    return kept.Parked(**fields)


@pytest.mark.parametrize(("exit_code", "raised", "processes", "key"), [
    (75, None, 1, None),
    (0, None, 1, kept.NOT_STOPPED),
    (1, None, 1, kept.NOT_STOPPED),
    (None, ValueError("boom"), 1, kept.RAISED),
    (75, None, 2, kept.SEVERAL_PROCESSES),
], ids=["stopped-parks", "finished", "failed-code", "raised", "several-processes"])
def test_a_trainer_parks_only_after_a_stop_of_its_one_process(exit_code: int | None, raised: BaseException | None,
                                                             processes: int, key: str | None) -> None:
    refusal = kept.decide_park(exit_code, raised, processes)
    assert (refusal.key if refusal else None) == key


NEXT = {**BASE, "RESILAX_GENERATION": "4", "RESILAX_INCARNATION": "2", "RESILAX_RESTORE_STEP": "7"}


@pytest.mark.parametrize(("the_parked", "next_env", "enabled", "key"), [
    (parked(), NEXT, True, None),
    (parked(), {**NEXT, "RESILAX_LIVE_JOB_UIDS": "a,b"}, True, None),
    (parked(), NEXT, False, kept.KEEP_OFF),
    (None, NEXT, True, kept.NOT_PARKED),
    (parked(hang=True), NEXT, True, kept.HANG),
    (parked(processes=2), NEXT, True, kept.SEVERAL_PROCESSES),
    (parked(), {**NEXT, "JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2"}, True, kept.SEVERAL_PROCESSES),
    (parked(), {**NEXT, "TPU_WORKER_ID": "1"}, True, kept.WORLD_CHANGED),
    (parked(), {**NEXT, "RESILAX_NUM_SLICES": "2"}, True, kept.WORLD_CHANGED),
], ids=["generation-only", "live-uids", "off", "not-parked", "hang", "parked-several", "next-several",
        "worker-id", "slices"])
def test_the_next_incarnation_keeps_the_parked_process_only_in_the_same_one_process_world(
        the_parked: kept.Parked | None, next_env: dict[str, str], enabled: bool, key: str | None) -> None:
    refusal = kept.decide_keep(the_parked, next_env, enabled)
    assert (refusal.key if refusal else None) == key
    if key == kept.WORLD_CHANGED:
        assert refusal is not None and ("TPU_WORKER_ID" in refusal.message or "RESILAX_NUM_SLICES" in refusal.message)


@pytest.mark.parametrize(("current", "next_env", "update"), [
    ({"RESILAX_GENERATION": "3", "LIBTPU_INIT_ARGS": "--a --added-by-jax"},
     {"RESILAX_GENERATION": "4", "LIBTPU_INIT_ARGS": "--a"}, {"RESILAX_GENERATION": "4"}),
    ({"RESILAX_RESTORE_STEP": "7", "TPU_ML_PLATFORM": "JAX"}, {}, {"RESILAX_RESTORE_STEP": None}),
    ({}, {"RESILAX_INCARNATION": "2", "RESILAX_LIVE_JOB_UIDS": "u1", kept.FD_ENV: "5"},
     {"RESILAX_INCARNATION": "2", "RESILAX_LIVE_JOB_UIDS": "u1"}),
    ({"RESILAX_GENERATION": "4", "PATH": "/bin"}, {"RESILAX_GENERATION": "4", "PATH": "/usr/bin"}, {}),
], ids=["generation-set-the-process-own-libtpu-args-kept", "restore-step-removed", "channel-fd-never-set",
        "nothing-of-the-generation-changes"])
def test_a_kept_process_takes_only_the_generations_own_variables_of_the_next_environment(
        current: dict[str, str], next_env: dict[str, str], update: dict[str, str | None]) -> None:
    assert kept.plan_env_update(current, next_env) == update


def test_what_the_last_process_said_is_the_reason_when_it_did_not_park() -> None:
    said = kept.Refusal(kept.RAISED, "the entry point raised ValueError: boom")
    assert kept.decide_keep(None, NEXT, True, said) == said


def test_messages_are_one_json_object_a_line_and_anything_else_is_ignored() -> None:
    line = kept.encode("resume", {"incarnation": 2, "env": {"A": "1"}})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert kept.parse_message(line.strip()) == ("resume", {"incarnation": 2, "env": {"A": "1"}})
    for bad in (b"", b"[]", b'{"a": 1}', b'{"a": {}, "b": {}}', b"\xff"):
        assert kept.parse_message(bad) is None


def test_a_line_past_the_bound_closes_the_channel_and_what_came_before_it_is_read(monkeypatch) -> None:
    """The supervisor's reads are bounded: a child that writes an endless line breaks the channel (its
    next incarnation is a fresh process) instead of growing the supervisor's memory."""
    import socket

    from resilax_ckpt.trainer import kept_channel

    monkeypatch.setattr(kept_channel, "MAX_LINE_BYTES", 100)
    for how in ("poll", "receive"):
        supervisor_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        supervisor_end.setblocking(how == "receive")
        channel = kept_channel.Channel(supervisor_end)
        child_end.sendall(kept.encode("parked", {"pid": 7}) + b"x" * 101)
        if how == "poll":
            assert channel.poll() == [("parked", {"pid": 7})]
        else:
            assert channel.receive() == ("parked", {"pid": 7})
            assert channel.receive() is None
        assert channel.closed and channel.poll() == []
        child_end.close()


# ---------------------------------------------------------------------------- real processes


class Run:
    """`resilax run -- python kept_child.py <reports> <mode>` with its control folder."""

    def __init__(self, tmp: Path, mode: str, env: dict[str, str] | None = None) -> None:
        self.control, self.reports = tmp / "control", tmp / "reports"
        self.reports.mkdir(parents=True)
        self.log_path = tmp / "supervisor.log"
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("RESILAX_")}
        full_env.update(RESILAX_CONTROL_DIR=str(self.control), RESILAX_GENERATION="3", TPU_WORKER_ID="0",
                        RESILAX_RESTART_GRACE_SECONDS="5", **(env or {}))
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen([str(RESILAX), "run", "--", sys.executable, str(CHILD), str(self.reports), mode],
                                     env=full_env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for(self, what: str, check: Callable[[], Any]) -> Any:
        end = time.monotonic() + DEADLINE
        while time.monotonic() < end:
            value = check()
            if value:
                return value
            if self.proc.poll() is not None:
                raise AssertionError(f"supervisor exited {self.proc.returncode} before {what}:\n{self.log()}")
            time.sleep(0.02)
        raise AssertionError(f"no {what} within {DEADLINE} s:\n{self.log()}")

    def wait_state(self, number: int, state: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            record = tc.read_incarnation(str(self.control))
            return record if record and record["incarnation"] == number and record["state"] == state else None
        return self.wait_for(f"incarnation {number} {state}", check)  # type: ignore[no-any-return]

    def child(self, number: int) -> dict[str, Any]:
        return self.wait_for(f"child {number}'s report",  # type: ignore[no-any-return]
                             lambda: read_json(self.reports / f"child-{number}.json"))

    def restart(self, generation: int, env: dict[str, str] | None = None, stacks: bool = False) -> None:
        """What the operator does through the sidecar: stop the trainer, then start the next generation."""
        tc.write_json(str(self.control), tc.STOP_FILE, {"generation": generation, "reason": "test", "stacks": stacks})
        self.wait_for("the stop done", lambda: (r := tc.read_incarnation(str(self.control))) and r["state"] == "exited")
        tc.write_json(str(self.control), tc.ASSIGNMENT_FILE, {"generation": generation, "env": env or {}})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for record in (tc.read_incarnation(str(self.control)) or {},):
            if isinstance(record.get("pid"), int):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(record["pid"], signal.SIGKILL)
        self.proc.wait()
        self._log.close()


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def make(mode: str, env: dict[str, str] | None = None) -> Run:
        runs.append(Run(tmp_path / f"run{len(runs)}", mode, env))
        return runs[-1]

    yield make
    for run in runs:
        run.stop()


def test_a_stopped_trainer_parks_and_runs_the_next_generation_in_the_same_process_with_its_environment(
        start: Callable[..., Run]) -> None:
    run = start("cooperate")
    first = run.child(1)
    run.restart(4, {"RESILAX_RESTORE_STEP": "7"})
    parked_record = tc.read_incarnation(str(run.control))
    assert parked_record is not None
    assert (parked_record["incarnation"], parked_record["exit_code"], parked_record["parked"]) == (1, 75, True)
    second = run.child(2)
    assert second["pid"] == first["pid"], "the same process runs incarnation 2"
    assert (second["env"]["RESILAX_GENERATION"], second["env"]["RESILAX_INCARNATION"],
            second["env"]["RESILAX_RESTORE_STEP"]) == ("4", "2", "7")
    assert "RESILAX_RESTORE_STEP" not in first["env"] and kept.FD_ENV not in second["env"]
    # what the process set in its own environment (as JAX's TPU start-up does) is still there
    assert (second["env"]["LIBTPU_INIT_ARGS"], second["env"]["TPU_ML_PLATFORM"]) == \
        ("--xla_tpu_use_enhanced_launch_barrier=true", "JAX")
    record = run.wait_for("the kept restart counted",
                          lambda: (r := tc.read_incarnation(str(run.control))) and r["restarts"]["kept"] == 1 and r)
    assert (record["incarnation"], record["generation"], record["state"], record["kept"], record["pid"]) == \
        (2, 4, "running", True, first["pid"])
    assert record["restarts"] == {"kept": 1, "fresh": {}}
    # and again: a process is kept across any number of generations
    run.restart(5)
    assert run.child(3)["pid"] == first["pid"]
    assert run.wait_state(3, "running")["generation"] == 5


def test_a_stop_that_comes_while_the_trainer_parks_does_not_kill_it(start: Callable[..., Run]) -> None:
    """The operator asks for the next generation the moment the final save is done, so the supervisor's
    stop (SIGTERM) can reach a trainer whose entry already returned but which has not parked yet
    (CI, 2026-12-07: exit 143 in test_op_e2e_rollback). The stand-in parks only after that SIGTERM came."""
    run = start("park-late")
    first = run.child(1)
    run.restart(4)
    parked_record = tc.read_incarnation(str(run.control))
    assert parked_record is not None and (parked_record["exit_code"], parked_record["parked"]) == (75, True), \
        run.log()
    assert run.child(2)["pid"] == first["pid"], run.log()
    run.wait_for("incarnation 2 kept", lambda: (r := tc.read_incarnation(str(run.control))) and r["incarnation"] == 2
                 and r["restarts"] == {"kept": 1, "fresh": {}})


@pytest.mark.parametrize(("mode", "env", "restart_env", "stacks", "key"), [
    ("cooperate", {}, {"TPU_WORKER_ID": "1"}, False, kept.WORLD_CHANGED),
    ("cooperate", {}, {}, True, kept.HANG),
    ("cooperate", {"RESILAX_KEEP_TRAINER": "0"}, {}, False, kept.KEEP_OFF),
    ("raise", {}, {}, False, kept.RAISED),
], ids=["world-changed", "hang", "keep-off", "entry-raised"])
def test_an_ineligible_restart_is_a_fresh_process_with_the_reason_logged_and_counted(
        start: Callable[..., Run], mode: str, env: dict[str, str], restart_env: dict[str, str], stacks: bool,
        key: str) -> None:
    run = start(mode, env)
    first = run.child(1)
    run.restart(4, restart_env, stacks=stacks)
    second = run.child(2)
    assert second["pid"] != first["pid"], "a fresh process"
    assert not pid_exists(first["pid"]), "the old process is gone before the new one runs"
    record = run.wait_state(2, "running")
    assert record["kept"] is False and record["restarts"] == {"kept": 0, "fresh": {key: 1}}
    assert f"gets a fresh trainer process ({key})" in run.log()


def test_a_kept_restart_that_fails_before_the_devices_reopen_is_replaced_by_a_fresh_process_of_the_same_incarnation(
        start: Callable[..., Run]) -> None:
    """RESILAX_RESTORE_STEP is a generation variable (eligible), but a malformed one makes the kept
    process's restore prefetch refuse it while it resumes (the stand-in itself never parses it)."""
    run = start("cooperate")
    first = run.child(1)
    run.restart(4, {"RESILAX_RESTORE_STEP": "not-a-step"})
    second = run.child(2)
    assert second["pid"] != first["pid"]
    record = run.wait_for("the fallback counted", lambda: (r := tc.read_incarnation(str(run.control)))
                          and r["restarts"]["fresh"].get(kept.KEPT_FAILED) == 1 and r)
    assert (record["incarnation"], record["generation"], record["kept"], record["pid"]) == (2, 4, False, second["pid"])
    assert "RESILAX_RESTORE_STEP" in run.log() and "the kept restart of incarnation 2 failed" in run.log()


def test_a_parked_process_that_dies_is_reaped_and_the_next_incarnation_is_a_fresh_process(
        start: Callable[..., Run]) -> None:
    run = start("cooperate")
    first = run.child(1)
    tc.write_json(str(run.control), tc.STOP_FILE, {"generation": 4, "reason": "test"})
    assert run.wait_state(1, "exited")["parked"] is True
    os.kill(first["pid"], signal.SIGKILL)
    run.wait_for("the parked process reaped", lambda: "the parked trainer process" in run.log() and
                 not pid_exists(first["pid"]))
    tc.write_json(str(run.control), tc.ASSIGNMENT_FILE, {"generation": 4, "env": {}})
    assert run.child(2)["pid"] != first["pid"]
    record = run.wait_state(2, "running")
    assert record["kept"] is False and record["restarts"] == {"kept": 0, "fresh": {kept.PARKED_DIED: 1}}


def test_a_trainer_that_finishes_exits_and_the_supervisor_with_it(start: Callable[..., Run]) -> None:
    run = start("exit0")
    assert run.proc.wait(timeout=DEADLINE) == 0, run.log()
    record = tc.read_incarnation(str(run.control))
    assert record is not None and (record["state"], record["exit_code"], record["parked"]) == ("exited", 0, False)


def test_sigterm_to_the_supervisor_ends_a_parked_process(start: Callable[..., Run]) -> None:
    run = start("cooperate")
    first = run.child(1)
    tc.write_json(str(run.control), tc.STOP_FILE, {"generation": 4, "reason": "test"})
    run.wait_state(1, "exited")
    assert pid_exists(first["pid"])
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=DEADLINE) == 75, run.log()
    assert not pid_exists(first["pid"])


CACHES_PROBE = """
import json
import jax
import numpy as np
from jax.extend.backend import clear_backends
from jax.sharding import NamedSharding, PartitionSpec as P
from resilax_ckpt import items
from resilax_ckpt.saving import copy_choice, device_snapshot

sharding = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("a",)), P("a"))
device_snapshot._sharding_key(sharding, 1)
copy_choice._shard_bytes(sharding, (4,), 4)
items._chunk_shape(sharding, (4,))
device_snapshot._COMPILED[("a signature",)] = None

def sizes():
    return [device_snapshot._sharding_key.cache_info().currsize, copy_choice._shard_bytes.cache_info().currsize,
            items._chunk_shape.cache_info().currsize, len(device_snapshot._COMPILED)]

before = sizes()
clear_backends()
print(json.dumps({"before": before, "after": sizes()}))
"""


def test_dropping_the_backends_empties_the_librarys_caches_of_devices_and_executables() -> None:
    """What a kept process must not carry into the next incarnation: executables compiled ahead for the
    old backend (they would be called with the new one's arrays) and shardings (their devices keep the
    old client alive). `jax.extend.backend.clear_backends` empties them (registered backend caches)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", CACHES_PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(n >= 1 for n in result["before"]) and result["after"] == [0, 0, 0, 0], result
