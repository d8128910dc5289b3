"""Ownership: the job's pods, Services and token Secret are its own by owner reference (the JAXJob's
uid, `observed.owner_uid`), never by name or label.

| observed                                                          | decision |
|-------------------------------------------------------------------|----------|
| a pod or Service labelled with the job's name, not owned by its uid (a JAXJob of the same name deleted and created again, anybody's) | not the job's: no worker, never deleted, never asked for its state or a save (`observed.assemble_observed` drops it) |
| creating a worker pod, the job's Service or the token Secret finds one of that name the job does not own (execute.py reads its owner after a 409; the Secret before every creation) | NameConflict=True and Ready=False naming the object and its owner, a Warning event per new conflict; the generation's workers count as not all created (the missing one is no lost pod) and the same generation creates it once the name is free (tried again at each reconcile) |
| every worker of the current generation exists, is the job's and runs | NameConflict=False |
| the token Secret is gone                                          | re-created before the next pods (execute.py); pods already starting without it get `EnsureTokenSecret` from container_waiting.py |
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from .. import api
from .. import status as st
from ..actions import Action, EmitEvent, RequeueAfter, status_change
from ..errors import NameConflictError
from ..observed.snapshot import Observed
from ..settings import OperatorSettings
from ..status import JobStatus


def decide(observed: Observed, conflict: NameConflictError, settings: OperatorSettings, *,
           creating: bool = True) -> list[Action]:
    """An object of the job's name that is not the job's: say so (once per conflict) and try again later.
    `creating`: found while creating the generation's workers, so they are not all created (a worker
    missing for that reason is no lost pod: the same generation creates it once the name is free)."""
    s, now = observed.status, observed.now
    if creating:
        s = replace(s, workers_created=False)
    message = api.NAME_CONFLICT.format(generation=s.generation, kind=conflict.kind, name=conflict.name,
                                       owner=conflict.owner)
    old = s.condition(api.COND_NAME_CONFLICT)
    new = st.set_condition(s, api.COND_NAME_CONFLICT, True, api.NAME_CONFLICT.name, message, now)
    new = st.set_condition(new, api.COND_READY, False, api.NAME_CONFLICT.name, message, now)
    same = old is not None and old.status == "True" and old.message == message
    events = [] if same else [EmitEvent("Warning", api.NAME_CONFLICT.name, message)]
    return [*status_change(s, new, *events), RequeueAfter(float(settings.refused_retry_seconds))]


def settle(s: JobStatus, observed: Observed, now: datetime) -> JobStatus:
    """NameConflict=False once every worker of the current generation exists, is the job's and runs."""
    cond = s.condition(api.COND_NAME_CONFLICT)
    if cond is None or cond.status != "True" or s.generation == 0 or not s.workers_created:
        return s
    running = {p.name for p in observed.pods_of(s.generation) if p.phase == "Running"}
    if not set(s.pod_names(observed.job.name)) <= running:
        return s
    return st.set_condition(s, api.COND_NAME_CONFLICT, False, api.NO_NAME_CONFLICT.name,
                            api.NO_NAME_CONFLICT.format(generation=s.generation), now)
