"""The supervisor's (`resilax run`, supervisor.py) settings, records and pure decisions: what to do
next with its child, the steps of a stop, the child's environment. JAX-free, no I/O."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Mapping

from resilax_ckpt.control import trainer_control as tc
from resilax_ckpt.trainer import kept


@dataclasses.dataclass(frozen=True)
class SupervisorSettings:
    control_dir: str | None
    """`RESILAX_CONTROL_DIR`: where the control files live; None: no in-place control (plain init)."""
    base_generation: int = 0
    """`RESILAX_GENERATION` of the pod's environment: the generation of the first child."""
    restart_grace_seconds: float = 5.0
    """`RESILAX_RESTART_GRACE_SECONDS`: between a stop's SIGTERM and its SIGKILL."""
    stacks_seconds: float = 2.0
    """How long a stop with stacks waits for them before its SIGTERM."""
    poll_seconds: float = 0.1
    """How often the control files are read (signals wake the loop at once)."""
    keep: bool = True
    """`RESILAX_KEEP_TRAINER` (default on; 0: off): a trainer run by `rc.run_kept` may be kept (kept.py)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SupervisorSettings:
        def number(name: str, default: float) -> float:
            raw = env.get(name, "").strip()
            try:
                value = float(raw) if raw else default
            except ValueError:
                value = -1.0
            if value < 0:
                raise ValueError(f"{name}: {raw!r} is not allowed; allowed: a number of seconds >= 0")
            return value

        raw_gen = env.get("RESILAX_GENERATION", "").strip() or "0"
        if not raw_gen.isdigit():
            raise ValueError(f"RESILAX_GENERATION: {raw_gen!r} is not allowed; allowed: an integer >= 0")
        return cls(control_dir=env.get("RESILAX_CONTROL_DIR", "").strip() or None, base_generation=int(raw_gen),
                   restart_grace_seconds=number("RESILAX_RESTART_GRACE_SECONDS", 5.0), keep=kept.keep_enabled(env))


@dataclasses.dataclass(frozen=True)
class Record:
    """One incarnation, as written to `incarnation.json`."""

    incarnation: int
    generation: int
    pid: int | None
    state: str
    started_at: float | None
    finished_at: float | None = None
    exit_code: int | None = None
    signal: int | None = None
    reason: str | None = None
    """Why it was stopped (the stop request's reason), or why it could not run; None: it ended by itself."""
    kept: bool = False
    """It runs in the process of the incarnation before it (kept.py)."""
    parked: bool = False
    """`exited` by parking: its entry returned and its process waits, holding no device, to be kept."""
    restarts: dict[str, object] | None = None
    """Counts of this supervisor's restarts: `{"kept": n, "fresh": {reason key: n}}`."""

    @property
    def live(self) -> bool:
        return self.state != tc.EXITED

    def to_json(self) -> dict[str, object]:
        return dataclasses.asdict(self)


# --- pure decisions ---

@dataclasses.dataclass(frozen=True)
class Start:
    assignment: tc.Assignment
    from_file: bool
    """False: the pod's own environment (no overlay, RESILAX_GENERATION left as the pod has it)."""


@dataclasses.dataclass(frozen=True)
class Stop:
    request: tc.StopRequest


@dataclasses.dataclass(frozen=True)
class Exit:
    code: int


Action = Start | Stop | Exit | None


def decide(record: Record | None, newest_generation_run: int, terminating: bool,
           stop: tc.StopRequest | None, assignment: tc.Assignment | None, from_file: bool) -> Action:
    """What to do next. `record`: the current or last incarnation (None: none yet); `assignment`: the
    newest of the pod's environment and `assignment.json`. Never a start while a child lives."""
    if terminating:
        if record is not None and record.live:
            return None  # the signal was forwarded; wait for the child
        return Exit(record.exit_code if record is not None and record.exit_code is not None
                    else 128 + signal.SIGTERM)
    if record is not None and record.live:
        if record.state == tc.RUNNING and stop is not None and stop.generation > record.generation:
            return Stop(stop)
        return None
    if record is not None and record.exit_code == 0 and record.reason is None:
        return Exit(0)
    if (assignment is not None and assignment.generation > newest_generation_run
            and (stop is None or stop.generation <= assignment.generation)):
        return Start(assignment, from_file)
    return None


STACKS, TERM, KILL = "stacks", "term", "kill"


def due_stop_steps(elapsed: float, stacks: bool, stacks_seconds: float, grace_seconds: float) -> list[str]:
    """The steps of a stop due `elapsed` seconds after it began, in order: stacks at once (if asked),
    SIGTERM after the stacks' window, SIGKILL a grace later."""
    due = [STACKS] if stacks else []
    term_at = stacks_seconds if stacks else 0.0
    if elapsed >= term_at:
        due.append(TERM)
    if elapsed >= term_at + grace_seconds:
        due.append(KILL)
    return due


def child_env(base: Mapping[str, str], start: Start, incarnation: int) -> dict[str, str]:
    """The pod's environment, overlaid by the assignment's, plus the incarnation (and its generation)."""
    env = dict(base)
    if start.from_file:
        env.update(start.assignment.env)
        env["RESILAX_GENERATION"] = str(start.assignment.generation)
    env["RESILAX_INCARNATION"] = str(incarnation)
    return env


def exit_code_of(status: int) -> tuple[int, int | None]:
    """A `waitpid` status to (exit code, signal): a signal n is 128+n, as a shell and the kubelet say."""
    code = os.waitstatus_to_exitcode(status)
    return (128 - code, -code) if code < 0 else (code, None)
