"""The trainer's figures, shared with the sidecar through `$RESILAX_CONTROL_DIR/trainer.json`.

The manager keeps running totals (saves, seconds the loop was blocked by them, restores and their
seconds, the newest step it was called with and the step rate, and the persistent compilation cache's
requests and hits, counted from JAX's events) and rewrites the file atomically at most
once per `WRITE_INTERVAL_SECONDS` of the loop and after every save and restore. The sidecar reads it at
each scrape and exports it as `resilax_trainer_*` (docs/operations.md, "Metrics"), and reports the step
in `/v1/state` as `trainer`, from which the operator measures the steps a recovery lost.

JAX-free: the sidecar imports it.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from resilax_ckpt.control.control_files import load_control_json

TRAINER_FILE = "trainer.json"
WRITE_INTERVAL_SECONDS = 1.0
HEARTBEAT_SECONDS = 1.0
"""How often the manager's heartbeat thread rewrites the file (also while the loop is blocked)."""
WARMUP_STEPS = 10
"""Steps of an incarnation left out of its step times (the first compiles, the input pipeline filling)."""
STEP_WINDOW = 256
"""How many recent steps (and saves) the step-time figures are taken over."""


def p99(values: Sequence[float]) -> float | None:
    """The 99th percentile of `values` (the nearest rank; None for none)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-99 * len(ordered) // 100) - 1))]


@dataclasses.dataclass
class TrainerFigures:
    """What trainer.json holds (all totals since the process started)."""

    step: int | None = None
    """The newest step `save` (or `should_save`) was called with: the step the loop reached."""
    step_time: float | None = None
    """Wall time (epoch seconds) when the loop first reached `step` (the operator's goodput accounting:
    productive until the last step reached)."""
    first_step: int | None = None
    """The first step this process reached (the one after the step it restored, or 1)."""
    first_step_time: float | None = None
    """Wall time when it reached `first_step` (its JAX start-up and first compile were before)."""
    steps_per_second: float = 0.0
    """Steps over seconds between the last two writes that saw the step advance."""
    saves: int = 0
    save_blocking_seconds: float = 0.0
    """Seconds the loop spent inside save() calls that saved (the device copy and the dispatch)."""
    last_save_blocking_seconds: float = 0.0
    last_save_device_copy: str = ""
    """How the last save took its shards off the devices: "on_device", "host_transfer" or "" (none)."""
    last_save_device_bytes: int = 0
    """Device memory (HBM on an accelerator) the last save's on-device copy held until drained."""
    restores: int = 0
    restore_seconds: float = 0.0
    last_restore_seconds: float = 0.0
    restored_step: int | None = None
    restored_time: float | None = None
    """Wall time when the last restore ended (it began `last_restore_seconds` earlier)."""
    generation: int | None = None
    """The generation this process belongs to (`RESILAX_GENERATION`; labels the cache counts)."""
    phase: str = "init"
    """What the process is doing: `init` (start-up, compiling, waiting for its first step), `restore`,
    `train` (between steps) or `save` (a save blocking the loop)."""
    phase_since: float | None = None
    """Wall time the phase began."""
    heartbeat: float | None = None
    """Wall time of the last write, by the heartbeat thread (every second, also while the loop is
    blocked) or the loop: a stale heartbeat means a stopped process, a fresh one with a stale step a
    loop stuck in a collective or its input."""
    step_seconds: float | None = None
    """The median of this host's own time per step over the last STEP_WINDOW steps after the first
    WARMUP_STEPS: the time between two steps less what the loop waited at the request agreement's
    barrier for the other processes (a straggler's own time is the longest; `resilax_trainer_step_seconds`)."""
    step_seconds_p99: float | None = None
    """The 99th percentile of the time between two steps over the same window (the operator's automatic
    hang timeout in phase `train`); None until WARMUP_STEPS + 1 steps."""
    save_seconds_p99: float | None = None
    """The 99th percentile of the seconds saves blocked the loop (the last STEP_WINDOW saves)."""
    barrier_wait_seconds: float = 0.0
    """Seconds the loop waited at the request agreement's barrier for the other processes (total)."""
    compilation_cache_requests: int = 0
    """Compilations that asked JAX's persistent compilation cache (`compile_requests_use_cache` events)."""
    compilation_cache_hits: int = 0
    """Of those, the ones the cache served (`cache_hits` events); misses are the difference."""
    time: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


CACHE_REQUEST_EVENT = "/jax/compilation_cache/compile_requests_use_cache"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
"""JAX's events (jax 0.10, `_src/compiler.py`); its own `cache_misses` fires only when an entry is written."""


@dataclasses.dataclass
class CompilationCacheCounts:
    """This process's persistent-cache lookups, counted by `count_jax_event` (JAX's event listener)."""

    requests: int = 0
    hits: int = 0


COMPILATION_CACHE = CompilationCacheCounts()


def count_jax_event(event: str, **_kwargs: str | int) -> None:
    """A `jax.monitoring` event listener: counts the compilation cache's requests and hits
    (registered by `initialize_distributed_from_env`). Called on: any thread of the process."""
    if event == CACHE_REQUEST_EVENT:
        COMPILATION_CACHE.requests += 1
    elif event == CACHE_HIT_EVENT:
        COMPILATION_CACHE.hits += 1


INIT, RESTORE, TRAIN, SAVE = "init", "restore", "train", "save"


class TrainerMetrics:
    """The manager's side: updates the figures and writes the file (when there is a control dir).
    Called on: each process, from the training loop's thread (and the heartbeat thread, which only writes)."""

    def __init__(self, control_dir: str | None, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time, generation: int | None = None,
                 heartbeat_seconds: float | None = None) -> None:
        self._path = os.path.join(control_dir, TRAINER_FILE) if control_dir else None
        self._clock = clock
        self._wall = wall_clock
        self.figures = TrainerFigures(generation=generation, phase_since=wall_clock())
        self._last_write = float("-inf")
        self._rate_from: tuple[int, float] | None = None
        self._steps_seen = 0
        self._step_at: float | None = None  # monotonic time the loop reached the current step
        self._waited = 0.0  # barrier seconds since then
        self._intervals: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)
        self._own: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)
        self._saves: collections.deque[float] = collections.deque(maxlen=STEP_WINDOW)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if self._path is not None and heartbeat_seconds:
            threading.Thread(target=self._beat, args=(heartbeat_seconds,), name="resilax-heartbeat",
                             daemon=True).start()

    def _beat(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            self._write(self._clock())

    def close(self) -> None:
        """Stop the heartbeat thread (the manager is closed), after a last write."""
        self.flush()
        self._stop.set()

    def flush(self) -> None:
        """Write the figures now: `step` writes at most once a WRITE_INTERVAL_SECONDS, so a process that
        exits between two writes (a peer's loss ends it at once) would leave its last steps untold."""
        self._write(self._clock())

    def phase(self, name: str) -> None:
        """The process enters phase `name` (INIT, RESTORE, TRAIN, SAVE); written at once."""
        with self._lock:
            if self.figures.phase == name:
                return
            self.figures.phase, self.figures.phase_since = name, self._wall()
        self._write(self._clock())

    def step(self, step: int) -> None:
        """The loop reached `step` (called by every save/should_save)."""
        if self.figures.phase != TRAIN:
            self.phase(TRAIN)
        with self._lock:
            f = self.figures
            now = self._clock()
            if step != f.step:
                f.step_time = self._wall()
                if f.first_step is None:
                    f.first_step, f.first_step_time = step, f.step_time
                self._steps_seen += 1
                if self._step_at is not None and self._steps_seen > WARMUP_STEPS + 1:
                    interval = now - self._step_at
                    self._intervals.append(interval)
                    self._own.append(max(0.0, interval - self._waited))
                    f.step_seconds = statistics.median(self._own)
                    f.step_seconds_p99 = p99(self._intervals)
                self._step_at, self._waited = now, 0.0
            f.step = step
        if now - self._last_write >= WRITE_INTERVAL_SECONDS:
            self._write(now)

    def waited(self, seconds: float) -> None:
        """The loop waited `seconds` at the request agreement's barrier (saver.py), not its own work."""
        with self._lock:
            self._waited += seconds
            self.figures.barrier_wait_seconds += seconds

    def saved(self, blocking_seconds: float, device_copy: str = "", device_bytes: int = 0) -> None:
        with self._lock:
            self.figures.last_save_device_copy = device_copy
            self.figures.last_save_device_bytes = device_bytes
            self._saves.append(blocking_seconds)
            self.figures.save_seconds_p99 = p99(self._saves)
            self.figures.saves += 1
            self.figures.save_blocking_seconds += blocking_seconds
            self.figures.last_save_blocking_seconds = blocking_seconds
            self.figures.phase, self.figures.phase_since = TRAIN, self._wall()
        self._write(self._clock())

    def restored(self, step: int | None, seconds: float) -> None:
        with self._lock:
            self.figures.restores += 1
            self.figures.restore_seconds += seconds
            self.figures.last_restore_seconds = seconds
            self.figures.restored_step = step
            self.figures.restored_time = self._wall()
            # compiling and waiting for the first step again
            self.figures.phase, self.figures.phase_since = INIT, self.figures.restored_time
        self._write(self._clock())

    def _write(self, now: float) -> None:
        with self._lock:
            self._write_locked(now)

    def _write_locked(self, now: float) -> None:
        f = self.figures
        if f.step is not None:
            if self._rate_from is not None and f.step > self._rate_from[0] and now > self._rate_from[1]:
                f.steps_per_second = (f.step - self._rate_from[0]) / (now - self._rate_from[1])
            if self._rate_from is None or f.step != self._rate_from[0]:
                self._rate_from = (f.step, now)
        self._last_write = now
        f.compilation_cache_requests, f.compilation_cache_hits = COMPILATION_CACHE.requests, COMPILATION_CACHE.hits
        if self._path is None:
            return
        f.time = f.heartbeat = self._wall()
        tmp = f"{self._path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self._path), exist_ok=True)
            with open(tmp, "w") as out:
                json.dump(f.to_json(), out)
            os.replace(tmp, self._path)
        except OSError:
            pass  # figures are best effort: never fail a training step for them


def read_trainer_figures(control_dir: str) -> dict[str, Any] | None:
    """The trainer's last figures, or None (no trainer yet, or unreadable). Called on: the sidecar."""
    raw = load_control_json(os.path.join(control_dir, TRAINER_FILE))
    return raw if isinstance(raw, dict) else None
