"""A tiny in-memory cluster that executes the operator's actions, for the decision tests.

It plays the API server, the scheduler and the kubelets just enough: created pods are Pending until
`schedule()` puts each on a free node of its node pool; graceful deletions finish on nodes that are up;
nothing on a down node is ever confirmed. Every `step()` checks the decision rules: deciding twice on
the same observed state gives the same actions, and no generation is created while another one's pods
exist.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from op_samples import good_spec
from resilax_operator import api
from resilax_operator.actions import (
    Action,
    CreateGeneration,
    CreateProbes,
    CreateSpares,
    DeleteGeneration,
    DeleteProbes,
    DeleteSpares,
    EmitEvent,
    PatchWorkerPods,
    PublishFreshness,
    RequestFinalSave,
    SetStatus,
    StartTrainers,
    StopTrainers,
)
from resilax_operator.builders import JobRef
from resilax_operator.observed.sidecar import worth_asking_every_host
from resilax_operator.observed.snapshot import (
    HostFigures,
    Observed,
    ObservedNode,
    ObservedPod,
    RestoreReport,
    SaveOutcome,
    Taint,
    TrainerReport,
)
from resilax_operator.observed.trainer_process import (
    EXITED,
    RUNNING,
    TrainerProcess,
    pods_to_poll,
    pods_to_poll_again,
    with_trainer_processes,
)
from resilax_operator.pods.probes import ObservedProbe
from resilax_operator.pods.spares import ObservedSpare
from resilax_operator.reconcile import decide_raw
from resilax_operator.settings import OperatorSettings
from resilax_operator.status import CheckpointInfo, JobStatus, build_status, build_status_patch, parse_status

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
SETTINGS = OperatorSettings(sidecar_image="resilax:test", grow_back_settle_seconds=60)


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies a status patch: objects merged member by member, null removes."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = apply_merge_patch(out.get(key), value)
    return out


def tpu_pool(pool: str, hosts: int, *, accelerator: str = "tpu-v5-lite-podslice", topology: str = "4x4",
             chips: int = 4) -> list[ObservedNode]:
    labels = {api.NODE_POOL_LABEL: pool, api.TPU_ACCELERATOR_LABEL: accelerator, api.TPU_TOPOLOGY_LABEL: topology}
    return [ObservedNode(f"{pool}-n{i}", dict(labels), (Taint(api.TPU_TAINT_KEY),), "True", T0,
                         allocatable={api.TPU_RESOURCE: chips}) for i in range(hosts)]


def cpu_pool(pool: str, hosts: int) -> list[ObservedNode]:
    return [ObservedNode(f"{pool}-n{i}", {api.NODE_POOL_LABEL: pool}, ready_since=T0) for i in range(hosts)]


@dataclass
class World:
    spec: dict[str, Any]
    nodes: dict[str, ObservedNode]
    now: datetime = T0
    job: JobRef = field(default_factory=lambda: JobRef("llama", "ml", "uid-1"))
    status: JobStatus = field(default_factory=JobStatus)
    pods: dict[str, ObservedPod] = field(default_factory=dict)
    services: set[int] = field(default_factory=set)
    outcomes: list[SaveOutcome] = field(default_factory=list)
    save_requests: list[RequestFinalSave] = field(default_factory=list)
    events: list[EmitEvent] = field(default_factory=list)
    created: list[int] = field(default_factory=list)
    checkpoint: CheckpointInfo | None = None
    #: Pod 0's trainer figures as the operator last read them (goodput accounting).
    trainer: TrainerReport | None = None
    #: Pod 0's restore report (`restore` in its sidecar's /v1/state).
    restore: RestoreReport | None = None
    next_ip: int = 1
    pool_of: dict[str, str] = field(default_factory=dict)
    selector_of: dict[str, dict[str, str]] = field(default_factory=dict)
    #: Scheduling gates new pods get (a queue's admission webhook, e.g. Kueue's).
    gates: tuple[str, ...] = ()
    #: metadata.generation of the JAXJob (bump it with an edit of `spec`).
    spec_generation: int = 1
    #: The supervisors of supervised pods (spec.recovery.inPlace: Auto): each pod's trainer incarnation,
    #: the newest stop and start its sidecar was asked for, pods whose trainer ignores a stop (hung in D
    #: state) and pods whose sidecar does not answer.
    processes: dict[str, TrainerProcess] = field(default_factory=dict)
    stop_asked: dict[str, int] = field(default_factory=dict)
    assigned: dict[str, int] = field(default_factory=dict)
    hung: set[str] = field(default_factory=set)
    unreachable: set[str] = field(default_factory=set)
    #: Every StopTrainers/StartTrainers executed, in order: (kind, generation, pods).
    trainer_calls: list[tuple[str, int, tuple[str, ...]]] = field(default_factory=list)
    #: The status subresource as the API server stores it (empty before the first write).
    stored: dict[str, Any] = field(default_factory=dict)
    #: The other live JAXJobs with the same storage (Observed.storage_sharers).
    storage_sharers: tuple[tuple[str, str], ...] = ()
    #: Each worker's trainer figures as its sidecar reports them (Observed.hosts).
    hosts: dict[str, HostFigures] = field(default_factory=dict)
    #: The JAXJob's checkpoint freshness annotations (Observed.freshness), as PublishFreshness left them.
    freshness: dict[str, str] = field(default_factory=dict)
    #: Every PublishFreshness executed, in order.
    published: list[PublishFreshness] = field(default_factory=list)
    #: The grow-back probe pods (Observed.probes) and their manifests, as CreateProbes/DeleteProbes left them.
    probes: dict[str, ObservedProbe] = field(default_factory=dict)
    probe_manifests: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Every CreateProbes/DeleteProbes executed, in order.
    probe_calls: list[CreateProbes | DeleteProbes] = field(default_factory=list)
    #: The spare slices' placeholder pods (Observed.spares) and their manifests, as CreateSpares/DeleteSpares left them.
    spares: dict[str, ObservedSpare] = field(default_factory=dict)
    spare_manifests: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def make(cls, spec: dict[str, Any], *pools: list[ObservedNode]) -> World:
        return cls(copy.deepcopy(spec), {n.name: n for pool in pools for n in pool})

    # ---- the operator
    def observed(self) -> Observed:
        observed = Observed(now=self.now, job=self.job, status=self.status, spec_generation=self.spec_generation,
                            pods=tuple(sorted(self.pods.values(), key=lambda p: p.name)),
                            services=tuple(sorted(self.services)), nodes=tuple(self.nodes.values()),
                            save_outcomes=tuple(self.outcomes), checkpoint=self.checkpoint, trainer=self.trainer,
                            restore=self.restore, storage_sharers=self.storage_sharers,
                            freshness=tuple(sorted(self.freshness.items())),
                            probes=tuple(sorted(self.probes.values(), key=lambda p: p.name)),
                            spares=tuple(sorted(self.spares.values(), key=lambda p: p.name)),
                            hosts={n: f for n, f in self.hosts.items() if n in self.pods and n not in self.unreachable})
        # As observed/observe.py: the sidecars asked (pods_to_poll) that answer report their trainer.
        polled = pods_to_poll(observed)
        pod0 = self.status.pod_names(self.job.name)[0] if self.status.generation else ""
        if worth_asking_every_host(self.hosts.get(pod0), self.now.timestamp()):  # observed/observe.py's second round
            polled = [p.name for p in self.gen_pods() if p.phase == "Running" and p.pod_ip is not None]
        first = with_trainer_processes(observed, self._answers(polled))
        polled = [*polled, *pods_to_poll_again(first, polled)]  # the answers put a fault in view: the rest
        observed = replace(observed, silent_sidecars=tuple(sorted(n for n in polled if n in self.unreachable)))
        return with_trainer_processes(observed, self._answers(polled))

    def _answers(self, polled: list[str]) -> dict[str, TrainerProcess]:
        """The trainer incarnation each asked sidecar that answers reports."""
        return {n: replace(self.processes[n], assigned=self.assigned.get(n))
                for n in polled if n not in self.unreachable and n in self.processes}

    def decide(self) -> list[Action]:
        observed = self.observed()
        first = decide_raw(self.spec, observed, SETTINGS)
        assert decide_raw(self.spec, observed, SETTINGS) == first, "deciding twice differs"
        return first

    def step_besides_goodput(self) -> list[Action]:
        """`step()`, less a SetStatus that only refreshes status.goodput (its periodic refresh)."""
        before = replace(self.status, goodput=None)
        return [a for a in self.step()
                if not (isinstance(a, SetStatus) and replace(a.status, goodput=None) == before)]

    def step(self, *, only: int | None = None) -> list[Action]:
        """Decide and execute the actions (only the first `only` of them: an operator that dies)."""
        actions = self.decide()
        for a in actions[:only]:
            self.apply(a)
        return actions

    def apply(self, a: Action) -> None:
        if isinstance(a, SetStatus):
            # through the wire: the I/O side's merge patch of what differs from the stored status, applied
            # as the API server does; what is stored must then be the decided status, member for member
            if parse_status(self.stored) != self.status:  # the test set the status itself
                self.stored = apply_merge_patch({}, build_status(self.status))
            self.stored = apply_merge_patch(self.stored, build_status_patch(self.stored, a.status))
            assert self.stored == apply_merge_patch({}, build_status(a.status)), "the status patch lost a change"
            self.status = parse_status(self.stored)
        elif isinstance(a, CreateGeneration):
            others = [p.name for p in self.pods.values() if p.generation != a.generation]
            assert not others, f"generation {a.generation} created while {others} exist"
            if a.service is not None:
                self.services.add(a.generation)
            for m in a.pods:
                name = m["metadata"]["name"]
                labels = m["metadata"]["labels"]
                if name not in self.pods:
                    supervised = m["metadata"]["annotations"].get(api.ANNOTATION_SUPERVISED) == "1"
                    self.pods[name] = ObservedPod(name, int(labels[api.LABEL_GENERATION]), int(labels[api.LABEL_SLICE]),
                                                  int(labels[api.LABEL_HOST]), gates=self.gates, uid=f"uid-{name}",
                                                  supervised=supervised, process=int(labels[api.LABEL_PROCESS]))
                    self.pool_of[name] = labels[api.LABEL_NODE_POOL]
                    self.selector_of[name] = dict(m["spec"].get("nodeSelector") or {})
            if a.generation not in self.created:
                self.created.append(a.generation)
        elif isinstance(a, DeleteGeneration):
            self.services.discard(a.generation)
            for d in a.pods:
                p = self.pods.get(d.name)
                assert p is not None and p.generation == a.generation, f"{d.name} is not a pod of generation {a.generation}"
                if d.not_before is not None and self.now < d.not_before:
                    continue
                if d.force:
                    del self.pods[p.name]
                elif p.deletion_timestamp is None:
                    grace = 330 if d.grace_seconds is None else d.grace_seconds
                    self.pods[p.name] = replace(p, deletion_timestamp=self.now, deletion_grace_seconds=grace)
        elif isinstance(a, RequestFinalSave):
            self.save_requests.append(a)
        elif isinstance(a, PatchWorkerPods):
            for name, labels, _ in a.pods:
                p = self.pods.get(name)
                if p is not None:
                    got = dict(labels)
                    self.pods[name] = replace(p, generation=int(got[api.LABEL_GENERATION]),
                                              slice_index=int(got[api.LABEL_SLICE]), host=int(got[api.LABEL_HOST]),
                                              process=int(got[api.LABEL_PROCESS]))
        elif isinstance(a, PublishFreshness):
            self.published.append(a)
            self.freshness = _merged(self.freshness, a.job)
            for name, notes in a.pods:
                p = self.pods.get(name)
                if p is not None:
                    self.pods[name] = replace(p, freshness=tuple(sorted(_merged(dict(p.freshness), notes).items())))
        elif isinstance(a, CreateProbes):
            self.probe_calls.append(a)
            for m in a.pods:
                name = m["metadata"]["name"]
                if name not in self.probes:
                    self.probes[name] = ObservedProbe(name, m["metadata"]["labels"][api.LABEL_PROBE_SET], uid=f"uid-{name}")
                    self.probe_manifests[name] = m
        elif isinstance(a, DeleteProbes):
            self.probe_calls.append(a)
            for name in a.names:  # grace 0: gone at once
                self.probes.pop(name, None)
                self.probe_manifests.pop(name, None)
        elif isinstance(a, CreateSpares):
            for m in a.pods:
                name, labels = m["metadata"]["name"], m["metadata"]["labels"]
                if name not in self.spares:
                    self.spares[name] = ObservedSpare(
                        name, int(labels[api.LABEL_SPARE_SLICE]), int(labels[api.LABEL_HOST]), uid=f"uid-{name}",
                        pinned=m["spec"]["nodeSelector"].get(api.NODE_POOL_LABEL, ""),
                        shape=m["metadata"]["annotations"][api.ANNOTATION_SHAPE])
                    self.spare_manifests[name] = m
        elif isinstance(a, DeleteSpares):
            for name in a.names:  # grace 0: gone at once
                self.spares.pop(name, None)
                self.spare_manifests.pop(name, None)
        elif isinstance(a, StopTrainers):
            self.trainer_calls.append(("stop", a.generation, a.pods))
            for name in a.pods:
                if name in self.pods and name not in self.unreachable:
                    self.stop_asked[name] = max(self.stop_asked.get(name, 0), a.generation)
        elif isinstance(a, StartTrainers):
            self.trainer_calls.append(("start", a.generation, tuple(n for n, _ in a.pods)))
            for name, env in a.pods:
                assert dict(env)["RESILAX_GENERATION"] == str(a.generation)
                if name in self.pods and name not in self.unreachable:
                    self.assigned[name] = max(self.assigned.get(name, 0), a.generation)
        elif isinstance(a, EmitEvent):
            self.events.append(a)

    # ---- the scheduler and kubelets
    def schedule(self) -> None:
        """Bind each schedulable pod: a pod of a placed slice on a free node of its pool; a pod of a waiting
        slice (pool "") on a free node carrying its node selector, in the pool its slice's bound pods use,
        else in a pool no other slice of its generation uses (the builders' pod affinity rules)."""
        used = {p.node_name for p in [*self.pods.values(), *self.spares.values()] if p.node_name}
        for name, p in sorted(self.pods.items()):
            if p.node_name is not None or p.deletion_timestamp is not None or p.gates:
                continue
            pools = self._pools_for(name, p)
            free = [n for n in self.nodes.values() if n.pool in pools and n.name not in used
                    and n.schedulable(self.now)]
            if not free:
                continue
            node = sorted(free, key=lambda n: n.name)[0]
            used.add(node.name)
            self.pods[name] = replace(p, node_name=node.name, phase="Running", ready=True, pod_ip=f"10.0.0.{self.next_ip}",
                                      trainer_running=True, trainer_started_at=self.now, trainer_ready=True)
            self.next_ip += 1
            if p.supervised:
                self.processes[name] = TrainerProcess(1, p.generation, RUNNING)

        self.schedule_spares(used)

    def schedule_spares(self, used: set[str | None]) -> None:
        """Bind each placeholder on a free schedulable node: the pool its slot's bound placeholders use, else
        one no other slot uses, never one its node affinity excludes (the workers' pools)."""
        for name, p in sorted(self.spares.items()):
            if p.node_name is not None:
                continue
            terms = self.spare_manifests[name]["spec"]["affinity"].get("nodeAffinity", {}).get(
                "requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms", [{}])
            excluded = {v for t in terms for e in t.get("matchExpressions", []) if e["operator"] == "NotIn"
                        for v in e["values"]}
            pool_of = {q.slot: self.nodes[q.node_name].pool for q in self.spares.values() if q.node_name}
            pinned = self.spare_manifests[name]["spec"]["nodeSelector"].get(api.NODE_POOL_LABEL)
            pools = {pool_of[p.slot]} if p.slot in pool_of else {pinned} if pinned else {
                n.pool for n in self.nodes.values() if n.pool not in excluded and n.pool not in pool_of.values()}
            free = sorted((n for n in self.nodes.values() if n.pool in pools and n.name not in used
                           and n.schedulable(self.now)), key=lambda n: n.name)
            if free:
                used.add(free[0].name)
                self.spares[name] = replace(p, node_name=free[0].name, running=True)

    def _pools_for(self, name: str, p: ObservedPod) -> set[str | None]:
        if self.pool_of[name]:
            return {self.pool_of[name]}
        selector = self.selector_of[name]
        kin = [q for q in self.pods.values() if q.generation == p.generation]
        bound = {self.nodes[q.node_name].pool for q in kin if q.slice_index == p.slice_index and q.node_name}
        if bound:
            return set(bound)
        taken = {self.pool_of[q.name] or (self.nodes[q.node_name].pool if q.node_name else None)
                 for q in kin if q.slice_index != p.slice_index}
        return {n.pool for n in self.nodes.values()
                if n.pool not in taken and all(n.labels.get(k) == v for k, v in selector.items())}

    def admit(self) -> None:
        """The queue admits: every pod's scheduling gates go."""
        for name, p in list(self.pods.items()):
            self.pods[name] = replace(p, gates=())

    def kubelets(self) -> None:
        """Graceful deletions finish on nodes that are up; processes told to stop exit 75 first."""
        for name, p in list(self.pods.items()):
            node = self.nodes.get(p.node_name or "")
            up = p.node_name is None or (node is not None and node.down_since(self.now) is None)
            if p.deletion_timestamp is not None and up:
                del self.pods[name]
        for name in list(self.processes):
            if name not in self.pods:
                del self.processes[name]
        self.supervise()

    def supervise(self) -> None:
        """The supervisors: a stop for a newer generation ends the trainer (unless hung); a start of a
        newer generation runs once no trainer lives in the pod. Checks the invariant: never two
        generations' trainers alive in the job at once (a dead node's pod counts until it is gone)."""
        for name, t in list(self.processes.items()):
            p = self.pods[name]
            node = self.nodes.get(p.node_name or "")
            if node is not None and node.down_since(self.now) is not None:
                continue  # no kubelet, no supervisor that answers: frozen as it was
            if p.trainer_container_ended:
                continue  # no supervisor: its sidecar repeats the incarnation it last read (`end_container`)
            if t.state == RUNNING and self.stop_asked.get(name, 0) > t.generation and name not in self.hung:
                t = replace(t, state=EXITED, exit_code=143, finished_at=self.now)
            if t.state == EXITED and self.assigned.get(name, 0) > t.generation:
                t = TrainerProcess(t.incarnation + 1, self.assigned[name], RUNNING, started_at=self.now)
            self.processes[name] = t
            # the readiness probe asks the sidecar (/v1/trainer/ready): a silent one fails it
            self.pods[name] = self.with_readiness(p, t.state == RUNNING and name not in self.unreachable)
        live = {t.generation for n, t in self.processes.items()
                if t.state != EXITED and not self.pods[n].trainer_container_ended}
        assert len(live) <= 1, f"trainers of generations {sorted(live)} alive at once"

    def queue_evict(self, detail: str = "WorkloadEvicted: Preempted to accommodate a workload", *,
                    generation: int | None = None) -> None:
        """The queue (Kueue) stops a generation's pod group: TerminationTarget on each pod, then its
        deletion (the workers get SIGTERM)."""
        g = self.status.generation if generation is None else generation
        for name, p in list(self.pods.items()):
            if p.generation == g:
                self.pods[name] = replace(p, queue_stop=detail, deletion_timestamp=self.now,
                                          deletion_grace_seconds=330)

    def fail_trainer(self, name: str, code: int) -> None:
        """A supervised trainer exits by itself (the pod stays Running: the supervisor waits)."""
        t = self.processes[name]
        self.processes[name] = replace(t, state=EXITED, exit_code=code, finished_at=self.now)
        self.pods[name] = self.with_readiness(self.pods[name], False)

    def end_container(self, name: str, code: int = 137) -> None:
        """The trainer container itself ends (its supervisor killed with the trainer, e.g. SIGKILL): the
        kubelet says terminated with `code` and not ready; the sidecar, still running, repeats the last
        incarnation it read (running) and no stop it is asked for reaches anyone."""
        p = self.pods[name]
        self.pods[name] = self.with_readiness(
            replace(p, exit_code=code, exit_reason="Error", trainer_running=False, trainer_finished_at=self.now,
                    trainer_container_ended=True), False)

    def with_readiness(self, p: ObservedPod, ready: bool) -> ObservedPod:
        """`p` with its trainer's readiness as the kubelet's probe would leave it (since when it is not ready:
        the pod's Ready condition's lastTransitionTime)."""
        since = None if ready else (p.trainer_not_ready_since if not p.trainer_ready else None) or self.now
        return replace(p, trainer_ready=ready, trainer_not_ready_since=since)

    def settle(self, steps: int = 10) -> None:
        for _ in range(steps):
            self.step()
            self.schedule()
            self.kubelets()

    # ---- faults and worker behaviour
    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def set_node(self, name: str, **changes: Any) -> None:
        self.nodes[name] = replace(self.nodes[name], **changes)

    def exit_workers(self, code: int, *, generation: int | None = None, names: list[str] | None = None) -> None:
        for name, p in list(self.pods.items()):
            if (generation is None or p.generation == generation) and (names is None or name in names):
                self.pods[name] = replace(p, phase="Succeeded" if code == 0 else "Failed", exit_code=code,
                                          exit_reason=None if code in (0, 75) else "Error", ready=False,
                                          trainer_running=False, trainer_finished_at=self.now)

    def gen_pods(self, generation: int | None = None) -> list[ObservedPod]:
        g = self.status.generation if generation is None else generation
        return sorted((p for p in self.pods.values() if p.generation == g), key=lambda p: p.name)

    def reasons(self) -> list[str]:
        return [e.reason for e in self.events]


def _merged(current: dict[str, str], notes: tuple[tuple[str, str | None], ...]) -> dict[str, str]:
    """Annotations after a merge patch of `notes` (None removes)."""
    out = dict(current)
    for k, v in notes:
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


# ---- worlds the policy tests start from


def fixed_spec(count: int = 2) -> dict[str, Any]:
    raw = good_spec()
    del raw["elastic"]
    raw["slices"]["count"] = count
    return raw


def four_pools(hosts: int = 4) -> list[list[ObservedNode]]:
    return [tpu_pool(f"pool-{c}", hosts) for c in "abcd"]


def running_world(spec: dict[str, Any] | None = None, pools: list[list[ObservedNode]] | None = None) -> World:
    w = World.make(spec or good_spec(), *(pools or four_pools()))
    w.settle()
    assert w.status.phase == api.PHASE_RUNNING, w.status
    return w
