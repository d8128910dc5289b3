"""The node agent's waiting states, as a kubelet shows them (docs/local-cluster.md, "Images" and
"Restarts"): an image the registry cannot serve (ErrImagePull, then ImagePullBackOff), a root image
under runAsNonRoot (CreateContainerConfigError), a Secret volume that does not exist (the start-up
state, with FailedMount events), and containers that keep exiting (CrashLoopBackOff, restartCount,
lastState). Every wait polls for a state; none asserts a duration."""

from __future__ import annotations

import uuid
from typing import Any

from resilax_local.testing import container_status, create_pod, get_pod, wait_for

SLEEP = ["python", "-c", "import time; time.sleep(3600)"]


def _pod(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"nodeName": "cpu-0", "terminationGracePeriodSeconds": 2,
                                                 "containers": containers, **spec}}


def _events(kube, namespace: str, pod: str) -> list[tuple[str, str, str]]:
    """(reason, container, message) of the kubelet's events about `pod`."""
    items = kube.get(f"/api/v1/namespaces/{namespace}/events")["items"]
    return [(e["reason"], e["involvedObject"].get("fieldPath", ""), e["message"]) for e in items
            if e["involvedObject"]["name"] == pod and e["source"].get("component") == "kubelet"]


def _watch_states(kube, namespace: str, pod: str, container: str, until, timeout: float = 90) -> tuple[list, dict]:
    """Poll the container's status until `until(status)`; return the waiting reasons seen (in order,
    without repeats) and the last status."""
    seen: list[str] = []
    last: dict[str, Any] = {}

    def check() -> bool:
        nonlocal last
        obj = get_pod(kube, namespace, pod)
        status = container_status(obj, container) if obj else None
        if not status:
            return False
        last = status
        reason = (status["state"].get("waiting") or {}).get("reason")
        if reason and (not seen or seen[-1] != reason):
            seen.append(reason)
        return bool(until(status))

    wait_for(check, timeout, interval=0.1, message=f"{pod}/{container}: the expected state (seen {seen}, last {last})")
    return seen, last


def test_an_image_the_registry_cannot_serve_waits_then_starts_once_it_can(cluster, kube, namespace):
    """`*.invalid` hosts never resolve; a table row says an image does not exist. Both containers wait
    with ErrImagePull then ImagePullBackOff (the pod stays Pending); once the row says the image exists,
    the next pull after the backoff succeeds and the container runs."""
    gone = f"example.com/gone-{uuid.uuid4().hex[:6]}:1"
    cluster.set_images([{"image": gone, "pullable": False}])
    create_pod(kube, namespace, _pod("pulls", [
        {"name": "unreachable", "image": "registry.invalid/team/app:1", "command": SLEEP},
        {"name": "missing", "image": gone, "command": SLEEP}]))

    seen, status = _watch_states(kube, namespace, "pulls", "unreachable", lambda s: s["state"].get("waiting", {})
                                 .get("reason") == "ImagePullBackOff")
    stuck = [r for r in seen if r not in ("PodInitializing", "ContainerCreating")]  # before the first pull
    assert stuck[:2] == ["ErrImagePull", "ImagePullBackOff"], seen
    assert status["state"]["waiting"]["message"] == 'Back-off pulling image "registry.invalid/team/app:1"'
    assert status["restartCount"] == 0 and not status["ready"]
    seen, status = _watch_states(kube, namespace, "pulls", "missing",
                                 lambda s: s["state"].get("waiting", {}).get("reason") == "ErrImagePull")
    assert f"{gone}: not found" in status["state"]["waiting"]["message"]
    assert get_pod(kube, namespace, "pulls")["status"]["phase"] == "Pending"
    events = wait_for(lambda: (e := _events(kube, namespace, "pulls"))
                      and {"Pulling", "Failed", "BackOff"} <= {r for r, _, _ in e} and e, 30, message="pull events")
    assert ("Failed", "spec.containers{unreachable}", "Error: ErrImagePull") in events
    assert any(r == "Failed" and m.startswith('Failed to pull image "registry.invalid/team/app:1": ')
               and "no such host" in m for r, _, m in events), events

    cluster.set_images([{"image": gone, "pullable": True}])
    _watch_states(kube, namespace, "pulls", "missing", lambda s: "running" in s["state"], timeout=60)
    status = container_status(get_pod(kube, namespace, "pulls"), "unreachable")
    assert status["state"].get("waiting", {}).get("reason") in ("ErrImagePull", "ImagePullBackOff"), status


def test_a_root_image_under_run_as_non_root_cannot_be_created(cluster, kube, namespace):
    """An image whose user is 0 with runAsNonRoot and no runAsUser: CreateContainerConfigError with the
    kubelet's message; the same image with a non-zero runAsUser runs."""
    image = f"example.com/root-{uuid.uuid4().hex[:6]}:1"
    cluster.set_images([{"image": image, "user": "0"}])
    pod = create_pod(kube, namespace, _pod("rooted", [
        {"name": "trainer", "image": image, "command": SLEEP, "securityContext": {"runAsNonRoot": True}},
        {"name": "as-user", "image": image, "command": SLEEP,
         "securityContext": {"runAsNonRoot": True, "runAsUser": 1000}}]))
    uid = pod["metadata"]["uid"]
    _, status = _watch_states(kube, namespace, "rooted", "trainer", lambda s: s["state"].get("waiting", {})
                              .get("reason") == "CreateContainerConfigError")
    expected = f'container has runAsNonRoot and image will run as root (pod: "rooted_{namespace}({uid})", container: trainer)'
    assert status["state"]["waiting"]["message"] == expected
    _watch_states(kube, namespace, "rooted", "as-user", lambda s: "running" in s["state"])
    events = wait_for(lambda: (e := _events(kube, namespace, "rooted")) and any(r == "Failed" for r, _, _ in e) and e,
                      30, message="Failed event")
    assert ("Failed", "spec.containers{trainer}", f"Error: {expected}") in events


def test_a_missing_secret_volume_keeps_the_pod_starting_until_the_secret_exists(cluster, kube, namespace):
    """As the kubelet: no container starts, each stays in its start-up state (PodInitializing with init
    containers, else ContainerCreating; no error reason, no timeout), a FailedMount event names the
    volume and the Secret; once the Secret is created, the pod starts."""
    volumes = [{"name": "token", "secret": {"secretName": "later"}}]
    mounts = [{"name": "token", "mountPath": "/var/run/token"}]
    create_pod(kube, namespace, _pod("mounts", [{"name": "main", "image": "x", "command": SLEEP,
                                                 "volumeMounts": mounts}], volumes=volumes))
    create_pod(kube, namespace, _pod("mounts-init", [{"name": "main", "image": "x", "command": SLEEP}],
                                     initContainers=[{"name": "side", "image": "x", "command": SLEEP,
                                                      "restartPolicy": "Always", "volumeMounts": mounts}],
                                     volumes=volumes))
    wait_for(lambda: any(r == "FailedMount" for r, _, _ in _events(kube, namespace, "mounts")), 60,
             message="a FailedMount event")
    (_, _, message), = [e for e in _events(kube, namespace, "mounts") if e[0] == "FailedMount"]
    assert 'volume "token"' in message and "later" in message and "not found" in message, message
    for pod, container, reason in (("mounts", "main", "ContainerCreating"), ("mounts-init", "side", "PodInitializing"),
                                   ("mounts-init", "main", "PodInitializing")):
        _watch_states(kube, namespace, pod, container, lambda s, r=reason: s["state"].get("waiting") == {"reason": r})
        obj = get_pod(kube, namespace, pod)
        assert obj is not None and obj["status"]["phase"] == "Pending", obj
    kube.create(f"/api/v1/namespaces/{namespace}/secrets",
                {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "later"}, "stringData": {"k": "v"}})
    for pod in ("mounts", "mounts-init"):
        _watch_states(kube, namespace, pod, "main", lambda s: "running" in s["state"])


def test_containers_that_keep_exiting_crash_loop_with_backoff(cluster, kube, namespace):
    """A native sidecar (restartable init container) and a main container of a restartPolicy Always pod
    both exit at once after every start: each is restarted, waits CrashLoopBackOff in between (the
    kubelet's message and a BackOff event), and counts restartCount with lastState set."""
    pod = create_pod(kube, namespace, _pod(
        "crashy", [{"name": "main", "image": "python", "command": ["python", "-c", "import sys; sys.exit(3)"]}],
        restartPolicy="Always",
        initContainers=[{"name": "sidecar", "image": "python", "restartPolicy": "Always",
                         "command": ["python", "-c", "import time, sys; time.sleep(0.3); sys.exit(1)"]}]))
    uid = pod["metadata"]["uid"]
    for container, code in (("sidecar", 1), ("main", 3)):
        seen, status = _watch_states(kube, namespace, "crashy", container,
                                     lambda s: s["restartCount"] >= 3 and "waiting" in s["state"])
        assert "CrashLoopBackOff" in seen, seen
        assert status["lastState"]["terminated"]["exitCode"] == code, status
        assert status["lastState"]["terminated"]["reason"] == "Error"
        waiting = status["state"]["waiting"]
        assert waiting["reason"] == "CrashLoopBackOff", status
        assert waiting["message"].startswith("back-off ") and waiting["message"].endswith(
            f"s restarting failed container={container} pod=crashy_{namespace}({uid})"), waiting
    events = wait_for(lambda: (e := _events(kube, namespace, "crashy")) and sum(r == "BackOff" for r, _, _ in e) >= 2
                      and e, 30, message="BackOff events")
    assert ("BackOff", "spec.initContainers{sidecar}",
            f"Back-off restarting failed container sidecar in pod crashy_{namespace}({uid})") in events
    assert get_pod(kube, namespace, "crashy")["status"]["phase"] == "Running"
