"""A generation that stays Recovering or Resizing for minutes says what it waits for (pure).

The Ready condition says why the job is not ready; a recovery that takes minutes deserves more than that,
and sooner than the 15-minute alert: a Warning Event `RecoveryWaiting` naming the pods not running yet
(and where they are), the nodes down, the final save or the old pods the transition waits for, the
kept trainers of an in-place restart not stopped or started yet.

| state                                                      | decision                                  |
|------------------------------------------------------------|-------------------------------------------|
| not Recovering/Resizing                                    | no notice (status.recoveryNotice cleared)  |
| Ready=False for less than `WAIT_EVENT_SECONDS`             | nothing yet                               |
| no notice yet for this generation                          | Event, notice recorded                    |
| what it waits for (the Ready reason) changed               | Event, at most one per `MIN_GAP_SECONDS`  |
| the same wait                                              | Event again every `REPEAT_SECONDS`         |

The notice lives in status.recoveryNotice (status_fields/recovery_notice.py): the status is the operator's memory, so
an operator restart neither repeats the Event nor forgets it. Deciding twice gives the same actions.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime
from typing import Final

from .. import api
from .. import status as st
from ..actions import Action, EmitEvent, SetStatus
from ..observed.snapshot import Observed, ObservedPod
from ..status import JobStatus
from ..status_fields.recovery_notice import RecoveryNotice

#: A recovery this long (Ready=False, phase Recovering or Resizing) gets its first Event.
WAIT_EVENT_SECONDS: Final = 120
#: The same wait is told again this often.
REPEAT_SECONDS: Final = 600
#: A change of what it waits for is told at most this often.
MIN_GAP_SECONDS: Final = 60
#: Phases a recovery waits in.
WAITING_PHASES: Final = (api.PHASE_RECOVERING, api.PHASE_RESIZING)
#: At most this many pods or nodes named per part; the rest counted.
NAMED: Final = 5
#: Event messages stay under the API's 1 KiB note limit.
MAX_MESSAGE: Final = 1000


def with_notice(actions: list[Action], observed: Observed) -> list[Action]:
    """`actions` with the `RecoveryWaiting` Event and status.recoveryNotice that `decide_notice` asks for
    (in the decision's status write, or one of its own)."""
    index = next((i for i in range(len(actions) - 1, -1, -1) if isinstance(actions[i], SetStatus)), None)
    s = actions[index].status if index is not None else observed.status  # type: ignore[union-attr]
    notice, event = decide_notice(s, observed)
    if notice == s.recovery_notice:
        return actions
    new = SetStatus(replace(s, recovery_notice=notice))
    out = list(actions)
    if index is None:
        out.insert(0, new)
    else:
        out[index] = new
    return out if event is None else [*out, event]


def decide_notice(s: JobStatus, observed: Observed) -> tuple[RecoveryNotice | None, EmitEvent | None]:
    """The notice the status should hold after this decision, and the Event to emit (module docstring)."""
    last, now = s.recovery_notice, observed.now
    since = waiting_since(s)
    if s.phase not in WAITING_PHASES or since is None:
        return None, None
    if last is not None and last.generation != s.generation:
        last = None
    waited = (now - since).total_seconds()
    if waited < WAIT_EVENT_SECONDS:
        return last, None
    key = waiting_key(s)
    if last is not None:
        gap = (now - last.time).total_seconds()
        if gap < (MIN_GAP_SECONDS if key != last.waiting_for else REPEAT_SECONDS):
            return last, None
    message = api.RECOVERY_WAITING.format(generation=s.generation, phase=s.phase, waited=format_duration(waited),
                                          what=describe_wait(s, observed))
    return (RecoveryNotice(s.generation, key, st.truncate(now)),
            EmitEvent("Warning", api.RECOVERY_WAITING.name, clip(message, MAX_MESSAGE)))


def waiting_since(s: JobStatus) -> datetime | None:
    """Since when the job has not been ready: the Ready condition's last transition to False (the
    generation's start when the status has no such condition)."""
    ready = s.condition(api.COND_READY)
    if ready is not None:
        return ready.last_transition_time if ready.status == "False" else None
    return s.generation_start_time


def waiting_key(s: JobStatus) -> str:
    """What the generation waits for, in short: the Ready condition's reason (else the phase)."""
    ready = s.condition(api.COND_READY)
    return ready.reason if ready is not None and ready.reason else s.phase


def describe_wait(s: JobStatus, observed: Observed) -> str:
    """What the recovery waits for, part by part: the Ready condition, the final save, the old pods to
    go, the kept trainers of an in-place restart, the pods of the generation not running, the nodes down."""
    parts: list[str] = []
    ready = s.condition(api.COND_READY)
    if ready is not None and ready.status == "False":
        parts.append(f"{ready.reason} ({clip(ready.message, 300)})")
    t = s.transition
    if t is not None and t.saving:
        parts.append(f"the final save of generation {t.generation} (until {st.format_time(t.save_deadline)})")
    old = [p for p in observed.pods if p.generation != s.generation
           and (s.in_place is None or p.name not in {k.pod for k in s.in_place.kept})]
    if old:
        parts.append("old pods to go: " + named([describe_pod(p) for p in old]))
    ip = s.in_place
    if ip is not None:
        if ip.phase == st.IN_PLACE_STOPPING:
            left = [k.pod for k in ip.kept if not k.stopped]
            if left:
                parts.append("kept trainers to stop: " + named(left))
        else:
            left = [k.pod for k in ip.kept if not k.started]
            if left:
                parts.append("kept trainers to start: " + named(left))
    current = {p.name: p for p in observed.pods if p.generation == s.generation}
    if s.generation and s.shape is not None and t is None:  # in a transition they are the old ones
        expected = s.pod_names(observed.job.name)
        missing = [n for n in expected if n not in current]
        if missing:
            parts.append("pods not created yet: " + named(missing))
    waiting = [describe_pod(p) for p in sorted(current.values(), key=lambda p: p.name)
               if not (p.phase == "Running" and p.ready) and p.deletion_timestamp is None]
    if waiting:
        parts.append("pods not ready: " + named(waiting))
    down = nodes_down(s, observed, current.values())
    if down:
        parts.append("nodes down: " + named(down))
    return "; ".join(parts) or "nothing the operator can name (see the Ready condition)"


def describe_pod(p: ObservedPod) -> str:
    """`name (phase, on node | no node yet[, container reason])`."""
    where = f"on {p.node_name}" if p.node_name else "no node yet"
    why = [f"{c} {r}" for c, r, _ in p.waiting] + [f"{c} {r}" for c, r in p.starting]
    going = ", terminating" if p.deletion_timestamp is not None else ""
    return f"{p.name} ({p.phase}, {where}{going}{', ' + ', '.join(why) if why else ''})"


def nodes_down(s: JobStatus, observed: Observed, pods: Iterable[ObservedPod]) -> list[str]:
    """The nodes of the generation's pods and of its workers' last nodes (status.workerNodes) that are
    down (`ObservedNode.down_since`) or not Ready, with since when."""
    names = {p.node_name for p in pods if p.node_name} | {n for _, n in s.worker_nodes}
    out = []
    for name in sorted(names):
        node = observed.node(name)
        if node is None:
            continue
        since = node.down_since(observed.now)
        if since is not None:
            out.append(f"{name} (down since {st.format_time(since)})")
        elif node.ready != "True":
            out.append(f"{name} (Ready={node.ready})")
    return out


def named(items: list[str]) -> str:
    """The first `NAMED` items, and how many more."""
    head = ", ".join(items[:NAMED])
    return head if len(items) <= NAMED else f"{head} and {len(items) - NAMED} more"


def format_duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."

