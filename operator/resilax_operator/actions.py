"""What a decision asks the I/O side to do (pure types). execute.py carries each out, in order,
stopping at the first failure; every action is idempotent, so the next decision may repeat it.

Rules every decision keeps (`collapse` and `status_change` help):
- At most one `SetStatus` per decision (the full status, not a diff), placed before the objects it
  describes.
- A status that names a new generation (or a transition) is written before acting on it.
- Events go with the status change that records what they announce, so deciding twice emits nothing new.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Final

from . import status as st
from .builders import Manifest
from .status import JobStatus

#: How soon to look again while waiting for something that has no event of its own (seconds).
POLL_SECONDS: Final = 5.0


@dataclass(frozen=True)
class SetStatus:
    """Make the status subresource `status` (the full status): the I/O side sends a JSON merge patch of
    what differs from the status as stored (`status.build_status_patch`)."""

    status: JobStatus


@dataclass(frozen=True)
class CreateGeneration:
    """Create `service` (if given) and each pod, skipping those that already exist and are the job's (a
    409 on an object owned by this JAXJob's uid is success). Before anything, the job's token Secret must
    exist and be the job's (`EnsureTokenSecret`). When the API server refuses a pod (admission: 400, 403,
    422), the I/O side stops and asks `reconcile.decide_pod_refused`; when an object of the name exists
    and is not the job's, it stops and asks `reconcile.decide_name_conflict` (never adopted)."""

    generation: int
    service: Manifest | None
    pods: tuple[Manifest, ...]


@dataclass(frozen=True)
class PodDeletion:
    """One pod to delete, and how."""

    name: str
    #: gracePeriodSeconds for the delete call; None: the pod's own terminationGracePeriodSeconds.
    grace_seconds: int | None = None
    #: No kubelet will confirm this pod (its node is down or gone): delete with gracePeriodSeconds=0.
    force: bool = False
    #: Not before this time (a trainer that stops by itself after its final save gets the chance);
    #: until then the I/O side leaves the pod alone and the decision asks to look again.
    not_before: datetime | None = None


@dataclass(frozen=True)
class DeleteGeneration:
    """Delete the generation's Service and the pods in `pods` (each as its `PodDeletion` says; pods
    already being deleted and not forced are not listed). 404 is success."""

    generation: int
    reason: str
    pods: tuple[PodDeletion, ...] = ()
    #: The processes of `generation` on a node proven down or gone (node_loss.pods_on_lost_nodes): the
    #: sidecars of the pods deleted here with a grace are told (`POST /v1/peers/lost`), so a final upload
    #: that waits for these processes' markers, which never come, ends at once instead of at SIGKILL.
    lost: tuple[int, ...] = ()

    @property
    def force_pods(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.pods if d.force)


@dataclass(frozen=True)
class RequestFinalSave:
    """Ask the workers of `generation` for a final save and stop. Emitted on every decision until the
    save is done, so executing it must be idempotent. With the sidecar's API (resilax_sidecar.routes):
    for each pod in `pods` that lacks the annotation `resilax.dev/save-request` starting with
    `<request_id>=`, POST `http://<podIP>:<RESILAX_SIDECAR_PORT>/v1/save` with the bearer token and
    {"reason": reason, "stop": true}, then annotate the pod `<request_id>=<the sidecar's id>`. Any one
    pod suffices (all processes agree on one step); posting to all survives a dead one. The answers
    come back as `Observed.save_outcomes` (observed/observe.py)."""

    generation: int
    request_id: str
    reason: str
    deadline: datetime
    pods: tuple[str, ...]


@dataclass(frozen=True)
class PatchWorkerPods:
    """Re-label and re-annotate pods an in-place restart keeps for `generation` (a JSON merge patch of
    each pod's labels and annotations). A pod that is gone (404) is skipped: the next decision drops it."""

    generation: int
    #: (pod, labels, annotations), each as sorted (key, value) pairs.
    pods: tuple[tuple[str, tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]], ...]


#: (annotation, value) pairs for a JSON merge patch of metadata.annotations; None removes the annotation.
Notes = tuple[tuple[str, str | None], ...]


@dataclass(frozen=True)
class PublishFreshness:
    """Merge-patch the checkpoint freshness annotations (api.FRESHNESS_ANNOTATIONS) onto the JAXJob
    (`job`; () leaves it alone) and onto each pod of `pods` (a pod gone, 404, is skipped). Decided by
    policies/freshness.py: only what differs, once per newly committed step."""

    job: Notes
    #: (pod, its notes)
    pods: tuple[tuple[str, Notes], ...]


@dataclass(frozen=True)
class CreateProbes:
    """Create these grow-back probe pods (policies/grow_back_probe.py); one of the name the job owns
    (409) is success, one it does not own is left alone (logged: never adopted)."""

    pods: tuple[Manifest, ...]


@dataclass(frozen=True)
class DeleteProbes:
    """Delete these probe pods of the job (grace 0, each of the uid observed); 404 is success."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class CreateSpares:
    """Create these spare placeholder pods (policies/spares.py); one of the name the job owns (409) is
    success; one it does not own, or a refusal (a missing PriorityClass, a quota), is logged and left:
    a spare is never worth failing a reconcile for (status.spares shows it not ready)."""

    pods: tuple[Manifest, ...]


@dataclass(frozen=True)
class DeleteSpares:
    """Delete these placeholder pods of the job (grace 0, each of the uid observed); 404 is success.
    Placed before a CreateGeneration whose workers take their nodes."""

    names: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class SuspendSpareJob:
    """Set `spec.suspend` of the JAXJob `name` of the job's namespace (only the object of `uid`) and its
    `resilax.dev/suspended-for` annotation (`lent_to`; "" removes it): a lower-priority job that serves
    as this job's spare is suspended (its own final save first) or resumed (policies/spare_jobs.py).
    A job gone (404, 409) is success."""

    name: str
    uid: str
    suspend: bool
    lent_to: str


@dataclass(frozen=True)
class StopTrainers:
    """POST `/v1/trainer/stop` {"generation", "reason", "stacks"} (bearer token) to each pod's sidecar:
    its supervisor stops a trainer older than `generation` and reports it `exited` once it and every
    descendant are reaped. An unreachable sidecar is logged and left to the restart's deadline."""

    generation: int
    pods: tuple[str, ...]
    reason: str
    stacks: bool = False


@dataclass(frozen=True)
class StartTrainers:
    """POST `/v1/trainer/start` {"generation", "env"} (bearer token) to each pod's sidecar: its supervisor
    starts the trainer of `generation` with the pod's environment overlaid by `env`, once none lives.
    Errors are logged; the decision sends it again until the sidecar reports the assignment."""

    generation: int
    #: (pod, env as sorted (name, value) pairs)
    pods: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]


@dataclass(frozen=True)
class EnsureTokenSecret:
    """Make sure the job's token Secret exists and is the job's: read it, re-create it when it is gone
    (with the token the sidecars know, when the operator still has it). One that is not the job's is a
    `NameConflictError` (the I/O side then asks `reconcile.decide_name_conflict`). CreateGeneration does
    the same before creating anything."""


@dataclass(frozen=True)
class EmitEvent:
    """A Kubernetes Event on the JAXJob. Emitted once per transition (decisions emit it together with
    the status change that records the transition)."""

    type: str
    reason: str
    message: str


@dataclass(frozen=True)
class DeleteJob:
    """Delete the JAXJob itself (spec.ttlSecondsAfterFinished ran out); only the object of this uid."""

    uid: str
    reason: str


@dataclass(frozen=True)
class RequeueAfter:
    """Decide again after this many seconds at the latest (a hint for the timer)."""

    seconds: float


Action = (SetStatus | CreateGeneration | DeleteGeneration | RequestFinalSave | PatchWorkerPods | PublishFreshness
          | CreateProbes | DeleteProbes | CreateSpares | DeleteSpares | SuspendSpareJob | StopTrainers | StartTrainers | EnsureTokenSecret
          | EmitEvent | DeleteJob
          | RequeueAfter)


def status_change(old: JobStatus, new: JobStatus, *events: EmitEvent) -> list[Action]:
    """SetStatus (and the events that go with it) only when the status changes."""
    if st.build_status(old) == st.build_status(new):
        return []
    return [SetStatus(new), *events]


def collapse(actions: list[Action]) -> list[Action]:
    """One SetStatus per decision: the last (most complete) status, at the place of the first, so the
    status is written before the objects it describes."""
    statuses = [a for a in actions if isinstance(a, SetStatus)]
    if len(statuses) <= 1:
        return actions
    first = actions.index(statuses[0])
    rest: list[Action] = [a for a in actions if not isinstance(a, SetStatus)]
    rest.insert(first, statuses[-1])
    return rest
