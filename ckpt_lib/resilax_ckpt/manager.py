"""CheckpointManager: periodic, requested and forced saves; restore onto any mesh.

A thin facade over the two halves of a manager (docs/checkpointing.md, "Module map"):
- tiers.py: the tier saves go to, the persistent tier behind a local tier, the state both halves
  share, the start-up (fences, leftovers, peers) and the local tier's rules;
- saver.py: save decisions (policy, requests, SIGTERM) agreed across processes, the device copy, the
  background write and commit; retention after each commit (retention.py's rules, pruning.py);
- restorer.py: the restore path (newest good step, fallback, two tiers, peer fetches, agreement),
  with its pure choices in restore_choice.py and one step folder read by step_reader.py.
The one-shot `save`/`restore` (no manager) are oneshot.py's, re-exported here with `read_metadata`
and `restore_step`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from resilax_ckpt import commit, pytrees, tiers
from resilax_ckpt.control.requests import RequestWatcher, clear_stop_record
from resilax_ckpt.control.trainer_metrics import HEARTBEAT_SECONDS, RESTORE, TrainerMetrics
from resilax_ckpt.errors import ResilaxCkptError, StepNotFoundError
from resilax_ckpt.multihost import Coordinator, add_exit_hook, current_coordinator, remove_exit_hook
from resilax_ckpt.oneshot import restore, save
from resilax_ckpt.options import DEFAULT_LOCAL_DIRECTORY, ManagerOptions, TierDirectories
from resilax_ckpt.restoring import prefetch
from resilax_ckpt.restoring.restorer import Restorer
from resilax_ckpt.restoring.step_info import StepInfo, read_step_info
from resilax_ckpt.restoring.step_reader import UNREADABLE_STEP_ERRORS, read_metadata, restore_step
from resilax_ckpt.saving.saver import Saver
from resilax_ckpt.storage import Storage
from resilax_ckpt.trainer import kept

__all__ = [
    "CRASH_ENV",
    "DEFAULT_LOCAL_DIRECTORY",
    "EXIT_CODE_STOPPED",
    "UNREADABLE_STEP_ERRORS",
    "CheckpointManager",
    "read_metadata",
    "restore",
    "restore_step",
    "save",
]

log = logging.getLogger(__name__)

EXIT_CODE_STOPPED = kept.EXIT_CODE_STOPPED
"""Exit code of a worker that stopped after a requested final save (operator: reschedule)."""

CRASH_ENV = commit.CRASH_ENV


class CheckpointManager:
    """Saves and restores the named items of a training job under one root folder.

    Called on: all processes, in the same order (constructor, save, wait, restore, close).
    """

    def __init__(self, directory: str, options: ManagerOptions | None = None, *,
                 coordinator: Coordinator | None = None, persistent_directory: str | None = None) -> None:
        """`directory` is where saves go. With `options.local_tier`, `persistent_directory` (the
        persistent tier the sidecar uploads to) is where restore falls back to when this host's
        local tier cannot serve a step; this manager never writes there except its fence."""
        self._options = options or ManagerOptions()
        self._closed = False
        coord = coordinator or current_coordinator()
        key = tiers.next_manager_key(self._options.generation)
        control_dir = self._options.control_dir
        watcher = RequestWatcher(control_dir) if control_dir else None
        self._trainer = TrainerMetrics(control_dir, generation=self._options.generation,
                                       heartbeat_seconds=HEARTBEAT_SECONDS)
        add_exit_hook(self._trainer.flush)  # a peer's loss ends the process at once: tell its last step first
        if watcher is not None:
            watcher.hold_trainer_lock()
            clear_stop_record(control_dir or "")
        self._watcher = watcher
        self._tiers = tiers.open_tiers(directory, self._options, coord, key, persistent_directory)
        self._root = self._tiers.local.root
        self._storage: Storage = self._tiers.local.storage
        self._saver = Saver(self._tiers, watcher, self._trainer)
        self._restorer = Restorer(self._tiers)
        tiers.exchange_peers(self._tiers)
        self._saver.install_sigterm()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> CheckpointManager:
        """The worker's manager from the RESILAX_* variables (docs/architecture.md).

        Without RESILAX_LOCAL_DIR: saves go to RESILAX_CHECKPOINT_DIR. With it: saves go to the
        per-host local tier (the sidecar uploads them and applies retention on both tiers, so this
        manager keeps every local step), and restore falls back to RESILAX_CHECKPOINT_DIR.
        Outside a pod (RESILAX_CHECKPOINT_DIR unset): saves go to `DEFAULT_LOCAL_DIRECTORY` under the
        working directory, and a warning on stderr says so."""
        env = os.environ if env is None else env
        dirs = TierDirectories.from_env(env)
        if not dirs.in_pod:
            log.warning("RESILAX_CHECKPOINT_DIR is not set (not in a JAXJob pod): checkpoints go to %s",
                        dirs.persistent_directory or dirs.directory)
        if dirs.persistent_directory is not None:
            fields: dict[str, Any] = {"local_tier": True, "keep_last": None, "keep_every_steps": None,
                                      "keep_every_seconds": None, "keep_best": None, "keep_best_metric": None,
                                      "keep_best_mode": None}
            fields.update(overrides)
            return cls(dirs.directory, ManagerOptions.from_env(env, **fields),
                       persistent_directory=dirs.persistent_directory)
        return cls(dirs.directory, ManagerOptions.from_env(env, **overrides))

    # ------------------------------------------------------------------ queries

    @property
    def directory(self) -> str:
        return self._root

    @property
    def should_stop(self) -> bool:
        """True once a save requested with stop (or after SIGTERM) committed: exit the loop with
        EXIT_CODE_STOPPED."""
        return self._saver.should_stop

    def steps(self) -> list[int]:
        """Committed (and not fenced-out) steps, ascending (on a local tier, without the steps a
        restore found unreadable)."""
        return self._tiers.steps()

    def superseded_steps(self) -> list[int]:
        """The steps of timelines a rollback abandoned (docs/checkpointing.md, "Timelines"): hidden
        from `steps()` and restore, kept on storage, never deleted."""
        return self._tiers.superseded_steps()

    def persistent_steps(self) -> list[int]:
        """Committed steps of the persistent tier behind a local tier (empty without one)."""
        return self._tiers.persistent_steps()

    def latest_step(self) -> int | None:
        """The newest committed step this process sees (both tiers with a local tier). With a
        local tier this is this process's view only: `restore_step_from_env` (`latest`) and
        `restore(step=None)` agree on a step every process can read."""
        steps = self.steps() + self.persistent_steps()
        return max(steps) if steps else None

    @property
    def restored_from(self) -> str | None:
        """Where this process's last `restore` read from: "local" (this host's local tier), "peer"
        (this host's local tier, after its sidecar fetched the step from a peer holding its replica)
        or "persistent" (without a local tier, the only tier); None before any restore."""
        if self._tiers.persistent is None:
            return "persistent" if self._tiers.protected_steps else None
        return self._restorer.restored_from

    @property
    def restore_step(self) -> int | None:
        """The step to restore per RESILAX_RESTORE_STEP (`latest` by default): see
        restore_step_from_env."""
        return self.restore_step_from_env()

    def restore_step_from_env(self, env: Mapping[str, str] | None = None, *,
                              target: Any = None,
                              items: Iterable[str] | None = None) -> int | None:
        """The step RESILAX_RESTORE_STEP asks for: `latest` (default), `none` or a number; None when
        there is nothing to restore. With a local tier, `latest` is the step the processes agree on
        (the newest one every process can read from its local tier or the persistent tier; pass the
        restore's `target` so that "can read" is judged for this process's shards, else whole
        arrays). `restore()` of the step `latest` resolved to is a restore of the newest step: it
        falls back (to the persistent tier's copy of that step, or to an older step) when that step
        cannot be read; the state's own step then says which step came back, `restore_report` why.
        With `target` and nothing to restore (a job's start), the on-device copy a save of the
        target's arrays dispatches starts compiling in the background (Saver.prepare_first_save), while
        the job makes its state, so that its first save blocks the loop no longer than later ones.
        Called on: all processes (with a local tier and several processes, a collective)."""
        env = os.environ if env is None else env
        raw = env.get("RESILAX_RESTORE_STEP", "latest").strip().lower() or "latest"
        if raw == "latest":
            step = self._restorer.resolve_latest(target, items)
        elif raw == "none":
            step = None
        else:
            self._restorer.asked_from_env = step = int(raw)  # restoring it starts the job's timeline there
        if step is None and target is not None:
            self._saver.prepare_first_save(pytrees.as_target(target)[0] or {}, restored=True)
        return step

    # ------------------------------------------------------------------ save

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would save (policy or agreed request), without saving.
        Called on: all processes, at the same steps."""
        return self._saver.should_save(step)

    def save(self, step: int, items: Any, force: bool = False, metrics: Mapping[str, Any] | None = None) -> bool:
        """Save `items` at `step` if forced, due by policy or requested. Returns whether it saved.
        `items`: a mapping of named items, or any other pytree (a flax TrainState, an optax state),
        saved as the one item "state" (resilax_ckpt.pytrees). `metrics`: names to numbers (e.g.
        `{"loss": 0.31}`), kept in the step's metadata (`metadata(step).metrics`); `keep_best` ranks
        steps by one of them. Raises the error of a failed earlier background save.
        Called on: all processes, same step, same metrics."""
        self._check_open()
        prefetch.release("the trainer saves")  # a read-ahead the trainer did not restore from
        return self._saver.save(step, items, force, metrics)

    @property
    def save_report(self) -> dict[str, Any] | None:
        """What this process's last save did (None before any): `{"step", "device_copy", "reason",
        "platform", "device_bytes", "host_bytes", "runtime_copy", "blocked_seconds", "transfer_seconds",
        "drain_held_peak_bytes"}`.
        `device_copy` is the path (`ManagerOptions.device_copy`): "on_device", "host_transfer" or ""
        (no device arrays), `reason` why ("forced", "cpu", "room", "no room", "no memory statistics",
        "copy not compiled yet", "out of memory", "runtime copy failed"); `device_bytes` the device memory (HBM) its on-device copy held until drained
        (0 for a host transfer); `runtime_copy` whether the on-device copy was `jax.device_put`'s
        (a save before the jitted copy was compiled, on an accelerator); `blocked_seconds` how long `save()` blocked the loop;
        `transfer_seconds` how long until every shard was on the host (None while it drains);
        `drain_held_peak_bytes` the most host bytes an on-device copy's drain held at once (0 otherwise)."""
        return self._saver.last_report

    def delete(self, step: int) -> None:
        """Delete committed `step` of the current branch (after the pending save committed). Only a
        step Resilax committed: `StepNotFoundError` for any other number (nothing else is touched); a
        step marked bad or superseded by a rollback is kept, never deleted (a `ResilaxCkptError` says
        so). Not with a local tier (the sidecar owns retention there). Called on: all processes (the
        primary deletes, the others wait for it)."""
        self._check_open()
        self._saver.delete(step)

    def metadata(self, step: int | None = None) -> StepInfo:
        """A committed step's items (kinds, leaves with shapes and dtypes), metrics, save time, era
        and generation, read from its metadata and commit marker only (no array data). Default: the
        newest step. Raises `StepNotFoundError` for a step that is not committed and visible."""
        self._check_open()
        t = self._tiers
        wanted = self.latest_step() if step is None else step
        for tier, steps, suffix in ((t.local, self.steps(), t.own_suffix), (t.persistent, self.persistent_steps(), None)):
            if tier is not None and wanted in steps:
                return read_step_info(tier.storage, tier.root, wanted, suffix)
        raise StepNotFoundError(f"{self._root}: no committed step {'' if step is None else step} to describe; "
                                f"committed steps: {', '.join(map(str, self.steps())) or 'none'}")

    def wait(self) -> None:
        """Block until the pending save committed (re-raise its failure) and a compile of the save's
        on-device copy in progress is done (docs/checkpointing.md §4)."""
        self._saver.wait()

    # ------------------------------------------------------------------ restore

    def restore(self, step: int | None = None, target: Any = None,
                items: Iterable[str] | None = None) -> Any:
        """Restore `items` (default: all) of `step` (default: latest). A target leaf that is a
        `jax.ShapeDtypeStruct` with a sharding, or a `jax.Array`, comes back as a jax.Array with that
        sharding and dtype; otherwise as NumPy. A target that is not a mapping of named items (a
        TrainState of ShapeDtypeStructs) restores the item "state" and returns it as that pytree.
        Called on: all processes."""
        self._check_open()
        started = time.perf_counter()
        self._trainer.phase(RESTORE)
        named, unwrap = pytrees.as_target(target)
        try:
            out = self._restorer.restore(step, named, [pytrees.STATE_ITEM] if unwrap else items)
        finally:
            prefetch.release()  # what the restore did not take (prefetch.py)
        protected = self._tiers.protected_steps
        self._trainer.restored(protected[0] if protected else None, time.perf_counter() - started)
        self._saver.prepare_first_save(out, restored=True)
        return out[pytrees.STATE_ITEM] if unwrap else out

    @property
    def restore_report(self) -> dict[str, Any] | None:
        """What the last `restore()` did (of the newest step or a pinned one): `{"step": N, "skipped":
        [{"step", "reason"}], "generation": G, "source": "local"|"peer"|"persistent"}` (None before any; `source`, the farthest
        tier any process read the step from, once a step was restored). With a local tier each entry also has "tier": "local" (this host's copy
        could not be read, marked bad, the persistent tier's copy of that step was read instead) or
        "all" (no tier could serve it on some process: skipped); and "local_misses" lists this
        process's local steps (the restored one and newer) that lacked a chunk it needed, naming the
        file (read from the persistent tier or skipped; not marked bad: after a change of mesh that is
        expected). Also written to `$RESILAX_CONTROL_DIR/restore.json` for the sidecar."""
        return self._restorer.report

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for the pending save (re-raising its failure) and release resources."""
        if self._closed:
            return
        try:
            prefetch.release("the manager is closed")
            self._saver.close()
        finally:
            self._closed = True
            remove_exit_hook(self._trainer.flush)
            self._trainer.close()
            if self._watcher is not None:
                self._watcher.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ResilaxCkptError(f"{self._root}: the CheckpointManager is closed")
