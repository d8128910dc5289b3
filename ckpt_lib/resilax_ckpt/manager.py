"""CheckpointManager: periodic, requested and forced saves; restore onto any mesh.

A save, step by step (shared folder, several processes):
1. `save()` (all processes, same step): agree on pending requests, decide, wait for the previous
   save, copy the shards off the devices (the only part the loop waits for), hand off to a thread.
2. Background, each process: write its replica-0 boxes and its files, publish ok/error, barrier.
3. Background, primary: write `_METADATA.json`, check the fences, commit (commit.py), apply
   retention, publish the commit result; the other processes wait for that result.
On a local shared folder, retention keeps retired steps as `.recycle-<step>/` (up to
`recycle_pool`); step 2 then starts with the primary renaming one to the save's temporary folder and
pruning it to the new step's files (commit.take_recycled), and every process rewrites its chunk
files in place (the file chunk backend, backends.py).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from resilax_ckpt import (
    backends,
    chunk_format,
    commit,
    fencing,
    layout,
    peer_client,
    peers,
    planning,
    policy,
    pytrees,
    reader,
)
from resilax_ckpt import items as items_lib
from resilax_ckpt.errors import (
    CorruptCheckpointError,
    IncompleteStepError,
    MetadataError,
    ResilaxCkptError,
    SaveError,
    ShapeMismatchError,
    StepNotCommittedError,
    StepNotFoundError,
    TreeMismatchError,
)
from resilax_ckpt.metadata import StepMetadata
from resilax_ckpt.multihost import Coordinator, current_coordinator
from resilax_ckpt.options import ManagerOptions
from resilax_ckpt.requests import (
    RequestWatcher,
    SaveRequest,
    clear_stop_record,
    write_restore_report,
    write_stop_record,
)
from resilax_ckpt.storage import Storage, open_storage
from resilax_ckpt.trainer_metrics import TrainerMetrics

log = logging.getLogger(__name__)

EXIT_CODE_STOPPED = 75
"""Exit code of a worker that stopped after a requested final save (operator: reschedule)."""

CRASH_ENV = commit.CRASH_ENV

_manager_count = 0
_manager_count_lock = threading.Lock()


#: What makes a committed step unreadable, as opposed to a transient storage error (which propagates):
#: a corrupt or truncated file, a missing one, metadata that cannot be read.
UNREADABLE_STEP_ERRORS = (CorruptCheckpointError, IncompleteStepError, MetadataError)


DEFAULT_LOCAL_DIRECTORY = "resilax-checkpoints"
"""Where `CheckpointManager.from_env` saves outside a pod (relative to the working directory)."""


class CheckpointManager:
    """Saves and restores the named items of a training job under one root folder.

    Called on: all processes, in the same order (constructor, save, wait, restore, close).
    """

    def __init__(self, directory: str, options: ManagerOptions | None = None, *,
                 coordinator: Coordinator | None = None, persistent_directory: str | None = None) -> None:
        """`directory` is where saves go. With `options.local_tier`, `persistent_directory` (the
        persistent tier the sidecar uploads to) is where restore falls back to when this host's
        local tier cannot serve a step; this manager never writes there except its fence."""
        global _manager_count
        self._options = options or ManagerOptions()
        self._root = directory.rstrip("/") or "/"
        self._storage: Storage = open_storage(self._root, fsync=self._options.fsync)
        self._coord = coordinator or current_coordinator()
        self._local_tier = self._options.local_tier
        self._is_primary = self._local_tier or self._coord.process_index == 0
        # Local tier with several processes: per-process marker and metadata names, so several
        # processes may share one host folder (docs/architecture.md, "Checkpoint layout").
        self._own_suffix: int | None = (
            self._coord.process_index if self._local_tier and self._coord.process_count > 1 else None)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="resilax-ckpt")
        self._pending: concurrent.futures.Future[None] | None = None
        self._copy_prepared = False  # the first save's device copy compiled ahead (or tried)
        self._preparing: concurrent.futures.Future[None] | None = None
        self._closed = False
        with _manager_count_lock:
            _manager_count += 1
            self._key = f"resilax_ckpt/{self._options.generation}/{_manager_count}"
        self._save_count = 0
        self._last_saved_step: int | None = None
        self._last_save_time: float = self._options.clock()
        self._poll_count = 0
        self._stop_requested_locally = False
        self._pending_requests: list[SaveRequest] = []
        self._should_stop = False
        self._sigterm = threading.Event()
        self._previous_sigterm: Any = None
        self._watcher = RequestWatcher(self._options.control_dir) if self._options.control_dir else None
        self._trainer = TrainerMetrics(self._options.control_dir)
        if self._watcher is not None:
            self._watcher.hold_trainer_lock()
            clear_stop_record(self._options.control_dir or "")
        self._persistent_root = persistent_directory.rstrip("/") if persistent_directory else None
        self._persistent: Storage | None = (
            open_storage(self._persistent_root, fsync=self._options.fsync)
            if self._persistent_root and self._local_tier else None)
        self._backend = backends.for_storage(self._storage, self._options)
        self._persistent_backend = (backends.for_storage(self._persistent, self._options)
                                    if self._persistent is not None else None)

        if self._storage.is_local:
            os.makedirs(self._root, exist_ok=True)
        # Recycling of retired steps: local shared folders committed by rename (not gs://, not the
        # local tier, whose retention is the sidecar's).
        self._recycles = self._storage.is_local and not self._local_tier
        # The epoch of this generation (fencing.py): the era is claimed where the fences live.
        self._epoch: fencing.Epoch = (0, self._options.generation)
        if self._is_primary:
            fence_storage, fence_root = ((self._persistent, self._persistent_root)
                                         if self._persistent is not None and self._persistent_root
                                         else (self._storage, self._root))
            self._epoch = (fencing.claim_era(fence_storage, fence_root, self._options.job_uid),
                           self._options.generation)
        if self._is_primary and not self._local_tier:
            commit.claim_root(self._storage, self._root)
            commit.clean_leftovers(self._storage, self._root, self._options.generation)
            if self._recycles:
                commit.clean_recycled(self._root, self._options.recycle_pool)
            visible = commit.list_visible(self._storage, self._root)
            if not self._storage.is_local:
                commit.clean_stale_attempts(self._storage, self._root, visible)
            fencing.write_fence(self._storage, self._root, self._epoch, visible[-1] if visible else None)
        elif self._local_tier:
            self._clean_local_tier()
        if self._persistent is not None and self._persistent_root and self._coord.process_index == 0:
            # The sidecars' uploads into the persistent tier are fenced by this generation's record.
            commit.claim_root(self._persistent, self._persistent_root)
            visible = commit.list_visible(self._persistent, self._persistent_root)
            # What stale or losing uploads left in committed steps (the sidecars' write-once attempts).
            commit.clean_stale_attempts(self._persistent, self._persistent_root, visible)
            fencing.write_fence(self._persistent, self._persistent_root, self._epoch,
                                visible[-1] if visible else None)
        peer_info = self._peer_info()
        if peer_info is not None:
            self._coord.publish(f"{self._key}/peers/{self._coord.process_index}", peer_info)
        self._coord.barrier(f"{self._key}/start", self._options.barrier_timeout_seconds)
        if peer_info is not None:
            self._write_peers()
        self._install_sigterm()

    def _peer_info(self) -> str | None:
        """This process's entry of peers.json (with a local tier, a persistent tier, several
        processes and a sidecar), else None."""
        o = self._options
        if not (self._persistent is not None and self._coord.process_count > 1 and o.sidecar_address):
            return None
        return json.dumps({"process": self._coord.process_index, "slice": o.slice_id, "node": o.node_name,
                           "address": o.sidecar_address})

    def _write_peers(self) -> None:
        """Every process's sidecar address, slice and node; for the sidecar's replicator (peers.json)
        and the restore's peer fetches."""
        raw = [json.loads(v) for v in self._coord.fetch_dir(f"{self._key}/peers/").values()]
        hosts = sorted((peers.PeerHost(int(h["process"]), int(h["slice"]), str(h["node"]), str(h["address"]))
                        for h in raw), key=lambda h: h.process)
        self._peer_addresses = {h.process: h.address for h in hosts}
        if self._options.control_dir:
            peer_client.write_peers(self._options.control_dir, self._coord.process_index, hosts)

    #: process -> its sidecar's address (exchanged at start when peer replicas are on).
    _peer_addresses: dict[int, str] = {}  # noqa: RUF012  (replaced, never mutated)
    #: step -> the sidecars holding this process's replica of it (of the last two-tier agreement).
    _peer_sources: dict[int, list[str]] = {}  # noqa: RUF012  (replaced, never mutated)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> CheckpointManager:
        """The worker's manager from the RESILAX_* variables (docs/architecture.md).

        Without RESILAX_LOCAL_DIR: saves go to RESILAX_CHECKPOINT_DIR. With it: saves go to the
        per-host local tier (the sidecar uploads them and applies retention on both tiers, so this
        manager keeps every local step), and restore falls back to RESILAX_CHECKPOINT_DIR.
        Outside a pod (RESILAX_CHECKPOINT_DIR unset): saves go to `DEFAULT_LOCAL_DIRECTORY` under the
        working directory, and a warning on stderr says so."""
        env = os.environ if env is None else env
        directory = env.get("RESILAX_CHECKPOINT_DIR", "").strip()
        if not directory:
            directory = os.path.abspath(DEFAULT_LOCAL_DIRECTORY)
            log.warning("RESILAX_CHECKPOINT_DIR is not set (not in a JAXJob pod): checkpoints go to %s",
                        directory)
        local = env.get("RESILAX_LOCAL_DIR", "").strip()
        if local:
            fields: dict[str, Any] = {"local_tier": True, "keep_last": None, "keep_every_steps": None}
            fields.update(overrides)
            return cls(local, ManagerOptions.from_env(env, **fields), persistent_directory=directory)
        return cls(directory, ManagerOptions.from_env(env, **overrides))

    # ------------------------------------------------------------------ queries

    @property
    def directory(self) -> str:
        return self._root

    @property
    def should_stop(self) -> bool:
        """True once a save requested with stop (or after SIGTERM) committed: exit the loop with
        EXIT_CODE_STOPPED."""
        return self._should_stop

    def steps(self) -> list[int]:
        """Committed (and not fenced-out) steps, ascending."""
        if self._local_tier:  # without the steps a restore found unreadable (`<local>/_bad/`)
            bad = commit.read_bad(self._storage, self._root)
            committed = commit.list_committed(self._storage, self._root, layout.commit_name(self._own_suffix))
            return [s for s in committed if s not in bad]
        return commit.list_visible(self._storage, self._root)

    def persistent_steps(self) -> list[int]:
        """Committed steps of the persistent tier behind a local tier (empty without one)."""
        if self._persistent is None or self._persistent_root is None:
            return []
        return commit.list_visible(self._persistent, self._persistent_root)

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
        if self._persistent is None:
            return "persistent" if self._protected_steps else None
        return self._restored_from

    _restored_from: str | None = None

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
        Called on: all processes (with a local tier and several processes, a collective)."""
        env = os.environ if env is None else env
        raw = env.get("RESILAX_RESTORE_STEP", "latest").strip().lower() or "latest"
        if raw == "none":
            return None
        if raw == "latest":
            if self._persistent is not None:
                named, unwrap = pytrees.as_target(target)
                candidates, _, _ = self._agree_two_tiers(None, named, [pytrees.STATE_ITEM] if unwrap else items)
                self._latest_from_env = candidates[0] if candidates else None
                return self._latest_from_env
            self._latest_from_env = self.latest_step()
            return self._latest_from_env
        return int(raw)

    #: The step `restore_step_from_env` resolved "latest" to: restoring it may fall back.
    _latest_from_env: int | None = None

    # ------------------------------------------------------------------ save

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would save (policy or agreed request), without saving.
        Called on: all processes, at the same steps."""
        return self._decide(step, force=False)

    def save(self, step: int, items: Any, force: bool = False) -> bool:
        """Save `items` at `step` if forced, due by policy or requested. Returns whether it saved.
        `items`: a mapping of named items, or any other pytree (a flax TrainState, an optax state),
        saved as the one item "state" (resilax_ckpt.pytrees). Raises the error of a failed earlier
        background save. Called on: all processes, same step."""
        started = time.perf_counter()
        items, _ = pytrees.as_items(items)
        self._check_open()
        self._trainer.step(step)
        self._raise_background_error()
        if self._last_saved_step is not None and (step == self._last_saved_step
                                                  or (step < self._last_saved_step and not force)):
            self._decide(step, force=False)  # keeps the agreement exchanges in line; answers requests
            return False
        if not self._decide(step, force):
            self._prepare_first_save(items)
            return False
        requests, self._pending_requests = self._pending_requests, []
        stop = self._stop_requested_locally
        self._wait_pending()
        if self._preparing is not None:
            self._preparing.result()  # never raises; its compile is this save's
            self._preparing = None
        self._copy_prepared = True
        self._save_count += 1
        key = f"{self._key}/save{self._save_count}"
        plan = items_lib.snapshot_items(
            items, step=step, generation=self._options.generation,
            process_index=self._coord.process_index, process_count=self._coord.process_count,
            local_tier=self._local_tier, time_now=0.0 if self._local_tier else time.time(),
            shard_files=self._options.shard_files and self._storage.is_local)
        self._last_saved_step = step
        self._last_save_time = self._options.clock()
        future = self._executor.submit(self._write_and_commit, step, plan, key, requests)
        self._pending = future
        if stop or not self._options.async_save:
            self.wait()
            if stop:
                self._stop_after(step)
        self._trainer.saved(time.perf_counter() - started)
        return True

    def _prepare_first_save(self, items: Mapping[str, Any], *, restored: bool = False) -> None:
        """Once, before this manager's first save: compile the device-side copy a save of `items`
        dispatches, on the background thread, so that the first save blocks the loop as briefly as
        later ones. Called with the items of a save() that did not save (one try: it costs a flatten
        of the state) and with what restore() returned (which, without device arrays, leaves the try
        to save()). A failure here only logs: the first save then compiles as usual."""
        if self._copy_prepared:
            return
        try:
            signature = items_lib.copy_signature(items, process_index=self._coord.process_index,
                                                 process_count=self._coord.process_count,
                                                 local_tier=self._local_tier)
        except Exception as e:  # e.g. an item save() would reject: save() reports it
            log.debug("not compiling the snapshot copy ahead: %s", e)
            signature = []
        if signature or not restored:
            self._copy_prepared = True
        if signature:
            self._preparing = self._executor.submit(_compile_quietly, signature)

    def wait(self) -> None:
        """Block until the pending save committed; re-raise its failure."""
        self._wait_pending()

    def _wait_pending(self) -> None:
        future, self._pending = self._pending, None
        if future is None:
            return
        try:
            future.result()
        except ResilaxCkptError:
            raise
        except Exception as e:
            raise SaveError(f"{self._root}: background save failed: {type(e).__name__}: {e}") from e

    def _raise_background_error(self) -> None:
        if self._pending is not None and self._pending.done() and self._pending.exception() is not None:
            self._wait_pending()

    def _decide(self, step: int, force: bool) -> bool:
        """Policy plus requests, agreed across processes. Every process must call it at each step
        it calls save() (so the agreement exchanges line up)."""
        opts = self._options
        now = opts.clock()
        time_due = (opts.save_every_seconds is not None
                    and now - self._last_save_time >= opts.save_every_seconds)
        if opts.save_every_steps is None and opts.save_every_seconds is None:
            step_due = True  # no policy: every save() call saves
        else:
            step_due = policy.decide_periodic_save(step, self._last_saved_step, None, now,
                                                   opts.save_every_steps, None)
        local_request = self._poll_local_requests()
        if self._coord.process_count == 1:
            requested = bool(local_request)
            stop = any(r.stop for r in self._pending_requests) or self._sigterm.is_set()
        else:
            requested, stop, time_due = self._agree(step, local_request, time_due)
        if stop:
            self._stop_requested_locally = True
        already = self._last_saved_step is not None and step <= self._last_saved_step
        if already and (requested or stop):
            # Answer the request with the step already saved (it is committed or committing).
            self._answer_with_last_save()
            if stop:
                self.wait()
                self._stop_after(self._last_saved_step)
            return False
        return force or step_due or time_due or requested or stop

    def _stop_after(self, step: int | None) -> None:
        """The final save of `step` committed: tell the loop to stop, and the sidecar which step."""
        self._should_stop = True
        if self._options.control_dir and step is not None:
            write_stop_record(self._options.control_dir, step, self._sigterm.is_set())

    def _poll_local_requests(self) -> bool:
        if self._watcher is not None:
            self._pending_requests.extend(self._watcher.poll())
        if self._sigterm.is_set() and not any(r.path is None for r in self._pending_requests):
            self._pending_requests.append(SaveRequest(id=f"sigterm-{os.getpid()}", reason="preemption",
                                                      stop=True))
        return bool(self._pending_requests)

    def _agree(self, step: int, local_request: bool, time_due: bool) -> tuple[bool, bool, bool]:
        """Several processes: every `request_check_every_steps` steps, exchange flags through the
        coordination service (set, barrier, list). A SIGTERM is one more local stop request
        (`_poll_local_requests`), so it is agreed here like the sidecar's: every process saves the
        same step and stops, whichever process got the signal."""
        if step % self._options.request_check_every_steps != 0:
            return False, False, False
        self._poll_count += 1
        prefix = f"{self._key}/poll{self._poll_count}/"
        local_stop = any(r.stop for r in self._pending_requests)
        if local_request or time_due:
            flags = {"request": local_request, "stop": local_stop, "time": time_due}
            self._coord.publish(prefix + str(self._coord.process_index), json.dumps(flags))
        self._coord.barrier(prefix.rstrip("/"), self._options.barrier_timeout_seconds)
        seen = [json.loads(v) for v in self._coord.fetch_dir(prefix).values()]
        if self._coord.process_index == 0 and self._poll_count > 1:
            self._coord.delete(f"{self._key}/poll{self._poll_count - 1}/")
        requested = any(f["request"] for f in seen)
        stop = any(f["stop"] for f in seen)
        return requested, stop, any(f["time"] for f in seen)

    def _answer_with_last_save(self) -> None:
        requests, self._pending_requests = self._pending_requests, []
        if self._watcher is None or not requests:
            return
        step = self._last_saved_step
        try:
            self.wait()
            self._write_results(requests, step, None)
        except Exception as e:
            self._write_results(requests, step, str(e))
            raise

    def _write_results(self, requests: Iterable[SaveRequest], step: int | None, error: str | None) -> None:
        if self._watcher is None:
            return
        for request in requests:
            if request.path is not None:
                self._watcher.write_result(request, step, error is None, error)

    def _write_and_commit(self, step: int, plan: items_lib.SnapshotPlan, key: str,
                          requests: list[SaveRequest]) -> None:
        try:
            self._write_and_commit_inner(step, plan, key)
        except BaseException as e:
            self._write_results(requests, step, f"{type(e).__name__}: {e}")
            raise
        self._write_results(requests, step, None)

    def _write_and_commit_inner(self, step: int, plan: items_lib.SnapshotPlan, key: str) -> None:
        storage, root, gen = self._storage, self._root, self._options.generation
        pid = self._coord.process_index
        final = storage.join(root, layout.step_name(step))
        renames = storage.is_local and self._own_suffix is None
        several = self._coord.process_count > 1 and not self._local_tier
        attempt: str | None = None
        if not storage.is_local:
            # Write-once steps: this attempt writes into a prefix of its own; `_COMMIT` names it.
            if self._is_primary:
                attempt = layout.attempt_name(*self._epoch, os.urandom(4).hex())
                if several:
                    self._coord.publish(f"{key}/attempt", attempt)
            else:
                attempt = self._coord.fetch(f"{key}/attempt", self._options.barrier_timeout_seconds)
        if renames:
            work = storage.join(root, layout.tmp_name(step, gen))
        elif attempt is not None:
            work = storage.join(final, attempt)
        else:
            work = final
        error: str | None = None
        recycled: str | None = None
        if renames and self._recycles and self._options.recycle_pool > 0:
            if self._is_primary:
                try:
                    recycled = commit.take_recycled(root, work, plan.metadata)
                except OSError as e:  # a folder we cannot prune: write new files instead
                    log.warning("recycling into %s failed (%s); writing new files", work, e)
                    storage.delete_tree(work)
                finally:
                    if several:
                        self._coord.publish(f"{key}/workdir", recycled or "")
            elif several:
                # The primary renames a recycled folder to `work` before anyone writes into it.
                self._coord.fetch(f"{key}/workdir", self._options.barrier_timeout_seconds)
        commit.kill_point("before_writes", pid)
        try:
            if self._is_primary or not renames:
                commit.check_step_free(storage, root, step)
            if not renames:  # object store, or a local tier folder shared by several processes
                storage.write_bytes(storage.join(work, layout.writer_name(pid)), b"")
            _write_step_files(storage, self._backend, work, plan, create_metadata=self._is_primary,
                              process_index=pid)
            commit.kill_point("after_writes", pid)
        except Exception as e:
            error = f"process {pid}: {type(e).__name__}: {e}"
            if not several:
                raise
        if several:
            self._coord.publish(f"{key}/written/{pid}", error or "ok")
            self._coord.barrier(f"{key}/written", self._options.barrier_timeout_seconds)
        if self._is_primary:
            result = "ok"
            try:
                if several:
                    failures = [v for v in self._coord.fetch_dir(f"{key}/written/").values() if v != "ok"]
                    if failures:
                        raise SaveError(f"step {step}: not committed; writes failed: {'; '.join(failures)}")
                if recycled is not None:
                    # Nothing the new step lacks may survive from the recycled step.
                    stale = commit.prune_to(work, commit.expected_files(plan.metadata))
                    if stale:
                        log.warning("step %d: deleted %d unexpected files from %s after the writes: %s",
                                    step, len(stale), work, ", ".join(stale[:5]))
                storage.write_bytes(storage.join(work, layout.metadata_name(self._own_suffix)),
                                    plan.metadata.to_bytes())
                commit.kill_point("before_commit", pid)
                # The local tier's marker carries the save's identity (`key`, the same on every
                # process): every host's sidecar uploads this save into one attempt (layout.py).
                marker = commit.build_marker(step, self._epoch, attempt, key if self._local_tier else None)
                if self._own_suffix is not None:
                    storage.write_bytes(storage.join(final, layout.commit_name(self._own_suffix)), marker)
                    commit.clear_bad(storage, root, step)  # a new save of a step marked bad
                elif storage.is_local:
                    commit.commit_local(storage, root, work, final, step, marker,
                                        None if self._local_tier else self._epoch)
                else:
                    commit.commit_object(storage, root, final, step, marker, self._epoch)
                commit.kill_point("after_commit", pid)
                log.info("committed step %d in %s", step, root)
            except Exception as e:
                result = f"{type(e).__name__}: {e}"
                if several:
                    self._coord.publish(f"{key}/committed", result)
                raise
            retention_error: Exception | None = None
            try:
                # Before the others hear of the commit, so every process then sees the same steps.
                self._apply_retention()
            except Exception as e:
                retention_error = e
            if several:
                self._coord.publish(f"{key}/committed", result)
            if retention_error is not None:
                raise SaveError(f"step {step} committed, but retention failed: {retention_error}") from retention_error
        else:
            if error is not None:
                raise SaveError(f"step {step}: {error}")
            result = self._coord.fetch(f"{key}/committed", self._options.barrier_timeout_seconds)
            if result != "ok":
                raise SaveError(f"step {step}: the primary did not commit: {result}")

    def _apply_retention(self) -> None:
        opts = self._options
        if opts.keep_last is None:
            return
        doomed = policy.plan_retention(self.steps(), opts.keep_last, opts.keep_every_steps,
                                       protected=self._protected_steps)
        for step in doomed:
            if self._recycles and commit.retire_step(self._root, step, opts.recycle_pool):
                log.info("retention retired step %d in %s for recycling", step, self._root)
                continue
            folder = self._storage.join(self._root, layout.step_name(step))
            if not self._storage.is_local:  # the marker first: a half-deleted step never looks committed
                self._storage.delete_tree(self._storage.join(folder, layout.COMMIT_FILE))
                commit.kill_point("retention_marker_deleted")
            self._storage.delete_tree(folder)
            log.info("retention deleted step %d in %s", step, self._root)

    _protected_steps: tuple[int, ...] = ()

    def _clean_local_tier(self) -> None:
        """Delete temporary folders and step folders without any commit marker (interrupted saves).
        Called on: every process of the local tier, at start."""
        for name in self._storage.list_dir(self._root):
            path = self._storage.join(self._root, name)
            leftover = name.startswith((layout.TMP_PREFIX, layout.TRASH_PREFIX))
            names = self._storage.list_dir(path) if layout.parse_step(name) is not None else []
            uncommitted = (layout.parse_step(name) is not None and layout.owns_step_folder(names)
                           and not any(n == layout.COMMIT_FILE or n.startswith(layout.COMMIT_FILE + ".")
                                       for n in names))
            if leftover or uncommitted:
                self._storage.delete_tree(path)

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
        named, unwrap = pytrees.as_target(target)
        out = self._restore(step, named, [pytrees.STATE_ITEM] if unwrap else items)
        self._trainer.restored(self._protected_steps[0] if self._protected_steps else None,
                               time.perf_counter() - started)
        self._prepare_first_save(out, restored=True)
        return out[pytrees.STATE_ITEM] if unwrap else out

    def _restore(self, step: int | None, target: Mapping[str, Any] | None,
                 items: Iterable[str] | None) -> dict[str, Any]:
        if self._persistent is not None:
            return self._restore_two_tiers(step, target, items)
        if step is None or step == self._latest_from_env:
            return self._restore_newest_good(target, items)
        self._protected_steps = (step,)
        step_path = self._storage.join(self._root, layout.step_name(step))
        if step not in self.steps():
            if self._storage.exists(step_path):
                raise StepNotCommittedError(
                    f"{step_path}: step {step} is not committed (interrupted or fenced-out save); "
                    f"committed steps: {self.steps()}")
            raise StepNotFoundError(f"{step_path}: step {step} does not exist; committed steps: {self.steps()}")
        return self._read_step(self._storage, commit.step_data_path(self._storage, self._root, step), step,
                               target, items)

    def _restore_newest_good(self, target: Mapping[str, Any] | None,
                             items: Iterable[str] | None) -> dict[str, Any]:
        """The newest committed step every process can read. A step that fails (a corrupt, truncated or
        missing file, bad metadata) on any process is marked bad (`<root>/_bad/<step>.json`, never
        deleted), reported, and the next older step is tried; all processes agree on each try.
        Called on: all processes."""
        candidates = sorted(self.steps(), reverse=True)
        if not candidates:
            raise StepNotFoundError(f"{self._root}: no committed checkpoint")
        self._restore_count += 1
        skipped: list[dict[str, Any]] = []
        for step in candidates:
            self._protected_steps = (step,)
            out: dict[str, Any] | None = None
            error = "ok"
            try:
                out = self._read_step(self._storage, commit.step_data_path(self._storage, self._root, step),
                                      step, target, items)
            except UNREADABLE_STEP_ERRORS as e:
                error = f"process {self._coord.process_index}: {type(e).__name__}: {e}"
            failures = self._agree_readable(f"{self._key}/restore/{self._restore_count}/{step}", error)
            if not failures:
                assert out is not None
                self._report_restore(step, skipped)
                return out
            reason = "; ".join(failures)
            if self._is_primary:
                commit.mark_bad(self._storage, self._root, step, reason)
            log.warning("step %d in %s cannot be restored, marked bad (kept), trying an older step: %s",
                        step, self._root, reason)
            skipped.append({"step": step, "reason": reason})
        self._report_restore(None, skipped)
        raise CorruptCheckpointError(
            f"{self._root}: no committed step can be restored: "
            + "; ".join(f"step {s['step']}: {s['reason']}" for s in skipped))

    def _agree_readable(self, key: str, error: str) -> list[str]:
        """Every process's error for one try ("ok" when it read the step); the failures."""
        return sorted(v for v in self._exchange(key, error) if v != "ok")

    def _exchange(self, key: str, value: str) -> list[str]:
        """Every process's `value` under `key`. Called on: all processes (a collective)."""
        if self._coord.process_count == 1:
            return [value]
        self._coord.publish(f"{key}/{self._coord.process_index}", value)
        self._coord.barrier(key, self._options.barrier_timeout_seconds)
        return list(self._coord.fetch_dir(f"{key}/").values())

    @property
    def restore_report(self) -> dict[str, Any] | None:
        """What the last `restore()` of the newest step did: `{"step": N, "skipped": [{"step", "reason"}]}`
        (None before any). With a local tier each entry also has "tier": "local" (this host's copy
        could not be read, marked bad, the persistent tier's copy of that step was read instead) or
        "all" (no tier could serve it on some process: skipped); and "local_misses" lists this
        process's local steps (the restored one and newer) that lacked a chunk it needed, naming the
        file (read from the persistent tier or skipped; not marked bad: after a change of mesh that is
        expected). Also written to `$RESILAX_CONTROL_DIR/restore.json` for the sidecar."""
        return self._restore_report

    _restore_report: dict[str, Any] | None = None
    _restore_count = 0

    #: This process's local steps (of the last two-tier agreement) it could not read whole locally, and why.
    _local_misses: dict[int, str] = {}  # noqa: RUF012  (replaced, never mutated)

    def _report_restore(self, step: int | None, skipped: list[dict[str, Any]],
                        local_misses: list[dict[str, Any]] | None = None) -> None:
        self._restore_report = {"step": step, "skipped": skipped}
        if local_misses:
            self._restore_report["local_misses"] = local_misses
        if self._options.control_dir:
            write_restore_report(self._options.control_dir, self._restore_report)

    def _read_step(self, storage: Storage, path: str, step: int, target: Mapping[str, Any] | None,
                   items: Iterable[str] | None, own_metadata: bool = True) -> dict[str, Any]:
        """`restore_step` with this manager's options; `own_metadata`: this process's metadata file
        (the local tier's per-process name), else the step's shared one."""
        backend = self._persistent_backend if storage is self._persistent and self._persistent_backend else self._backend
        return restore_step(storage, backend, path, step, target, items, self._options.max_inflight_bytes,
                            self._coord.process_index,
                            layout.metadata_name(self._own_suffix) if own_metadata else layout.METADATA_FILE,
                            self._options.io_concurrency)

    def _restore_two_tiers(self, step: int | None, target: Mapping[str, Any] | None,
                           items: Iterable[str] | None) -> dict[str, Any]:
        """Local tier first, persistent tier behind it. Each process finds the local steps whose
        chunks its target shards need are all on this host; the processes agree on the newest step
        every one of them can read from its local tier or the persistent tier. Restoring the newest
        step (`step` None, or the one restore_step_from_env resolved "latest" to) falls back like
        `_restore_newest_good`: a process whose local copy cannot be read (a corrupt, truncated or
        missing file, bad metadata) marks it bad in its local tier (`<local>/_bad/<step>.json`, kept;
        its sidecar never uploads it) and reads the persistent tier's copy of the same step; a step no
        tier can serve on some process is skipped by all (the persistent copy marked bad) and the next
        older one tried. `restore_report` lists what was skipped, why, naming the file.
        Called on: all processes."""
        assert self._persistent is not None and self._persistent_root is not None
        fallback = step is None or step == self._latest_from_env
        candidates, local_ok, persistent = self._agree_two_tiers(None if fallback else step, target, items)
        if fallback and step is not None:
            candidates = [c for c in candidates if c <= step]
        if not candidates:
            raise StepNotFoundError(f"{self._root} and {self._persistent_root}: no committed checkpoint "
                                    "that every process can read")
        self._restore_count += 1
        skipped: list[dict[str, Any]] = []
        own_local = set(self.steps())
        for cand in candidates:
            self._protected_steps = (cand,)
            # An older persistent step this host also holds (left out of the agreement, which looks at
            # local steps from the newest persistent one up): read locally when it covers this process.
            has_local = cand in local_ok or (cand in own_local and cand in persistent and cand not in self._local_misses
                                             and self._local_covers(cand, target, items) is None)
            from_peer = not has_local and self._fetch_from_peers(cand, target, items)
            out, source, errors = self._read_either_tier(cand, has_local or from_peer, cand in persistent,
                                                         target, items, mark_persistent=fallback)
            if from_peer and source == "local":
                source = "peer"
            views = [json.loads(v) for v in self._exchange(
                f"{self._key}/restore2/{self._restore_count}/{cand}", json.dumps(errors))]
            if self._coord.process_index == 0:
                bad_persistent = [v["persistent"] for v in views if v.get("persistent")]
                if bad_persistent and fallback:
                    commit.mark_bad(self._persistent, self._persistent_root, cand, "; ".join(bad_persistent))
            failed = [v["error"] for v in views if v.get("error")]
            recovered = sorted(v["local"] for v in views if v.get("local") and not v.get("error"))
            if recovered:  # a local copy could not be read; the persistent tier's was
                skipped.append({"step": cand, "tier": "local",
                                "reason": "; ".join(recovered) + " (read from the persistent tier instead)"})
            if not failed:
                assert out is not None
                # Local steps after the restored one belong to a timeline this generation abandons; it
                # may save the same step numbers into the same folders: withdraw them first.
                self._withdraw_local_steps_after(cand)
                self._restored_from = source
                self._report_restore(cand, skipped, [
                    {"step": m, "reason": why} for m, why in sorted(self._local_misses.items()) if m >= cand])
                return out
            reason = "; ".join(sorted(failed))
            skipped.append({"step": cand, "tier": "all", "reason": reason})
            if not fallback:
                self._report_restore(None, skipped)
                raise CorruptCheckpointError(f"step {cand} cannot be restored: {reason}")
            log.warning("step %d cannot be restored from either tier, trying an older step: %s", cand, reason)
        self._report_restore(None, skipped)
        raise CorruptCheckpointError(
            f"{self._root} and {self._persistent_root}: no committed step can be restored: "
            + "; ".join(f"step {s['step']}: {s['reason']}" for s in skipped if s["tier"] == "all"))

    def _read_either_tier(self, step: int, local_ok: bool, in_persistent: bool,
                          target: Mapping[str, Any] | None, items: Iterable[str] | None,
                          mark_persistent: bool) -> tuple[dict[str, Any] | None, str | None, dict[str, str | None]]:
        """(what this process read of `step`, from which tier, and {"local", "persistent", "error"}:
        why each tier failed, and why the step failed for this process; None where nothing failed)."""
        assert self._persistent is not None and self._persistent_root is not None
        pid = self._coord.process_index
        errors: dict[str, str | None] = {"local": None, "persistent": None, "error": None}
        if local_ok:  # this host holds what this process needs (same bytes as persistent)
            path = self._storage.join(self._root, layout.step_name(step))
            try:
                return self._read_step(self._storage, path, step, target, items), "local", errors
            except UNREADABLE_STEP_ERRORS as e:
                reason = f"process {pid}: local tier: {type(e).__name__}: {e}"
                errors["local"] = reason
                commit.mark_bad(self._storage, self._root, step, reason)
                log.warning("step %d in this host's local tier %s cannot be read, marked bad (kept): %s",
                            step, self._root, reason)
        if in_persistent:
            path = commit.step_data_path(self._persistent, self._persistent_root, step)
            try:
                out = self._read_step(self._persistent, path, step, target, items, own_metadata=False)
                return out, "persistent", errors
            except UNREADABLE_STEP_ERRORS as e:
                errors["persistent"] = f"process {pid}: persistent tier: {type(e).__name__}: {e}"
                errors["error"] = "; ".join(x for x in (errors["local"], errors["persistent"]) if x)
                if mark_persistent:
                    log.warning("step %d in the persistent tier %s cannot be read: %s", step,
                                self._persistent_root, errors["persistent"])
                return None, None, errors
        errors["error"] = errors["local"] or (
            f"process {pid}: step {step}: neither this host's local tier {self._root} holds what this process "
            f"needs nor is it committed in {self._persistent_root}")
        return None, None, errors

    def _fetch_from_peers(self, step: int, target: Mapping[str, Any] | None, items: Iterable[str] | None) -> bool:
        """Have the sidecar copy this process's replica of `step` from the peers holding it into the
        local tier (checksums checked there; the next peer tried when one fails); whether the local
        tier then covers this process's restore."""
        sources = self._peer_sources.get(step)
        if not sources or not self._options.sidecar_address:
            return False
        try:
            source = peer_client.request_fetch(self._options.sidecar_address, self._options.sidecar_token_file,
                                               self._coord.process_index, step, sources)
        except peer_client.PeerFetchError as e:
            log.warning("step %d: no peer replica of process %d could be fetched: %s", step,
                        self._coord.process_index, e)
            return False
        why = self._local_covers(step, target, items)
        if why is not None:
            log.warning("step %d fetched from peer %s does not cover this process's restore: %s", step, source, why)
            return False
        log.info("step %d of process %d fetched from peer %s", step, self._coord.process_index, source)
        return True

    def _own_holdings(self, steps: Iterable[int], newest_persistent: int | None) -> peers.Holdings:
        """This process's local steps `steps` and the peer replicas on this host (no older than the
        persistent tier's newest), with their save identities."""
        def identity(step: int) -> str:
            path = self._storage.join(self._root, layout.step_name(step), layout.commit_name(self._own_suffix))
            try:
                return str(json.loads(self._storage.read_bytes(path)).get("save", ""))
            except (OSError, ValueError):
                return ""
        held = {} if not self._storage.is_local else peer_client.held_replicas(self._root)
        floor = -1 if newest_persistent is None else newest_persistent
        return peers.Holdings({s: identity(s) for s in steps},
                              {p: {s: v for s, v in got.items() if s >= floor} for p, got in held.items()})

    def _agree_two_tiers(self, step: int | None, target: Mapping[str, Any] | None,
                         items: Iterable[str] | None) -> tuple[list[int], list[int], list[int]]:
        """(the steps every process can read, newest first — with `step` given, just `step`; this
        process's local steps that cover its restore; the persistent tier's steps). Called on: all
        processes (a collective with several)."""
        persistent = self.persistent_steps()
        local = [s for s in self.steps() if (step is None or s == step)
                 and (not persistent or s >= persistent[-1] or s == step)]
        misses = {s: self._local_covers(s, target, items) for s in local}
        local_ok = [s for s in local if misses[s] is None]
        self._local_misses = {s: why for s, why in misses.items() if why is not None}
        agreed_persistent = set(persistent)
        if self._coord.process_count > 1:
            # The persistent lists too: a sidecar's commit landing between two processes' listings
            # must not give them different candidates (every try below is a collective).
            self._save_count += 1
            key = f"{self._key}/restore-agree{self._save_count}"
            mine = self._own_holdings(local_ok, persistent[-1] if persistent else None)
            self._coord.publish(f"{key}/{self._coord.process_index}",
                                json.dumps({"process": self._coord.process_index, "persistent": persistent,
                                            **mine.to_json()}))
            self._coord.barrier(key, self._options.barrier_timeout_seconds)
            raw = [json.loads(v) for v in self._coord.fetch_dir(f"{key}/").values()]
            agreed_persistent = set.intersection(*(set(v["persistent"]) for v in raw)) if raw else set()
            # Which step every process can get, each from its own tier or a peer's (peers.py).
            plan = peers.decide_sources({int(v["process"]): peers.Holdings.from_json(v) for v in raw})
            me = self._coord.process_index
            self._peer_sources = {s: [self._peer_addresses[q] for q in by[me] if q in self._peer_addresses]
                                  for s, by in plan.items() if by.get(me)}
            agreed_local = {s for s, by in plan.items()
                            if all(not holders or any(q in self._peer_addresses for q in holders)
                                   for holders in by.values())}
        else:
            agreed_local = set(local_ok)
        if step is not None:
            return [step], local_ok, persistent
        return sorted(agreed_local | agreed_persistent, reverse=True), local_ok, persistent

    def _withdraw_local_steps_after(self, step: int) -> None:
        """Withdraw this process's commit marker of every local step newer than `step`, marker
        first, then the step's folder if no other process's marker is left in it (a crash in
        between leaves an uncommitted folder, never a committed mix). Called on: every process of
        the local tier, at restore."""
        marker = layout.commit_name(self._own_suffix)
        for old in self.steps():
            if old <= step:
                continue
            path = self._storage.join(self._root, layout.step_name(old))
            self._storage.delete_tree(self._storage.join(path, marker))
            self._storage.sync_dir(path)
            if not any(n == layout.COMMIT_FILE or n.startswith(layout.COMMIT_FILE + ".")
                       for n in self._storage.list_dir(path)):
                self._storage.delete_tree(path)
            log.info("withdrew local step %d (newer than the restored step %d) in %s", old, step, self._root)
        # Replicas held for peers of steps newer than `step` belong to the abandoned timeline too.
        if self._storage.is_local:
            for origin, got in peer_client.held_replicas(self._root).items():
                for old in got:
                    if old > step:
                        self._storage.delete_tree(self._storage.join(
                            self._root, peers.PEER_DIR, peers.origin_dir_name(origin), layout.step_name(old)))

    def _local_covers(self, step: int, target: Mapping[str, Any] | None, items: Iterable[str] | None) -> str | None:
        """Why this host's local step lacks a chunk this process's restore would read (naming the
        file), or None when it has every one. A missing chunk is not proof of damage (after a change
        of mesh, another host holds it): the step is just not read locally. Unreadable metadata is:
        the step is marked bad (`<local>/_bad/<step>.json`, kept), so its sidecar never uploads it."""
        step_path = self._storage.join(self._root, layout.step_name(step))
        try:
            meta = read_metadata(self._storage, step_path, layout.metadata_name(self._own_suffix))
        except MetadataError as e:
            reason = f"process {self._coord.process_index}: local tier: {type(e).__name__}: {e}"
            commit.mark_bad(self._storage, self._root, step, reason)
            log.warning("step %d in this host's local tier cannot be read, marked bad (kept): %s", step, reason)
            return reason
        target = target or {}
        for name in (list(items) if items is not None else list(meta.items)):
            item = meta.items.get(name)
            if item is None:
                return f"{step_path}: no item {name!r}"
            if item.kind != "pytree":
                continue
            if target.get(name) is not None:
                try:
                    leaves, _ = items_lib.match_target(step, name, item, target[name])
                except TreeMismatchError as e:
                    return str(e)
                wants = jax.tree_util.tree_leaves(target[name])
            else:
                leaves, wants = list(item.leaves), [None] * len(item.leaves)
            for leaf, want in zip(leaves, wants, strict=True):
                if leaf.kind != "array":
                    continue
                sharding = getattr(want, "sharding", None)
                if sharding is None:
                    boxes = [tuple((0, d) for d in leaf.shape)]
                else:
                    boxes = list(planning.plan_read_boxes(
                        sharding.addressable_devices_indices_map(leaf.shape).items(), leaf.shape))
                files = chunk_format.ArrayFiles.of(leaf)
                file_keys = {files.locate(c)[0] for box in boxes for c in planning.chunks_of_box(box, leaf.chunks)}
                leaf_path = self._storage.join(step_path, name, str(leaf.dir))
                for key in sorted(file_keys):
                    if not self._storage.exists(self._storage.join(leaf_path, *key)):
                        return f"{self._storage.join(leaf_path, *key)} is missing on this host"
        return None

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Wait for the pending save (re-raising its failure) and release resources."""
        if self._closed:
            return
        try:
            self._wait_pending()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._uninstall_sigterm()
            if self._watcher is not None:
                self._watcher.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ResilaxCkptError(f"{self._root}: the CheckpointManager is closed")

    def _install_sigterm(self) -> None:
        """SIGTERM becomes a stop request (`options.handle_sigterm`), in every mode: one process or
        several, with or without a local tier. The handler only sets a flag; the next `save()` turns it
        into a save request with stop, which the processes agree on like any other (`_agree`). It
        replaces the handler installed before (with several processes, JAX's preemption notifier, so
        `multihost_utils.reached_preemption_sync_point` no longer fires). Needs the main thread
        (Python delivers signals there); a manager built on another thread installs none."""
        if not self._options.handle_sigterm or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        # None: a handler not installed from Python (JAX's); on close the default action comes back.
        self._previous_sigterm = previous if previous is not None else signal.SIG_DFL

        def on_sigterm(signum: int, frame: Any) -> None:
            self._sigterm.set()

        signal.signal(signal.SIGTERM, on_sigterm)

    def _uninstall_sigterm(self) -> None:
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None


def _compile_quietly(signature: list[list[jax.ShapeDtypeStruct]]) -> None:
    try:
        items_lib.compile_copies(signature)
    except Exception as e:
        log.warning("compiling the snapshot copy ahead failed (the first save will compile it): %s", e)


def _write_step_files(storage: Storage, backend: backends.ChunkBackend, work: str, plan: items_lib.SnapshotPlan,
                      create_metadata: bool, process_index: int) -> None:
    """Write this process's chunks (through the chunk backend) and small files of `plan` under `work`."""
    def progress(n: int) -> None:
        if n == len(plan.writes) // 2:
            commit.kill_point("mid_writes", process_index)

    backend.write(plan, work, create_metadata, progress)
    backends.release_free_memory()  # the snapshot is written and dropped
    for parts, data in plan.files:
        storage.write_bytes(storage.join(work, *parts), data)


def read_metadata(storage: Storage, step_path: str, name: str = layout.METADATA_FILE) -> StepMetadata:
    where = storage.join(step_path, name)
    try:
        data = storage.read_bytes(where)
    except FileNotFoundError as e:
        raise MetadataError(f"{where}: missing") from e
    except OSError as e:
        raise MetadataError(f"{where}: unreadable ({e})") from e
    return StepMetadata.from_bytes(data, where)


def restore_step(storage: Storage, backend: backends.ChunkBackend, step_path: str, step: int,
                 target: Mapping[str, Any] | None, items: Iterable[str] | None, max_inflight_bytes: int,
                 process_index: int, metadata_name: str = layout.METADATA_FILE,
                 io_concurrency: int = 32) -> dict[str, Any]:
    """Restore from one committed step folder (see CheckpointManager.restore), reading the chunks
    through `backend` (the storage's: backends.for_storage)."""
    meta = read_metadata(storage, step_path, metadata_name)
    names = list(items) if items is not None else list(meta.items)
    unknown = [n for n in names if n not in meta.items]
    if unknown:
        raise TreeMismatchError(f"step {step}: no item(s) {', '.join(map(repr, unknown))} in the checkpoint; "
                                f"it has: {', '.join(map(repr, meta.items))}")
    target = target or {}
    out: dict[str, Any] = {}
    reads: list[reader.LeafRead] = []
    assemble: list[tuple[str, Any, list[Any]]] = []  # (item, treedef or paths, slots)
    problems: list[str] = []
    for name in names:
        item = meta.items[name]
        if item.kind == "json":
            out[name] = _read_json_item(storage, storage.join(step_path, layout.item_json_name(name)), step)
            continue
        if item.kind == "per_process":
            path = storage.join(step_path, name, layout.process_json_name(process_index))
            out[name] = _read_json_item(storage, path, step) if storage.exists(path) else None
            continue
        item_target = target.get(name)
        if item_target is not None:
            leaves, treedef = items_lib.match_target(step, name, item, item_target)
            targets = jax.tree_util.tree_leaves(item_target)
        else:
            leaves, treedef = list(item.leaves), None
            targets = [None] * len(leaves)
        slots: list[Any] = []
        for leaf, want in zip(leaves, targets, strict=True):
            if leaf.kind == "scalar":
                slots.append(_scalar_value(leaf.value, leaf.pytype, want))
                continue
            sharding = None
            dtype = np.dtype(leaf.dtype)
            if want is not None and hasattr(want, "shape"):
                want_shape, want_dtype = tuple(want.shape), want.dtype
                if leaf.prng_impl and pytrees.is_prng_key(want_dtype):
                    want_shape, want_dtype = want_shape + tuple(leaf.shape[len(want_shape):]), dtype
                if want_shape != tuple(leaf.shape):
                    problems.append(f"step {step}: array '{name}/{leaf.keystr}' has shape {tuple(leaf.shape)} "
                                    f"on disk, the target expects {tuple(want.shape)}")
                    continue
                dtype = np.dtype(want_dtype)
                sharding = getattr(want, "sharding", None)
                if leaf.prng_impl and sharding is not None:
                    sharding = pytrees.data_sharding(sharding, len(want.shape))
            read = reader.LeafRead(name, leaf, dtype, sharding)
            reads.append(read)
            slots.append(read)
        assemble.append((name, treedef if treedef is not None else [lf.path for lf in leaves], slots))
    if problems:
        raise ShapeMismatchError("; ".join(problems))
    try:
        reader.read_leaves(reads, step_path, backend, max_inflight_bytes, io_concurrency)
    except IncompleteStepError as e:  # a chunk file is missing (MissingChunkError)
        hint = " (a local-tier step holds only its host's shards: restore from the persistent tier)"
        raise type(e)(f"step {step}: {e}{hint if meta.local_tier else ''}") from e
    except CorruptCheckpointError as e:
        raise type(e)(f"step {step}: {e}") from e
    for name, structure, slots in assemble:
        values = [(pytrees.wrap(s.result, s.leaf.prng_impl) if s.leaf.prng_impl else s.result)
                  if isinstance(s, reader.LeafRead) else s for s in slots]
        if isinstance(structure, list):
            out[name] = items_lib.rebuild_tree(structure, values)
        else:
            out[name] = jax.tree_util.tree_unflatten(structure, values)
    return out


def _read_json_item(storage: Storage, path: str, step: int) -> Any:
    """A JSON item's value; a missing or damaged file is an error of the step that names the file (so a
    restore of the newest step falls back)."""
    try:
        return json.loads(storage.read_bytes(path))
    except FileNotFoundError as e:
        raise IncompleteStepError(f"step {step}: {path} is missing") from e
    except ValueError as e:
        raise CorruptCheckpointError(f"step {step}: {path} is not valid JSON ({e})") from e


def _scalar_value(value: Any, pytype: str, want: Any) -> Any:
    if pytype in ("int", "float", "bool", "str"):
        value = {"int": int, "float": float, "bool": bool, "str": str}[pytype](value)
    else:
        value = np.dtype(pytype).type(value)
    if want is not None and hasattr(want, "dtype") and not isinstance(want, (int, float, bool)):
        return np.asarray(value, dtype=want.dtype)[()]
    return value


def save(path: str, items: Any) -> None:
    """Save `items` (named items or any pytree, as CheckpointManager.save) into the folder `path`
    (one step, no manager), synchronously and atomically. Called on: all processes."""
    items, _ = pytrees.as_items(items)
    path = path.rstrip("/")
    storage = open_storage(path)
    coord = current_coordinator()
    root, name = path.rsplit("/", 1) if "/" in path else (".", path)
    plan = items_lib.snapshot_items(items, step=0, generation=0, process_index=coord.process_index,
                                    process_count=coord.process_count, local_tier=False, time_now=time.time(),
                                    shard_files=storage.is_local)
    work = storage.join(root, f"{layout.TMP_PREFIX}{name}") if storage.is_local else path
    _write_step_files(storage, backends.for_storage(storage, ManagerOptions()), work, plan, coord.process_index == 0,
                      coord.process_index)
    key = f"resilax_ckpt/oneshot/{name}/{time.time_ns() if coord.process_count == 1 else 0}"
    coord.barrier(f"{key}/written", 900)
    if coord.process_index == 0:
        storage.write_bytes(storage.join(work, layout.METADATA_FILE), plan.metadata.to_bytes())
        marker = commit.build_marker(0, 0)
        if storage.is_local:
            commit.commit_local(storage, root, work, path, 0, marker, None)
        else:
            storage.write_bytes(storage.join(path, layout.COMMIT_FILE), marker)
    coord.barrier(f"{key}/committed", 900)


def restore(path: str, target: Any = None, items: Iterable[str] | None = None) -> Any:
    """Restore from a folder written by `save` (or one step folder of a manager); a target that is
    not a mapping of named items returns the item "state" as that pytree."""
    named, unwrap = pytrees.as_target(target)
    if unwrap:
        return restore(path, named, [pytrees.STATE_ITEM])[pytrees.STATE_ITEM]
    path = path.rstrip("/")
    storage = open_storage(path)
    if not storage.exists(storage.join(path, layout.COMMIT_FILE)):
        if storage.exists(path):
            raise StepNotCommittedError(f"{path}: not committed (no {layout.COMMIT_FILE})")
        raise StepNotFoundError(f"{path}: does not exist")
    coord = current_coordinator()
    return restore_step(storage, backends.for_storage(storage, ManagerOptions()), commit.data_path(storage, path),
                        layout.parse_step(path.rsplit("/", 1)[-1]) or 0, target, items,
                        ManagerOptions.max_inflight_bytes, coord.process_index)
