"""Coordinator discovery for real: two JAX processes started with exactly the environment the builders
give pod 0 (its own IP through $(RESILAX_POD_IP)) and pod 1 (pod 0's IP written in), each on its own
loopback address as on the local cluster, form one 2-process x 2-device JAX cluster."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from op_samples import good_spec
from resilax_operator.builders import GenerationPlan, JobRef, build_pods
from resilax_operator.settings import OperatorSettings
from resilax_operator.spec import Shape
from resilax_operator.validation import validate_spec

pytestmark = pytest.mark.slow

WORKER = """
import os
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from resilax_ckpt.multihost import initialize_distributed_from_env
assert initialize_distributed_from_env()
ids = multihost_utils.process_allgather(jnp.array([jax.process_index()]))
result = f"{jax.process_count()} {jax.device_count()} {sorted(int(i) for i in ids.ravel())}"
with open(os.environ["RESULT_FILE"], "w") as f:
    f.write(result)
jax.distributed.shutdown()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _resolve(pod: dict[str, Any], ip: str) -> dict[str, str]:
    """What a kubelet does with the trainer's env: downward API, then $(VAR) expansion."""
    fields = {"status.podIP": ip, "metadata.name": pod["metadata"]["name"], "spec.nodeName": "node"}
    env: dict[str, str] = {}
    for e in pod["spec"]["containers"][0]["env"]:
        if "valueFrom" in e:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
    return env


#: What JAX's coordinator prints (before it crashes) when the port _free_port() found was taken by another
#: program in the meantime (the harness's race on a shared machine, not the code under test; the same
#: text tests/ckpt/ckpt_procs.py retries on).
PORT_TAKEN = "Failed to add port to server"


def _run_pair(pods: list[dict[str, Any]], ips: list[str], results: list[Path]) -> list[tuple[int, str]]:
    """Start the two workers and return (exit code, stdout + stderr) of each; each writes what it saw to its
    file in `results`. When pod 0's coordinator could not bind its port, pod 1 (waiting for it) is killed
    at once."""
    procs = []
    for pod, ip, result in zip(pods, ips, results, strict=True):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
        env.update(_resolve(pod, ip))
        env["JAX_PLATFORMS"] = "cpu"
        # The result goes to a file, not stdout: Gloo's C++ logging writes "[Gloo] Rank 0 is connected..."
        # to stdout from its own thread, and once landed inside the printed line (CI, 2026-12-07).
        env["RESULT_FILE"] = str(result)
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs: list[tuple[int, str]] = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=600)  # generous: the machine is shared and JAX start-up varies
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        outputs.append((p.returncode, out + "\n--- stderr ---\n" + err))
        if len(outputs) == 1 and p.returncode != 0 and PORT_TAKEN in err:
            for other in procs[1:]:
                other.kill()
                other.communicate()
            break
    return outputs


def test_two_processes_find_the_coordinator_without_dns(tmp_path: Path) -> None:
    raw = good_spec()
    # Storage the test machine can reach: the sample's gs://bucket resolves nowhere here, and the restore
    # prefetch that initialize_distributed_from_env starts first (it lists the checkpoint root before
    # JAX starts) then spent ~50 s in gcsfs's retries before the processes even met.
    raw["checkpoint"]["storage"] = str(tmp_path / "ckpt")
    raw["slices"] = {"accelerator": "cpu", "topology": "1x2", "count": 2}
    raw["elastic"] = {"minCount": 1, "maxCount": 2}
    spec = validate_spec(raw)
    job = JobRef("coord", "default", "u")
    plan = GenerationPlan(1, Shape("1x2", 2), ("a", "b"))
    ips = ["127.0.9.1", "127.0.9.2"]
    results = [tmp_path / "result-0", tmp_path / "result-1"]
    for _attempt in range(3):  # another port when the one found free was taken before JAX bound it
        settings = OperatorSettings(coordinator_port=_free_port())
        (pod0,) = build_pods(job, spec, plan, settings, coordinator_ip=None)
        pod1 = build_pods(job, spec, plan, settings, coordinator_ip=ips[0])[1]
        outputs = _run_pair([pod0, pod1], ips, results)
        if not (outputs[0][0] != 0 and PORT_TAKEN in outputs[0][1]):
            break
    assert len(outputs) == 2, outputs[0][1][-3000:]
    for (code, text), result in zip(outputs, results, strict=True):
        assert code == 0, text[-3000:]
        assert result.read_text() == "2 4 [0, 1]", text[-3000:]
