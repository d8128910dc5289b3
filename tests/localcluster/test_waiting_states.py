"""The node agent's waiting states, as a kubelet shows them (docs/local-cluster.md, "Images" and
"Restarts"): an image the registry cannot serve (ErrImagePull, then ImagePullBackOff), a root image
under runAsNonRoot (CreateContainerConfigError), and containers that keep exiting (CrashLoopBackOff,
restartCount, lastState). Every wait polls for a state; none asserts a duration."""

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
