"""Issue 18, item 4 end to end: stuck containers on the local cluster, whose node agent shows them as a
kubelet does (tests/localcluster/test_waiting_states.py). Three small jobs at once (1 CPU worker each, no
JAX: the trainer only sleeps), with the operator's containerWaitingTimeoutSeconds at 15 s (CI time: the
test waits it out three times; every stuck container shows its reason within a few seconds):

| job   | what is wrong                                         | condition (Ready=False)                  | after the timeout |
|-------|-------------------------------------------------------|------------------------------------------|-------------------|
| pull  | the trainer's image is on a registry that never resolves | ContainerWaiting: trainer, ErrImagePull/ImagePullBackOff | Failed, ContainerWaitingTimeout |
| root  | the trainer's image runs as root; the operator sets runAsNonRoot | ContainerWaiting: trainer, CreateContainerConfigError | Failed, ContainerWaitingTimeout |
| crash | a native sidecar of the template exits at once, again and again | ContainerWaiting: log-shipper, CrashLoopBackOff | a worker failure: generation 2; past maxRestarts (1) Failed |

And issue 25, item 8 (`test_ownership_by_uid_...`): what the job creates is its own by owner uid, not by
name or label; a pod in a start-up state past the timeout is named too.
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any

from op_cluster import GROUP, VERSION, Jobs, OperatorProcess, unique_name
from resilax_local.cluster import LocalCluster
from resilax_local.testing import wait_for

SLEEP = [sys.executable, "-c", "import time; time.sleep(3600)"]
TIMEOUT = 15


def _job(name: str, storage: Path, template: dict[str, Any], max_restarts: int = 0) -> dict[str, Any]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "JAXJob", "metadata": {"name": name}, "spec": {
        "slices": {"accelerator": "cpu", "topology": "1x2", "count": 1},
        # the trainer does not use resilax_ckpt (no trainer.lock): a sidecar told to stop cannot tell it
        # has gone and waits this long for its final save before the pod goes (docs/sidecar.md)
        "checkpoint": {"storage": str(storage), "every": {"steps": 10}, "finalSave": {"timeoutSeconds": 5}},
        "recovery": {"maxRestarts": max_restarts, "backoffSeconds": 2},
        "template": template}}


def _ready(status: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})


def test_stuck_containers_are_named_then_the_job_fails_or_is_replanned(operator: OperatorProcess, jobs: Jobs,
                                                                        cluster: LocalCluster, tmp_path: Path) -> None:
    operator.kill()
    operator.settings_env["RESILAX_OPERATOR_CONTAINER_WAITING_TIMEOUT_SECONDS"] = str(TIMEOUT)
    operator.start()
    root_image = f"example.com/root-trainer-{uuid.uuid4().hex[:6]}:1"
    cluster.set_images([{"image": root_image, "user": "0"}])
    pull, root, crash = unique_name("pull"), unique_name("root"), unique_name("crash")
    trainer = {"name": "trainer", "command": SLEEP}
    started = time.monotonic()
    jobs.create(_job(pull, tmp_path / "pull", {"spec": {"containers": [
        {**trainer, "image": "registry.invalid/team/trainer:1"}]}}))
    jobs.create(_job(root, tmp_path / "root", {"spec": {"containers": [{**trainer, "image": root_image}]}}))
    jobs.create(_job(crash, tmp_path / "crash", {"spec": {
        "containers": [{**trainer, "image": "python:3.11"}],
        "initContainers": [{"name": "log-shipper", "image": "python:3.11", "restartPolicy": "Always",
                            "command": [sys.executable, "-c", "import sys; sys.exit(1)"]}]}}, max_restarts=1))

    expected = {pull: ("trainer", ("ErrImagePull", "ImagePullBackOff")),
                root: ("trainer", ("CreateContainerConfigError",)),
                crash: ("log-shipper", ("CrashLoopBackOff",))}
    for name, (container, reasons) in expected.items():
        def named(s: dict[str, Any], container: str = container, reasons: tuple[str, ...] = reasons) -> bool:
            ready = _ready(s)
            return ready.get("reason") == "ContainerWaiting" and f"container {container} " in ready["message"] \
                and any(f"waiting: {r}" in ready["message"] for r in reasons)
        status = jobs.wait_status(name, named, 120, f"Ready=False ContainerWaiting naming {container}")
        print(f"\n{name}: named after {time.monotonic() - started:.0f} s: {_ready(status)['message']}")
        assert f"{name}-g1-s0-h0" in _ready(status)["message"] and "giving up at" in _ready(status)["message"]
    root_message = _ready(jobs.status(root))["message"]
    assert "container has runAsNonRoot and image will run as root" in root_message, root_message
    assert "runAsUser" in root_message  # the fix

    for name in (pull, root):
        status = jobs.wait_status(name, lambda s: s.get("phase") == "Failed", 120, "Failed after the timeout")
        ready = _ready(status)
        assert ready["reason"] == "ContainerWaitingTimeout" and "container trainer" in ready["message"], ready
        assert status["generation"] == 1 and status.get("failures", 0) == 0, status
        reasons = jobs.event_reasons(name, "ContainerWaiting", "ContainerWaitingTimeout")
        # one event per stuck container, though the kubelet's reason and message kept changing
        assert reasons.count("ContainerWaiting") == 1 and reasons.count("ContainerWaitingTimeout") == 1, reasons

    status = jobs.wait_status(crash, lambda s: s.get("generation", 0) >= 2, 120, "a new generation after the timeout")
    assert status["failures"] == 1, status
    status = jobs.wait_status(crash, lambda s: s.get("phase") == "Failed", 180, "Failed past maxRestarts")
    ready = _ready(status)
    assert ready["reason"] == "MaxRestartsExceeded" and "CrashLoopBackOff" in ready["message"], ready
    assert "log-shipper" in ready["message"] and status["generation"] == 2 and status["failures"] == 2, status
    print(f"{crash}: events {jobs.event_reasons(crash, 'MaxRestartsExceeded')}")
    for name in (pull, root, crash):
        wait_for(lambda name=name: not jobs.pods(name), timeout=120, message=f"{name}: a failed job keeps no workers")


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def test_ownership_by_uid_a_squatter_pod_a_deleted_token_secret_a_missing_volume(
        operator: OperatorProcess, jobs: Jobs, tmp_path: Path) -> None:
    """1. A pod created beforehand with the first worker's name and labels (no owner) is not adopted:
    NameConflict names it, nothing touches it; once it is gone the job runs with a pod of its own.
    2. The token Secret deleted while the job runs: the next generation (a worker pod deleted) re-creates
    it, with a new token (a deleted Secret rotates the token: docs/sidecar.md, "Auth"), before its pods, which start (without, they would wait in PodInitializing: the node agent keeps a
    pod with a missing Secret volume there, as a kubelet does), so no ContainerWaiting report comes.
    3. A template mounting a Secret that does not exist: past the timeout (15 s here) Ready=False
    ContainerWaiting names the start-up state; nothing is torn down; the Secret created, the job runs."""
    operator.kill()
    operator.settings_env["RESILAX_OPERATOR_CONTAINER_WAITING_TIMEOUT_SECONDS"] = str(TIMEOUT)
    operator.start()
    kube, ns = jobs.kube, jobs.namespace
    name, mounts = unique_name("own"), unique_name("mount")
    squatter = f"{name}-g1-s0-h0"
    kube.create(f"/api/v1/namespaces/{ns}/pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": squatter, "labels": {"resilax.dev/job": name, "resilax.dev/generation": "1",
                                     "resilax.dev/slice": "0", "resilax.dev/host": "0", "resilax.dev/role": "worker"}},
        "spec": {"terminationGracePeriodSeconds": 1,
                 "containers": [{"name": "trainer", "image": "python:3.11", "command": SLEEP}]}})
    squatter_uid = kube.get(f"/api/v1/namespaces/{ns}/pods/{squatter}")["metadata"]["uid"]
    trainer = {"name": "trainer", "image": "python:3.11", "command": SLEEP}
    jobs.create(_job(name, tmp_path / "own", {"spec": {"containers": [trainer]}}, max_restarts=3))
    status = jobs.wait_status(name, lambda s: _condition(s, "NameConflict").get("status") == "True", 120,
                              "NameConflict")
    conflict = _condition(status, "NameConflict")
    assert f"Pod {squatter} exists and is not this job's (no owner)" in conflict["message"], conflict
    time.sleep(10)  # several reconciles: the squatter is still not adopted, touched or asked anything
    pod = kube.get(f"/api/v1/namespaces/{ns}/pods/{squatter}")
    assert pod["metadata"]["uid"] == squatter_uid and not pod["metadata"].get("ownerReferences"), pod["metadata"]
    assert not pod["metadata"].get("annotations") and not pod["metadata"].get("deletionTimestamp")
    assert jobs.status(name).get("phase") != "Running"
    assert jobs.event_reasons(name, "NameConflict").count("NameConflict") == 1
    kube.delete(f"/api/v1/namespaces/{ns}/pods/{squatter}")
    status = jobs.wait_status(name, lambda s: s.get("phase") == "Running", 120, "Running with its own worker")
    assert _condition(status, "NameConflict")["status"] == "False"
    (worker,) = jobs.pods(name, 1)
    uid = jobs.get(name)["metadata"]["uid"]
    assert worker["metadata"]["uid"] != squatter_uid and worker["metadata"]["ownerReferences"][0]["uid"] == uid

    secret = f"/api/v1/namespaces/{ns}/secrets/{name}-resilax-token"
    token = kube.get(secret)["data"]["token"]
    kube.delete(secret)
    kube.delete(f"/api/v1/namespaces/{ns}/pods/{name}-g1-s0-h0")
    status = jobs.wait_status(name, lambda s: s.get("generation") == 2 and s.get("phase") == "Running", 180,
                              "generation 2 Running")
    recreated = kube.get(secret)
    assert recreated["data"]["token"] != token and recreated["metadata"]["ownerReferences"][0]["uid"] == uid
    assert "ContainerWaiting" not in jobs.event_reasons(name), jobs.event_reasons(name)

    volume = unique_name("later")
    jobs.create(_job(mounts, tmp_path / "mounts", {"spec": {
        "containers": [{**trainer, "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}]}],
        "volumes": [{"name": "cfg", "secret": {"secretName": volume}}]}}))
    status = jobs.wait_status(mounts, lambda s: _ready(s).get("reason") == "ContainerWaiting", 120,
                              "Ready=False ContainerWaiting for the start-up state")
    message = _ready(status)["message"]
    assert f"{mounts}-g1-s0-h0" in message and "PodInitializing" in message and "FailedMount" in message, message
    assert status["generation"] == 1 and status.get("failures", 0) == 0 and status["phase"] != "Failed", status
    kube.create(f"/api/v1/namespaces/{ns}/secrets", {"apiVersion": "v1", "kind": "Secret",
                                                     "metadata": {"name": volume}, "stringData": {"k": "v"}})
    status = jobs.wait_status(mounts, lambda s: s.get("phase") == "Running", 120, "Running once the Secret exists")
    assert status["generation"] == 1, status

