"""The world a decision sees (pure): its types and the parsers that build them from raw API bodies.
By kind: observed/nodes.py (nodes), observed/pods.py (worker pods), observed/sidecar.py (what the
sidecars report); this module assembles them into one `Observed` snapshot and re-exports their names.

The I/O side (observed/observe.py) reads the JAXJob, its pods and Services, the nodes and the pods of others
from the watch cache and the sidecars' answers, and hands them to `build_observed`; every decision reads
only the resulting `Observed` snapshot (time included: `Observed.now`, never the clock).
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from functools import cached_property
from typing import Any

from .. import api
from .. import status as st
from ..builders import JobRef
from ..ownership import owner_uid
from ..pods.probes import ObservedProbe
from ..pods.spares import ObservedSpare
from ..pods.worker_env import storage_dir
from ..status import CheckpointInfo, JobStatus
from .devices import count_devices_in_use
from .nodes import (
    SHUTTING_DOWN_MESSAGE,
    ObservedNode,
    Taint,
    parse_lease,
    parse_lease_seconds,
    parse_maintenance_time,
    parse_node,
)
from .pods import (
    STARTING_REASONS,
    HealthResult,
    ObservedPod,
    parse_health_result,
    parse_pod,
    pick_freshness,
)
from .sidecar import (
    HostFigures,
    RestoreReport,
    SaveOutcome,
    TrainerReport,
    parse_host_figures,
    parse_restore_report,
    parse_save_outcome,
    parse_sidecar_state,
    parse_trainer_report,
)
from .spare_jobs import SpareJob
from .trainer_process import TrainerProcess

__all__ = (
    "SHUTTING_DOWN_MESSAGE",
    "STARTING_REASONS",
    "HealthResult",
    "HostFigures",
    "Observed",
    "ObservedNode",
    "ObservedPod",
    "RestoreReport",
    "SaveOutcome",
    "Taint",
    "TrainerReport",
    "assemble_observed",
    "build_observed",
    "count_devices_in_use",
    "nodes_needing_lease",
    "parse_health_result",
    "parse_host_figures",
    "parse_job_ref",
    "parse_lease",
    "parse_lease_seconds",
    "parse_maintenance_time",
    "parse_node",
    "parse_pod",
    "parse_restore_report",
    "parse_save_outcome",
    "parse_service",
    "parse_sidecar_state",
    "parse_trainer_report",
    "with_leases",
)


@dataclass(frozen=True)
class Observed:
    """One snapshot of everything a decision needs. Built by the I/O side; never mutated."""

    now: datetime
    job: JobRef
    status: JobStatus
    #: metadata.generation of the JAXJob (recorded as status.observedGeneration).
    spec_generation: int = 0
    pods: tuple[ObservedPod, ...] = ()
    #: Generations whose headless Service exists.
    services: tuple[int, ...] = ()
    nodes: tuple[ObservedNode, ...] = ()
    save_outcomes: tuple[SaveOutcome, ...] = ()
    #: The newest checkpoint the sidecars report (None if unknown).
    checkpoint: CheckpointInfo | None = None
    #: What the current generation's restore did, from pod 0's sidecar (None if unknown).
    restore: RestoreReport | None = None
    #: Pod 0's trainer figures, the last read (its `generation` says of which generation).
    trainer: TrainerReport | None = None
    #: Pod name → its supervised trainer's incarnation, from the sidecars asked (observed/trainer_process.py).
    trainer_processes: Mapping[str, TrainerProcess] = field(default_factory=dict, hash=False)
    #: The pods whose sidecar was asked this time and did not answer (no connection, an error, past the
    #: deadline), sorted: a supervised trainer there cannot be heard (trainer_process.unreachable_workers).
    silent_sidecars: tuple[str, ...] = ()
    #: Pod name → its trainer's figures, from the sidecars asked this time (pod 0 always; every worker
    #: when a hang is suspected or the stragglers' sample is due: observed/observe.py).
    hosts: Mapping[str, HostFigures] = field(default_factory=dict, hash=False)
    #: (uid, "namespace/name") of the other live JAXJobs with the same spec.checkpoint.storage
    #: (`decide_storage_sharers`): the workers do not take the storage over from them.
    storage_sharers: tuple[tuple[str, str], ...] = ()
    #: The job's grow-back probe pods (pods/probes.py; observed/observe.py adds them).
    probes: tuple[ObservedProbe, ...] = ()
    #: The job's spare slices' placeholder pods (pods/spares.py; observed/observe.py adds them).
    spares: tuple[ObservedSpare, ...] = ()
    #: The lower-priority JAXJobs annotated as this job's spares (spare_jobs.py; observed/observe.py adds them), and
    #: the job this one was suspended for when that job is gone ("" otherwise).
    spare_jobs: tuple[SpareJob, ...] = ()
    lent_to_gone: str = ""
    #: The JAXJob's checkpoint freshness annotations (`observed.pods.pick_freshness`).
    freshness: tuple[tuple[str, str], ...] = ()

    def node(self, name: str | None) -> ObservedNode | None:
        return self._nodes_by_name.get(name) if name else None

    @cached_property
    def _nodes_by_name(self) -> dict[str, ObservedNode]:
        return {n.name: n for n in self.nodes}

    def nodes_held_down(self) -> tuple[str, ...]:
        """The nodes the API server still shows Ready that are down for the operator (a witnessed Lease:
        `ObservedNode.down_since`): the scheduler would still place pods there. Sorted."""
        return tuple(sorted(n.name for n in self.nodes if n.ready == "True" and n.down_since(self.now) is not None))

    def avoid_list(self) -> tuple[tuple[str, str], ...]:
        """(node, why) of every node a new pod must not go to, by name: the nodes held down (a witnessed
        Lease, `nodes_held_down`) and those the job keeps out after a failed health check
        (`ObservedNode.kept_out`). One list, one required node anti-affinity (`GenerationPlan.avoid_nodes`)."""
        out: dict[str, list[str]] = {}
        for n in self.nodes:
            if n.ready == "True" and (since := n.down_since(self.now)) is not None:
                out.setdefault(n.name, []).append(f"NodeDown: its Lease proves the kubelet gone since "
                                                  f"{st.format_time(since)}")
            if n.kept_out:
                out.setdefault(n.name, []).append(n.kept_out)
        return tuple((name, "; ".join(why)) for name, why in sorted(out.items()))

    def nodes_to_avoid(self) -> tuple[str, ...]:
        """The names of `avoid_list`, sorted."""
        return tuple(name for name, _ in self.avoid_list())

    def pods_of(self, generation: int) -> list[ObservedPod]:
        """The pods of one generation, by name."""
        return sorted((p for p in self.pods if p.generation == generation), key=lambda p: p.name)


# ---------------------------------------------------------------- parsers (raw API bodies → Observed)


def parse_job_ref(job: Mapping[str, Any]) -> JobRef:
    """The JAXJob → the reference the builders use (name, namespace, uid, Kueue queue label)."""
    meta = job.get("metadata") or {}
    return JobRef(str(meta.get("name", "")), str(meta.get("namespace", "")), str(meta.get("uid", "")),
                  str((meta.get("labels") or {}).get(api.KUEUE_QUEUE_LABEL) or ""))


def parse_service(raw: Mapping[str, Any]) -> tuple[int, str] | None:
    """A job's headless Service → (the generation it serves: its `resilax.dev/generation` label, the uid
    of the JAXJob owning it: `ownership.owner_uid`)."""
    label = ((raw.get("metadata") or {}).get("labels") or {}).get(api.LABEL_GENERATION)
    return (int(label), owner_uid(raw)) if label is not None and str(label).isdigit() else None


def build_observed(job: Mapping[str, Any], *, now: datetime, pods: Iterable[Mapping[str, Any]],
                   services: Iterable[Mapping[str, Any]], nodes: Iterable[Mapping[str, Any]],
                   other_pods: Iterable[Mapping[str, Any]] = (), save_outcomes: Iterable[SaveOutcome] = (),
                   checkpoint: CheckpointInfo | None = None, restore: RestoreReport | None = None,
                   leases: Mapping[str, datetime] | None = None, trainer: TrainerReport | None = None) -> Observed:
    """Observed from raw API bodies (the full parse): the JAXJob, its pods and Services (label
    resilax.dev/job=<name>), all Nodes, and the pods of everything else that may hold accelerators
    (`other_pods`, any namespace; this job's pods among them are ignored). `leases`: node name →
    `parse_lease` of the NotReady nodes hosting a worker (`nodes_needing_lease`).

    The operator builds the same snapshot from what the watch cache keeps parsed (`assemble_observed`
    with cache.py's indexes); this is the reference the cache's tests compare it with."""
    meta = job.get("metadata") or {}
    nodes = tuple(nodes)
    in_use = count_devices_in_use(other_pods, str(meta.get("name", "")), nodes, str(meta.get("namespace", "")))
    parsed = [parse_node(n, in_use.get(str((n.get("metadata") or {}).get("name", "")), {})) for n in nodes]
    observed = assemble_observed(
        job, now=now, pods=[p for p in (parse_pod(raw) for raw in pods) if p is not None],
        services=[g for g in (parse_service(s) for s in services) if g is not None],
        nodes=sorted(parsed, key=lambda n: n.name), save_outcomes=save_outcomes, checkpoint=checkpoint,
        restore=restore, trainer=trainer)
    return with_leases(observed, leases or {})


def assemble_observed(job: Mapping[str, Any], *, now: datetime, pods: Iterable[ObservedPod],
                      services: Iterable[tuple[int, str]], nodes: Sequence[ObservedNode],
                      save_outcomes: Iterable[SaveOutcome] = (), checkpoint: CheckpointInfo | None = None,
                      restore: RestoreReport | None = None, trainer: TrainerReport | None = None,
                      storage_sharers: Iterable[tuple[str, str]] = ()) -> Observed:
    """Observed from parts already parsed: the pods and Services (generation, owner uid) labelled with
    the job's name and every node, sorted by name, with the devices others hold counted
    (`in_use_by_others`). Only what the job owns (`owner_uid` = its uid) is its own: a pod or Service
    carrying its label but owned by another object (a JAXJob of the same name deleted and created
    again, anybody's) is never a worker, never deleted, never asked anything."""
    meta = job.get("metadata") or {}
    ref = parse_job_ref(job)
    mine = [p for p in pods if p.owner_uid and p.owner_uid == ref.uid]
    generations = {g for g, owner in services if owner and owner == ref.uid}
    return Observed(now=now, job=ref, status=st.parse_status(job.get("status")),
                    spec_generation=int(meta.get("generation") or 0),
                    pods=tuple(sorted(mine, key=lambda p: p.name)), services=tuple(sorted(generations)),
                    nodes=tuple(nodes), save_outcomes=tuple(save_outcomes), checkpoint=checkpoint, restore=restore,
                    trainer=trainer, storage_sharers=tuple(storage_sharers), freshness=pick_freshness(meta))


def storage_location(value: object) -> tuple[str, str] | None:
    """`spec.checkpoint.storage` normalised (pure): (its canonical form, the path a pod sees it at).
    `/data/./ckpt/` and `/data/ckpt` are one place, `gs://b/x//y` and `gs://b/x/y` too; a
    `pvc://claim/sub` is mounted at `/var/run/resilax/storage/sub` (worker_env.storage_dir), where a job
    naming that path sees the same files. None for no storage."""
    if not isinstance(value, str) or not value.strip():
        return None
    value = value.strip()
    scheme, sep, rest = value.partition("://")
    if sep:
        head, _, path = rest.partition("/")
        canonical = f"{scheme}://{head}" + (posixpath.normpath("/" + path.lstrip("/")) if path.strip("/") else "")
        if scheme == "pvc":
            return canonical, posixpath.normpath(storage_dir(f"pvc://{head}/{path}"))
        return canonical, canonical
    path = posixpath.normpath(value)
    path = "/" + path.lstrip("/") if path.startswith("//") else path  # POSIX keeps a leading '//'
    return path, path


def same_storage(a: tuple[str, str] | None, b: tuple[str, str] | None) -> bool:
    """Whether two `storage_location`s are one place: the same canonical form, or a `pvc://` and the
    plain path it is mounted at (two claims mounted at the same path are still two storages)."""
    if a is None or b is None:
        return False
    if a[0] == b[0]:
        return True
    a_pvc, b_pvc = a[0].startswith("pvc://"), b[0].startswith("pvc://")
    return a_pvc != b_pvc and a[1] == b[1]


def decide_storage_sharers(job: Mapping[str, Any], jobs: Iterable[Mapping[str, Any]]) -> tuple[tuple[str, str], ...]:
    """(uid, "namespace/name") of the other JAXJobs among `jobs` (any namespace the operator sees) that
    are live — not Succeeded or Failed, not being deleted — with the same `spec.checkpoint.storage`
    after normalisation (`same_storage`), sorted. The workers refuse to take the storage over from one
    of them; only the storage's own era records say whether one holds it (the same path on two volumes
    is two storages)."""
    def storage(body: Mapping[str, Any]) -> tuple[str, str] | None:
        checkpoint = (body.get("spec") or {}).get("checkpoint") or {}
        return storage_location(checkpoint.get("storage") if isinstance(checkpoint, Mapping) else None)

    mine, uid = storage(job), str((job.get("metadata") or {}).get("uid", ""))
    out = set()
    for other in jobs:
        meta = other.get("metadata") or {}
        phase = (other.get("status") or {}).get("phase")
        if (same_storage(mine, storage(other)) and str(meta.get("uid", "")) not in ("", uid)
                and phase not in api.TERMINAL_PHASES and not meta.get("deletionTimestamp")):
            out.add((str(meta["uid"]), f"{meta.get('namespace', '')}/{meta.get('name', '')}"))
    return tuple(sorted(out))


def nodes_needing_lease(observed: Observed) -> list[str]:
    """The nodes whose Lease a decision reads: NotReady (Ready=False, the kubelet's own report) and
    hosting one of the job's pods; and, once a worker of the current generation exited 76 (a peer
    process is gone) or 134 (aborted, maybe by the coordination service: api.PEER_LOSS_WITNESS_CODES),
    the Ready nodes of the workers that did not: an expired Lease there proves that
    kubelet dead before the node lifecycle controller says so (`ObservedNode.down_since`); and, while
    a process of the current generation has no pod yet, the Ready node it last ran on (its pod there
    was lost: the new one must not go back while that Lease is stale, `Observed.nodes_held_down`). Sorted."""
    out = {p.node_name for p in observed.pods
           if p.node_name and (node := observed.node(p.node_name)) is not None and node.ready == "False"}
    s = observed.status
    current = observed.pods_of(s.generation)
    if any(p.exit_code in api.PEER_LOSS_WITNESS_CODES for p in current):
        out |= {p.node_name for p in current if p.node_name and p.exit_code not in api.PEER_LOSS_WITNESS_CODES
                and (node := observed.node(p.node_name)) is not None and node.ready == "True"}
    if s.generation > 0 and s.worker_nodes:
        existing = {p.name for p in observed.pods}
        last = dict(s.worker_nodes)
        out |= {name for i, pod in enumerate(s.pod_names(observed.job.name)) if pod not in existing
                and (name := last.get(i)) and (node := observed.node(name)) is not None and node.ready == "True"}
    return sorted(out)


def with_leases(observed: Observed, leases: Mapping[str, datetime],
                seconds: Mapping[str, float] | None = None) -> Observed:
    """`observed` with each node of `leases` (name → `parse_lease`) knowing until when its kubelet lives,
    and its Lease's duration (`seconds`: name → `parse_lease_seconds`; default the kubelet's)."""
    if not leases:
        return observed
    durations = seconds or {}
    nodes = tuple(replace(n, lease_live_until=leases[n.name], lease_seconds=durations.get(n.name, n.lease_seconds))
                  if n.name in leases else n for n in observed.nodes)
    return replace(observed, nodes=nodes)
