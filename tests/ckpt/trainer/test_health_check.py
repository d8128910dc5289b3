"""`resilax health-check` (resilax_ckpt/trainer/health_check.py, issue 39): the pure decision in a table, the
settings' errors, and the real console script on fake CPU devices (one process; two processes on
127.0.0.1 running the psum), healthy and with each test-only fault (RESILAX_HEALTH_FAULT)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import pytest
from resilax_ckpt.control import health_verdict as hv
from resilax_ckpt.trainer import health_check as hc
from resilax_local.processes import free_port

RESILAX = Path(sys.executable).with_name("resilax")
DEADLINE = 240  # a bound on hangs under load, not a timing claim

OK = hc.expected_checksum()
FOUR_CPU = hc.HealthSettings(expected_devices=4, expected_platform="cpu")
TWO_PROCS = hc.HealthSettings(expected_devices=2, num_processes=2, coordinator="127.0.0.1:1")
SEEN_FOUR = dict(platform="cpu", device_kinds=("cpu",) * 4)


def test_the_checksum_is_the_known_exact_value() -> None:
    assert OK == 2051
    a, b, _ = hc.build_matmul_inputs()
    assert a.min() == b.min() == -2 and a.max() == b.max() == 2  # exact in bfloat16; products below 2**24


def test_the_jitted_checksum_is_exact_on_each_fake_cpu_device(devices: list[jax.Device]) -> None:
    progress = hc._Progress()
    hc.measure(hc.HealthSettings(expected_devices=len(jax.local_devices())), progress)
    assert progress.m.matmul_checksums == (OK,) * len(jax.local_devices())


CASES: list[tuple[str, hc.HealthSettings, hc.Measurements, list[tuple[str, bool]], str]] = [
    ("healthy-one-process", FOUR_CPU, hc.Measurements(**SEEN_FOUR, matmul_checksums=(OK,) * 4),
     [("rendezvous", True), ("devices", True), ("matmul", True), ("collective", True)], "one process: no collective"),
    ("a-device-missing", FOUR_CPU, hc.Measurements(platform="cpu", device_kinds=("cpu",) * 3),
     [("rendezvous", True), ("devices", False)], "3 devices visible, 4 expected (RESILAX_DEVICES_PER_HOST)"),
    ("no-device", FOUR_CPU, hc.Measurements(), [("rendezvous", True), ("devices", False)], "no device is visible"),
    ("listing-raised", FOUR_CPU, hc.Measurements(device_error="RuntimeError: no TPU"), [("rendezvous", True), ("devices", False)],
     "listing the devices failed: RuntimeError: no TPU"),
    ("wrong-platform", hc.HealthSettings(expected_devices=4, expected_platform="tpu"),
     hc.Measurements(**SEEN_FOUR), [("rendezvous", True), ("devices", False)], "platform 'cpu', 'tpu' expected"),
    ("any-count-when-unplanned", hc.HealthSettings(), hc.Measurements(**SEEN_FOUR, matmul_checksums=(OK,) * 4),
     [("rendezvous", True), ("devices", True), ("matmul", True), ("collective", True)], "one process"),
    ("wrong-checksum", FOUR_CPU, hc.Measurements(**SEEN_FOUR, matmul_checksums=(OK, OK + 1, OK, OK - 6)),
     [("rendezvous", True), ("devices", True), ("matmul", False)], f"wrong checksum on local device 1 ({OK + 1}, expected {OK}) and 1 more"),
    ("matmul-raised", FOUR_CPU, hc.Measurements(**SEEN_FOUR, matmul_error="XlaRuntimeError: boom"),
     [("rendezvous", True), ("devices", True), ("matmul", False)], "the matmul failed: XlaRuntimeError: boom"),
    ("matmul-timed-out", FOUR_CPU, hc.Measurements(**SEEN_FOUR, timed_out_in="matmul"),
     [("rendezvous", True), ("devices", True), ("matmul", False)], "did not finish within the 120 s bound"),
    ("devices-timed-out", FOUR_CPU, hc.Measurements(timed_out_in="devices"), [("rendezvous", True), ("devices", False)],
     "did not finish within"),
    ("rendezvous-raised", TWO_PROCS, hc.Measurements(rendezvous_error="DEADLINE_EXCEEDED: barrier"),
     [("rendezvous", False)], "jax.distributed.initialize with 2 processes failed: DEADLINE_EXCEEDED: barrier"),
    ("rendezvous-timed-out", TWO_PROCS, hc.Measurements(timed_out_in="rendezvous"), [("rendezvous", False)],
     "did not finish within"),
    ("collective-ok", TWO_PROCS, hc.Measurements(platform="cpu", device_kinds=("cpu",) * 2, matmul_checksums=(OK,) * 2,
                                                 collective_value=10, collective_expected=10),
     [("rendezvous", True), ("devices", True), ("matmul", True), ("collective", True)], "psum over 2 processes gave 10"),
    ("collective-wrong", TWO_PROCS, hc.Measurements(platform="cpu", device_kinds=("cpu",) * 2,
                                                    matmul_checksums=(OK,) * 2, collective_value=12,
                                                    collective_expected=10),
     [("rendezvous", True), ("devices", True), ("matmul", True), ("collective", False)], "psum over the slice gave 12, expected 10"),
    ("collective-raised", TWO_PROCS, hc.Measurements(platform="cpu", device_kinds=("cpu",) * 2,
                                                     matmul_checksums=(OK,) * 2, collective_error="gloo: closed"),
     [("rendezvous", True), ("devices", True), ("matmul", True), ("collective", False)], "the collective failed: gloo: closed"),
    ("collective-timed-out", TWO_PROCS, hc.Measurements(platform="cpu", device_kinds=("cpu",) * 2,
                                                        matmul_checksums=(OK,) * 2, timed_out_in="collective"),
     [("rendezvous", True), ("devices", True), ("matmul", True), ("collective", False)], "did not finish within"),
]


@pytest.mark.parametrize(("settings", "seen", "want", "reason"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide_health(settings: hc.HealthSettings, seen: hc.Measurements, want: list[tuple[str, bool]],
                       reason: str) -> None:
    results = hc.decide_health(settings, seen, OK)
    assert [(r.name, r.ok) for r in results] == want
    deciding = next((r for r in results if not r.ok), results[-1])
    assert reason in deciding.reason
    assert hc.is_healthy(results) == (want == [("rendezvous", True), ("devices", True), ("matmul", True), ("collective", True)])


@pytest.mark.parametrize(("env", "message"), [
    ({"RESILAX_DEVICES_PER_HOST": "four"}, "RESILAX_DEVICES_PER_HOST: 'four' is not allowed; allowed: an integer >= 1"),
    ({"RESILAX_HEALTH_PLATFORM": "fpga"}, "RESILAX_HEALTH_PLATFORM: 'fpga' is not allowed; allowed: tpu, gpu, cpu"),
    ({"RESILAX_HEALTH_FAULT": "disk"}, "RESILAX_HEALTH_FAULT: 'disk' is not allowed"),
    ({"RESILAX_HEALTH_TIMEOUT_SECONDS": "0"}, "RESILAX_HEALTH_TIMEOUT_SECONDS: '0' is not allowed"),
    ({"JAX_NUM_PROCESSES": "2"}, "JAX_COORDINATOR_ADDRESS: empty with JAX_NUM_PROCESSES=2"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2", "JAX_COORDINATOR_ADDRESS": "h:1"},
     "JAX_PROCESS_ID: 2 is not allowed; allowed: 0..1"),
], ids=["devices", "platform", "fault", "timeout", "coordinator", "process-id"])
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        hc.HealthSettings.from_env(env)


def test_settings_from_the_operators_environment() -> None:
    s = hc.HealthSettings.from_env({"RESILAX_DEVICES_PER_HOST": "4", "TPU_WORKER_ID": "0", "JAX_NUM_PROCESSES": "2",
                                    "JAX_PROCESS_ID": "1", "JAX_COORDINATOR_ADDRESS": "10.0.0.1:8482"}, timeout=30)
    assert s == hc.HealthSettings(4, "tpu", 2, 1, "10.0.0.1:8482", 30.0, None)
    with_control = hc.HealthSettings.from_env({"RESILAX_CONTROL_DIR": "/var/run/resilax/control"}, timeout=30)
    assert with_control.control_dir == "/var/run/resilax/control"


@pytest.mark.parametrize(("raw", "want"), [
    ({"passed": False, "failed_part": "matmul", "reason": "wrong checksum"}, hv.HealthVerdict(False, "matmul", "wrong checksum")),
    ({"passed": True, "failed_part": None, "reason": None}, hv.HealthVerdict(True)),
    ({"passed": "no"}, None),
    ({"failed_part": "matmul"}, None),
    ([False], None),
], ids=["failed", "passed", "passed-not-a-bool", "no-passed", "not-an-object"])
def test_read_verdict_takes_only_the_documented_shape(tmp_path: Path, raw: Any, want: hv.HealthVerdict | None) -> None:
    (tmp_path / hv.HEALTH_FILE).write_text(json.dumps(raw))
    assert hv.read_verdict(str(tmp_path)) == want
    assert hv.read_verdict(str(tmp_path / "missing")) is None


# ---------------------------------------------------------------------------------- the real command


def _start(tmp: Path, devices: int, env: dict[str, str], name: str, timeout: float = 120) -> subprocess.Popen[bytes]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "RESILAX_", "TPU_"))}
    full.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
                RESILAX_DEVICES_PER_HOST=str(devices), RESILAX_HEALTH_PLATFORM="cpu",
                JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", **env)
    return subprocess.Popen([str(RESILAX), "health-check", "--timeout", str(timeout), "--result", str(tmp / name)],
                            env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(procs: list[subprocess.Popen[bytes]], tmp: Path, names: list[str]) -> list[tuple[int, dict[str, Any], str]]:
    out = []
    try:
        for p, name in zip(procs, names, strict=True):
            raw, _ = p.communicate(timeout=DEADLINE)
            text = raw.decode(errors="replace")
            lines = [ln for ln in text.splitlines() if ln.startswith(hc.RESULT_PREFIX)]
            assert lines, text
            printed = json.loads(lines[-1][len(hc.RESULT_PREFIX):])
            assert json.loads((tmp / name).read_text()) == printed  # the termination message is the same JSON
            out.append((p.returncode, printed, text))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "code", "part", "reason"), [
    ("", hc.EXIT_HEALTHY, None, None),
    ("devices", hc.EXIT_UNHEALTHY, "devices", "3 devices visible, 4 expected"),
    ("matmul", hc.EXIT_UNHEALTHY, "matmul", f"wrong checksum on local device 0 ({OK - 6}, expected {OK})"),
    ("hang", hc.EXIT_UNHEALTHY, "devices", "did not finish within the 20 s bound"),
], ids=["healthy", "devices", "matmul", "hang"])
def test_one_process_on_four_fake_cpu_devices(tmp_path: Path, fault: str, code: int, part: str | None,
                                              reason: str | None) -> None:
    control = tmp_path / "control"  # the pod's control folder, shared with the sidecar
    proc = _start(tmp_path, 4, {"RESILAX_HEALTH_FAULT": fault, "RESILAX_CONTROL_DIR": str(control)}, "result.json",
                  timeout=20 if fault == "hang" else 120)
    [(rc, result, text)] = _finish([proc], tmp_path, ["result.json"])
    assert rc == code, text
    # The verdict the sidecar reads (on a failure it then makes no final save: no trainer ran).
    assert json.loads((control / hv.HEALTH_FILE).read_text()) == {
        "passed": code == 0, "failed_part": part, "reason": result["reason"]}
    assert hv.read_verdict(str(control)) == hv.HealthVerdict(code == 0, part, result["reason"])
    assert [p.name for p in control.iterdir()] == [hv.HEALTH_FILE]  # written whole: no temporary left
    assert (result["healthy"], result["failed_part"], result["devices"], result["host_fault"]) == (
        code == 0, part, 3 if fault == "devices" else 0 if fault == "hang" else 4, code != 0)
    if reason is not None:
        assert reason in result["reason"]
    else:
        assert [p["name"] for p in result["parts"]] == list(hc.PARTS)


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "want"), [
    ("", [(None, True), (None, True)]),
    ("collective", [("collective", False), ("collective", False)]),
    ("matmul", [("collective", False), ("matmul", True)]),
], ids=["healthy", "collective-fault-on-process-1", "matmul-fault-on-process-1"])
def test_two_processes_run_a_psum_over_the_slice(tmp_path: Path, fault: str,
                                                 want: list[tuple[str | None, bool]]) -> None:
    """Two processes of 2 fake CPU devices each; the fault on process 1 only. A host that fails its own
    part leaves; the other fails the collective within the bound and is not blamed (host_fault)."""
    address = f"127.0.0.1:{free_port()}"
    procs = [_start(tmp_path, 2, {"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(i),
                                  "RESILAX_HEALTH_FAULT": fault if i == 1 else ""}, f"result-{i}.json",
                    timeout=30 if fault == "matmul" else 120)
             for i in range(2)]
    results = _finish(procs, tmp_path, ["result-0.json", "result-1.json"])
    for i, (rc, result, text) in enumerate(results):
        assert result["process_id"] == i and result["num_processes"] == 2
        assert (result["failed_part"], result["host_fault"] or result["healthy"]) == want[i], text
        assert rc == (hc.EXIT_HEALTHY if result["healthy"] else hc.EXIT_UNHEALTHY), text
        if not fault:
            assert result["parts"][-1]["reason"] == "psum over 2 processes gave 10"  # 1+2+3+4 over 4 devices
        elif fault == "collective":  # one process's wrong contribution makes the slice's psum wrong for everyone
            assert result["reason"] == "psum over the slice gave 12, expected 10"  # its 2 devices each +1


@pytest.mark.slow
def test_the_tpu_script_runs_the_same_code_path_on_cpu(tmp_path: Path) -> None:
    """bench/tpu/health-check, as the TPU run calls it, with JAX_PLATFORMS=cpu (one CPU device)."""
    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "RESILAX_", "TPU_", "XLA_"))}
    env.update(JAX_PLATFORMS="cpu", OUT=str(tmp_path), PYTHON=sys.executable)
    done = subprocess.run(["bash", str(root / "bench" / "tpu" / "health-check")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=DEADLINE)
    assert done.returncode == 0, done.stdout + done.stderr
    healthy = json.loads((tmp_path / "health-check" / "healthy.json").read_text())
    fault = json.loads((tmp_path / "health-check" / "matmul-fault.json").read_text())
    assert (healthy["healthy"], healthy["platform"], healthy["devices"]) == (True, "cpu", 1)
    assert (fault["failed_part"], fault["host_fault"]) == ("matmul", True)


def test_the_rendezvous_joins_only_once_the_coordinator_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Process 1's rendezvous calls jax.distributed.initialize only after process 0's port accepts
    connections (multihost.wait_for_coordinator), never into gRPC's reconnect backoff; by order of
    events (refused tries, the listener, initialize), not by time."""
    import socket
    import threading

    seen: list[str] = []
    connect = socket.create_connection

    def counting(address: Any, *args: Any, **kwargs: Any) -> socket.socket:
        try:
            return connect(address, *args, **kwargs)
        except OSError:
            seen.append("refused")
            raise

    def initialize(*args: Any, **kwargs: Any) -> None:
        seen.append("initialize")
        raise RuntimeError("the test stops the check here")

    monkeypatch.setattr(socket, "create_connection", counting)
    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    settings = hc.HealthSettings(expected_devices=2, num_processes=2, process_id=1, coordinator=f"127.0.0.1:{port}",
                                 timeout_seconds=120)
    progress = hc._Progress()
    checking = threading.Thread(target=hc.measure, args=(settings, progress))
    checking.start()
    try:
        for _ in range(600):
            if seen:
                break
            threading.Event().wait(0.05)
        seen.append("listening")
        server.listen()
        checking.join(timeout=60)
    finally:
        server.close()
    assert seen[0] == "refused" and seen.index("listening") < seen.index("initialize"), seen
    assert "the test stops the check here" in (progress.m.rendezvous_error or ""), progress.m
