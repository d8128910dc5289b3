"""Lower-priority JAXJobs that serve as a job's spare (pure): which jobs consent, parsed from the
operator's cache (policies/spare_jobs.py decides when one is suspended and resumed).

A JAXJob annotated `resilax.dev/spare-for: <name>` may be suspended (its own final save first, as a
`spec.suspend` edit does) so that the JAXJob `<name>` of its namespace takes its nodes when that job
would otherwise wait for capacity; it is resumed once that job runs at its declared shape again, and
then waits for capacity of its own. The operator marks a job it suspended so with
`resilax.dev/suspended-for: <name>`, and resumes only such jobs (a user's own suspension stays).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from .. import api

#: On a lower-priority JAXJob: the JAXJob of its namespace it serves as a spare for (set by its user).
ANNOTATION_SPARE_FOR: Final = "resilax.dev/spare-for"
#: Set by the operator with spec.suspend: true: the job it suspended this one for (removed on resume).
ANNOTATION_SUSPENDED_FOR: Final = "resilax.dev/suspended-for"


@dataclass(frozen=True)
class SpareJob:
    """A live JAXJob that serves as this job's spare."""

    name: str
    uid: str
    #: spec.suspend as it stands.
    suspended: bool
    #: The operator suspended it for this job (`resilax.dev/suspended-for` names it).
    lent: bool
    #: Its status.phase and whether it has workers (status.generation > 0 and not Suspended).
    phase: str = ""


def parse_spare_jobs(job: Mapping[str, Any], jobs: Iterable[Mapping[str, Any]]) -> tuple[SpareJob, ...]:
    """The other live JAXJobs of `job`'s namespace annotated `resilax.dev/spare-for: <job's name>`
    (not Succeeded or Failed, not being deleted), sorted by name."""
    meta = job.get("metadata") or {}
    name, namespace, uid = meta.get("name"), meta.get("namespace"), meta.get("uid")
    out = []
    for other in jobs:
        m = other.get("metadata") or {}
        notes = m.get("annotations") or {}
        phase = str((other.get("status") or {}).get("phase") or "")
        if (m.get("namespace") != namespace or m.get("uid") == uid or notes.get(ANNOTATION_SPARE_FOR) != name
                or phase in api.TERMINAL_PHASES or m.get("deletionTimestamp")):
            continue
        out.append(SpareJob(str(m.get("name", "")), str(m.get("uid", "")), bool((other.get("spec") or {}).get("suspend")),
                            notes.get(ANNOTATION_SUSPENDED_FOR) == name, phase))
    return tuple(sorted(out, key=lambda j: j.name))


def suspended_for_gone(job: Mapping[str, Any], jobs: Iterable[Mapping[str, Any]]) -> str:
    """The name in `job`'s `resilax.dev/suspended-for` when no live JAXJob of that name is left in its
    namespace (the job it was lent to is gone: it resumes); "" otherwise."""
    meta = job.get("metadata") or {}
    lent_to = (meta.get("annotations") or {}).get(ANNOTATION_SUSPENDED_FOR)
    if not lent_to:
        return ""
    for other in jobs:
        m = other.get("metadata") or {}
        if m.get("namespace") == meta.get("namespace") and m.get("name") == lent_to and not m.get("deletionTimestamp"):
            return ""
    return str(lent_to)
