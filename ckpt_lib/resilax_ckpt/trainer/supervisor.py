"""`resilax run -- CMD...`: run the training program as a child that can be replaced in place.

docs/architecture.md, "In-place restart of the survivors". The container's command is the supervisor;
it runs CMD as its child (incarnation 1 with the pod's environment) and never exits for a restart:
1. Each child gets `RESILAX_INCARNATION=<n>` and its own process group (same session); the supervisor
   is a child subreaper (`PR_SET_CHILD_SUBREAPER`), so whatever a child leaves behind is re-parented
   to it, killed and reaped.
2. Every change is written to `$RESILAX_CONTROL_DIR/incarnation.json` (`trainer_control`); `exited`
   only once the child is reaped and `waitpid(-1)` finds no descendant left (ECHILD).
3. The child exits 0 (and was not being stopped): the supervisor exits 0. Any other end: it stays.
4. `trainer-stop.json` naming a newer generation than the child's: stacks if asked (`py-spy dump
   --nonblocking` when on PATH and it succeeds, else SIGCONT + SIGUSR1, which
   `initialize_distributed_from_env` binds to faulthandler), SIGTERM to the child's group,
   `RESILAX_RESTART_GRACE_SECONDS` (default 5), SIGKILL, reap.
5. `assignment.json` naming a generation newer than any run: the next child, only once none lives.
6. SIGTERM or SIGINT to the supervisor: forwarded to the child; it exits with the child's code once
   the child is gone (128+n for a signal n). Usage errors exit 2, internal ones 70.
7. A kept trainer (kept.py, `rc.run_kept`): each child gets a channel (`$RESILAX_KEPT_FD`); a child
   that parks after its stop's final save counts as `exited` (its entry returned, its backends are
   dropped: it holds no device), and the next start hands it the new environment when `kept.decide_keep`
   allows (same pid, `"kept": true`), else ends it and spawns a fresh process, the reason logged and
   counted (`incarnation.json`'s `restarts`). A kept restart that fails before the devices reopen is
   replaced by a fresh process for the same incarnation.
Without `RESILAX_CONTROL_DIR` it only forwards signals and exits with the child's code.

JAX-free (shipped with `resilax[train]`): the decisions (`decide`, `due_stop_steps`) are pure, in
supervisor_rules.py; the `Supervisor` class does the process handling.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from resilax_ckpt.control import trainer_control as tc
from resilax_ckpt.trainer import kept
from resilax_ckpt.trainer.kept_channel import Channel
from resilax_ckpt.trainer.supervisor_rules import (
    KILL,
    STACKS,
    TERM,
    Action,
    Exit,
    Record,
    Start,
    Stop,
    SupervisorSettings,
    child_env,
    decide,
    due_stop_steps,
    exit_code_of,
)

__all__ = ["KILL", "STACKS", "TERM", "Action", "Exit", "Record", "Start", "Stop", "Supervisor", "SupervisorSettings",
           "child_env", "decide", "due_stop_steps", "exit_code_of", "main"]

log = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_INTERNAL = 70
EXIT_SPAWN_FAILED = 127
"""Recorded as the exit code of a child that could not be started (the command is missing), as a shell does."""
PR_SET_CHILD_SUBREAPER = 36
USAGE = "usage: resilax run [--] COMMAND [ARGS...]"


# --- process handling ---

def set_child_subreaper() -> bool:
    """Become the reaper of orphaned descendants (Linux); False where the kernel refuses."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def own_children() -> list[int]:
    """Pids whose parent is this process (orphans re-parented to the subreaper included)."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 1 and int(fields[1]) == me:
            found.append(int(name))
    return found


def _signal_quietly(send: Callable[[int, int], None], target: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        send(target, sig)


class Supervisor:
    """Runs the command as successive incarnations. `run()` returns the supervisor's exit code."""

    def __init__(self, command: Sequence[str], settings: SupervisorSettings,
                 env: Mapping[str, str] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.command = list(command)
        self.settings = settings
        self.env = dict(os.environ if env is None else env)
        self.clock = clock
        self.record: Record | None = None
        self.newest_generation_run = -1
        self.terminating = 0  # the signal received (SIGTERM or SIGINT), 0: none
        self._forwarded = False
        self._child_status: int | None = None  # the child's waitpid status once reaped
        self._waiting_logged = False
        self._stop: tc.StopRequest | None = None
        self._stop_began = 0.0
        self._stop_done: set[str] = set()
        self._last_incarnation = 0
        self._explained: tuple[int, str] | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._channel: Channel | None = None  # to the current (or parked) trainer process
        self._child_env: dict[str, str] = {}  # the environment of its current (or last) incarnation
        self._parked: kept.Parked | None = None
        self._left: kept.Refusal | None = None  # why the current process said it will not park
        self._resuming: Start | None = None  # a kept incarnation whose process has not reopened its devices yet
        self.restarts: dict[str, Any] = {"kept": 0, "fresh": {}}

    # signals wake the loop through a pipe; the handlers only record
    def _install_signals(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_terminate)

    def _on_terminate(self, signum: int, _frame: object) -> None:
        if not self.terminating:
            self.terminating = signum

    def run(self) -> int:
        if not set_child_subreaper():
            log.warning("resilax run: could not become a child subreaper; orphans of the trainer are not reaped")
        self._install_signals()
        self._recover_previous_record()
        while True:
            self._read_channel()  # first: what a child said before it exited, or parked before a stop's SIGKILL
            self._reap()
            self._forward_termination()
            self._advance_stop()
            action = self._decide()
            if isinstance(action, Exit):
                self._end_parked("the supervisor exits")
                log.info("resilax run: exiting %d", action.code)
                return action.code
            if isinstance(action, Start):
                self._start(action)
                continue
            if isinstance(action, Stop):
                self._begin_stop(action.request)
                continue
            waits = [self._wake_r] + ([self._channel.fileno()] if self._channel and not self._channel.closed else [])
            with contextlib.suppress(InterruptedError):
                select.select(waits, [], [], self.settings.poll_seconds)
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 512)

    def _decide(self) -> Action:
        stop = assignment = None
        from_file = False
        base = tc.Assignment(self.settings.base_generation)
        if self.settings.control_dir is not None:
            stop = tc.read_stop(self.settings.control_dir)
            assignment = tc.read_assignment(self.settings.control_dir)
        if assignment is not None and assignment.generation > base.generation:
            from_file = True
        else:
            assignment = base
        if self.settings.control_dir is None and self.record is not None and not self.record.live:
            return Exit(self.record.exit_code if self.record.exit_code is not None else EXIT_INTERNAL)
        action = decide(self.record, self.newest_generation_run, bool(self.terminating), stop, assignment, from_file)
        if action is None and not self.terminating:
            self._explain_hold(stop, tc.read_assignment(self.settings.control_dir) if self.settings.control_dir else None)
        return action

    def _explain_hold(self, stop: tc.StopRequest | None, assignment: tc.Assignment | None) -> None:
        """Say once per assignment why it does not start (the operator's and the tests' evidence)."""
        if assignment is None:
            return
        record = self.record
        if assignment.generation <= self.newest_generation_run:
            why = f"is not newer than generation {self.newest_generation_run} already run; ignored"
        elif record is not None and record.live:
            why = f"waits: incarnation {record.incarnation} (generation {record.generation}) still lives"
        elif stop is not None and stop.generation > assignment.generation:
            why = f"waits: a stop for generation {stop.generation} is newer"
        else:
            return
        if self._explained != (assignment.generation, why):
            self._explained = (assignment.generation, why)
            log.info("resilax run: assignment for generation %d %s", assignment.generation, why)

    def _recover_previous_record(self) -> None:
        """A supervisor starting again (its container restarted) continues the incarnation count; a record
        left `running` is history now: the container's processes died with it."""
        if self.settings.control_dir is None:
            return
        previous = tc.read_incarnation(self.settings.control_dir)
        if previous is None:
            return
        number = previous.get("incarnation")
        self._last_incarnation = number if isinstance(number, int) else 0
        if previous.get("state") != tc.EXITED:
            previous.update(state=tc.EXITED, pid=None, finished_at=self.clock(), reason="supervisor_restarted")
            tc.write_json(self.settings.control_dir, tc.INCARNATION_FILE, previous)

    def _write(self, record: Record) -> None:
        record = dataclasses.replace(record, restarts=self.restarts)
        self.record = record
        if self.settings.control_dir is not None:
            tc.write_json(self.settings.control_dir, tc.INCARNATION_FILE, record.to_json())

    def _start(self, start: Start) -> None:
        if self.record is not None:  # a restart: keep the trainer process where kept.decide_keep allows
            refusal = kept.decide_keep(self._parked, child_env(self.env, start, self._last_incarnation + 1),
                                       self.settings.keep, self._left)
            if refusal is None:
                self._resume(start)
                return
            self._count(refusal.key)
            log.info("resilax run: generation %d gets a fresh trainer process (%s): %s", start.assignment.generation,
                     refusal.key, refusal.message)
            self._end_parked(refusal.message)
        self._spawn(start)

    def _begin_incarnation(self, start: Start) -> None:
        self.newest_generation_run = start.assignment.generation
        self._child_status = None
        self._waiting_logged = False
        self._stop, self._stop_done = None, set()
        self._left = None

    def _spawn(self, start: Start, number: int | None = None) -> None:
        """A fresh process for the incarnation (`number`: again for one whose kept restart failed)."""
        if number is None:
            self._last_incarnation += 1
            number = self._last_incarnation
        generation = start.assignment.generation
        self._begin_incarnation(start)
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        env = child_env(self.env, start, number)
        channel, fd = Channel.open_pair() if self.settings.keep else (None, -1)
        if channel is not None:
            env[kept.FD_ENV] = str(fd)
        try:
            pid = os.posix_spawnp(self.command[0], self.command, env, setpgroup=0)
        except OSError as e:
            log.error("resilax run: incarnation %d (generation %d) could not start %r: %s",
                      number, generation, self.command[0], e)
            if channel is not None:
                channel.close()
            now = self.clock()
            self._write(Record(number, generation, None, tc.EXITED, now, now, EXIT_SPAWN_FAILED, None,
                               f"spawn_failed: {e.strerror or e}"))
            return
        finally:
            if channel is not None:
                os.close(fd)
        self._channel, self._child_env = channel, env
        log.info("resilax run: incarnation %d (generation %d) started, pid %d", number, generation, pid)
        self._write(Record(number, generation, pid, tc.RUNNING, self.clock()))

    def _resume(self, start: Start) -> None:
        """The next incarnation in the parked process: its whole environment over the channel."""
        parked, self._parked = self._parked, None
        assert parked is not None and self._channel is not None
        self._last_incarnation += 1
        number, generation = self._last_incarnation, start.assignment.generation
        env = child_env(self.env, start, number)
        self._begin_incarnation(start)
        self._child_env = env
        if not self._channel.send("resume", {"incarnation": number, "generation": generation, "env": env}):
            log.warning("resilax run: the parked trainer process %d is gone; a fresh one", parked.pid)
            self._count(kept.PARKED_DIED)
            self._spawn(start, number)
            return
        self._resuming = start
        log.info("resilax run: incarnation %d (generation %d) runs in the kept process %d", number, generation,
                 parked.pid)
        self._write(Record(number, generation, parked.pid, tc.RUNNING, self.clock(), kept=True))

    def _count(self, key: str) -> None:
        if key == "kept":
            self.restarts["kept"] += 1
        else:
            fresh = self.restarts["fresh"]
            fresh[key] = fresh.get(key, 0) + 1

    def _read_channel(self) -> None:
        """The current process's messages: parked, leaving, resumed (kept_channel.py)."""
        if self._channel is None:
            return
        for kind, body in self._channel.poll():
            record = self.record
            if kind == "leaving":
                key = body.get("key") if body.get("key") in kept.REASONS else kept.NOT_PARKED
                self._left = kept.Refusal(str(key), str(body.get("message", "")))
                log.info("resilax run: the trainer process will not be kept (%s): %s", key, self._left.message)
            elif kind == "parked" and record is not None and record.live and record.pid is not None:
                code = body.get("exit_code")
                code = code if isinstance(code, int) else kept.EXIT_CODE_STOPPED
                processes = body.get("processes")
                self._parked = kept.Parked(record.pid, record.incarnation, record.generation, code,
                                           processes if isinstance(processes, int) else 1, dict(self._child_env),
                                           hang=bool(self._stop is not None and self._stop.stacks))
                log.info("resilax run: incarnation %d (generation %d) returned %d and parked, pid %d (backends dropped)",
                         record.incarnation, record.generation, code, record.pid)
                self._write(dataclasses.replace(record, state=tc.EXITED, finished_at=self.clock(), exit_code=code,
                                                parked=True))
            elif kind == "resumed" and self._resuming is not None and record is not None:
                self._resuming = None
                self._count("kept")
                log.info("resilax run: incarnation %d (generation %d) reopened its devices in the kept process %s",
                         record.incarnation, record.generation, record.pid)
                self._write(record)

    def _end_parked(self, reason: str) -> None:
        """End a parked process (asked to exit, killed after the restart grace) and reap it."""
        parked, self._parked = self._parked, None
        if parked is None:
            return
        if self._channel is not None:
            self._channel.send("exit", {"reason": reason})
        deadline = time.monotonic() + self.settings.restart_grace_seconds
        while True:
            try:
                pid, _ = os.waitpid(parked.pid, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                break
            if time.monotonic() > deadline:
                _signal_quietly(os.killpg, parked.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(parked.pid, 0)
                break
            time.sleep(0.02)
        _signal_quietly(os.killpg, parked.pid, signal.SIGKILL)  # whatever it left in its group

    def _begin_stop(self, request: tc.StopRequest) -> None:
        assert self.record is not None
        log.info("resilax run: stopping incarnation %d (generation %d) for generation %d: %s",
                 self.record.incarnation, self.record.generation, request.generation, request.reason or "-")
        self._stop, self._stop_began, self._stop_done = request, self.clock(), set()
        self._write(dataclasses.replace(self.record, state=tc.STOPPING, reason=request.reason or "stopped"))
        self._advance_stop()

    def _advance_stop(self) -> None:
        if self._stop is None or self.record is None or not self.record.live:
            return
        due = due_stop_steps(self.clock() - self._stop_began, self._stop.stacks, self.settings.stacks_seconds,
                             self.settings.restart_grace_seconds)
        for step in due:
            if step in self._stop_done:
                continue
            self._stop_done.add(step)
            if self._child_status is not None and step != KILL:
                continue  # the child is gone; only its leftovers are left to kill
            if step == STACKS:
                self._dump_stacks()
            elif step == TERM:
                self._signal_child_group(signal.SIGTERM)
            else:
                self.kill_leftovers()

    def _dump_stacks(self) -> None:
        assert self.record is not None and self.record.pid is not None
        pid = self.record.pid
        spy = shutil.which("py-spy")
        if spy is not None:
            # --nonblocking reads the stacks without suspending the process: py-spy's own suspension
            # fails on a stopped process (SIGSTOP, a debugger), which is one of the hangs it is here for.
            try:
                done = subprocess.run([spy, "dump", "--nonblocking", "--pid", str(pid)], stdout=sys.stderr,
                                      stderr=sys.stderr, timeout=self.settings.stacks_seconds, check=False)
                if done.returncode == 0:
                    return
                log.warning("resilax run: py-spy dump of pid %d exited %d; asking faulthandler", pid,
                            done.returncode)
            except (OSError, subprocess.TimeoutExpired) as e:
                log.warning("resilax run: py-spy dump of pid %d failed (%s); asking faulthandler", pid, e)
        _signal_quietly(os.kill, pid, signal.SIGCONT)
        _signal_quietly(os.kill, pid, signal.SIGUSR1)

    def _signal_child_group(self, sig: int) -> None:
        assert self.record is not None and self.record.pid is not None
        _signal_quietly(os.kill, self.record.pid, signal.SIGCONT)
        _signal_quietly(os.killpg, self.record.pid, sig)

    def kill_leftovers(self) -> None:
        """SIGKILL the child's group and every process re-parented to the supervisor."""
        if self.record is not None and self.record.pid is not None:
            _signal_quietly(os.killpg, self.record.pid, signal.SIGKILL)
        for pid in own_children():
            _signal_quietly(os.kill, pid, signal.SIGKILL)

    def _forward_termination(self) -> None:
        if not self.terminating or self._forwarded:
            return
        self._forwarded = True
        if self.record is not None and self.record.live and self._child_status is None and self.record.pid:
            log.info("resilax run: forwarding signal %d to pid %d", self.terminating, self.record.pid)
            _signal_quietly(os.kill, self.record.pid, self.terminating)

    def _reap(self) -> None:
        """Reap whatever ended; once the child is reaped, kill its leftovers; `exited` once none is left."""
        none_left = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                none_left = True
                break
            if pid == 0:
                break
            if self._parked is not None and pid == self._parked.pid:
                log.warning("resilax run: the parked trainer process %d ended (status %d)", pid, status)
                self._parked, self._left = None, kept.Refusal(kept.PARKED_DIED, f"the parked process {pid} ended")
                continue
            record = self.record
            if (self._resuming is not None and self._stop is None and record is not None and record.live
                    and pid == record.pid):
                start, self._resuming = self._resuming, None
                why = self._left.message if self._left else f"its process ended (status {status})"
                log.warning("resilax run: the kept restart of incarnation %d failed (%s); a fresh process",
                            record.incarnation, why)
                self._count(kept.KEPT_FAILED)
                self.kill_leftovers()
                self._spawn(start, record.incarnation)
                continue
            if self.record is not None and pid == self.record.pid:
                self._child_status = status
                self.kill_leftovers()
        record = self.record
        if record is None or not record.live or self._child_status is None:
            return
        if not none_left:
            if record.state == tc.RUNNING or not self._waiting_logged:
                self._waiting_logged = True
                log.info("resilax run: incarnation %d's pid %d is reaped; waiting for its leftover processes",
                         record.incarnation, record.pid)
                self._write(dataclasses.replace(record, state=tc.STOPPING))
            return
        code, sig = exit_code_of(self._child_status)
        log.info("resilax run: incarnation %d (generation %d) exited %d%s", record.incarnation, record.generation,
                 code, f" (signal {sig})" if sig else "")
        self._write(dataclasses.replace(record, state=tc.EXITED, finished_at=self.clock(), exit_code=code,
                                        signal=sig))


def main(argv: Sequence[str]) -> int:
    """`resilax run [--] COMMAND [ARGS...]` (the console script's `run` subcommand)."""
    args = list(argv)
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print(f"resilax run: no command given\n{USAGE}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        settings = SupervisorSettings.from_env(os.environ)
    except ValueError as e:
        print(f"resilax run: {e}", file=sys.stderr)
        return EXIT_USAGE
    supervisor = Supervisor(args, settings)
    try:
        return supervisor.run()
    except Exception:
        log.exception("resilax run: internal error; killing the trainer")
        supervisor.kill_leftovers()
        return EXIT_INTERNAL

