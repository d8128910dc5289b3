"""The save side of a manager: decisions (policy, requests, SIGTERM) agreed across processes, the
device copy, and the background write and commit.

A save, step by step (shared folder, several processes):
1. `save()` (all processes, same step): agree on pending requests, decide, wait for the previous
   save, copy the shards off the devices (the only part the loop waits for), hand off to a thread.
2. Background, each process: write its replica-0 boxes and its files, publish ok/error, barrier.
3. Background, primary: write `_METADATA.json`, check the fences, commit (commit.py), apply
   retention (retention.py's rules, applied by pruning.py), publish the commit result; the other
   processes wait for that result.
On a local shared folder, retention keeps retired steps as `.recycle-<step>/` (up to
`recycle_pool`); step 2 then starts with the primary renaming one to the save's temporary folder and
pruning it to the new step's files (commit.take_recycled), and every process rewrites its chunk
files in place (the file chunk backend, backends.py).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any

from resilax_ckpt import commit, layout, pytrees
from resilax_ckpt import items as items_lib
from resilax_ckpt.chunks import backends, staging
from resilax_ckpt.control.requests import RequestWatcher, SaveRequest, write_stop_record
from resilax_ckpt.control.trainer_metrics import SAVE, TrainerMetrics
from resilax_ckpt.errors import ResilaxCkptError, SaveError, StepNotFoundError
from resilax_ckpt.saving import device_snapshot, policy, retention
from resilax_ckpt.saving.pruning import Pruner
from resilax_ckpt.storage import Storage
from resilax_ckpt.tiers import Tiers

log = logging.getLogger(__name__)


class Saver:
    """Saves a manager's steps (see CheckpointManager.save). Called on: all processes, same steps."""

    def __init__(self, tiers: Tiers, watcher: RequestWatcher | None, trainer: TrainerMetrics) -> None:
        self._tiers = tiers
        self._options = tiers.options
        self._coord = tiers.coord
        self._key = tiers.key
        self._storage: Storage = tiers.local.storage
        self._root = tiers.local.root
        self._backend = tiers.local.backend
        self._local_tier = tiers.local_tier
        self._is_primary = tiers.is_primary
        self._own_suffix = tiers.own_suffix
        self._recycles = tiers.recycles
        self._epoch = tiers.epoch
        self._watcher = watcher
        self._trainer = trainer
        self._pruner = Pruner(tiers)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="resilax-ckpt")
        self._pending: concurrent.futures.Future[None] | None = None
        self.arena = staging.HostArena()
        """Host memory a host transfer on CPU devices copies shards into, reused by every save."""
        self._last_report: tuple[int, device_snapshot.CopyReport, float] | None = None
        self._copy_prepared = False  # the first save's device copy compiled ahead (or tried)
        self._preparing: concurrent.futures.Future[None] | None = None
        self._preparing_waits = True  # a save waits for that compile (CPU devices; see save())
        self._compiler: concurrent.futures.ThreadPoolExecutor | None = None
        self._last_saved_step: int | None = None
        self._last_save_time: float = self._options.clock()
        self._poll_count = 0
        self._stop_requested_locally = False
        self._pending_requests: list[SaveRequest] = []
        self.should_stop = False
        """True once a save requested with stop (or after SIGTERM) committed."""
        self._sigterm = threading.Event()
        self._previous_sigterm: Any = None

    def should_save(self, step: int) -> bool:
        """Whether `save(step, ...)` would save (policy or agreed request), without saving.
        Called on: all processes, at the same steps."""
        return self._decide(step, force=False)

    def save(self, step: int, items: Any, force: bool = False, metrics: Mapping[str, Any] | None = None) -> bool:
        """Save `items` at `step` if forced, due by policy or requested. Returns whether it saved.
        `items`: a mapping of named items, or any other pytree (a flax TrainState, an optax state),
        saved as the one item "state" (resilax_ckpt.pytrees). `metrics` (names to numbers) go into
        the step's metadata (best-N retention ranks by them; read only when this call saves). Raises
        the error of a failed earlier background save. Called on: all processes, same step."""
        started = time.perf_counter()
        items, _ = pytrees.as_items(items)
        self._trainer.step(step)
        self._raise_background_error()
        if self._last_saved_step is not None and (step == self._last_saved_step
                                                  or (step < self._last_saved_step and not force)):
            self._decide(step, force=False)  # keeps the agreement exchanges in line; answers requests
            return False
        if not self._decide(step, force):
            self.prepare_first_save(items)
            return False
        # Only a save reads the metrics (a jax scalar's float() waits for the device): not every step.
        checked = retention.validate_metrics(metrics, f"save(step={step}, metrics=...)")
        self._trainer.phase(SAVE)
        requests, self._pending_requests = self._pending_requests, []
        stop = self._stop_requested_locally
        self._wait_pending()
        if self._preparing is not None and (self._preparing_waits or self._preparing.done()):
            # Never raises; its compile is this save's. On an accelerator a save does not wait for
            # it: until it is done, a save takes a runtime copy (device_snapshot.plan_runtime_copy).
            self._preparing.result()
            self._preparing = None
        self._copy_prepared = True
        key = f"{self._key}/save{self._tiers.next_ordinal()}"
        plan = items_lib.snapshot_items(
            items, step=step, generation=self._options.generation,
            process_index=self._coord.process_index, process_count=self._coord.process_count,
            local_tier=self._local_tier, time_now=0.0 if self._local_tier else time.time(),
            shard_files=self._options.shard_files and self._storage.is_local,
            device_copy=self._options.device_copy, arena=self.arena)
        if checked:
            plan.metadata = dataclasses.replace(plan.metadata, metrics=checked)
        self._last_saved_step = step
        self._last_save_time = self._options.clock()
        transfer, report = plan.transfer, plan.report
        self._pending = self._executor.submit(self._write_and_commit, step, plan, key, requests)
        if transfer is not None:
            # After the hand-off, so that each shard is written as soon as it lands. A host transfer
            # returns once every shard landed: the loop's next step may donate the arrays.
            try:
                transfer.start()
            except Exception as e:
                with contextlib.suppress(Exception):
                    self._wait_pending()  # its writes fail on the shards that never landed
                raise SaveError(f"step {step}: taking the shards off the devices failed: "
                                f"{type(e).__name__}: {e}") from e
        if stop or not self._options.async_save:
            self._wait_pending()
            if stop:
                self._stop_after(step)
        blocked = time.perf_counter() - started
        self._last_report = (step, report, blocked)
        if report.runtime_copy or report.reason == device_snapshot.RUNTIME_COPY_FAILED:  # compile for the next save
            self._copy_prepared = False
            self.prepare_first_save(items)
        self._trainer.saved(blocked, report.path, report.device_bytes)
        return True

    @property
    def last_report(self) -> dict[str, Any] | None:
        """What the last save did (`CheckpointManager.save_report`), None before any."""
        return None if self._last_report is None else self._last_report[1].as_dict(*self._last_report[::2])

    def prepare_first_save(self, items: Mapping[str, Any], *, restored: bool = False) -> None:
        """Once, before this manager's first save: compile the device-side copy a save of `items`
        dispatches, on the background thread, so that the first save blocks the loop as briefly as
        later ones. Called with the items of a save() that did not save (one try: it costs a flatten
        of the state) and with what restore() returned (which, without device arrays, leaves the try
        to save()). A failure here only logs: the first save then compiles as usual."""
        if self._copy_prepared or self._options.device_copy == device_snapshot.HOST_TRANSFER:
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
        if signature and self._preparing is None:
            # A thread of its own: it runs while a save's writes do (the first save on an accelerator).
            if self._compiler is None:
                self._compiler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="resilax-ckpt-compile")
            self._preparing_waits = not device_snapshot.decides_as_accelerator(signature)
            self._preparing = self._compiler.submit(device_snapshot.compile_copies_quietly, signature)

    def wait(self) -> None:
        """Block until the pending save committed (re-raise its failure) and a compile of the
        on-device copy in progress is done (so the next save can take that path)."""
        self._wait_pending()
        if self._preparing is not None:
            self._preparing.result()  # never raises

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
                self._wait_pending()
                self._stop_after(self._last_saved_step)
            return False
        return force or step_due or time_due or requested or stop

    def _stop_after(self, step: int | None) -> None:
        """The final save of `step` committed: tell the loop to stop, and the sidecar which step."""
        self.should_stop = True
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
        waiting = time.perf_counter()
        self._coord.barrier(prefix.rstrip("/"), self._options.barrier_timeout_seconds)
        self._trainer.waited(time.perf_counter() - waiting)
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
            self._wait_pending()
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
        finally:
            if plan.transfer is not None:  # a drain waiting for writes that will not come goes on
                plan.transfer.close()
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
            write_step_files(storage, self._backend, work, plan, create_metadata=self._is_primary,
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
                if recycled is not None and not isinstance(self._backend, backends.FileChunkBackend):
                    # Nothing the new step lacks may survive (our chunk files: only the plan's paths).
                    stale = commit.prune_to(work, commit.expected_files(plan.metadata))
                    if stale:
                        log.warning("step %d: deleted %d unexpected files from %s after the writes: %s",
                                    step, len(stale), work, ", ".join(stale[:5]))
                storage.write_bytes(storage.join(work, layout.metadata_name(self._own_suffix)),
                                    plan.metadata.to_bytes())
                commit.kill_point("before_commit", pid)
                # The local tier's marker carries the save's identity (`key`, the same on every
                # process): every host's sidecar uploads this save into one attempt (layout.py).
                marker = commit.build_marker(step, self._epoch, attempt, key if self._local_tier else None,
                                             (pid, self._coord.process_count) if self._local_tier else None)
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
                self._pruner.remember(plan.metadata)
                self._pruner.apply_retention()
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

    def delete(self, step: int) -> None:
        """Delete committed `step` (see CheckpointManager.delete). Called on: all processes."""
        if self._local_tier:
            raise ResilaxCkptError(
                f"{self._root}: delete({step}) is not available with a local tier: the sidecar applies "
                "retention on both tiers (spec.checkpoint.keep); delete from the persistent tier's own manager")
        self._wait_pending()
        key = f"{self._key}/delete{self._tiers.next_ordinal()}"
        several = self._coord.process_count > 1
        if not self._is_primary:  # the primary decides and deletes: the others hear its outcome
            outcome = self._coord.fetch(f"{key}/deleted", self._options.barrier_timeout_seconds)
            if outcome != "ok":
                kind, _, message = outcome.partition(":")
                raise _DELETE_ERRORS.get(kind, SaveError)(message)
            return
        try:
            self._check_deletable(step)
            self._pruner.delete(step)
        except Exception as e:
            if several:
                kind = next((k for k, t in _DELETE_ERRORS.items() if type(e) is t), "failed")
                self._coord.publish(f"{key}/deleted", f"{kind}:{e}")
            raise
        if several:
            self._coord.publish(f"{key}/deleted", "ok")

    def _check_deletable(self, step: int) -> None:
        kept = commit.list_superseded(self._storage, self._root)
        if step in commit.read_bad(self._storage, self._root) or step in kept:
            raise ResilaxCkptError(
                f"{self._root}: step {step} is {'marked bad' if step not in kept else 'superseded by a rollback'}: "
                "Resilax keeps such steps and never deletes them (docs/checkpointing.md, 'Timelines')")
        steps = self._tiers.steps()
        if step not in steps:
            raise StepNotFoundError(
                f"{self._root}: no committed step {step} to delete; committed steps: "
                f"{', '.join(map(str, steps)) or 'none'} (folders Resilax did not write are never deleted)")

    def close(self) -> None:
        """Wait for the pending save (re-raising its failure), stop the thread, restore SIGTERM."""
        try:
            self._wait_pending()
        finally:
            self._executor.shutdown(wait=True)
            if self._compiler is not None:
                self._compiler.shutdown(wait=True)
            self._uninstall_sigterm()

    def install_sigterm(self) -> None:
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


_DELETE_ERRORS: dict[str, type[ResilaxCkptError]] = {"not_found": StepNotFoundError, "kept": ResilaxCkptError}
"""delete(): the primary's outcome, as the other processes raise it."""


def write_step_files(storage: Storage, backend: backends.ChunkBackend, work: str, plan: items_lib.SnapshotPlan,
                     create_metadata: bool, process_index: int) -> None:
    """Write this process's chunks (through the chunk backend) and small files of `plan` under `work`."""
    def progress(n: int) -> None:
        if n == len(plan.writes) // 2:
            commit.kill_point("mid_writes", process_index)

    backend.write(plan, work, create_metadata, progress)
    # The snapshot is written and dropped: its memory goes back to the OS on a thread of its own
    # (malloc_trim walks every arena: 0.05-0.35 s that the commit need not wait for).
    threading.Thread(target=backends.release_free_memory, name="resilax-trim", daemon=True).start()
    for parts, data in plan.files:
        storage.write_bytes(storage.join(work, *parts), data)
