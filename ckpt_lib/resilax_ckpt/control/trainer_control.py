"""The files through which a pod's sidecar controls its supervised trainer (docs/architecture.md,
"In-place restart of the survivors"). JAX-free: the supervisor (`resilax run`) and the sidecar import it.

All three live in `$RESILAX_CONTROL_DIR` and are written to a temporary name, then renamed:
- `incarnation.json`, written by the supervisor at every change of its child: `{"incarnation": n,
  "generation": G, "pid", "state": "running"|"stopping"|"exited", "started_at", "finished_at",
  "exit_code", "signal", "reason"}`. `"exited"` means the child and every descendant are reaped.
- `trainer-stop.json` `{"generation": G', "reason": str, "stacks": bool}`, written by the sidecar:
  stop a child whose generation is older than G'.
- `assignment.json` `{"generation": G', "env": {name: value}}`, written by the sidecar: start a child
  of generation G' (newer than any run) with the pod's environment overlaid by `env`, once none lives.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from resilax_ckpt.control.control_files import load_control_json

INCARNATION_FILE = "incarnation.json"
STOP_FILE = "trainer-stop.json"
ASSIGNMENT_FILE = "assignment.json"

RUNNING = "running"
STOPPING = "stopping"
EXITED = "exited"
STATES = (RUNNING, STOPPING, EXITED)


class InvalidControlFileError(ValueError):
    """A control file or request body that does not have the documented fields."""


@dataclasses.dataclass(frozen=True)
class StopRequest:
    generation: int
    """Stop a child whose generation is older than this one."""
    reason: str = ""
    stacks: bool = False
    """Capture the child's stacks to the pod log first (a hang)."""

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "reason": self.reason, "stacks": self.stacks}


@dataclasses.dataclass(frozen=True)
class Assignment:
    generation: int
    """The generation the next child runs; it starts only if newer than every generation run."""
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Overlay on the pod's environment (the generation-dependent variables, literal values)."""

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "env": dict(self.env)}


def _generation(raw: Mapping[str, Any], where: str) -> int:
    value = raw.get("generation")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidControlFileError(f"{where}.generation: {value!r} is not allowed; allowed: an integer >= 0")
    return value


def parse_stop(raw: object, where: str = "trainer-stop") -> StopRequest:
    """`{"generation", "reason"?, "stacks"?}` to a StopRequest; field-path errors."""
    if not isinstance(raw, dict):
        raise InvalidControlFileError(f"{where}: {type(raw).__name__} is not allowed; allowed: a JSON object")
    reason = raw.get("reason", "")
    if not isinstance(reason, str):
        raise InvalidControlFileError(f"{where}.reason: {reason!r} is not allowed; allowed: a string")
    stacks = raw.get("stacks", False)
    if not isinstance(stacks, bool):
        raise InvalidControlFileError(f"{where}.stacks: {stacks!r} is not allowed; allowed: true or false")
    return StopRequest(generation=_generation(raw, where), reason=reason, stacks=stacks)


def parse_assignment(raw: object, where: str = "assignment") -> Assignment:
    """`{"generation", "env"?}` to an Assignment; field-path errors."""
    if not isinstance(raw, dict):
        raise InvalidControlFileError(f"{where}: {type(raw).__name__} is not allowed; allowed: a JSON object")
    env = raw.get("env", {})
    if not isinstance(env, dict):
        raise InvalidControlFileError(f"{where}.env: {env!r} is not allowed; allowed: an object of strings")
    for key, value in env.items():
        if not isinstance(value, str) or not key or "=" in key:
            raise InvalidControlFileError(f"{where}.env.{key}: {value!r} is not allowed; allowed: a string value "
                                          "under a variable name without '='")
    return Assignment(generation=_generation(raw, where), env=dict(env))


def read_json(control_dir: str, name: str) -> dict[str, Any] | None:
    """A control file's object, or None when it is missing or not (yet) a JSON object."""
    raw = load_control_json(os.path.join(control_dir, name))
    return raw if isinstance(raw, dict) else None


def write_json(control_dir: str, name: str, body: Mapping[str, Any]) -> None:
    """Write a control file atomically (temporary name in the same folder, then rename)."""
    os.makedirs(control_dir, exist_ok=True)
    path = os.path.join(control_dir, name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(dict(body), f)
    os.replace(tmp, path)


def read_stop(control_dir: str) -> StopRequest | None:
    """The stop request in force, or None (none, or an unreadable file: ignored)."""
    raw = read_json(control_dir, STOP_FILE)
    try:
        return None if raw is None else parse_stop(raw)
    except InvalidControlFileError:
        return None


def read_assignment(control_dir: str) -> Assignment | None:
    """The newest assignment, or None (none, or an unreadable file: ignored)."""
    raw = read_json(control_dir, ASSIGNMENT_FILE)
    try:
        return None if raw is None else parse_assignment(raw)
    except InvalidControlFileError:
        return None


def read_incarnation(control_dir: str) -> dict[str, Any] | None:
    """The supervisor's `incarnation.json`, or None: no supervisor runs the trainer (or not yet)."""
    return read_json(control_dir, INCARNATION_FILE)
