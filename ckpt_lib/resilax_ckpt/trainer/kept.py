"""A kept trainer process (issue 38; docs/architecture.md, "Keep what can be kept"): the decisions.

A trainer whose entry point is `rc.run_kept(main)` and which runs under `resilax run` can run the next
incarnation in the same process instead of a fresh one, where JAX allows it: one process, the same
world. The entry returns after its final save (EXIT_CODE_STOPPED), the process drops its JAX backends
and parks (holding no device, no distributed client); the supervisor, given the next generation's
start, either hands it the new environment (same pid: the interpreter, the imports, the host memory
and ~7 s of a TPU chip's opening kept) or ends it and starts a fresh process, saying why and counting
the reason. Every case that is not eligible falls back to a fresh process:

| case | decision | reason key |
|---|---|---|
| the entry raised, or returned anything but EXIT_CODE_STOPPED | not parked (the process exits as always) | `not_stopped` / `raised` |
| the trainer ran several JAX processes | not parked | `several_processes` |
| dropping the backends failed | not parked | `drop_failed` |
| the trainer does not call `rc.run_kept` (it exits) | fresh | `not_parked` |
| `RESILAX_KEEP_TRAINER=0` | fresh | `keep_off` |
| the stop asked for stacks (a hang of the trainer's own process) | fresh | `hang` |
| the next generation runs several processes | fresh | `several_processes` |
| any variable other than the generation's own changes (a new world or mesh) | fresh | `world_changed` |
| the parked process died, or the kept restart failed before it reopened the devices | fresh | `parked_died` / `kept_failed` |

Pure and JAX-free (the supervisor imports it); kept_channel.py carries the messages, kept_trainer.py is
the trainer's side.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any, Final

FD_ENV: Final = "RESILAX_KEPT_FD"
"""Set by `resilax run` in each child's environment: the number of the child's end of the channel."""
KEEP_ENV: Final = "RESILAX_KEEP_TRAINER"
"""`0` (or false/no/off): `resilax run` never keeps a trainer process (every incarnation a fresh one)."""
EXIT_CODE_STOPPED: Final = 75
"""What an entry point returns after a stop's final save (manager.EXIT_CODE_STOPPED, JAX-free here)."""

GENERATION_ENV_NAMES: Final = frozenset({"RESILAX_GENERATION", "RESILAX_RESTORE_STEP", "RESILAX_LIVE_JOB_UIDS",
                                         "RESILAX_INCARNATION", FD_ENV})
"""What may change between two incarnations kept in one process: the generation (the fencing token),
the restore's step choice, the job uids the storage claim checks and the incarnation number. Any other
change (coordinator address, process count or id, slices, TPU worker hostnames) is a new world."""

NOT_STOPPED, RAISED, SEVERAL_PROCESSES, DROP_FAILED = "not_stopped", "raised", "several_processes", "drop_failed"
NOT_PARKED, KEEP_OFF, HANG, WORLD_CHANGED = "not_parked", "keep_off", "hang", "world_changed"
PARKED_DIED, KEPT_FAILED = "parked_died", "kept_failed"
REASONS: Final = (NOT_STOPPED, RAISED, SEVERAL_PROCESSES, DROP_FAILED, NOT_PARKED, KEEP_OFF, HANG, WORLD_CHANGED,
                  PARKED_DIED, KEPT_FAILED)
"""Every reason a restart is a fresh process (bounded: the keys of `incarnation.json`'s counts)."""

_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a trainer process is not kept: a key of REASONS and the sentence logged."""

    key: str
    message: str


@dataclasses.dataclass(frozen=True)
class Parked:
    """A trainer process that parked after its incarnation's entry point returned."""

    pid: int
    incarnation: int
    generation: int
    exit_code: int
    """What its entry point returned (EXIT_CODE_STOPPED)."""
    processes: int
    """jax.process_count() of the incarnation that parked."""
    env: Mapping[str, str]
    """The environment it ran that incarnation with."""
    hang: bool = False
    """The stop it obeyed asked for stacks: the operator found its process hung."""


def keep_enabled(env: Mapping[str, str]) -> bool:
    """RESILAX_KEEP_TRAINER: on unless 0/false/no/off."""
    return env.get(KEEP_ENV, "").strip().lower() not in _FALSE


def process_count_of(env: Mapping[str, str]) -> int:
    """The JAX processes a generation's environment asks for (JAX_NUM_PROCESSES with a coordinator, else 1)."""
    raw = env.get("JAX_NUM_PROCESSES", "").strip()
    if not env.get("JAX_COORDINATOR_ADDRESS", "").strip() or not raw.isdigit():
        return 1
    return max(1, int(raw))


def decide_park(exit_code: int | None, raised: BaseException | None, processes: int) -> Refusal | None:
    """The trainer's side, once its entry point ended: None to park (drop the backends, wait for the
    next incarnation), else why it exits as it always did."""
    if raised is not None:
        return Refusal(RAISED, f"the entry point raised {type(raised).__name__}: {raised}")
    if exit_code != EXIT_CODE_STOPPED:
        return Refusal(NOT_STOPPED, f"the entry point returned {exit_code}, not {EXIT_CODE_STOPPED} (stopped after "
                                    "its final save)")
    if processes != 1:
        return Refusal(SEVERAL_PROCESSES, f"the trainer ran {processes} JAX processes: a process joins one "
                                          "jax.distributed world once")
    return None


def decide_keep(parked: Parked | None, next_env: Mapping[str, str], enabled: bool,
                left: Refusal | None = None) -> Refusal | None:
    """The supervisor's side, at the next incarnation's start: None to hand `next_env` to the parked
    process, else why the next incarnation is a fresh process. `left`: what the last process said
    when it exited without parking (its own refusal), if it said anything."""
    if not enabled:
        return Refusal(KEEP_OFF, f"{KEEP_ENV}=0: every incarnation is a fresh process")
    if parked is None:
        return left or Refusal(NOT_PARKED, "the last trainer process exited without parking (its entry point "
                                           "is not run by resilax_ckpt.run_kept, or it was killed)")
    if parked.hang:
        return Refusal(HANG, "its stop asked for stacks: the operator found the trainer's own process hung")
    wanted = process_count_of(next_env)
    if parked.processes != 1 or wanted != 1:
        return Refusal(SEVERAL_PROCESSES, f"the next generation runs {wanted} JAX processes: a process joins one "
                                          "jax.distributed world once")
    changed = sorted(k for k in set(parked.env) | set(next_env)
                     if k not in GENERATION_ENV_NAMES and parked.env.get(k) != next_env.get(k))
    if changed:
        return Refusal(WORLD_CHANGED, f"the environment changes beyond the generation's own variables "
                                      f"({', '.join(changed)}): a new world or mesh")
    return None


def plan_env_update(current: Mapping[str, str], next_env: Mapping[str, str]) -> dict[str, str | None]:
    """What the kept process sets (a string) or removes (None) in its own environment for the next
    incarnation: the generation's own variables (GENERATION_ENV_NAMES, but the channel's descriptor), and
    nothing else. decide_keep has checked that the supervisor's environments agree on the rest, so the
    rest stays as this process made it: JAX's TPU start-up appends to LIBTPU_INIT_ARGS (and sets
    TPU_ML_PLATFORM) in os.environ, its persistent compilation cache puts LIBTPU_INIT_ARGS and XLA_FLAGS
    in every cache key, and replacing the environment wholesale made every compile of a kept incarnation
    a cache miss on a TPU v5e (2026-12-07: 3 requests, 0 hits, 12.3 s instead of 1-2 s)."""
    return {name: next_env.get(name) for name in sorted(GENERATION_ENV_NAMES - {FD_ENV})
            if current.get(name) != next_env.get(name)}


# ---------------------------------------------------------------------------- messages (one JSON object a line)

def encode(kind: str, body: Mapping[str, Any]) -> bytes:
    """`{"<kind>": body}` as one line."""
    return (json.dumps({kind: dict(body)}, separators=(",", ":")) + "\n").encode()


def parse_message(line: bytes) -> tuple[str, dict[str, Any]] | None:
    """One line to (kind, body); None for anything that is not `{"<kind>": {...}}`."""
    try:
        raw = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(raw, dict) or len(raw) != 1:
        return None
    ((kind, body),) = raw.items()
    return (kind, body) if isinstance(kind, str) and isinstance(body, dict) else None
