"""Run ckpt_worker.py as one or several JAX processes on 127.0.0.1, with bounded time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from resilax_local.processes import PortTaken, on_free_port

WORKER = Path(__file__).with_name("ckpt_worker.py")
ROOT = Path(__file__).resolve().parents[2]


#: What JAX's coordinator prints (before it crashes) when the port free_port() found was taken by
#: another program in the meantime: the test harness's race, not the code under test (PortTaken).
PORT_TAKEN = "Failed to add port to server"


def run_processes(args: dict[str, Any], num_processes: int = 1, timeout: float = 240,
                  env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Start `num_processes` workers (each with devices // num_processes local devices) and return
    their results in process order; raises with their output if any fails. A run whose coordinator
    could not bind its port (nothing ran yet) is started again on another port, at most twice."""
    try:
        return on_free_port(lambda port: _run_once(args, num_processes, timeout, env, port))
    except _PortTaken as e:
        raise WorkerFailed(0, e.code, e.output) from None


def _run_once(args: dict[str, Any], num_processes: int, timeout: float,
              env: dict[str, str] | None, port: int) -> list[dict[str, Any]]:
    procs = []
    base_env = dict(os.environ, **(env or {}))
    base_env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "ckpt_lib"), base_env.get("PYTHONPATH", "")])
    for pid in range(num_processes):
        a = dict(args, num_processes=num_processes, process_id=pid, coordinator=f"127.0.0.1:{port}")
        a.setdefault("devices", 8 // num_processes)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), json.dumps(a)], stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, env=base_env, start_new_session=True))
    outputs: list[tuple[int | None, str]] = []
    hung = None
    try:
        for p in procs:
            try:
                raw, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                hung = len(outputs)
                break
            outputs.append((p.returncode, raw.decode(errors="replace")))
            if len(outputs) == 1 and p.returncode != 0 and PORT_TAKEN in outputs[0][1]:
                break  # the others wait for a coordinator that never came up
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs[len(outputs):]:
            # Whatever a killed worker printed says where it hung; this also closes its pipe.
            raw, _ = p.communicate()
            outputs.append((p.returncode, raw.decode(errors="replace")))
    if outputs[0][0] != 0 and PORT_TAKEN in outputs[0][1]:
        raise _PortTaken(outputs[0][0], outputs[0][1])
    if hung is not None:
        raise WorkerFailed(hung, None, f"(did not finish within {timeout} s; killed)\n{outputs[hung][1]}")
    results = []
    for pid, (code, out) in enumerate(outputs):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if code != 0 or not lines:
            raise WorkerFailed(pid, code, out)
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


class WorkerFailed(RuntimeError):
    def __init__(self, pid: int, code: int | None, output: str) -> None:
        super().__init__(f"worker {pid} exited with {code}:\n{output[-4000:]}")
        self.code = code
        self.output = output


class _PortTaken(PortTaken):
    def __init__(self, code: int | None, output: str) -> None:
        super().__init__(output[-4000:])
        self.code = code
        self.output = output


def snapshot_files(root: str, path: str) -> dict[str, bytes]:
    """Every file under `path` (a local folder or a gs:// prefix): relative name -> bytes."""
    if not root.startswith("gs://"):
        base = Path(path)
        return {str(p.relative_to(base)): p.read_bytes() for p in sorted(base.rglob("*")) if p.is_file()}
    from resilax_ckpt.storage import GcsStorage

    fs = GcsStorage()._fs
    fs.invalidate_cache()
    prefix = path.removeprefix("gs://").rstrip("/") + "/"
    return {name[len(prefix):]: bytes(fs.cat_file(name)) for name in sorted(fs.find(prefix))}


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON file a child process writes, or None while it is missing or half-written."""
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (FileNotFoundError, ValueError):
        return None


def pid_exists(pid: int) -> bool:
    """Whether a process (also a zombie not yet reaped) with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
