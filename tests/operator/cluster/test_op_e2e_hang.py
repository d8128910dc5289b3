"""A hung trainer end to end (issue 26, item 3): real JAX workers (examples/train.py) under the
supervisor `resilax run`, the real sidecars and the operator on the local cluster.

Job: 1 slice of tpu-v5-lite-podslice 2x4 (2 hosts) = 2 processes x 2 fake CPU devices,
`recovery.inPlace: Auto`, the automatic hang timeout (no `hangTimeoutSeconds`), a checkpoint every 4
steps. Process 1's trainer is stopped with SIGSTOP (a frozen process: its heartbeat stops, process 0
waits in a collective): the operator must find `TrainerHung` naming that pod within the automatic
timeout, dump the stacks of the hung process into its pod log, restart the generation in place and not
count a failure. (Every other e2e flow checks that a healthy job never gets `TrainerHung`: conftest.py.)

Then the pods lose their network (their addresses removed from the loopback interface, what a second
local cluster of the same pod block did to goodput seed 2 of 2026-12-07): every sidecar falls silent,
every readiness probe fails and the trainers stall, unheard; the hang detector, which reads the same
sidecars, sees nothing. The operator must replace the generation once the silence lasts
(`WorkerUnreachable`), not wait for an answer that never comes."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from op_cluster import Jobs, OperatorProcess, committed_steps, event_time, job_manifest, unique_name
from resilax_local.testing import wait_for

pytestmark = pytest.mark.expects_hang

#: The automatic timeout while training, for steps far shorter than its tenth: the operator's floor,
#: `RESILAX_OPERATOR_HANG_FLOOR_SECONDS` (OperatorSettings.hang_floor_seconds), set from its default 60 s
#: to 20 s here (CI time: the test waits it out; still 100 steps of 0.2 s).
AUTOMATIC_TIMEOUT = 20


def trainer_pid(job: str, process: int, generation: int) -> int | None:
    """The pid of the supervised trainer (the supervisor's child: it alone has RESILAX_INCARNATION) of
    `job`'s JAX process `process` in `generation`, from /proc."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{entry}/environ").read_bytes().decode(
                errors="replace").split("\0") if "=" in kv)
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if (env.get("RESILAX_JOB_NAME") == job and env.get("JAX_PROCESS_ID") == str(process)
                and env.get("RESILAX_GENERATION") == str(generation) and "RESILAX_INCARNATION" in env
                and state != "Z"):
            return int(entry)
    return None


def cut_pod_network(ip: str) -> None:
    """Remove a pod's address from the loopback interface (resilax_local.node.pod_network): nothing reaches
    its processes any more, nor do they reach each other."""
    assert ip.startswith("240."), f"pod IP {ip}: this cluster has no addresses of its own to remove (no CAP_NET_ADMIN)"
    subprocess.run(["ip", "addr", "del", f"{ip}/32", "dev", "lo"], check=True, capture_output=True, timeout=30)


def test_a_stopped_trainer_is_detected_and_restarted(operator: OperatorProcess, jobs: Jobs, tmp_path: Path) -> None:
    operator.kill()
    operator.settings_env["RESILAX_OPERATOR_HANG_FLOOR_SECONDS"] = str(AUTOMATIC_TIMEOUT)
    operator.start()
    name, storage = unique_name("hang"), tmp_path / "ckpt"
    jobs.create(job_manifest(name, storage, count=1, every_steps=4, steps=100000, step_seconds=0.2,
                             recovery={"inPlace": "Auto"}, final_save_timeout=20))
    jobs.wait_status(name, lambda s: s.get("phase") == "Running" and s.get("generation") == 1, 600,
                     "generation 1 Running")
    pod0, pod1 = f"{name}-g1-s0-h0", f"{name}-g1-s0-h1"
    # past the warm-up (10 steps) with a p99 step time, and a checkpoint to restart from
    wait_for(lambda: max(jobs.losses(name, 1), default=0) >= 30 and committed_steps(storage), timeout=600,
             interval=1, message=f"{name}: generation 1 past step 30 with a checkpoint")
    before = jobs.status(name)
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in jobs.pods(name)}
    pid = trainer_pid(name, 1, 1)
    assert pid is not None, "process 1's trainer not found in /proc"
    stopped = time.time()
    os.kill(pid, signal.SIGSTOP)
    try:
        def hung() -> dict[str, object] | None:
            return next((e for e in jobs.events(name) if e.get("reason") == "TrainerHung"), None)

        event = wait_for(hung, timeout=AUTOMATIC_TIMEOUT + 240, interval=1, message=f"{name}: TrainerHung")
        detected = event_time(event)
        status = jobs.wait_status(
            name, lambda s: s.get("generation") == 2 and s.get("phase") == "Running" and not s.get("inPlace"), 600,
            "generation 2 Running")
        wait_for(lambda: jobs.losses(name, 2), timeout=600, interval=1, message=f"{name}: a step of generation 2")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    message = str(event.get("message"))
    print(f"\n{name}: SIGSTOP of {pod1}'s trainer -> TrainerHung after {detected - stopped:.1f}s: {message}")
    assert event.get("type") == "Warning"
    assert message.startswith(f"worker {pod1} (process 1, node "), message
    assert "heartbeat stopped" in message and "last step " in message, message
    assert f"timeout {AUTOMATIC_TIMEOUT}s, automatic" in message, message  # steps of 0.2 s: the floor
    assert detected - stopped >= AUTOMATIC_TIMEOUT - 2  # not before its timeout (event times have whole seconds)
    assert status["failures"] == before.get("failures", 0) == 0, status  # not counted
    assert status["inPlaceRestarts"] == 1 and status["restarts"] == 1, status
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in jobs.pods(name)} == uids  # in place: same pods
    assert trainer_pid(name, 1, 1) is None  # the stopped process is gone
    assert trainer_pid(name, 1, 2) is not None
    log = jobs.cluster.logs(jobs.namespace, pod1, "trainer")
    # the hung process's stacks: py-spy's (when on PATH) or faulthandler's
    assert re.search(r'Thread \d+ \(\w+\): "MainThread"', log) or "most recent call first" in log, log[-3000:]
    records = jobs.losses(name, 2)  # process 0's, by generation (op_cluster.Jobs.losses)
    assert min(records) - 1 in committed_steps(storage)
    hang_seconds = ((status.get("goodput") or {}).get("breakdown") or {}).get("hang")
    print(f"{name}: restarted in place, generation 2 restored step {min(records) - 1}; goodput hang bucket "
          f"{hang_seconds}s; pod 0 {pod0}")

    # Every pod's network goes: no sidecar answers the operator or the readiness probes any more.
    gen2 = {p["metadata"]["name"]: p["status"]["podIP"] for p in jobs.pods(name)}
    cut = time.time()
    for ip in gen2.values():
        cut_pod_network(ip)

    def unreachable() -> dict[str, object] | None:
        return next((e for e in jobs.events(name) if e.get("reason") == "WorkerUnreachable"), None)

    silent = wait_for(unreachable, timeout=120, interval=1, message=f"{name}: WorkerUnreachable")
    print(f"{name}: pod network cut -> WorkerUnreachable after {event_time(silent) - cut:.1f}s: {silent.get('message')}")
    # (the first worker whose silence lasted: the two probes failed a moment apart)
    assert re.match(rf"worker {name}-g1-s0-h[01] of generation 2 is unreachable: ", str(silent.get("message"))), silent
    assert jobs.event_reasons(name, "TrainerHung").count("TrainerHung") == 1  # the first phase's only
    status = jobs.wait_status(name, lambda s: s.get("generation") == 3 and s.get("phase") == "Running", 600,
                              "generation 3 Running")
    assert not set(gen2) & {p["metadata"]["name"] for p in jobs.pods(name)}  # no sidecar answered: none kept
    assert status["failures"] == 0, status
