"""The sidecar's `/v1/trainer/*` calls with a real `resilax sidecar` and a real supervisor (`resilax run`)
sharing one control folder, as in a supervised pod (docs/architecture.md, "Sidecar API").

The trainer is tests/ckpt/trainer/supervisor_child.py (it reports the environment it was given and exits 75 on
SIGTERM, as a trainer after its final save). Waits are on conditions, never on time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from resilax_ckpt.control import trainer_control as tc
from resilax_ckpt.control.health_verdict import HealthVerdict
from resilax_sidecar import trainer_control as trainer
from resilax_sidecar.control import plan_nothing_to_save
from sidecar_harness import REPO, TOKEN, wait_until, write_local_step

CHILD = REPO / "tests" / "ckpt" / "trainer" / "supervisor_child.py"
KEPT_CHILD = REPO / "tests" / "ckpt" / "trainer" / "kept_child.py"
RESILAX = Path(sys.executable).with_name("resilax")


class Supervised:
    """`resilax run -- python supervisor_child.py <reports> cooperate 75` in the sidecar's control folder."""

    def __init__(self, env: dict[str, str], tmp_path: Path, child: Path = CHILD,
                 args: tuple[str, ...] = ("cooperate", "75")) -> None:
        self.reports = tmp_path / "reports"
        self.reports.mkdir()
        self._log = open(tmp_path / "supervisor.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(RESILAX), "run", "--", sys.executable, str(child), str(self.reports), *args],
            env={**os.environ, **env}, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def child(self, number: int) -> dict[str, Any]:
        path = self.reports / f"child-{number}.json"
        return wait_until(lambda: path.is_file() and json.loads(path.read_text()), 60,  # type: ignore[no-any-return]
                          f"child {number}'s report")

    def close(self) -> None:
        """Kill the supervisor's session (its children lead process groups of their own in it)."""
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError):
                    if os.getsid(int(name)) == self.proc.pid:
                        os.kill(int(name), signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()


@pytest.fixture
def supervise(tmp_path: Path) -> Iterator[Callable[..., Supervised]]:
    started: list[Supervised] = []

    def start(env: dict[str, str], **kw: Any) -> Supervised:
        started.append(Supervised(env, tmp_path, **kw))
        return started[-1]

    yield start
    for s in started:
        s.close()


def _state_where(sidecar: Any, what: str, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        state: dict[str, Any] = sidecar.get("/v1/state").body
        return state if check(state) else None
    return wait_until(probe, 60, what)  # type: ignore[no-any-return]


def _process(state: dict[str, Any]) -> dict[str, Any]:
    return state.get("trainer_process") or {}


def test_stop_and_start_restart_the_trainer_in_place_with_the_new_generation(
        sidecar_env: dict[str, str], start_sidecar: Any, supervise: Any) -> None:
    env = {**sidecar_env, "RESILAX_GENERATION": "3"}
    sidecar = start_sidecar(env)
    stop4 = {"generation": 4, "reason": "NodeLoss", "stacks": False}
    # no supervisor yet: nothing to stop; the token is checked first
    assert sidecar.post("/v1/trainer/stop", stop4).status == 401
    assert sidecar.post("/v1/trainer/stop", stop4, token="wrong").status == 403
    refused = sidecar.post("/v1/trainer/stop", stop4, token=TOKEN)
    assert (refused.status, refused.body["error"]["code"]) == (409, "not_supervised")
    assert sidecar.get("/v1/trainer/ready").status == 503

    supervised = supervise(env)
    _state_where(sidecar, "incarnation 1 running",
                 lambda s: _process(s).get("state") == "running" and _process(s).get("generation") == 3)
    assert sidecar.get("/v1/trainer/ready").status == 200
    state = sidecar.get("/v1/state").body
    assert state["assignment"] is None and state["trainer_process"]["incarnation"] == 1
    supervised.child(1)  # its SIGTERM handler is in place (before it, a stop ends it with 143)

    # stop: 202, the same again 200, an older one 409, a malformed one 400
    assert sidecar.post("/v1/trainer/stop", stop4, token=TOKEN).status == 202
    assert sidecar.get("/v1/trainer/ready").status == 503, "asked to stop: no longer ready, whatever the process"
    assert sidecar.post("/v1/trainer/stop", stop4, token=TOKEN).status == 200
    stale = sidecar.post("/v1/trainer/stop", {"generation": 3}, token=TOKEN)
    assert (stale.status, stale.body["error"]["code"]) == (409, "stale_generation")
    bad = sidecar.post("/v1/trainer/stop", {"generation": "x", "colour": 1}, token=TOKEN)
    assert bad.status == 400 and "colour" in bad.body["error"]["message"]
    stopped = _state_where(sidecar, "incarnation 1 exited", lambda s: _process(s).get("state") == "exited")
    assert (stopped["trainer_process"]["exit_code"], stopped["trainer_process"]["reason"]) == (75, "NodeLoss")
    # a final save request that came after the trainer's own final save (the operator asks every worker;
    # the first one seen stops them all) and one plain save: neither is answered by generation 3
    late = sidecar.post("/v1/save", {"reason": "preemption", "stop": True}, token=TOKEN)
    plain = sidecar.post("/v1/save", {"reason": "manual"}, token=TOKEN)
    requests = Path(env["RESILAX_CONTROL_DIR"]) / "requests"
    assert late.status == plain.status == 202 and (requests / f"{late.body['id']}.json").is_file()

    # start: a bad value is refused before the trainer sees it; then 202, the same 200, others 409
    start4 = {"generation": 4, "env": {"JAX_PROCESS_ID": "1", "JAX_NUM_PROCESSES": "2", "RESILAX_LIVE_JOB_UIDS": "uid-x"}}
    # a variable outside the allowlist (one that runs code in the trainer) is refused, naming it
    crafted = sidecar.post("/v1/trainer/start", {"generation": 4, "env": {
        "JAX_PROCESS_ID": "1", "PYTHONWARNINGS": "ignore::x.y", "BROWSER": "sh -c id"}}, token=TOKEN)
    assert (crafted.status, crafted.body["error"]["code"]) == (400, "bad_request")
    assert crafted.body["error"]["message"].startswith("env: BROWSER, PYTHONWARNINGS may not be set by a start call; "
                                                       "allowed: JAX_COORDINATOR_ADDRESS, ")
    assert tc.read_assignment(env["RESILAX_CONTROL_DIR"]) is None
    bad = sidecar.post("/v1/trainer/start", {"generation": 4, "env": {"JAX_PROCESS_ID": "2", "JAX_NUM_PROCESSES": "2"}},
                       token=TOKEN)
    assert bad.status == 400 and "env.JAX_PROCESS_ID=2" in bad.body["error"]["message"]
    assert tc.read_assignment(env["RESILAX_CONTROL_DIR"]) is None
    assert sidecar.post("/v1/trainer/start", start4, token=TOKEN).status == 202
    # the stale stop is withdrawn before generation 4's trainer could take it for its own; the plain one stays
    assert not (requests / f"{late.body['id']}.json").exists() and (requests / f"{plain.body['id']}.json").is_file()
    assert sidecar.get(f"/v1/save/{late.body['id']}").status == 404
    assert sidecar.post("/v1/trainer/start", start4, token=TOKEN).status == 200
    other = sidecar.post("/v1/trainer/start", {"generation": 4, "env": {"JAX_PROCESS_ID": "0"}}, token=TOKEN)
    assert (other.status, other.body["error"]["code"]) == (409, "conflict")
    older = sidecar.post("/v1/trainer/start", {"generation": 3, "env": {}}, token=TOKEN)
    assert (older.status, older.body["error"]["code"]) == (409, "stale_generation")

    state = _state_where(sidecar, "incarnation 2 running", lambda s: _process(s).get("incarnation") == 2
                         and _process(s).get("state") == "running")
    assert (state["generation"], state["process_id"], state["num_processes"]) == (4, 1, 2), "settings re-read"
    assert state["assignment"] == {"generation": 4} and state["trainer_process"]["generation"] == 4
    wait_until(lambda: sidecar.get("/v1/trainer/ready").status == 200, 60, "the new incarnation ready")
    second = supervised.child(2)
    assert {k: second["env"].get(k) for k in ("JAX_PROCESS_ID", "JAX_NUM_PROCESSES", "RESILAX_GENERATION",
                                              "RESILAX_LIVE_JOB_UIDS", "RESILAX_INCARNATION")} == {
        "JAX_PROCESS_ID": "1", "JAX_NUM_PROCESSES": "2", "RESILAX_GENERATION": "4", "RESILAX_LIVE_JOB_UIDS": "uid-x",
        "RESILAX_INCARNATION": "2"}
    assert second["previous_alive"] is False

    # a sidecar started again in the kept pod (its env still says generation 3) reads the assignment
    sidecar.close()
    again = start_sidecar(env)
    state = again.get("/v1/state").body
    assert (state["generation"], state["process_id"], state["num_processes"]) == (4, 1, 2)


def test_a_kept_trainer_parks_on_a_stop_and_the_start_runs_it_again_in_the_same_process_counted_in_metrics(
        sidecar_env: dict[str, str], start_sidecar: Any, supervise: Any) -> None:
    """tests/ckpt/trainer/kept_child.py runs its entry point under rc.run_kept: a stop parks it (exited, parked,
    not ready), a start of the next generation with only generation variables runs it in the same process;
    one with another world is a fresh process. `resilax_trainer_restarts_total` counts both kinds."""
    env = {**sidecar_env, "RESILAX_GENERATION": "3"}
    sidecar = start_sidecar(env)
    supervised = supervise(env, child=KEPT_CHILD, args=("cooperate",))
    first = supervised.child(1)
    assert sidecar.post("/v1/trainer/stop", {"generation": 4, "reason": "Rollback"}, token=TOKEN).status == 202
    parked = _state_where(sidecar, "incarnation 1 parked", lambda s: _process(s).get("state") == "exited")
    assert (parked["trainer_process"]["exit_code"], parked["trainer_process"]["parked"]) == (75, True)
    assert sidecar.get("/v1/trainer/ready").status == 503
    start4 = {"generation": 4, "env": {"RESILAX_RESTORE_STEP": "7"}}
    assert sidecar.post("/v1/trainer/start", start4, token=TOKEN).status == 202
    state = _state_where(sidecar, "incarnation 2 running", lambda s: _process(s).get("incarnation") == 2
                         and _process(s).get("state") == "running")
    assert state["trainer_process"]["kept"] is True and state["trainer_process"]["pid"] == first["pid"]
    second = supervised.child(2)
    assert second["pid"] == first["pid"]
    assert (second["env"]["RESILAX_GENERATION"], second["env"]["RESILAX_RESTORE_STEP"]) == ("4", "7")
    wait_until(lambda: sidecar.get("/v1/trainer/ready").status == 200, 60, "the kept incarnation ready")
    wait_until(lambda: sidecar.metric("resilax_trainer_restarts_total", 'kind="kept",reason=""') == 1, 60,
               "the kept restart counted")
    # another world (a process id and count): a fresh process, counted with its reason
    assert sidecar.post("/v1/trainer/stop", {"generation": 5}, token=TOKEN).status == 202
    _state_where(sidecar, "incarnation 2 parked", lambda s: _process(s).get("state") == "exited")
    start5 = {"generation": 5, "env": {"JAX_PROCESS_ID": "1", "JAX_NUM_PROCESSES": "2"}}
    assert sidecar.post("/v1/trainer/start", start5, token=TOKEN).status == 202
    assert supervised.child(3)["pid"] != first["pid"]
    wait_until(lambda: sidecar.metric("resilax_trainer_restarts_total", 'kind="fresh",reason="world_changed"') == 1,
               60, "the fresh restart counted")
    assert sidecar.metric("resilax_trainer_restarts_total", 'kind="kept",reason=""') == 1


def test_an_old_generations_local_step_uploads_as_the_process_that_saved_it(
        tmp_path: Path, sidecar_env: dict[str, str], start_sidecar: Any, supervise: Any) -> None:
    """After a restart this sidecar speaks for process 1 of 2 (generation 4); a step the old trainer
    (process 0 of 1, generation 3) committed locally still uploads as process 0 of 1 and commits."""
    local, persistent = tmp_path / "local", tmp_path / "persistent"
    local.mkdir()
    env = {**sidecar_env, "RESILAX_GENERATION": "3", "RESILAX_LOCAL_DIR": str(local),
           "RESILAX_CHECKPOINT_DIR": str(persistent)}
    sidecar = start_sidecar(env)
    supervise(env)
    _state_where(sidecar, "incarnation 1 running", lambda s: _process(s).get("state") == "running")
    assert sidecar.post("/v1/trainer/stop", {"generation": 4, "reason": "NodeLoss"}, token=TOKEN).status == 202
    _state_where(sidecar, "incarnation 1 exited", lambda s: _process(s).get("state") == "exited")
    start = {"generation": 4, "env": {"JAX_PROCESS_ID": "1", "JAX_NUM_PROCESSES": "2"}}
    assert sidecar.post("/v1/trainer/start", start, token=TOKEN).status == 202
    _state_where(sidecar, "process 1 of 2", lambda s: (s["process_id"], s["num_processes"]) == (1, 2))

    folder = write_local_step(local, 10, {"state/leaf/c/0": b"x" * 100}, generation=3)
    body = json.loads((folder / "_COMMIT").read_text())
    (folder / "_COMMIT").write_text(json.dumps({**body, "process": 0, "process_count": 1, "save": "s10"}))
    _state_where(sidecar, "step 10 persisted", lambda s: s["newest_persisted_step"] == 10)
    marker = json.loads((persistent / "10" / "_COMMIT").read_text())
    attempt = persistent / "10" / marker["attempt"]
    assert sorted(p.name for p in attempt.iterdir() if p.name.startswith("_UPLOADED")) == ["_UPLOADED.0"]
    assert marker["generation"] == 3 and "process" not in marker and "process_count" not in marker


@pytest.mark.parametrize(("existing", "request_", "expected"), [
    pytest.param(None, tc.StopRequest(4), trainer.Verdict(202, True), id="first"),
    pytest.param(tc.StopRequest(4), tc.StopRequest(5), trainer.Verdict(202, True), id="newer"),
    pytest.param(tc.StopRequest(4), tc.StopRequest(4, "other", True), trainer.Verdict(200, False), id="same"),
    pytest.param(tc.StopRequest(5), tc.StopRequest(4), trainer.Verdict(409, False, "stale_generation"), id="older"),
])
def test_decide_stop(existing: tc.StopRequest | None, request_: tc.StopRequest, expected: trainer.Verdict) -> None:
    verdict = trainer.decide_stop(existing, request_)
    assert (verdict.status, verdict.write, verdict.code) == (expected.status, expected.write, expected.code)


@pytest.mark.parametrize(("existing", "request_", "expected"), [
    pytest.param(None, tc.Assignment(4, {"A": "1"}), (202, True, None), id="first"),
    pytest.param(tc.Assignment(4, {"A": "1"}), tc.Assignment(5), (202, True, None), id="newer"),
    pytest.param(tc.Assignment(4, {"A": "1"}), tc.Assignment(4, {"A": "1"}), (200, False, None), id="same"),
    pytest.param(tc.Assignment(4, {"A": "1"}), tc.Assignment(4, {"A": "2"}), (409, False, "conflict"), id="conflict"),
    pytest.param(tc.Assignment(5), tc.Assignment(4), (409, False, "stale_generation"), id="older"),
])
def test_decide_start(existing: tc.Assignment | None, request_: tc.Assignment,
                      expected: tuple[int, bool, str | None]) -> None:
    verdict = trainer.decide_start(existing, request_)
    assert (verdict.status, verdict.write, verdict.code) == expected


@pytest.mark.parametrize(("incarnation", "stop", "ready"), [
    pytest.param(None, None, False, id="no-supervisor"),
    pytest.param({"incarnation": 1, "generation": 3, "state": "running"}, None, True, id="running"),
    pytest.param({"incarnation": 1, "generation": 3, "state": "running"}, tc.StopRequest(3), True, id="stale-stop"),
    pytest.param({"incarnation": 1, "generation": 3, "state": "running"}, tc.StopRequest(4), False, id="asked-to-stop"),
    pytest.param({"incarnation": 1, "generation": 3, "state": "stopping"}, None, False, id="stopping"),
    pytest.param({"incarnation": 1, "generation": 3, "state": "exited"}, None, False, id="exited"),
])
def test_trainer_ready(incarnation: dict[str, Any] | None, stop: tc.StopRequest | None, ready: bool) -> None:
    assert trainer.trainer_ready(incarnation, stop)[0] is ready


@pytest.mark.parametrize(("env", "refused"), [
    ({"JAX_PROCESS_ID": "1", "RESILAX_GENERATION": "4"}, None),
    ({}, None),
    ({"PYTHONWARNINGS": "x"}, "PYTHONWARNINGS"),
    ({"BROWSER": "x", "LD_PRELOAD": "/tmp/x.so", "JAX_PROCESS_ID": "0"}, "BROWSER, LD_PRELOAD"),
    ({"RESILAX_SIDECAR_TOKEN_FILE": "/tmp/mine"}, "RESILAX_SIDECAR_TOKEN_FILE"),
], ids=["generation-variables", "none", "python-hook", "several", "a-resilax-setting-that-is-not-the-generations"])
def test_the_start_env_allowlist(env: dict[str, str], refused: str | None) -> None:
    message = trainer.refuse_start_env(env)
    if refused is None:
        assert message is None
    else:
        assert message is not None and message.startswith(f"env: {refused} may not be set by a start call; allowed: ")



# ---- no final save where no trainer ran (issue 39) -------------------------------------------------------

_FAILED = HealthVerdict(False, "devices", "3 devices visible, 4 expected")


@pytest.mark.parametrize(("verdict", "alive", "nothing"), [
    (None, None, False),          # no check ran: a silent trainer may run, wait as before
    (HealthVerdict(True), None, False),  # passed: a silent trainer may run
    (_FAILED, None, True),        # failed, no trainer announced itself: the trainer container never started
    (_FAILED, True, False),       # a trainer holds trainer.lock: never skip its save
    (_FAILED, False, False),      # a trainer ran and exited: its steps are persisted as before
], ids=["no-check", "passed", "failed-no-trainer", "failed-live-trainer", "failed-gone-trainer"])
def test_plan_nothing_to_save(verdict: HealthVerdict | None, alive: bool | None, nothing: bool) -> None:
    why = plan_nothing_to_save(verdict, alive)
    assert (why is not None) == nothing
    if nothing:
        assert why == ("the health check failed (devices: 3 devices visible, 4 expected) and no trainer ran in "
                       "this pod: nothing to save")
