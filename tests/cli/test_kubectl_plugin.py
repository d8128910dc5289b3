"""`kubectl resilax` against the local cluster: the `kubectl-resilax` executable the install puts on
PATH, with the admin kubeconfig, on a JAXJob the real operator runs (examples/train.py workers), all in
one job run (CI is serial): `status` shows the operator's view (phase, generation, shape, the step
reached, the saved step, goodput), `goodput` its breakdown, `save` asks process 0's sidecar through the
API server's pod proxy and prints the newer step once committed (the token never printed), `suspend`
makes the operator save and stop the workers (Suspended), `resume` starts a new generation that restores
the saved step, `timeline` (and `--png`) shows both generations from status.history; `logs -f`,
started in generation 1, follows process 0 into generation 2's pod (a new name);
`kubectl_complete-resilax` completes the namespace's jobs and the namespaces; a missing job is an error
naming it."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from op_cluster import Jobs, OperatorProcess, committed_steps, job_manifest, unique_name
from resilax_local.cluster import LocalCluster
from resilax_local.kubeapi import KubeClient
from resilax_local.testing import wait_for

pytestmark = pytest.mark.cluster


def _plugin(name: str = "kubectl-resilax") -> str:
    """An installed console script (next to this interpreter, as pip installs them)."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    assert found, f"{name} is not installed: reinstall the project (scripts/setup)"
    return found


def _run(cluster: LocalCluster, *args: str, executable: str = "kubectl-resilax") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    return subprocess.run([_plugin(executable), *args], capture_output=True, text=True, timeout=300, env=env)


def _fields(screen: str) -> dict[str, str]:
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in screen.splitlines())}


def _steps(out: str) -> list[int]:
    """The steps of the loss lines in `out` (process 0's JSON lines)."""
    return [json.loads(line)["step"] for line in out.splitlines() if line.startswith("{") and '"loss"' in line]


class _Follower:
    """A command that runs until stopped (`logs -f`), its stdout and stderr read as they come."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.out: list[str] = []
        self.err: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                        for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def read_until(self, done: Callable[[str, str], bool], timeout: float) -> tuple[str, str]:
        """Stop the command once `done(stdout, stderr)` holds (or `timeout` passed); all it printed."""
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: done("".join(self.out), "".join(self.err)) or self.proc.poll() is not None,
                     timeout=timeout, interval=0.5)
        self.proc.terminate()
        self.proc.wait(timeout=30)
        for reader in self.readers:
            reader.join(timeout=30)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        return "".join(self.out), "".join(self.err)


def test_status_goodput_save_suspend_resume_and_timeline(operator: OperatorProcess, jobs: Jobs, cluster: LocalCluster,
                                                           kube: KubeClient, namespace: str, tmp_path: Path) -> None:
    name, storage = unique_name("plug"), tmp_path / "ckpt"
    jobs.create(job_manifest(name, storage, count=1, every_steps=4, steps=100000, step_seconds=0.3))
    jobs.wait_status(name, lambda s: s.get("phase") == "Running" and (s.get("checkpoint") or {}).get("step")
                     and ((s.get("goodput") or {}).get("ledger") or {}).get("current", {}).get("lastStep"),
                     300, "Running with a checkpoint and a step reached")

    proc = _run(cluster, "status", name, "-n", namespace)
    assert proc.returncode == 0, proc.stderr
    fields = _fields(proc.stdout)
    status: dict[str, Any] = jobs.status(name)
    assert fields["JAXJob"] == f"{namespace}/{name}"
    assert fields["Phase"] == "Running"
    assert fields["Generation"].startswith("1 (started ")
    assert fields["Shape"] == "1 x 2x4 (2 hosts)"
    assert int(fields["Step"].split()[0]) >= 1
    saved = int(fields["Saved step"].split()[0])
    assert saved in committed_steps(storage), (saved, committed_steps(storage))
    assert fields["Goodput"].endswith(" s") and "%" in fields["Goodput"]
    assert fields["Last fault"] == "none", fields
    assert status["phase"] == "Running"

    proc = _run(cluster, "goodput", name, "-n", namespace)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"{namespace}/{name}: goodput ")
    assert "productive" in proc.stdout and "jaxStartup" in proc.stdout

    # save: through pods/proxy to process 0's sidecar, with the token from the job's Secret in the
    # sidecar's own header (the API server drops Authorization); it prints the step once committed.
    before = max(committed_steps(storage))
    proc = _run(cluster, "save", name, "-n", namespace, "--timeout", "240")
    assert proc.returncode == 0, proc.stderr
    saved_line = re.fullmatch(rf"jaxjob {namespace}/{name}: step (\d+) committed, persisted; "
                              r"the newest saved step was \d+\n", proc.stdout)
    assert saved_line, proc.stdout
    manual = int(saved_line.group(1))
    assert manual > before and manual in committed_steps(storage), (manual, before, committed_steps(storage))
    assert "save requested from " in proc.stderr and f"{name}-" in proc.stderr
    secret = kube.get(f"/api/v1/namespaces/{namespace}/secrets/{name}-resilax-token")
    token = base64.b64decode(secret["data"]["token"]).decode().strip()
    assert token not in proc.stdout + proc.stderr

    # logs -f: process 0's trainer log, followed across the generation change that suspend and resume make.
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    follower = _Follower([_plugin(), "logs", name, "-n", namespace, "-f"], env)

    # suspend: the operator saves, stops the workers and says Suspended.
    proc = _run(cluster, "suspend", name, "-n", namespace)
    assert proc.returncode == 0, proc.stderr
    assert jobs.get(name)["spec"]["suspend"] is True
    jobs.wait_status(name, lambda s: s.get("phase") == "Suspended", 300, "Suspended")
    wait_for(lambda: not jobs.pods(name), timeout=120, interval=1, message=f"{name}: no workers while suspended")
    final = max(jobs.losses(name, 1))
    assert final in committed_steps(storage), (final, committed_steps(storage))
    assert _fields(_run(cluster, "status", name, "-n", namespace).stdout)["Phase"] == "Suspended"

    # resume: a new generation restores the final save.
    proc = _run(cluster, "resume", name, "-n", namespace)
    assert proc.returncode == 0, proc.stderr
    assert jobs.get(name)["spec"]["suspend"] is False
    jobs.wait_status(name, lambda s: s.get("phase") == "Running" and s.get("generation") == 2, 300,
                     "generation 2 Running")
    wait_for(lambda: jobs.losses(name, 2), timeout=300, interval=1, message=f"{name}: a step of generation 2")
    assert min(jobs.losses(name, 2)) - 1 == final
    # It follows until the job ends (not in this test): stopped once it printed generation 2's first step
    # (or after 60 s: the asserts below then say what it printed).
    out, err = follower.read_until(lambda out, err: f"==> {namespace}/{name}-g2-s0-h0 " in err
                                   and final + 1 in _steps(out), timeout=60)
    followed = _steps(out)
    assert f"==> {namespace}/{name}-g1-s0-h0 " in err and f"==> {namespace}/{name}-g2-s0-h0 " in err, err
    assert final in followed and final + 1 in followed, (final, followed[-5:], err)
    assert _fields(_run(cluster, "status", name, "-n", namespace).stdout)["Generation"].startswith("2 ")

    # timeline: status.history's two generations, the first ended by the suspend, the second restored
    # the final save and runs; --png draws the picture (the history fills on the operator's next writes).
    jobs.wait_status(name, lambda s: [(e.get("generation"), e.get("endReason"), e.get("restoredStep"))
                                      for e in s.get("history") or []] == [(1, "Suspended", None), (2, None, final)]
                     and (s["history"][1].get("firstStep") or 0) > final, 120, "history of both generations")
    png = tmp_path / "timeline.png"
    proc = _run(cluster, "timeline", name, "-n", namespace, "--png", str(png))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"{namespace}/{name}: 2 generations over "), proc.stdout
    rows = [line for line in lines if re.match(r"^\s+[12]  1 x 2x4 \(2 hosts\)", line)]
    assert len(rows) == 2, proc.stdout
    bars = [row.split("|")[1] for row in rows]
    assert bars[0].rstrip().endswith("]") and re.search(r"\| Suspended after \S+$", rows[0]), proc.stdout
    assert " fresh " in rows[0] and re.search(r" 1-\d+ ", rows[0]), proc.stdout
    assert bars[1].endswith(">") and rows[1].endswith("| running"), proc.stdout
    assert re.search(rf" {final}( \(\w+\))? ", rows[1]), proc.stdout
    assert any(line.strip().startswith("1  ] Suspended at ") for line in lines), proc.stdout
    assert lines[-1] == f"picture: {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Shell completion (what kubectl 1.26+ asks kubectl_complete-resilax): the namespace's jobs, its namespaces.
    completion = _run(cluster, "status", "-n", namespace, name[:4], executable="kubectl_complete-resilax")
    assert completion.returncode == 0 and completion.stdout.splitlines() == [name, ":4"], completion
    completion = _run(cluster, "status", "-n", namespace[:-1], executable="kubectl_complete-resilax")
    assert namespace in completion.stdout.splitlines(), completion

    missing = _run(cluster, "status", "no-such-job", "-n", namespace)
    assert missing.returncode == 1
    assert f"jaxjob {namespace}/no-such-job: 404" in missing.stderr
