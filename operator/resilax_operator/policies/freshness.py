"""Checkpoint freshness for schedulers and people: annotations on the JAXJob and its current workers.

Kueue, Volcano and people deciding whom to preempt (or whether a job may be disturbed now) read them
from the objects they already watch, without reading Resilax's status schema:

| annotation                          | value                                                             |
|-------------------------------------|-------------------------------------------------------------------|
| `resilax.dev/last-checkpoint-time`  | when the operator first saw the newest step committed (status.checkpoint.time, RFC 3339, UTC) |
| `resilax.dev/last-checkpoint-step`  | that step (status.checkpoint.step)                                |
| `resilax.dev/last-checkpoint-tier`  | `persistent` (survives anything) or `local` (the node-local tier, not yet uploaded) |
| `resilax.dev/steps-at-risk`         | the trainer's step when the operator saw the commit, minus that step (not below 0); left out when pod 0's trainer of the current generation has not reported a step |

| observed                                                         | decision                                      |
|------------------------------------------------------------------|-----------------------------------------------|
| no committed checkpoint in the status                            | nothing                                       |
| the job's time/step/tier annotations differ from status.checkpoint | the job and every current worker get the four values, steps at risk computed now |
| the job's annotations name status.checkpoint                     | each current worker (not being deleted; a finished one too: it stays until the job goes) whose annotations differ gets the job's |

Write budget: at most one metadata patch per object per newly committed step (or tier), only of what
differs; the values are fixed when the job gets them (the workers copy the job's), so neither time nor
the trainer's progress alone ever causes a write. The commit is seen in the reconcile that reads pod
0's sidecar (every 5 s at least), and the annotations go out in the same reconcile as the status.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .. import api
from .. import status as st
from ..actions import Action, Notes, PublishFreshness, SetStatus
from ..observed.snapshot import Observed
from ..status import JobStatus

#: The annotations that identify the commit (steps at risk is derived once, when they change).
_COMMIT_KEYS = (api.ANNOTATION_LAST_CHECKPOINT_TIME, api.ANNOTATION_LAST_CHECKPOINT_STEP,
                api.ANNOTATION_LAST_CHECKPOINT_TIER)


def freshness_of(observed: Observed, s: JobStatus) -> dict[str, str] | None:
    """The four annotations every object should carry for `s.checkpoint` (None: nothing committed).
    The job's own values when they name the same commit, else computed from what is observed now."""
    c = s.checkpoint
    if c is None or not c.committed:
        return None
    commit = {api.ANNOTATION_LAST_CHECKPOINT_STEP: str(c.step), api.ANNOTATION_LAST_CHECKPOINT_TIER: c.tier}
    if c.time is not None:
        commit[api.ANNOTATION_LAST_CHECKPOINT_TIME] = str(st.format_time(c.time))
    job = dict(observed.freshness)
    if {k: job[k] for k in _COMMIT_KEYS if k in job} == commit:
        return {k: v for k, v in job.items() if k in api.FRESHNESS_ANNOTATIONS}
    trainer = observed.trainer
    if trainer is not None and trainer.generation == s.generation and trainer.step is not None:
        commit[api.ANNOTATION_STEPS_AT_RISK] = str(max(0, trainer.step - c.step))
    return commit


def notes_to_publish(current: Sequence[tuple[str, str]], wanted: Mapping[str, str]) -> Notes:
    """The merge-patch pairs that turn `current` into `wanted` (None removes an annotation); () if equal."""
    have = dict(current)
    return tuple((k, wanted.get(k)) for k in api.FRESHNESS_ANNOTATIONS if have.get(k) != wanted.get(k))


def decide(observed: Observed, s: JobStatus) -> PublishFreshness | None:
    """What to publish for status `s` (the status this decision leaves), or None when every object
    already carries it."""
    wanted = freshness_of(observed, s)
    if wanted is None:
        return None
    job = notes_to_publish(observed.freshness, wanted)
    pods = tuple((p.name, notes) for p in observed.pods_of(s.generation)
                 if p.deletion_timestamp is None and (notes := notes_to_publish(p.freshness, wanted)))
    return PublishFreshness(job, pods) if job or pods else None


def with_freshness(actions: list[Action], observed: Observed) -> list[Action]:
    """`actions` and, last, the freshness annotations the status they leave calls for."""
    s = next((a.status for a in reversed(actions) if isinstance(a, SetStatus)), observed.status)
    publish = decide(observed, s)
    return actions if publish is None else [*actions, publish]
