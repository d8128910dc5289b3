"""Spare slices (spec.recovery.spareSlices): a job holds N slices of its shape with placeholder pods
(pods/spares.py) of a PriorityClass below every job's, so the scheduler and autoscaler keep those nodes;
on a hard loss or a preemption the next generation takes a spare's nodes at once, at full size.

How a spare is taken: the placeholders carry the job's label, so the job's capacity planning counts the
nodes they hold as its own (free for its next generation); `mark_spare_nodes` marks them, and the
planner takes such pools last (capacity.plan_pools: the spare choice). When the status a decision leaves
puts the job's workers on a pool a spare holds (a new generation planned there), the spare's
placeholders are deleted (forced: grace 0) in the same decision, before the workers are created.

| observed (the status the decision leaves)                                   | decision |
|------------------------------------------------------------------------------|----------|
| spareSlices 0, the job finished, suspended, or in a Kueue queue               | delete every placeholder |
| the first generation not planned yet                                          | none yet (a spare never takes the first generation's pools) |
| a spare slot beyond spareSlices                                               | delete its placeholders |
| a slot with a placeholder on (or pinned to) a pool the job's workers use (`s.pools`) | taken: delete the slot's placeholders; one SpareTaken event per generation |
| a slot with a placeholder on a node down past nodeLossGraceSeconds, gone, cordoned, kept out (health check) or noticed (preemption, maintenance) | delete the slot's placeholders (placed again elsewhere) |
| a slot of another shape (a `slices` edit: `resilax.dev/shape` differs)        | delete the slot's placeholders (placed again) |
| a slot with hosts missing (none deleted by this decision)                     | create them, off the workers' pools: a whole slot pinned to the first free pool that fits it (capacity.plan_pools), else left to the scheduler, Pending until capacity returns (replenishment) |

status.spares: desired, ready (slots whose every placeholder runs on a node that is up) and their pools,
why none is held, the last take and the total taken. Deciding twice gives the same actions; the
placeholders carry an owner reference (the garbage collector removes them with the job).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import timedelta

from .. import api
from ..actions import Action, CreateGeneration, CreateSpares, DeleteSpares, EmitEvent, SetStatus
from ..builders import geometry_of
from ..capacity import plan_pools
from ..generation import kueue_queue
from ..observed.snapshot import Observed
from ..pods.spares import ObservedSpare, SpareStatus, build_spare_pods, spare_shape
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus


@dataclass(frozen=True)
class SparePlan:
    """What `plan` decided: placeholders to delete and create, and status.spares."""

    #: (placeholder names, why) to delete.
    delete: tuple[tuple[str, ...], str] | None
    #: (slot, the hosts to create, the node pool they are pinned to or "" for the scheduler's choice).
    create: tuple[tuple[int, tuple[int, ...], str], ...]
    status: SpareStatus | None
    #: Pools of the slots the job's workers take in this decision (sorted); () for none.
    taken: tuple[str, ...] = ()


def desired(spec: JobSpec, observed: Observed, s: JobStatus) -> tuple[int, str]:
    """How many spare slices to hold now, and why none when some are asked for."""
    asked = spec.recovery.spare_slices
    if asked == 0:
        return 0, ""
    if s.phase in api.TERMINAL_PHASES:
        return 0, f"the job is {s.phase}"
    if spec.suspend:
        return 0, "the job is suspended (spec.suspend)"
    queue = kueue_queue(observed.job, spec)
    if queue:
        return 0, (f"the job is in Kueue queue {queue!r}: the queue decides its capacity, so no placeholder "
                   "holds nodes outside its quota")
    if s.generation == 0 or not any(s.pools):
        return asked, "held once the first generation is planned"
    return asked, ""


def mark_spare_nodes(observed: Observed) -> Observed:
    """`observed` with the nodes the job's live placeholders are bound to marked `spare`."""
    held = {p.node_name for p in observed.spares if p.node_name and not p.deleting}
    if not held:
        return observed
    return replace(observed, nodes=tuple(replace(n, spare=True) if n.name in held else n for n in observed.nodes))


def plan(spec: JobSpec, observed: Observed, s: JobStatus) -> SparePlan:
    """The spares' decision for the status `s` the decision leaves (see the module's table)."""
    want, why = desired(spec, observed, s)
    if spec.recovery.spare_slices == 0 and not observed.spares:
        return SparePlan(None, (), None)  # status.spares goes with the field
    live = [p for p in observed.spares if not p.deleting]
    workers = {p for p in s.pools if p}
    hosts, shape = geometry_of(spec, spec.slices.topology).hosts, spare_shape(spec)
    grace = timedelta(seconds=spec.recovery.node_loss_grace_seconds)
    by_slot: dict[int, list[ObservedSpare]] = {}
    for p in live:
        by_slot.setdefault(p.slot, []).append(p)
    doomed: list[str] = []
    reasons: list[str] = []
    taken: set[str] = set()
    healthy: dict[int, str] = {}  # slot -> pool, for the ready ones
    placing = want > 0 and not why
    for slot, pods in sorted(by_slot.items()):
        pools = {_pool(observed, p) for p in pods if p.node_name or p.pinned}
        on_workers = sorted(p for p in pools if p in workers)
        bad = [p.name for p in pods if p.node_name and _down(observed, p.node_name, grace)]
        if slot >= want:
            doomed += [p.name for p in pods]
            reasons.append(f"slot {slot} not asked for")
        elif on_workers:
            doomed += [p.name for p in pods]
            taken.update(on_workers)
            reasons.append(f"slot {slot} taken by generation {s.generation} on {', '.join(on_workers)}")
        elif bad:
            doomed += [p.name for p in pods]
            reasons.append(f"slot {slot} on a node down, gone, cordoned, kept out or noticed ({', '.join(bad)})")
        elif any(p.host >= hosts or p.shape != shape for p in pods):
            doomed += [p.name for p in pods]
            reasons.append(f"slot {slot} holds another shape than {shape}")
        elif len(pods) == hosts and all(p.running and p.node_name for p in pods) and len(pools) == 1:
            healthy[slot] = next(iter(pools)) or ""
    create: list[tuple[int, tuple[int, ...], str]] = []
    if placing:
        doomed_set = set(doomed)
        present = {(p.slot, p.host) for p in observed.spares}  # a name still being deleted waits
        held = {_pool(observed, p) for p in live if p.name not in doomed_set}
        free = [p for p in plan_pools(geometry_of(spec, spec.slices.topology), observed.nodes, observed.now)
                if p not in workers and p not in held]
        for slot in range(want):
            if any(n in doomed_set for n in (p.name for p in by_slot.get(slot, []))):
                continue  # created again by the next decision, once the deleted names are gone
            missing = tuple(h for h in range(hosts) if (slot, h) not in present)
            if not missing:
                continue
            # The spare's pool: a whole slot goes on the first pool that fits it now (pinned); else, or
            # for the rest of a slot, wherever the scheduler finds room (replenished when capacity returns).
            pool = free.pop(0) if len(missing) == hosts and free else ""
            create.append((slot, missing, pool))
    old = s.spares or SpareStatus()
    taken_pools = tuple(sorted(taken))
    new_take = bool(taken_pools) and old.taken_generation != s.generation
    taken_slots = sum(1 for pods in by_slot.values() if any(_pool(observed, p) in taken for p in pods))
    status = None if spec.recovery.spare_slices == 0 else SpareStatus(
        desired=spec.recovery.spare_slices, ready=len(healthy), pools=tuple(sorted(healthy.values())), message=why,
        taken_generation=s.generation if new_take else old.taken_generation,
        taken_pools=taken_pools if new_take else old.taken_pools,
        taken_total=old.taken_total + (taken_slots if new_take else 0))
    delete = (tuple(sorted(doomed)), "; ".join(reasons)) if doomed else None
    return SparePlan(delete, tuple(create), status, taken_pools if new_take else ())


def with_spares(actions: list[Action], spec: JobSpec, observed: Observed, settings: OperatorSettings) -> list[Action]:
    """`actions` with status.spares up to date, the placeholders to delete placed before the first
    CreateGeneration (its workers take their nodes), the SpareTaken event, and the ones to create last."""
    index = next((i for i, a in enumerate(actions) if isinstance(a, SetStatus)), None)
    s = actions[index].status if index is not None else observed.status  # type: ignore[union-attr]
    decided = plan(spec, observed, s)
    out = list(actions)
    if decided.status != s.spares:
        new = replace(s, spares=decided.status)
        if index is not None:
            out[index] = SetStatus(new)
        else:
            out.insert(0, SetStatus(new))
            index = 0
    if decided.taken:
        message = api.SPARE_TAKEN.format(generation=s.generation, pools=", ".join(decided.taken))
        out.insert((index or 0) + 1, EmitEvent("Normal", api.SPARE_TAKEN.name, message))
    if decided.delete is not None:
        at = next((i for i, a in enumerate(out) if isinstance(a, CreateGeneration)), len(out))
        out.insert(at, DeleteSpares(*decided.delete))
    pods = tuple(m for slot, hosts, pool in decided.create for m in build_spare_pods(
        observed.job, spec, slot, tuple(sorted(p for p in s.pools if p)), settings, hosts, pool))
    if pods:
        out.append(CreateSpares(pods))
    return out


def _pool(observed: Observed, p: ObservedSpare) -> str | None:
    """The pool a placeholder holds: its node's once bound, else the one it is pinned to (None: neither)."""
    if p.node_name is None:
        return p.pinned or None
    node = observed.node(p.node_name)
    return None if node is None else node.pool


def _down(observed: Observed, name: str, grace: timedelta) -> bool:
    """The node cannot serve the job's next generation: down past `grace` (the job's
    recovery.nodeLossGraceSeconds: a NotReady blip within it leaves the spare alone), gone, cordoned,
    kept out after a failed health check, or with a preemption or maintenance notice."""
    node = observed.node(name)
    if node is None:
        return True
    down = node.down_since(observed.now)
    return ((down is not None and observed.now - down >= grace) or bool(node.kept_out) or node.unschedulable
            or node.notice(observed.now, timedelta(0)) is not None)

