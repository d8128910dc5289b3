"""Pure: a supervised trainer as its pod's sidecar reports it (`trainer_process` in `/v1/state`, the
supervisor's `incarnation.json`), and what the operator derives from it.

A supervised trainer's exit no longer ends its container (the supervisor stays for the next start), so
the kubelet does not see it: observed/observe.py asks the sidecar of each pod whose trainer is not ready (the
doorbell: the readinessProbe on `/v1/trainer/ready`), of pod 0 as always, and of every pod of the
generation while a fault is in view (`pods_to_poll`), and `with_trainer_processes` turns the answers
into the pods' exit codes, so every policy keeps reading `ObservedPod` only. When the doorbell rings and
no answer comes (`unreachable_workers`: not ready SILENCE_SECONDS, its sidecar silent), the trainer can
be heard neither exiting nor stepping (the hang detector reads the same sidecars): worker_exit.py
replaces it rather than wait for an answer that may never come.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from .snapshot import Observed, ObservedPod

RUNNING: Final = "running"
STOPPING: Final = "stopping"
#: The child and every descendant are reaped: the incarnation is proven gone.
EXITED: Final = "exited"
#: A supervised trainer not ready this long (seconds) whose sidecar, asked, does not answer is unreachable
#: (`unreachable_workers`). Long enough for a sidecar restarted once, or slowed past a probe's 1 s by a
#: loaded node, to answer again; short against the hang floor (60 s), which cannot fire anyway without
#: the sidecars' figures. (Goodput seed 2 of 2026-12-07: the pods' addresses gone, every sidecar silent,
#: the trainers aborted unheard; nothing acted for 110 s, until an unrelated node loss.)
SILENCE_SECONDS: Final = 20.0
#: A trainer container younger than this (seconds) is not judged by its silence: its sidecar may still be
#: starting (the kubelet starts the trainer once the native sidecar runs, not once it listens; a few
#: seconds when quiet, more on a loaded node).
SIDECAR_START_SECONDS: Final = 60.0


@dataclass(frozen=True)
class TrainerProcess:
    """One pod's current (or last) trainer incarnation."""

    incarnation: int
    generation: int
    state: str
    exit_code: int | None = None
    signal: int | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    reason: str = ""
    #: The newest generation a start was asked for (the sidecar's `assignment.generation`); None: none.
    assigned: int | None = None

    def proven_stopped_before(self, generation: int) -> bool:
        """No trainer older than `generation` lives in this pod: the last one exited, or it is already
        of `generation` or newer (which the supervisor starts only once the old one is gone)."""
        return self.generation >= generation or self.state == EXITED

    def runs(self, generation: int) -> bool:
        return self.generation == generation and self.state == RUNNING


def _time(raw: Any) -> datetime | None:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        return None
    try:
        return datetime.fromtimestamp(float(raw), UTC)
    except (OverflowError, OSError, ValueError):
        return None


def _int(raw: Any) -> int | None:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else None


def parse_trainer_process(state: Mapping[str, Any]) -> TrainerProcess | None:
    """A sidecar's `/v1/state` → its pod's trainer incarnation (None: no supervisor, or not yet)."""
    raw = state.get("trainer_process")
    if not isinstance(raw, Mapping):
        return None
    incarnation, generation, name = _int(raw.get("incarnation")), _int(raw.get("generation")), raw.get("state")
    if incarnation is None or generation is None or name not in (RUNNING, STOPPING, EXITED):
        return None
    assignment = state.get("assignment")
    assigned = _int(assignment.get("generation")) if isinstance(assignment, Mapping) else None
    return TrainerProcess(incarnation, generation, str(name), _int(raw.get("exit_code")), _int(raw.get("signal")),
                          _time(raw.get("started_at")), _time(raw.get("finished_at")), str(raw.get("reason") or ""),
                          assigned)


def fault_in_view(observed: Observed) -> bool:
    """Whether something may be wrong with the current generation, or it is about to be replaced, so every
    sidecar is worth asking (the mode decision needs to know which survivors qualify): an in-place
    restart running, a planned move under way (its in-place decision comes once the final save is seen
    done, when the stopped trainers' readiness may not have turned false yet), a supervised trainer not
    ready, a worker's node not Ready, a worker Failed or being deleted, a worker no node takes yet (the
    capacity wait's shrink keeps the bound ones; a worker held by a queue's gates does not count: a job
    with a queue is never restarted in place), a worker whose trainer exited (the kubelet's word, or its
    sidecar's once asked: `pods_to_poll_again`)."""
    s = observed.status
    if s.in_place is not None or s.transition is not None:
        return True
    for p in observed.pods_of(s.generation):
        node = observed.node(p.node_name)
        if (p.supervised and p.phase == "Running" and not p.trainer_ready) or p.terminated \
                or p.trainer_exited or p.deletion_timestamp is not None \
                or (node is not None and node.ready != "True") or (p.node_name is None and not p.gates):
            return True
    return False


def pods_to_poll(observed: Observed) -> list[str]:
    """The pods whose sidecar `/v1/state` observed/observe.py reads: pod 0 of the current generation (as always),
    each supervised pod whose trainer is not ready (the doorbell), and every pod of the generation while
    a fault is in view; only pods Running with an IP, not on a node that is down (no answer would come)."""
    s = observed.status
    names = s.pod_names(observed.job.name) if s.generation > 0 else []
    every = fault_in_view(observed)
    out = []
    for p in observed.pods_of(s.generation):
        node = observed.node(p.node_name)
        if p.phase != "Running" or p.pod_ip is None or (node is not None and node.down_since(observed.now)):
            continue
        if (names and p.name == names[0]) or every or (p.supervised and not p.trainer_ready):
            out.append(p.name)
    return sorted(out)


def pods_to_poll_again(observed: Observed, polled: Collection[str]) -> list[str]:
    """The second round of `/v1/state` reads: the pods `pods_to_poll` names once the first round's answers
    are in `observed` (`with_trainer_processes`) that the first round did not ask. An answer can bring a
    fault into view that nothing before it showed: pod 0's sidecar says its trainer exited while the
    kubelet's readiness probe has not run since. Heard that same tick, every survivor can be kept; unheard,
    the in-place restart counted only pod 0 a survivor and replaced the other pods."""
    asked = set(polled)
    return [name for name in pods_to_poll(observed) if name not in asked]


def unreachable_workers(observed: Observed) -> list[tuple[ObservedPod, float]]:
    """(pod, seconds not ready) of each supervised worker of the running generation, by name, that the
    doorbell named and no answer followed: Running on a node that is Ready and not down (else the node
    rules decide), its trainer container running for SIDECAR_START_SECONDS and not ready for at least
    SILENCE_SECONDS, and its sidecar asked this time without an answer (`Observed.silent_sidecars`). Its
    trainer may have exited or be running: neither can be learnt, and no policy that reads the sidecars
    (its exit, a hang) can act on it."""
    silent = set(observed.silent_sidecars)
    young = observed.now - timedelta(seconds=SIDECAR_START_SECONDS)
    out = []
    for p in observed.pods_of(observed.status.generation):
        node = observed.node(p.node_name)
        since = p.trainer_not_ready_since
        if (p.name not in silent or not p.supervised or p.phase != "Running" or p.deletion_timestamp is not None
                or not p.trainer_running or p.trainer_ready or since is None or node is None
                or node.ready != "True" or node.down_since(observed.now) is not None
                or (p.trainer_started_at is not None and p.trainer_started_at > young)):
            continue
        quiet = observed.now - since
        if quiet >= timedelta(seconds=SILENCE_SECONDS):
            out.append((p, quiet.total_seconds()))
    return out


def with_trainer_processes(observed: Observed, processes: Mapping[str, TrainerProcess]) -> Observed:
    """`observed` with each supervised pod's exit code and finish time from its trainer incarnation,
    counted only for an incarnation of the pod's own generation (a kept pod's old trainer, stopped by an
    in-place restart, is never read as a failure); the kubelet's code stays when the container itself
    ended (the supervisor died)."""
    if not processes:
        return observed
    pods = tuple(_with_process(p, processes.get(p.name)) for p in observed.pods)
    return replace(observed, pods=pods, trainer_processes={**observed.trainer_processes, **processes})


def _with_process(pod: ObservedPod, tp: TrainerProcess | None) -> ObservedPod:
    if tp is None or not pod.supervised or pod.exit_code is not None:
        return pod
    if tp.generation != pod.generation or tp.state != EXITED:
        return pod
    code = tp.exit_code if tp.exit_code is not None else (128 + tp.signal if tp.signal is not None else None)
    if code is None:
        return pod
    return replace(pod, exit_code=code, exit_reason=tp.reason or "TrainerExited", trainer_running=False,
                   trainer_finished_at=tp.finished_at)
