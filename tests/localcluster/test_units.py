"""Pure parts of the local cluster: profiles, the pod-manifest helpers, the build recipe."""

from __future__ import annotations

import base64
import os
from collections.abc import Callable

import pytest
from resilax_local import binaries
from resilax_local.node import pod_network, podspec, profiles, termination


@pytest.mark.parametrize(("accelerator", "topology", "hosts"), [
    ("tpu-v5-lite-podslice", "2x4", 2),
    ("tpu-v5-lite-podslice", "4x4", 4),
    ("tpu-v5-lite-podslice", "2x2", 1),
    ("tpu-v4-podslice", "2x2x4", 4),
    ("tpu-v6e-slice", "8x8", 16),
    ("tpu7x", "2x2x2", 2),
    ("tpu7x", "4x4x4", 16),
], ids=lambda v: str(v))
def test_hosts_per_slice(accelerator, topology, hosts):
    assert profiles.hosts_per_slice(accelerator, topology) == hosts


def test_unknown_accelerator_names_the_valid_ones():
    with pytest.raises(ValueError, match="tpu-v5-lite-podslice"):
        profiles.hosts_per_slice("tpu-v9", "2x2")


def test_default_profile_is_two_v5e_slices_and_a_cpu_node():
    nodes = profiles.build_profile("default")
    tpu = [n for n in nodes if profiles.TPU_RESOURCE in n.capacity]
    assert [n.name for n in tpu] == ["tpu-slice-0-h0", "tpu-slice-0-h1", "tpu-slice-1-h0", "tpu-slice-1-h1"]
    for node in tpu:
        assert node.labels[profiles.ACCELERATOR_LABEL] == "tpu-v5-lite-podslice"
        assert node.labels[profiles.TOPOLOGY_LABEL] == "2x4"
        assert node.capacity[profiles.TPU_RESOURCE] == "4"
        assert node.taints == (profiles.TPU_TAINT,)
    assert {n.labels[profiles.NODEPOOL_LABEL] for n in tpu} == {"tpu-slice-0", "tpu-slice-1"}
    assert [n.name for n in nodes if n not in tpu] == ["cpu-0"]


def test_tpu7x_profile_is_two_ironwood_slices_and_a_cpu_node():
    nodes = profiles.build_profile("tpu7x")
    tpu = [n for n in nodes if profiles.TPU_RESOURCE in n.capacity]
    assert [n.name for n in tpu] == ["tpu7x-slice-0-h0", "tpu7x-slice-0-h1", "tpu7x-slice-1-h0", "tpu7x-slice-1-h1"]
    for node in tpu:
        assert node.labels[profiles.ACCELERATOR_LABEL] == "tpu7x" and node.labels[profiles.TOPOLOGY_LABEL] == "2x2x2"
        assert node.labels["node.kubernetes.io/instance-type"] == "tpu7x-standard-4t"
        assert node.capacity[profiles.TPU_RESOURCE] == "4"
    assert [n.name for n in nodes if n not in tpu] == ["cpu-0"]


def test_scale_profile_has_200_tpu_hosts_without_processes():
    nodes = profiles.build_profile("scale200")
    assert sum(1 for n in nodes if not n.run_pods) == 200


@pytest.mark.parametrize(("text", "env", "expected"), [
    ("$(A)-$(B)", {"A": "1", "B": "2"}, "1-2"),
    ("$(MISSING)", {}, "$(MISSING)"),
    ("$$(A)", {"A": "1"}, "$(A)"),
    ("plain $A", {"A": "1"}, "plain $A"),
], ids=["both", "unknown-kept", "escaped", "shell-style-untouched"])
def test_expand(text, env, expected):
    assert podspec.expand(text, env) == expected


POD = {
    "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"app": "x"}, "annotations": {"a": "b"}},
    "spec": {"nodeName": "n1", "serviceAccountName": "sa"},
    "status": {"podIP": "127.9.1.1", "hostIP": "127.9.0.1"},
}


def test_build_env_resolves_every_source_in_order():
    objects = {
        ("configmaps", "cm"): {"data": {"k": "from-cm", "other": "x"}},
        ("secrets", "sec"): {"data": {"pw": base64.b64encode(b"s3cret").decode()}},
    }
    container = {
        "name": "c",
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "K", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}},
            {"name": "PW", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "pw"}}},
            {"name": "OPT", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "x", "optional": True}}},
            {"name": "ADDR", "value": "$(IP):8080/$(NAME)"},
        ],
    }
    env = podspec.build_env(POD, container, lambda kind, name: objects.get((kind, name)), {"PATH": "/bin"})
    assert env["NAME"] == "p" and env["IP"] == "127.9.1.1" and env["NODE"] == "n1" and env["APP"] == "x"
    assert env["K"] == "from-cm" and env["PW"] == "s3cret" and env["CM_other"] == "x"
    assert env["ADDR"] == "127.9.1.1:8080/p"
    assert "OPT" not in env and env["PATH"] == "/bin"


def test_build_env_missing_key_names_it():
    container = {"name": "c", "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "k"}}}]}
    with pytest.raises(ValueError, match="env X: key 'k' of configmap 'cm' not found"):
        podspec.build_env(POD, container, lambda kind, name: None, {})


def test_a_container_without_command_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="does not pull images"):
        podspec.command_line({"name": "c", "image": "busybox"}, {})


@pytest.mark.parametrize(("policy", "code", "restart"), [
    ("Always", 0, True), ("Always", 1, True), ("OnFailure", 0, False), ("OnFailure", 2, True),
    ("Never", 0, False), ("Never", 1, False),
], ids=lambda v: str(v))
def test_restart_rules(policy, code, restart):
    assert podspec.should_restart(policy, code) is restart


def test_staging_replaces_follow_upstream_go_mod():
    upstream = """
replace (
\tk8s.io/api => ./staging/src/k8s.io/api
\tk8s.io/client-go => ./staging/src/k8s.io/client-go
\tgithub.com/other/thing => github.com/other/thing v1.0.0
)
"""
    assert binaries.staging_replaces(upstream, "v1.37.2") == [
        "\tk8s.io/api => k8s.io/api v0.37.2", "\tk8s.io/client-go => k8s.io/client-go v0.37.2"]


def test_without_go_or_binaries_the_message_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("RESILAX_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    with pytest.raises(binaries.BinaryError, match="KUBEBUILDER_ASSETS") as info:
        binaries.ensure_binaries()
    assert "install Go" in str(info.value)


def test_kubebuilder_assets_come_first(tmp_path, monkeypatch):
    for name in ("kube-apiserver", "etcd"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path))
    assert binaries.ensure_etcd(build=False) == tmp_path / "etcd"


def test_a_long_build_step_says_it_is_still_running(tmp_path, monkeypatch, caplog):
    """A build step prints a heartbeat (elapsed time, the log's path) while it runs, then logs its end."""
    import logging
    import sys

    monkeypatch.setenv("RESILAX_CACHE", str(tmp_path))
    monkeypatch.setattr(binaries, "HEARTBEAT_SECONDS", 0.2)
    with caplog.at_level(logging.INFO, logger=binaries.__name__):
        binaries._run_build([sys.executable, "-c", "import time; time.sleep(1.0); print('done')"], tmp_path,
                            "test-build.log")
    beats = [r.getMessage() for r in caplog.records if "still building" in r.getMessage()]
    assert beats and all(str(tmp_path / "test-build.log") in b and "s so far" in b for b in beats)
    assert "done" in (tmp_path / "test-build.log").read_text()
    with pytest.raises(binaries.BinaryError, match=r"test-build\.log"):
        binaries._run_build([sys.executable, "-c", "raise SystemExit(3)"], tmp_path, "test-build.log")


def test_on_free_port_tries_another_port_when_the_first_was_taken() -> None:
    from resilax_local.processes import PortTaken, on_free_port

    tried: list[int] = []

    def start(port: int) -> int:
        tried.append(port)
        if len(tried) < 3:
            raise PortTaken(f"port {port} taken")
        return port

    assert on_free_port(start) == tried[-1] and len(tried) == 3

    def never(port: int) -> int:
        tried.append(port)
        raise PortTaken(f"port {port} taken")

    tried.clear()
    with pytest.raises(PortTaken):
        on_free_port(never, attempts=2)
    assert len(tried) == 2


def graced(spec: int | None, deletion: int | None) -> dict:
    """A pod whose spec says `spec` seconds (None: unset) and whose DELETE said `deletion` (None: none)."""
    return {"metadata": {} if deletion is None else {"deletionGracePeriodSeconds": deletion},
            "spec": {} if spec is None else {"terminationGracePeriodSeconds": spec}}


@pytest.mark.parametrize(("current", "pod", "grace"), [
    pytest.param(None, graced(30, None), 30, id="not-deleted-the-pods-own"),
    pytest.param(None, graced(None, None), 30, id="no-spec-the-default"),
    pytest.param(None, graced(30, 2), 2, id="a-2s-delete-beats-the-pods-30s"),
    pytest.param(None, graced(30, 0), 1, id="force-delete-at-least-1s"),
    pytest.param(None, graced(0, None), 1, id="spec-0-at-least-1s"),
    pytest.param(30, graced(30, 2), 2, id="a-later-shorter-delete-shortens"),
    pytest.param(2, graced(30, 30), 2, id="never-longer-than-in-force"),
    pytest.param(5, graced(30, None), 5, id="in-force-kept"),
])
def test_plan_grace_is_the_kubelets_effective_grace(current, pod, grace):
    assert termination.plan_grace(current, pod) == grace


def _draws(*octets: int) -> Callable[[int, int], int]:
    """A `randrange` that gives these octets in turn."""
    left = list(octets)

    def draw(start: int, stop: int) -> int:
        value = left.pop(0)
        assert start <= value < stop
        return value
    return draw


def test_each_cluster_holds_its_octet_alone(tmp_path) -> None:
    """Goodput seed 2 of 2026-12-07: a second cluster that drew the same octet flushed the first one's pod
    addresses when it stopped. Now an octet whose lock is held, or whose block has an address on the
    loopback interface already, is passed over; a closed lock frees it."""
    first, lock = pod_network.hold_octet(_draws(40), tmp_path, in_use=lambda o: False)
    second, other = pod_network.hold_octet(_draws(40, 41), tmp_path, in_use=lambda o: False)
    assert (first, second) == (40, 41)
    third, held = pod_network.hold_octet(_draws(42, 43), tmp_path, in_use=lambda o: o == 42)  # an older cluster's
    assert third == 43
    for fd in (lock, other, held):
        os.close(fd)
    again, fd = pod_network.hold_octet(_draws(40), tmp_path, in_use=lambda o: False)
    assert again == 40
    os.close(fd)
    taken = pod_network.lock_octet(44, tmp_path)
    assert taken is not None
    try:
        with pytest.raises(RuntimeError, match="no free octet"):
            pod_network.hold_octet(_draws(44, 44), tmp_path, in_use=lambda o: False, tries=2)
    finally:
        os.close(taken)
