"""An invalid spec: what the job runs under meanwhile, and the InvalidSpec condition.

The status keeps the newest spec that validated (`status.lastValidSpec`: the spec without its nulls,
and its metadata.generation). It is recorded with the status change that records that generation as
`observedGeneration`, so it costs no write of its own, and a write carries it only when it changed
(`status.build_status_patch`: a merge patch of what differs from the stored status). An operator restart reads it back: the status is the memory.

| the spec | the job                                                         | decision |
|----------|-----------------------------------------------------------------|----------|
| valid    | any                                                             | the policies on it; lastValidSpec := it; InvalidSpec=False (SpecValid) |
| invalid  | has run a generation; lastValidSpec still validates             | the policies on lastValidSpec: node loss, preemption, worker exits, backoff, capacity all handled as before the edit; InvalidSpec=True (LastValidSpecKept) naming every problem, a Warning event per new set of problems. Fixed, the spec applies as any edit would (a resize, the next generation's template) |
| invalid  | never ran a generation                                          | Failed, InvalidSpec=True (SpecInvalid); fixing the spec starts it |
| invalid  | has run; no usable lastValidSpec (none recorded by an older operator, or it fails the operator's current settings) | InvalidSpec=True (SpecInvalid); the running generation is left alone |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import datetime
from typing import Any

from .. import api
from .. import status as st
from ..actions import Action, EmitEvent, status_change
from ..errors import InvalidSpecError
from ..observed.snapshot import Observed
from ..settings import OperatorSettings
from ..spec import JobSpec
from ..status import JobStatus, SpecRecord
from ..validation import validate_spec


def record(raw_spec: Mapping[str, Any], observed: Observed) -> SpecRecord:
    """What status.lastValidSpec holds for a spec that validated."""
    return SpecRecord(observed.spec_generation, st.without_nulls(raw_spec))


def last_valid(observed: Observed, settings: OperatorSettings) -> JobSpec | None:
    """The spec a job that has run keeps running under while its spec is invalid (None: none usable)."""
    s = observed.status
    if s.last_valid_spec is None or s.generation == 0:
        return None
    try:
        return validate_spec(s.last_valid_spec.spec, name=observed.job.name, settings=settings)
    except InvalidSpecError:
        return None


def describe(error: InvalidSpecError) -> str:
    """Every problem, each with its field path."""
    return "; ".join(str(p) for p in error.problems)


def mark_valid(s: JobStatus, now: datetime) -> JobStatus:
    return st.set_condition(s, api.COND_INVALID_SPEC, False, api.SPEC_VALID.name, api.SPEC_VALID.message, now)


def mark_kept(s: JobStatus, error: InvalidSpecError, now: datetime) -> tuple[JobStatus, list[EmitEvent]]:
    """InvalidSpec=True (LastValidSpecKept) naming every problem and the generation of the spec the job
    runs under, with a Warning event when the problems are new (the condition is the memory)."""
    generation = s.last_valid_spec.generation if s.last_valid_spec is not None else 0
    message = api.SPEC_INVALID_KEPT.format(problems=describe(error), generation=generation)
    old = s.condition(api.COND_INVALID_SPEC)
    new = st.set_condition(s, api.COND_INVALID_SPEC, True, api.SPEC_INVALID_KEPT.name, message, now)
    if old is not None and (old.status, old.reason, old.message) == ("True", api.SPEC_INVALID_KEPT.name, message):
        return new, []
    return new, [EmitEvent("Warning", api.SPEC_INVALID_KEPT.name, message)]


def decide_without_spec(error: InvalidSpecError, observed: Observed) -> list[Action]:
    """No spec to run under: InvalidSpec=True (SpecInvalid); a job that never ran a generation is Failed
    (`reconcile.decide_policies` starts it once the spec is fixed), a running one is left alone."""
    s, now = observed.status, observed.now
    message = describe(error)
    new = st.set_condition(s, api.COND_INVALID_SPEC, True, api.SPEC_INVALID.name, message, now)
    new = replace(new, observed_generation=observed.spec_generation)
    if s.generation == 0 and s.phase not in api.TERMINAL_PHASES:
        new = replace(new, phase=api.PHASE_FAILED)
        new = st.set_condition(new, api.COND_READY, False, api.SPEC_INVALID.name, message, now)
    return status_change(s, new, EmitEvent("Warning", api.SPEC_INVALID.name, message))
