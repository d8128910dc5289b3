"""The I/O side, part 1: gather the world one decision sees (`observe` → `World`).

The JAXJob, its pods and Services, the nodes and the devices others hold (capacity) are read from the
watch cache (cache.py), never listed, already parsed (observed/indexes.py); the Lease of a NotReady node hosting a worker is read directly
(a GET, only then: watching every node's heartbeats would cost more than it tells); the sidecars answer over HTTP: pod 0's `/v1/state` (newest
checkpoint, restore report, the trainer's figures for metrics) and, while a final save runs, each
asked pod's `/v1/save/<id>`. The parsing is observed/snapshot.py's; nothing here decides. Synchronous (a
kopf daemon thread runs it, execute.py's `reconcile_job`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from .. import api, metrics
from .. import status as st
from ..builders import JobRef
from ..k8s import Kube, KubeError, SidecarCall, SidecarError, ask_sidecars
from ..ownership import owner_uid
from ..pods.probes import parse_probe
from ..pods.spares import parse_spare
from ..settings import OperatorSettings
from .cache import WorldCache
from .sidecar import LastWords, newest_trainer_report, worth_asking_every_host
from .snapshot import (
    HostFigures,
    Observed,
    SaveOutcome,
    TrainerReport,
    assemble_observed,
    decide_storage_sharers,
    nodes_needing_lease,
    parse_host_figures,
    parse_job_ref,
    parse_lease,
    parse_lease_seconds,
    parse_restore_report,
    parse_save_outcome,
    parse_sidecar_state,
    parse_trainer_report,
    with_leases,
)
from .spare_jobs import parse_spare_jobs, suspended_for_gone
from .trainer_process import (
    TrainerProcess,
    parse_trainer_process,
    pods_to_poll,
    pods_to_poll_again,
    with_trainer_processes,
)

Logger = logging.Logger | logging.LoggerAdapter[Any]


@dataclass(frozen=True)
class World:
    """What one reconcile read: the raw bodies of the job's own pods (execute.py acts on them) and the
    parsed snapshot."""

    job: Mapping[str, Any]
    pods: tuple[Mapping[str, Any], ...]
    observed: Observed


#: job uid -> the last trainer figures pod 0's sidecar gave (kept when pod 0 stops answering: its
#: node died; the goodput accounting counts the generation's training up to them).
_trainers: dict[str, TrainerReport] = {}
_trainers_lock = threading.Lock()


def forget_trainer(job: JobRef) -> None:
    with _trainers_lock:
        _trainers.pop(job.uid, None)
        _straggler_samples.pop(job.uid, None)


def now_utc() -> datetime:
    """The clock (the only place the operator reads it; decisions get `Observed.now`)."""
    return datetime.now(UTC)


def job_ref(job: Mapping[str, Any]) -> JobRef:
    return parse_job_ref(job)


def _pod_ip(pod: Mapping[str, Any]) -> str | None:
    return (pod.get("status") or {}).get("podIP") or None


def _annotation(pod: Mapping[str, Any], key: str) -> str | None:
    return ((pod.get("metadata") or {}).get("annotations") or {}).get(key)


def observe(kube: Kube, cache: WorldCache, job: Mapping[str, Any], settings: OperatorSettings,
            logger: Logger) -> World:
    """The world of one JAXJob now: the cache's objects, the sidecars' answers, the time."""
    now = now_utc()
    ref = job_ref(job)
    labelled, workers = cache.pods_of(ref.namespace, ref.name)
    pods = [p for p in labelled if ref.uid and owner_uid(p) == ref.uid]  # its own: asked for state and saves, acted on
    status = st.parse_status(job.get("status"))
    words = tuple(w for w in cache.last_words_of(ref.namespace, ref.name) if ref.uid and w.owner_uid == ref.uid)
    outcomes = observe_save_outcomes(kube, status, pods, settings, logger, words)
    observed = assemble_observed(job, now=now, pods=workers,
                                 services=cache.services_of(ref.namespace, ref.name),
                                 nodes=cache.nodes_for(ref.namespace, ref.name), save_outcomes=outcomes,
                                 storage_sharers=decide_storage_sharers(job, cache.all_jobs()))
    probes = tuple(sorted((p for p in (parse_probe(raw, ref.uid) for raw in pods) if p is not None),
                          key=lambda p: p.name))
    if probes:
        observed = replace(observed, probes=probes)
    spares = tuple(sorted((p for p in (parse_spare(raw, ref.uid) for raw in pods) if p is not None),
                          key=lambda p: p.name))
    if spares:
        observed = replace(observed, spares=spares)
    everyone = cache.all_jobs()
    spare_jobs, gone = parse_spare_jobs(job, everyone), suspended_for_gone(job, everyone)
    if spare_jobs or gone:
        observed = replace(observed, spare_jobs=spare_jobs, lent_to_gone=gone)
    read = nodes_needing_lease(observed)  # before the sidecars: none is asked on a node known down
    if read:
        observed = with_leases(observed, *observe_leases(kube, read, logger))
    observed = observe_sidecars(kube, observed, settings, logger, words)
    # and after them: a supervised trainer's exit 76 (the witness) is known only from its sidecar
    more = sorted(set(nodes_needing_lease(observed)) - set(read))
    if more:
        observed = with_leases(observed, *observe_leases(kube, more, logger))
    return World(job, tuple(pods), observed)


def observe_sidecars(kube: Kube, observed: Observed, settings: OperatorSettings, logger: Logger,
                     words: Sequence[LastWords] = ()) -> Observed:
    """The sidecars' `/v1/state` of the pods `trainer_process.pods_to_poll` names (pod 0 always: newest
    checkpoint, restore report, trainer figures; the others for their trainer's incarnation), then of
    those the first answers put in view (`trainer_process.pods_to_poll_again`), or of every other worker
    of the generation when pod 0 looks stalled (`hang.worth_asking_every_host`: the hang policy names the
    culprit from them) or the stragglers' sample is due (`settings.straggler_sample_seconds`). The
    sidecars that are gone speak through their last `words`: the newest checkpoint they knew, and the
    furthest step the generation's trainers reached (kept as pod 0's figures: `newest_trainer_report`),
    so a generation's last step is exact however fast its pods ended."""
    ref, status = observed.job, observed.status
    checkpoint = restore = None
    processes: dict[str, TrainerProcess] = {}
    hosts: dict[str, HostFigures] = {}
    silent: list[str] = []
    pod0_name = status.pod_names(ref.name)[0] if status.generation > 0 else ""
    by_name = {p.name: p for p in observed.pods}
    polled = pods_to_poll(observed)
    now = observed.now.timestamp()
    states = ask_sidecars(kube, [SidecarCall(name, str(by_name[name].pod_ip), "GET", "/v1/state") for name in polled],
                          settings.sidecar_port)
    for name in polled:
        state = states[name]
        if isinstance(state, SidecarError):
            logger.debug("no sidecar state from %s: %s", name, state)
            silent.append(name)
            continue
        process = parse_trainer_process(state)
        if process is not None:
            processes[name] = process
        figures = parse_host_figures(state)
        if figures is not None:
            hosts[name] = figures
        if name != pod0_name:
            continue
        checkpoint = parse_sidecar_state(state, observed.now)
        restore = parse_restore_report(state)
        metrics.record_worker_state(ref, status.generation, state)
        report = parse_trainer_report(state, status.generation)
        if report is not None:
            with _trainers_lock:
                _trainers[ref.uid] = report
    # a fault the answers brought into view (pod 0's trainer exited): every survivor heard this tick too
    again = set(pods_to_poll_again(with_trainer_processes(observed, processes), polled))
    every = status.generation > 0 and (worth_asking_every_host(hosts.get(pod0_name), now)
                                       or _straggler_sample_due(ref.uid, now, settings))
    others = [SidecarCall(p.name, p.pod_ip, "GET", "/v1/state") for p in observed.pods_of(status.generation)
              if p.name not in polled and p.phase == "Running" and p.pod_ip is not None and (every or p.name in again)]
    if others:
        for name, state in ask_sidecars(kube, others, settings.sidecar_port).items():
            if isinstance(state, SidecarError):
                logger.debug("no sidecar state from %s: %s", name, state)
                silent.append(name)
                continue
            process = parse_trainer_process(state)
            if process is not None:
                processes[name] = process
            figures = parse_host_figures(state)
            if figures is not None:
                hosts[name] = figures
    for w in words:
        checkpoint = st.newer_checkpoint(checkpoint, parse_sidecar_state(w.words, observed.now))
        said = parse_trainer_report(w.words, w.generation)
        if said is not None and said.step is not None and _said_generation(w) == status.generation:
            metrics.record_reached(ref, status.generation, said.step)  # (older ones counted when current)
    with _trainers_lock:
        trainer = newest_trainer_report(_trainers.get(ref.uid), words, status.generation) or _trainers.get(ref.uid)
        if trainer is not None:
            _trainers[ref.uid] = trainer
    observed = replace(observed, checkpoint=checkpoint, restore=restore, trainer=trainer, hosts=hosts,
                       silent_sidecars=tuple(sorted(silent)))
    return with_trainer_processes(observed, processes)


def _said_generation(w: LastWords) -> int:
    """The generation whose trainer spoke last (its figures say; else the pod's label)."""
    g = (w.words.get("trainer") or {}).get("generation")
    return g if isinstance(g, int) else w.generation


#: job uid -> when every worker's sidecar was last read for the stragglers' sample (epoch seconds).
_straggler_samples: dict[str, float] = {}


def _straggler_sample_due(uid: str, now: float, settings: OperatorSettings) -> bool:
    """Whether the stragglers' sample is due for the job (and, if so, it counts as taken now)."""
    every = settings.straggler_sample_seconds
    if every <= 0:
        return False
    with _trainers_lock:
        if now - _straggler_samples.get(uid, float("-inf")) < every:
            return False
        _straggler_samples[uid] = now
    return True


def observe_leases(kube: Kube, names: Sequence[str],
                   logger: Logger) -> tuple[dict[str, datetime], dict[str, float]]:
    """Node → until when its Lease says the kubelet lives, and node → its leaseDurationSeconds, for the
    nodes `nodes_needing_lease` names (a few GETs, only then; a Lease that cannot be read counts as none)."""
    out: dict[str, datetime] = {}
    seconds: dict[str, float] = {}
    for name in names:
        try:
            lease = kube.get_node_lease(name)
        except KubeError as e:
            logger.debug("lease of node %s not readable: %s", name, e)
            continue
        live_until = parse_lease(lease) if lease else None
        if lease and live_until is not None:
            out[name], seconds[name] = live_until, parse_lease_seconds(lease)
    return out, seconds


def observe_save_outcomes(kube: Kube, status: st.JobStatus, pods: Sequence[Mapping[str, Any]],
                          settings: OperatorSettings, logger: Logger,
                          words: Sequence[LastWords] = ()) -> tuple[SaveOutcome, ...]:
    """Every sidecar's answer to the open final save request (final_save.py picks which counts): from
    the sidecars' last words (those that already exited: the workers stop right after a final save)
    and from the sidecars that still answer."""
    t = status.transition
    if t is None or not t.saving or not t.save_request_id:
        return ()
    found = [o for w in words if (o := w.save_outcome(t.save_request_id)) is not None]
    calls = []
    for pod in pods:
        value = _annotation(pod, api.ANNOTATION_SAVE_REQUEST) or ""
        request_id, _, sidecar_id = value.partition("=")
        ip = _pod_ip(pod)
        ended = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")  # its sidecar is gone
        if request_id != t.save_request_id or not sidecar_id or not ip or ended:
            continue
        calls.append(SidecarCall(str(pod["metadata"]["name"]), ip, "GET", f"/v1/save/{sidecar_id}"))
    for call, answer in zip(calls, ask_sidecars(kube, calls, settings.sidecar_port).values(), strict=True):
        if isinstance(answer, SidecarError):
            logger.debug("%s not readable from %s: %s", call.path, call.pod, answer)
            continue
        outcome = parse_save_outcome(t.save_request_id, answer)
        if outcome is not None:
            found.append(outcome)
    return tuple(found)


