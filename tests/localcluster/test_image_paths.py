"""A container's "image" (this Python and the checkout) stays visible under a volume that would hide it:
the chart's operator mounts an emptyDir at /tmp, so a checkout under /tmp used to fail to import."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import resilax_ckpt
from resilax_local.node.containers import image_mounts, image_paths
from resilax_local.testing import create_pod, wait_for_pod_phase


def test_image_mounts_rebind_only_what_a_volume_hides() -> None:
    image = ["/root/.cache/resilax/venv", "/tmp/ci/main", "/usr"]
    assert image_mounts(["/data", "/etc/hosts"], image) == []
    assert image_mounts(["/tmp"], image) == [{"source": "/tmp/ci/main", "target": "/tmp/ci/main", "read_only": True}]
    assert [m["target"] for m in image_mounts(["/root", "/tmp/ci/main"], image)] == [
        "/root/.cache/resilax/venv", "/tmp/ci/main"]
    assert image_mounts(["/tmp/ci/main/sub", "/tm"], image) == []  # inside the image, or a mere prefix


def test_image_paths_hold_this_python_and_the_checkout() -> None:
    paths = image_paths()
    here = Path(resilax_ckpt.__file__).resolve()
    assert any(here.is_relative_to(p) for p in paths), (here, paths)


def test_a_volume_over_the_checkouts_parent_does_not_hide_the_project(cluster, kube, namespace) -> None:
    project = Path(resilax_ckpt.__file__).resolve().parents[2]
    if project.parent == Path("/"):
        pytest.skip(f"the checkout {project} sits at the root: no folder above it to mount over")
    script = ("import json, os, resilax_ckpt; print('IMPORTED', resilax_ckpt.__file__); "
              "print('LISTING', json.dumps(sorted(os.listdir(os.environ['OVER']))))")
    create_pod(kube, namespace, {"metadata": {"name": "over"}, "spec": {
        "restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
        "containers": [{"name": "main", "image": "python", "command": ["python", "-c", script],
                        "env": [{"name": "OVER", "value": str(project.parent)}],
                        "volumeMounts": [{"name": "scratch", "mountPath": str(project.parent)}]}],
        "volumes": [{"name": "scratch", "emptyDir": {}}]}})
    pod = wait_for_pod_phase(kube, namespace, "over", ("Succeeded", "Failed"), timeout=90)
    log = cluster.logs(namespace, "over", "main")
    assert pod["status"]["phase"] == "Succeeded", log
    lines = dict(ln.split(" ", 1) for ln in log.splitlines() if ln.startswith(("IMPORTED ", "LISTING ")))
    assert Path(lines["IMPORTED"]).resolve() == Path(resilax_ckpt.__file__).resolve()
    # The volume is mounted (the folder's own files are hidden) and holds only the image's folders.
    rebound = {Path(p).relative_to(project.parent).parts[0] for p in image_paths() if Path(p).is_relative_to(project.parent)}
    assert set(json.loads(lines["LISTING"])) == rebound
    assert project.name in rebound
