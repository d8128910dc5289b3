"""Pure parts of the node agent's waiting states: image references and the registry table (images.py),
the kubelet's backoff curve and its runAsNonRoot check (podspec.py)."""

from __future__ import annotations

import pytest
from resilax_local.node import images, podspec
from resilax_local.node.images import ImageEntry, ImageRef, Registry


@pytest.mark.parametrize(("image", "expected"), [
    ("python", ImageRef("docker.io", "library/python")),
    ("python:3.11", ImageRef("docker.io", "library/python", "3.11")),
    ("example/train:1", ImageRef("docker.io", "example/train", "1")),
    ("ghcr.io/resilax/resilax:0.1.0", ImageRef("ghcr.io", "resilax/resilax", "0.1.0")),
    ("localhost:5000/app", ImageRef("localhost:5000", "app")),
    ("registry.invalid/team/app:v2", ImageRef("registry.invalid", "team/app", "v2")),
    ("x@sha256:" + "a" * 64, ImageRef("docker.io", "library/x", None, "sha256:" + "a" * 64)),
    ("my_app__x-y.z", ImageRef("docker.io", "library/my_app__x-y.z")),
], ids=["short", "tag", "user-repo", "ghcr", "localhost-port", "invalid-host", "digest", "separators"])
def test_references_parse_and_normalize_as_a_runtime_does(image, expected):
    assert images.parse_reference(image) == expected


@pytest.mark.parametrize(("image", "why"), [
    ("", "invalid reference format"),
    ("Python", "must be lowercase"),
    ("ex ample/app", "invalid reference format"),
    ("app:", "invalid reference format"),
    ("app::1", "invalid reference format"),
    ("app@sha256:short", "invalid reference format"),
    ("a//b", "invalid reference format"),
    ("-app", "invalid reference format"),
], ids=["empty", "upper-case", "space", "empty-tag", "double-colon", "short-digest", "empty-component",
        "leading-dash"])
def test_bad_references_are_refused_with_the_kubelets_message(image, why):
    with pytest.raises(images.InvalidImageError) as info:
        images.parse_reference(image)
    assert str(info.value).startswith(f'Failed to apply default image tag "{image}": couldn\'t parse image name')
    assert why in str(info.value)


def test_full_name_gets_the_default_tag():
    assert images.parse_reference("python").full == "docker.io/library/python:latest"
    assert images.parse_reference("a.io/b:1@sha256:" + "f" * 64).full == "a.io/b:1@sha256:" + "f" * 64


@pytest.mark.parametrize(("image", "pullable", "user"), [
    ("python:3.11", True, images.DEFAULT_USER),          # not in the table: served, non-root
    ("example.com/root-app:1", True, "0"),               # the repository's row: every tag
    ("example.com/root-app", True, "0"),
    ("example.com/gone:1", False, images.DEFAULT_USER),  # a tag's row
    ("example.com/gone:2", True, images.DEFAULT_USER),   # another tag of it is served
    ("docker.io/library/busybox:latest", True, "root"),  # rows match normalized names
], ids=["default", "repo-row-tag", "repo-row-latest", "tag-row", "other-tag", "normalized"])
def test_the_registry_table_row_of_an_image(image, pullable, user):
    registry = Registry([ImageEntry("example.com/root-app", user="0"), ImageEntry("example.com/gone:1", pullable=False),
                         ImageEntry("busybox", user="root")])
    entry = registry.lookup(images.parse_reference(image))
    assert (entry.pullable, entry.user) == (pullable, user)


def test_a_later_row_for_the_same_image_replaces_the_earlier():
    registry = Registry([ImageEntry("example.com/app:1", pullable=False)])
    registry.set([ImageEntry("example.com/app:1")])
    assert registry.lookup(images.parse_reference("example.com/app:1")).pullable
    assert len(registry.entries()) == 1


@pytest.mark.parametrize(("image", "entry", "expected"), [
    ("python", ImageEntry("python"), None),
    ("registry.invalid/app:1", ImageEntry("registry.invalid/app:1"),
     'Head "https://registry.invalid/v2/app/manifests/1": dial tcp: lookup registry.invalid: no such host'),
    ("reg.invalid:5000/app", ImageEntry("reg.invalid:5000/app"), "lookup reg.invalid: no such host"),
    ("example.com/gone:1", ImageEntry("example.com/gone:1", pullable=False),
     'code = NotFound desc = failed to pull and unpack image "example.com/gone:1": failed to resolve reference '
     '"example.com/gone:1": example.com/gone:1: not found'),
    ("example.com/private:1", ImageEntry("example.com/private:1", pullable=False, error="403 Forbidden"),
     "403 Forbidden"),
], ids=["served", "unreachable-host", "unreachable-host-port", "not-found", "own-error"])
def test_pull_errors(image, entry, expected):
    error = images.pull_error(images.parse_reference(image), entry)
    if expected is None:
        assert error is None
    else:
        assert error is not None and expected in error


@pytest.mark.parametrize(("data", "problem"), [
    ({"image": "Bad"}, "must be lowercase"),
    ({"image": "x", "pullable": "no"}, "pullable: 'no' is not true or false"),
    ({"image": "x", "user": ""}, "user: '' is not a user"),
    ({"image": "x", "root": True}, "unknown fields ['root']"),
    ({}, "image: None is not an image reference"),
], ids=["bad-image", "pullable-type", "empty-user", "unknown-field", "no-image"])
def test_bad_table_rows_are_refused_naming_the_field(data, problem):
    with pytest.raises(ValueError, match="image entry: ") as info:
        ImageEntry.from_json(data)
    assert problem in str(info.value)


@pytest.mark.parametrize(("user", "expected"), [
    ("0", (0, "")), ("0:0", (0, "")), ("1000:1000", (1000, "")), ("65532", (65532, "")), ("app", (None, "app")),
    ("root:root", (None, "root")),
])
def test_image_user(user, expected):
    assert images.image_user(user) == expected


POD = {"metadata": {"name": "w-0", "namespace": "ns", "uid": "u-1"}, "spec": {}}
WHERE = '(pod: "w-0_ns(u-1)", container: trainer)'


@pytest.mark.parametrize(("pod_context", "container_context", "user", "expected"), [
    ({}, {"runAsNonRoot": True}, "0", f"container has runAsNonRoot and image will run as root {WHERE}"),
    ({"runAsNonRoot": True}, {}, "0:0", f"container has runAsNonRoot and image will run as root {WHERE}"),
    ({}, {"runAsNonRoot": True}, "65532", None),
    ({}, {"runAsNonRoot": True, "runAsUser": 1000}, "0", None),              # runAsUser overrides the image
    ({"runAsUser": 1000}, {"runAsNonRoot": True}, "0", None),                # the pod's runAsUser counts too
    ({}, {"runAsNonRoot": True, "runAsUser": 0}, "65532", f"container's runAsUser breaks non-root policy {WHERE}"),
    ({}, {"runAsNonRoot": True}, "app",
     f"container has runAsNonRoot and image has non-numeric user (app), cannot verify user is non-root {WHERE}"),
    ({"runAsNonRoot": True}, {"runAsNonRoot": False}, "0", None),            # the container's setting wins
    ({}, {}, "0", None),                                                     # no runAsNonRoot: root is fine
], ids=["root-image", "pod-level", "non-root-image", "run-as-user", "pod-run-as-user", "run-as-root",
        "named-user", "container-overrides", "unset"])
def test_run_as_non_root_as_the_kubelet_checks_it(pod_context, container_context, user, expected):
    pod = {**POD, "spec": {"securityContext": pod_context}}
    container = {"name": "trainer", "securityContext": container_context}
    assert podspec.verify_run_as_non_root(pod, container, *images.image_user(user)) == expected


def test_crash_loop_backoff_follows_the_kubelets_curve():
    """First restart at once; a container that keeps exiting waits 1, 2, 4 ... 20 s (upstream 10 s .. 5 min)."""
    b = podspec.Backoff(1.0, 20.0)
    now, waits = 100.0, []
    for _ in range(8):
        finished = now  # the container exits right after each start
        assert b.in_backoff_since(finished, now) is (b.last_update is not None)
        wait = b.delay if b.last_update is not None else 0.0
        assert not b.in_backoff_since(finished, finished + wait)
        waits.append(wait)
        now = finished + wait
        b.next(now)
    assert waits == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 20.0, 20.0]


def test_crash_loop_backoff_starts_over_after_a_long_run():
    b = podspec.Backoff(1.0, 20.0)
    b.next(0.0)
    b.next(1.0)
    assert b.delay == 2.0 and b.in_backoff_since(2.0, 3.0)
    assert not b.in_backoff_since(42.0, 42.0)  # exited more than 2x the maximum after the last restart
    b.next(42.0)
    assert b.delay == 1.0


@pytest.mark.parametrize(("seconds", "text"), [(1, "1s"), (20, "20s"), (80, "1m20s"), (300, "5m0s"),
                                               (3700, "1h1m40s")])
def test_go_duration(seconds, text):
    assert podspec.go_duration(seconds) == text


def test_format_pod():
    assert podspec.format_pod(POD) == "w-0_ns(u-1)"
