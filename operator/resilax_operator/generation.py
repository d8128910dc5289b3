"""Pure: a generation of workers — the job it belongs to, its plan — and the names of the objects
the builders make for it. Below both `builders.py` (manifests) and `pods/worker_env.py` (environment)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import api
from .spec import JobSpec, Shape


@dataclass(frozen=True)
class JobRef:
    """The JAXJob object that owns what the builders make."""

    name: str
    namespace: str
    uid: str
    #: The JAXJob's `kueue.x-k8s.io/queue-name` label ("" without one).
    queue: str = ""


@dataclass(frozen=True)
class GenerationPlan:
    """One generation: its number, shape, the node pool each slice runs on, and the step to restore."""

    generation: int
    shape: Shape
    #: pools[i] is the node pool (value of cloud.google.com/gke-nodepool) of slice i; len == shape.count.
    #: "" (capacity.provisioning Autoscaled): no Ready pool hosts slice i yet; its pods go to whichever
    #: node pool the cluster provides, all on one pool and none on another slice's (`_slice_placement`).
    pools: tuple[str, ...]
    restore_step: str = "latest"
    #: Worker process index → the node it last ran on (status.workerNodes): a preferred node affinity.
    worker_nodes: tuple[tuple[int, str], ...] = ()
    #: The pod of each process id (status.workerPods); () or "" for a process: the name `build_pod_name`
    #: gives this generation. A pod kept by an in-place restart keeps the name it was created with.
    worker_pods: tuple[str, ...] = ()
    #: The uids of the other live JAXJobs with the same spec.checkpoint.storage (Observed.storage_sharers):
    #: the workers refuse to take the storage over from one of them (RESILAX_LIVE_JOB_UIDS).
    live_job_uids: tuple[str, ...] = ()
    #: Nodes the operator holds down while the API server still shows them Ready (a witnessed Lease:
    #: `Observed.nodes_held_down`): the scheduler would still place a pod there, so none of this
    #: generation may go (a required node anti-affinity), nor prefers it as its process's last node.
    avoid_nodes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if len(self.pools) != self.shape.count:
            raise ValueError(f"generation {self.generation}: {len(self.pools)} pools for {self.shape.count} slices")

    def pod_name(self, job: str, process_id: int, hosts: int) -> str:
        """The name of the pod of `process_id` (hosts per slice: `hosts`)."""
        if process_id < len(self.worker_pods) and self.worker_pods[process_id]:
            return self.worker_pods[process_id]
        return build_pod_name(job, self.generation, process_id // hosts, process_id % hosts)


def build_pod_name(job: str, generation: int, slice_index: int, host: int) -> str:
    """A new pod's name: the generation it is created for (it may serve later ones, in place)."""
    return f"{job}-g{generation}-s{slice_index}-h{host}"


def build_workers_service_name(job: str) -> str:
    """The job-wide headless Service every worker pod names as its `subdomain` (a pod's subdomain is
    immutable, and a kept pod serves several generations)."""
    return f"{job}-workers"


def build_generation_service_name(job: str, generation: int) -> str:
    """The per-generation headless Service of operators before the job-wide one: deleted as a leftover."""
    return f"{job}-g{generation}"


def build_pod_group_name(job: str, generation: int) -> str:
    """The Kueue pod group of a generation's workers."""
    return f"{job}-g{generation}"


def build_token_secret_name(job: str) -> str:
    return f"{job}-resilax-token"


def kueue_queue(job: JobRef, spec: JobSpec) -> str:
    """The Kueue LocalQueue of the job's workers: the JAXJob's `kueue.x-k8s.io/queue-name` label, else the
    template's; "" for none."""
    labels: dict[str, Any] = (spec.template.get("metadata") or {}).get("labels") or {}
    return job.queue or str(labels.get(api.KUEUE_QUEUE_LABEL) or "")


def creates_all_at_once(job: JobRef, spec: JobSpec) -> bool:
    """Whether a generation's pods are all created together, the coordinator named by DNS
    (`<pod 0>.<service>`), instead of pod 0 first and the others with its IP. For a Kueue queue: Kueue
    creates the pod group's Workload only once it sees all of its pods, and gates each until then."""
    return bool(kueue_queue(job, spec))


def worker_pod_names(job: str, workers: tuple[str, ...], generation: int, count: int, hosts: int) -> list[str]:
    """The current generation's pod names by process id: `workers` (status.workerPods) when the status
    has them, else (a status written before them) the names `build_pod_name` gives `generation`."""
    if workers:
        return list(workers)
    per_slice = max(1, hosts // max(1, count))
    return [build_pod_name(job, generation, i, h) for i in range(max(1, count)) for h in range(per_slice)]
