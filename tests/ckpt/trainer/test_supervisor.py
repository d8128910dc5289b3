"""`resilax run -- CMD`: the in-place restart supervisor (resilax_ckpt/trainer/supervisor.py), with real processes.

Each test starts the real console script (`resilax run -- python supervisor_child.py ...`) and drives it
only through its files (`trainer-stop.json`, `assignment.json`) and signals, as the sidecar and the
kubelet do. Waits are on conditions (files, log lines), never on time.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from ckpt_procs import pid_exists, read_json
from resilax_ckpt.control import trainer_control as tc
from resilax_ckpt.trainer import supervisor as sv

CHILD = Path(__file__).with_name("supervisor_child.py")
RESILAX = Path(sys.executable).with_name("resilax")
PTRACE_SEIZE = 0x4206
DEADLINE = 60.0  # a bound on hangs under load, not a timing claim


class Run:
    """A running `resilax run` with its control folder and the children's reports."""

    def __init__(self, tmp: Path, mode: str, arg: str = "", env: dict[str, str] | None = None) -> None:
        self.control = tmp / "control"
        self.reports = tmp / "reports"
        self.reports.mkdir(parents=True)
        self.log_path = tmp / "supervisor.log"
        full_env = dict(os.environ, RESILAX_CONTROL_DIR=str(self.control), RESILAX_GENERATION="3",
                        RESILAX_RESTART_GRACE_SECONDS="1", PATH="/usr/bin:/bin")
        full_env.update(env or {})
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        command = [str(RESILAX), "run", "--", sys.executable, str(CHILD), str(self.reports), mode]
        self.proc = subprocess.Popen(command + ([arg] if arg else []), env=full_env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for(self, what: str, check: Callable[[], Any]) -> Any:
        end = time.monotonic() + DEADLINE
        while time.monotonic() < end:
            value = check()
            if value:
                return value
            if self.proc.poll() is not None and not check():
                raise AssertionError(f"supervisor exited {self.proc.returncode} before {what}:\n{self.log()}")
            time.sleep(0.02)
        raise AssertionError(f"no {what} within {DEADLINE} s:\n{self.log()}")

    def incarnation(self) -> dict[str, Any] | None:
        return tc.read_incarnation(str(self.control))

    def wait_state(self, number: int, state: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            record = self.incarnation()
            return record if record and record["incarnation"] == number and record["state"] == state else None
        return self.wait_for(f"incarnation {number} {state}", check)  # type: ignore[no-any-return]

    def child(self, number: int) -> dict[str, Any]:
        return self.wait_for(f"child {number}'s report",  # type: ignore[no-any-return]
                             lambda: read_json(self.reports / f"child-{number}.json"))

    def write(self, name: str, body: dict[str, Any]) -> None:
        tc.write_json(str(self.control), name, body)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self) -> int:
        return self.proc.wait(timeout=DEADLINE)

    def stop(self) -> None:
        """Kill the supervisor's whole session (its children have their own process groups in it) and the
        grandchildren the children started in sessions of their own."""
        grandchildren = [r["grandchild"] for path in self.reports.glob("child-*.json")
                         if (r := read_json(path)) and "grandchild" in r and _is_grandchild(r["grandchild"])]
        for pid in _session(self.proc.pid) + grandchildren:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()


def _is_grandchild(pid: int) -> bool:
    """Whether the pid is still a grandchild of supervisor_child.py (not a reused pid)."""
    try:
        return b"SIG_IGN" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _session(sid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if os.getsid(int(name)) == sid:
                    found.append(int(name))
    return found


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    runs: list[Run] = []

    def make(mode: str, arg: str = "", env: dict[str, str] | None = None) -> Run:
        run = Run(tmp_path / f"run{len(runs)}", mode, arg, env)
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.stop()


def test_the_first_incarnation_gets_the_pods_environment_and_exit_0_ends_the_supervisor(
        start: Callable[..., Run]) -> None:
    run = start("exit", "0")
    assert run.wait_exit() == 0, run.log()
    child = run.child(1)
    assert child["env"]["RESILAX_INCARNATION"] == "1" and child["env"]["RESILAX_GENERATION"] == "3"
    assert child["pgid"] == child["pid"], "the child leads its own process group"
    assert child["sid"] == run.proc.pid, "... in the supervisor's session (it leads one here)"
    record = run.incarnation()
    assert record is not None
    assert (record["incarnation"], record["generation"], record["state"], record["exit_code"], record["signal"],
            record["reason"]) == (1, 3, "exited", 0, None, None)
    assert record["pid"] == child["pid"] and record["finished_at"] >= record["started_at"]


def test_a_failed_child_waits_for_a_newer_assignment_which_starts_with_its_env(start: Callable[..., Run]) -> None:
    run = start("exit", "76")
    record = run.wait_state(1, "exited")
    assert (record["exit_code"], record["signal"]) == (76, None)
    assert run.proc.poll() is None, "a failed child does not end the supervisor"
    # an assignment of a generation already run starts nothing; the newer one does
    run.write(tc.ASSIGNMENT_FILE, {"generation": 3, "env": {"X_SHOULD_NOT": "appear"}})
    run.wait_for("the stale assignment ignored", lambda: "assignment for generation 3 is not newer" in run.log())
    run.write(tc.ASSIGNMENT_FILE, {"generation": 4, "env": {"X_NEW": "yes", "JAX_PROCESS_ID": "2"}})
    second = run.child(2)
    assert second["env"]["RESILAX_INCARNATION"] == "2" and second["env"]["RESILAX_GENERATION"] == "4"
    assert second["env"]["X_NEW"] == "yes" and second["env"]["JAX_PROCESS_ID"] == "2"
    assert "X_SHOULD_NOT" not in second["env"]
    assert second["previous_alive"] is False
    assert run.wait_state(2, "exited")["exit_code"] == 76  # same mode; the supervisor waits again
    assert run.proc.poll() is None


def test_a_command_that_cannot_start_is_recorded_127_and_the_supervisor_waits(tmp_path: Path) -> None:
    control = tmp_path / "control"
    env = dict(os.environ, RESILAX_CONTROL_DIR=str(control), RESILAX_GENERATION="1")
    proc = subprocess.Popen([str(RESILAX), "run", "--", "/nonexistent/trainer"], env=env,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        end = time.monotonic() + DEADLINE
        while (record := tc.read_incarnation(str(control))) is None and time.monotonic() < end:
            time.sleep(0.02)
        assert record is not None
        assert (record["state"], record["exit_code"], record["pid"]) == ("exited", 127, None)
        assert record["reason"].startswith("spawn_failed")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=DEADLINE)
        assert proc.returncode == 127, "with no child alive SIGTERM ends it with the last child's code"
        assert b"could not start '/nonexistent/trainer'" in err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_a_stop_sends_sigterm_then_sigkill_after_the_grace_and_reaps_grandchildren_before_exited(
        start: Callable[..., Run]) -> None:
    run = start("stubborn")
    child = run.child(1)
    grandchild = child["grandchild"]
    # The test traces the grandchild (in its own session) so that, once killed, it stays a zombie only
    # the tracer can release: the supervisor then holds `exited` back until it has reaped it too.
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.ptrace(PTRACE_SEIZE, grandchild, None, None) == 0, f"ptrace: errno {ctypes.get_errno()}"
    # a stop for the child's own generation (or older) is stale: nothing happens
    run.write(tc.STOP_FILE, {"generation": 3, "reason": "stale"})
    run.write(tc.STOP_FILE, {"generation": 4, "reason": "NodeLoss", "stacks": False})
    run.wait_for("the child reaped", lambda: "1's pid" in run.log() and "waiting for its leftover" in run.log())
    # `stopping`, not `exited`, while the killed grandchild is unreaped (checked before the test reaps it:
    # read after, the supervisor may already have seen it go and written `exited`)
    record = run.wait_state(1, "stopping")
    assert run.incarnation()["state"] == "stopping", "not `exited` while a descendant was unreaped"
    assert os.waitpid(grandchild, 0) == (grandchild, signal.SIGKILL), "the supervisor SIGKILLed the grandchild"
    record = run.wait_state(1, "exited")
    assert not pid_exists(child["pid"]) and not pid_exists(grandchild)
    assert (record["exit_code"], record["signal"], record["reason"]) == (128 + 9, 9, "NodeLoss")
    assert read_json(run.reports / "sigterm-1.json") == {"signal": signal.SIGTERM}, "SIGTERM came before the SIGKILL"
    assert run.proc.poll() is None
    run.write(tc.ASSIGNMENT_FILE, {"generation": 4, "env": {}})
    second = run.child(2)
    assert second["previous_alive"] is False and second["env"]["RESILAX_GENERATION"] == "4"


def test_a_stop_of_a_cooperative_child_keeps_its_exit_code_and_does_not_end_the_supervisor(
        start: Callable[..., Run]) -> None:
    run = start("cooperate", "0")
    run.child(1)
    run.write(tc.STOP_FILE, {"generation": 5, "reason": "WorkerFailure"})
    record = run.wait_state(1, "exited")
    assert (record["exit_code"], record["signal"], record["reason"]) == (0, None, "WorkerFailure")
    assert run.proc.poll() is None, "a child stopped for a restart that exits 0 is no success of the job"
    # the assignment of generation 4 is older than the stop's 5: it is not started; 5 is
    run.write(tc.ASSIGNMENT_FILE, {"generation": 4, "env": {}})
    run.wait_for("the assignment held back", lambda: "assignment for generation 4 waits" in run.log())
    run.write(tc.ASSIGNMENT_FILE, {"generation": 5, "env": {}})
    assert run.child(2)["env"]["RESILAX_GENERATION"] == "5"


def test_no_start_while_a_child_lives(start: Callable[..., Run]) -> None:
    run = start("cooperate", "75")
    first = run.child(1)
    run.write(tc.ASSIGNMENT_FILE, {"generation": 4, "env": {}})
    run.wait_for("the start held back", lambda: "assignment for generation 4 waits" in run.log())
    assert not (run.reports / "child-2.json").exists() and pid_exists(first["pid"])
    run.write(tc.STOP_FILE, {"generation": 4, "reason": "PeerLost"})
    second = run.child(2)
    assert second["previous_alive"] is False
    assert read_json(run.reports / "sigterm-1.json") == {"signal": signal.SIGTERM}


def test_sigterm_is_forwarded_to_the_child_and_its_exit_code_kept(start: Callable[..., Run]) -> None:
    run = start("cooperate", "75")
    child = run.child(1)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait_exit() == 75, run.log()
    assert read_json(run.reports / "sigterm-1.json") == {"signal": signal.SIGTERM}
    assert not pid_exists(child["pid"])
    record = run.incarnation()
    assert record is not None and (record["state"], record["exit_code"]) == ("exited", 75)


def test_a_stop_with_stacks_has_faulthandler_write_them_to_the_pod_log(start: Callable[..., Run]) -> None:
    run = start("stacks")
    run.child(1)
    run.write(tc.STOP_FILE, {"generation": 4, "reason": "TrainerHung", "stacks": True})
    run.wait_state(1, "exited")
    assert "a_distinctively_named_training_step" in run.log()


@pytest.mark.parametrize("py_spy", ["absent", "real", "failing"])
def test_the_stacks_of_a_stopped_child_reach_the_pod_log(start: Callable[..., Run], tmp_path: Path,
                                                           py_spy: str) -> None:
    """A hang as SIGSTOP makes it: py-spy's own suspension fails on a stopped process, so the supervisor
    reads it with --nonblocking; a py-spy that fails anyway (no ptrace here) falls back to faulthandler."""
    tools = tmp_path / "tools"
    tools.mkdir()
    if py_spy == "real":
        (tools / "py-spy").symlink_to(Path(sys.executable).with_name("py-spy"))
    elif py_spy == "failing":
        (tools / "py-spy").write_text("#!/bin/sh\necho 'Error: Failed to suspend process' >&2\nexit 1\n")
        (tools / "py-spy").chmod(0o755)
    run = start("stacks", env={"PATH": f"{tools}:/usr/bin:/bin"})
    pid = run.child(1)["pid"]
    os.kill(pid, signal.SIGSTOP)
    run.write(tc.STOP_FILE, {"generation": 4, "reason": "TrainerHung", "stacks": True})
    run.wait_state(1, "exited")
    log = run.log()
    assert "a_distinctively_named_training_step" in log, log
    assert ("most recent call first" in log) == (py_spy != "real"), log  # faulthandler's, not py-spy's
    assert ("asking faulthandler" in log) == (py_spy == "failing"), log


def test_no_command_is_a_usage_error() -> None:
    done = subprocess.run([str(RESILAX), "run", "--"], capture_output=True, text=True, timeout=DEADLINE)
    assert done.returncode == 2 and "usage: resilax run" in done.stderr


def test_resilax_run_imports_no_jax_and_no_operator_or_sidecar_dependency() -> None:
    """So an image with `resilax[train]` alone (or none of its extras) can run it."""
    code = ("import sys\nfrom resilax_operator.cli import main\nrc = main(['run', '--', 'true'])\n"
            "heavy = [m for m in ('jax', 'numpy', 'tensorstore', 'kopf', 'kubernetes', 'aiohttp', 'prometheus_client',"
            " 'resilax_sidecar', 'resilax_local') if m in sys.modules]\nprint(heavy)\nsys.exit(rc or (3 if heavy else 0))")
    with tempfile.TemporaryDirectory() as control:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE,
                              env=dict(os.environ, RESILAX_CONTROL_DIR=control))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "[]"


# --- the pure decisions ---

def _rec(state: str, generation: int = 3, exit_code: int | None = None, reason: str | None = None) -> sv.Record:
    return sv.Record(1, generation, 100 if state != "exited" else None, state, 1.0, None, exit_code, None, reason)


STOP4 = tc.StopRequest(4, "NodeLoss")
ASSIGN4 = tc.Assignment(4, {"A": "b"})


@pytest.mark.parametrize(("record", "newest", "terminating", "stop", "assignment", "expected"), [
    pytest.param(None, -1, False, None, tc.Assignment(3), sv.Start(tc.Assignment(3), False), id="first-start"),
    pytest.param(None, -1, False, STOP4, tc.Assignment(3), None, id="first-start-held-by-a-newer-stop"),
    pytest.param(None, -1, True, None, tc.Assignment(3), sv.Exit(143), id="terminated-before-any-child"),
    pytest.param(_rec("running"), 3, False, None, ASSIGN4, None, id="no-start-while-running"),
    pytest.param(_rec("stopping"), 3, False, STOP4, ASSIGN4, None, id="no-start-while-stopping"),
    pytest.param(_rec("running"), 3, False, STOP4, None, sv.Stop(STOP4), id="stop-newer"),
    pytest.param(_rec("running"), 3, False, tc.StopRequest(3), None, None, id="stop-same-generation-stale"),
    pytest.param(_rec("running", 5), 5, False, STOP4, None, None, id="stop-older-stale"),
    pytest.param(_rec("stopping"), 3, False, STOP4, None, None, id="stop-already-stopping"),
    pytest.param(_rec("running"), 3, True, STOP4, ASSIGN4, None, id="terminating-waits-for-child"),
    pytest.param(_rec("exited", exit_code=75), 3, True, None, ASSIGN4, sv.Exit(75), id="terminating-last-code"),
    pytest.param(_rec("exited", exit_code=0), 3, False, None, ASSIGN4, sv.Exit(0), id="success-ends"),
    pytest.param(_rec("exited", exit_code=0, reason="NodeLoss"), 3, False, STOP4, ASSIGN4,
                 sv.Start(ASSIGN4, True), id="stopped-exit-0-is-no-success"),
    pytest.param(_rec("exited", exit_code=1), 3, False, None, tc.Assignment(3), None, id="failed-waits"),
    pytest.param(_rec("exited", exit_code=1), 3, False, None, ASSIGN4, sv.Start(ASSIGN4, True), id="failed-restart"),
    pytest.param(_rec("exited", exit_code=1), 3, False, tc.StopRequest(5), ASSIGN4, None,
                 id="assignment-older-than-stop"),
])
def test_decide(record: sv.Record | None, newest: int, terminating: bool, stop: tc.StopRequest | None,
                assignment: tc.Assignment | None, expected: sv.Action) -> None:
    from_file = assignment is not None and assignment.generation > 3
    assert sv.decide(record, newest, terminating, stop, assignment, from_file) == expected
    assert sv.decide(record, newest, terminating, stop, assignment, from_file) == expected, "decides twice alike"


@pytest.mark.parametrize(("elapsed", "stacks", "expected"), [
    (0.0, False, ["term"]), (4.9, False, ["term"]), (5.0, False, ["term", "kill"]),
    (0.0, True, ["stacks"]), (2.0, True, ["stacks", "term"]), (7.0, True, ["stacks", "term", "kill"]),
])
def test_due_stop_steps(elapsed: float, stacks: bool, expected: list[str]) -> None:
    assert sv.due_stop_steps(elapsed, stacks, stacks_seconds=2.0, grace_seconds=5.0) == expected


def test_exit_codes_of_signals_are_128_plus_n() -> None:
    assert sv.exit_code_of(9) == (137, 9) and sv.exit_code_of(75 << 8) == (75, None)


@pytest.mark.parametrize(("env", "error"), [
    ({"RESILAX_GENERATION": "x"}, "RESILAX_GENERATION: 'x' is not allowed"),
    ({"RESILAX_RESTART_GRACE_SECONDS": "-1"}, "RESILAX_RESTART_GRACE_SECONDS: '-1' is not allowed"),
])
def test_settings_errors_name_the_variable(env: dict[str, str], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        sv.SupervisorSettings.from_env(env)
