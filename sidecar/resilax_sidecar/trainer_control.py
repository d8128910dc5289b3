"""The sidecar's side of an in-place restart (docs/architecture.md, "Sidecar API"): what a stop or a
start call does with the supervisor's files, and whether the trainer is ready. Pure decisions here;
routes.py reads and writes the files (resilax_ckpt.control.trainer_control, the one format).

| call | answer |
|---|---|
| `POST /v1/trainer/stop` `{"generation": G', "reason", "stacks"}` | writes `trainer-stop.json`: 202; same generation again: 200; older than one already asked: 409 `stale_generation` |
| `POST /v1/trainer/start` `{"generation": G', "env"}` | writes `assignment.json`: 202; same generation and body: 200; same generation, other body: 409 `conflict`; older: 409 `stale_generation` |
| start with an `env` name outside `START_ENV_NAMES` | 400 `bad_request`, naming the refused names and the allowed ones |
| either, with no `incarnation.json` (no supervisor) | 409 `not_supervised` |
| `GET /v1/trainer/ready` | 200 while the current incarnation runs (and no newer stop is asked), else 503 |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from resilax_ckpt.control import trainer_control as tc

START_ENV_NAMES: frozenset[str] = frozenset({
    "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
    "RESILAX_NUM_SLICES", "RESILAX_SLICE_ID", "RESILAX_HOSTS_PER_SLICE", "RESILAX_GENERATION",
    "RESILAX_RESTORE_STEP", "RESILAX_LIVE_JOB_UIDS",
    "TPU_WORKER_ID", "TPU_WORKER_HOSTNAMES",
    "MEGASCALE_COORDINATOR_ADDRESS", "MEGASCALE_PORT", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID",
})
"""The only variables a start call may set for the new trainer: those that change with the generation
(the operator's `worker_env.build_generation_env`; a test holds the two equal). The token opens the
start call, not the trainer's interpreter: a variable such as `PYTHONWARNINGS`, `PYTHONPATH`,
`LD_PRELOAD` or `BROWSER` would run code of the caller's choosing in the trainer (docs/sidecar.md)."""


def refuse_start_env(env: Mapping[str, str]) -> str | None:
    """Why a start call's `env` is refused (names outside START_ENV_NAMES), or None (pure)."""
    refused = sorted(set(env) - START_ENV_NAMES)
    if not refused:
        return None
    return (f"env: {', '.join(refused)} may not be set by a start call; allowed: "
            f"{', '.join(sorted(START_ENV_NAMES))}")


@dataclass(frozen=True)
class Verdict:
    """What to answer: the HTTP status, whether to write the file, and the error code (None: success)."""

    status: int
    write: bool
    code: str | None = None
    message: str = ""


def decide_stop(existing: tc.StopRequest | None, request: tc.StopRequest) -> Verdict:
    """A stop call against the stop already asked (None: none)."""
    if existing is None or request.generation > existing.generation:
        return Verdict(202, True)
    if request.generation == existing.generation:
        return Verdict(200, False)
    return Verdict(409, False, "stale_generation",
                   f"generation: {request.generation} is older than the stop already asked for generation "
                   f"{existing.generation}")


def decide_start(existing: tc.Assignment | None, request: tc.Assignment) -> Verdict:
    """A start call against the newest assignment (None: none)."""
    if existing is None or request.generation > existing.generation:
        return Verdict(202, True)
    if request.generation < existing.generation:
        return Verdict(409, False, "stale_generation",
                       f"generation: {request.generation} is older than the start already asked for generation "
                       f"{existing.generation}")
    if dict(request.env) == dict(existing.env):
        return Verdict(200, False)
    changed = sorted(k for k in set(request.env) | set(existing.env) if request.env.get(k) != existing.env.get(k))
    return Verdict(409, False, "conflict",
                   f"env: generation {request.generation} was already started with other values (for {changed})")


def trainer_ready(incarnation: Mapping[str, Any] | None, stop: tc.StopRequest | None) -> tuple[bool, str]:
    """Whether the pod's trainer counts as ready (the readinessProbe, the operator's doorbell), and why not."""
    if incarnation is None:
        return False, "no supervised trainer (no incarnation.json)"
    state, generation = incarnation.get("state"), incarnation.get("generation")
    if state != tc.RUNNING:
        return False, f"incarnation {incarnation.get('incarnation')} is {state}"
    if stop is not None and isinstance(generation, int) and stop.generation > generation:
        return False, f"generation {generation} is asked to stop for generation {stop.generation}"
    return True, ""
