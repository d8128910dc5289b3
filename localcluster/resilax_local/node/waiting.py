"""Why a container is not running yet, as the kubelet reports it: image pulls against the local
registry (InvalidImageName, ErrImageNeverPull, ErrImagePull, ImagePullBackOff), configuration errors
(CreateContainerConfigError) and the crash-loop backoff (CrashLoopBackOff), each with the kubelet's
events and its retry time."""

from __future__ import annotations

import time

from . import images, podspec
from .containers import ContainerRun
from .podhost import Pod, PodHost

CREATE_CONFIG_ERROR = "CreateContainerConfigError"
CRASH_LOOP_BACK_OFF = "CrashLoopBackOff"
#: How soon a container that could not be created (config error, image not present) is tried again.
RETRY_SECONDS = 2.0
#: How long ErrImagePull shows before ImagePullBackOff (the kubelet's next sync of the pod).
ERR_IMAGE_PULL_SECONDS = 1.0


def set_waiting(host: PodHost, pod: Pod, c: ContainerRun, reason: str, message: str, retry_at: float, event: bool = True) -> None:
    """The container cannot start now: it waits with `reason` (a `Failed` event `Error: ...` when the
    message is new, as the kubelet's startContainer reports it) and is tried again at `retry_at`."""
    if event and (c.waiting_reason, c.waiting_message) != (reason, message):
        text = message if reason == CREATE_CONFIG_ERROR else reason
        host.emit_event(pod, "Failed", f"Error: {text}", warning=True, container=c.name)
    c.waiting_reason, c.waiting_message = reason, message
    c.restart_at = retry_at

def ensure_image(host: PodHost, pod: Pod, c: ContainerRun,
                 image_backoff: dict[str, podspec.Backoff]) -> images.ImageEntry | None:
    """The kubelet's EnsureImageExists against the local registry (images.py): the image's entry when
    it is present or pulled now; None while the container waits (InvalidImageName, ErrImageNeverPull,
    ErrImagePull, then ImagePullBackOff until the pull backoff of that image ends). `image_backoff`:
    the pod's pull backoff per image (the kubelet keys it by pod uid and image)."""
    image = str(c.spec.get("image") or "")
    now = time.monotonic()
    try:
        ref = images.parse_reference(image)
    except images.InvalidImageError as e:
        if c.waiting_reason != "InvalidImageName":
            host.emit_event(pod, "InspectFailed", str(e), warning=True, container=c.name)
        set_waiting(host, pod, c, "InvalidImageName", str(e), now + RETRY_SECONDS)
        return None
    entry = host.image_entry(ref)
    error = images.pull_error(ref, entry)
    policy = c.spec.get("imagePullPolicy") or images.default_pull_policy(ref)
    if error is None and policy != "Always":  # served images are present on every node
        host.emit_event(pod, "Pulled", f'Container image "{image}" already present on machine',
                             container=c.name)
        return entry
    if policy == "Never":
        message = f'Container image "{image}" is not present with pull policy of Never'
        if c.waiting_reason != "ErrImageNeverPull":
            host.emit_event(pod, "ErrImageNeverPull", message, warning=True, container=c.name)
        set_waiting(host, pod, c, "ErrImageNeverPull", message, now + RETRY_SECONDS)
        return None
    backoff = image_backoff.setdefault(
        image, podspec.Backoff(podspec.IMAGE_BACKOFF_INITIAL, podspec.IMAGE_BACKOFF_MAX))
    if backoff.last_update is not None and backoff.in_backoff_since(backoff.last_update, now):
        message = f'Back-off pulling image "{image}"'
        if c.waiting_reason != "ImagePullBackOff":
            host.emit_event(pod, "BackOff", message, container=c.name)
        set_waiting(host, pod, c, "ImagePullBackOff", message, backoff.last_update + backoff.delay)
        return None
    host.emit_event(pod, "Pulling", f'Pulling image "{image}"', container=c.name)
    if error is None:
        host.emit_event(pod, "Pulled", f'Successfully pulled image "{image}" in 0s', container=c.name)
        return entry
    backoff.next(now)
    host.emit_event(pod, "Failed", f'Failed to pull image "{image}": {error}', warning=True,
                         container=c.name)
    # ErrImagePull stays in the status until the next sync (a second here), then ImagePullBackOff
    set_waiting(host, pod, c, "ErrImagePull", error, now + min(ERR_IMAGE_PULL_SECONDS, backoff.delay))
    return None


def crash_loop_due(host: PodHost, pod: Pod, c: ContainerRun) -> bool:
    """Whether an exited container may start again now: the kubelet's crash-loop backoff (`doBackOff`).
    The first restart is immediate; a container that exits again within the backoff waits with
    CrashLoopBackOff (`back-off 2s restarting failed container=NAME pod=NAME_NS(UID)`, a BackOff
    event) until `finished + delay`; each restart doubles the delay (podspec.Backoff)."""
    now = time.monotonic()
    if c.waiting_reason != CRASH_LOOP_BACK_OFF and c.restart_at is not None and now < c.restart_at:
        return False  # an image or config retry is pending
    finished = c.finished_at if c.finished_at is not None else now
    if c.backoff.in_backoff_since(finished, now):
        until = finished + c.backoff.delay
        if c.restart_at != until:
            host.emit_event(
                pod, "BackOff",
                f"Back-off restarting failed container {c.name} in pod {podspec.format_pod(pod)}",
                warning=True, container=c.name)
        c.waiting_reason = CRASH_LOOP_BACK_OFF
        c.waiting_message = (f"back-off {podspec.go_duration(c.backoff.delay)} restarting failed "
                             f"container={c.name} pod={podspec.format_pod(pod)}")
        c.restart_at = until
        return False
    c.backoff.next(now)
    return True
