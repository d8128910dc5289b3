"""`resilax sidecar`: the checkpoint sidecar of a worker pod.

It runs three things side by side until SIGTERM:
1. the HTTP API (routes.py) on RESILAX_SIDECAR_HOST:RESILAX_SIDECAR_PORT;
2. the uploader (uploader.py) on a background thread, when RESILAX_LOCAL_DIR is set, and the peer
   replicator (peers.py) on another, keeping copies of the peers' newest local steps;
3. a watcher of the save requests it made, which times them (request -> committed) and wakes the
   uploader when a save lands.
On SIGTERM it asks the trainer for a final save with `stop: true`, waits until that save is committed
(and, with a local tier, uploaded and committed in the persistent tier) or RESILAX_SIDECAR_GRACE_SECONDS
run out, then exits 0; in a pod whose health check failed (its `health.json`) and where no trainer
announced itself, it asks nothing and exits at once (no trainer ever ran there). The upload's wait also
ends once it can never succeed: a process of the step's generation that the operator said is lost
(`POST /v1/peers/lost`) has no upload marker in it (shutdown.py). SIGINT exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

from aiohttp import web
from resilax_ckpt.control import trainer_control as tc
from resilax_ckpt.control.health_verdict import read_verdict
from resilax_ckpt.control.requests import read_restore_report
from resilax_ckpt.control.trainer_metrics import read_trainer_figures

from resilax_sidecar import control, node_sweep, shutdown
from resilax_sidecar.config import SidecarConfig, log_level_number
from resilax_sidecar.direct_view import DirectView
from resilax_sidecar.errors import ConfigError
from resilax_sidecar.last_words import build_last_words, write_last_words
from resilax_sidecar.log_format import configure_logging
from resilax_sidecar.metrics import CompileCacheLog, SidecarMetrics
from resilax_sidecar.peers import Replicator
from resilax_sidecar.routes import build_app
from resilax_sidecar.store import BlobStore, open_store
from resilax_sidecar.uploader import Uploader

log = logging.getLogger(__name__)

_WATCH_SECONDS = 0.2


class Sidecar:
    """The running sidecar's state, shared by the HTTP handlers, the watcher and the shutdown."""

    def __init__(self, config: SidecarConfig, metrics: SidecarMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or SidecarMetrics()
        self.metrics.export_trainer(str(config.control_dir))
        self.compile_cache_log = CompileCacheLog()
        self.store: BlobStore | None = None
        self.uploader: Uploader | None = None
        self.storage_error: str | None = None
        self.storage_ready = threading.Event()
        """Set once the persistent tier is open (or there is none). Opening imports gcsfs and
        tensorstore, which takes many seconds on a busy node: the API serves meanwhile."""
        self._urgent = False
        self.pending: dict[str, tuple[float, str, bool]] = {}
        """Requests made by this sidecar and not answered yet: id -> (monotonic start, reason, stop)."""
        self.stopping = False
        self.final_request: str | None = None
        self.last_stop_request: str | None = None
        """The newest request with `stop` this sidecar made."""
        self.lost_peers: dict[int, frozenset[int]] = {}
        """generation -> its processes the operator proved lost (`note_lost_peers`)."""
        self._direct_view = DirectView()
        self._uploader_stop = threading.Event()
        self._uploader_thread: threading.Thread | None = None
        self._config_lock = threading.Lock()

    # ---- token -------------------------------------------------------------------------------------

    def read_token(self) -> str | None:
        """The accepted token, read fresh (a rotated Secret applies at once); None when unavailable."""
        if self.config.token_file is None:
            return None
        try:
            token = self.config.token_file.read_text().strip()
        except OSError as e:
            log.error("cannot read RESILAX_SIDECAR_TOKEN_FILE=%s: %s", self.config.token_file, e)
            return None
        return token or None

    # ---- peers the operator proved lost -----------------------------------------------------------

    def note_lost_peers(self, generation: int, processes: Collection[int]) -> frozenset[int]:
        """The operator proved these processes of `generation` lost (their nodes down or gone, as it
        deletes this pod: `POST /v1/peers/lost`): a final save's upload that waits for their markers
        ends at once (`shutdown.wait_persisted`). Kept for the sidecar's life; every process of `generation`
        said lost so far."""
        known = self.lost_peers.get(generation, frozenset()) | frozenset(processes)
        if known != self.lost_peers.get(generation):
            log.info("the operator says processes %s of generation %d are lost (their nodes are down): a final "
                     "upload no longer waits for them", sorted(known), generation)
        self.lost_peers[generation] = known
        return known

    # ---- save requests -------------------------------------------------------------------------

    async def request_save(self, reason: str, stop: bool) -> str:
        """Drop a request file for the trainer; returns its id."""
        request_id = control.new_request_id(reason)
        await asyncio.to_thread(control.write_request, self.config.control_dir, request_id, reason, stop)
        self.pending[request_id] = (time.monotonic(), reason, stop)
        if stop:
            self.last_stop_request = request_id
            self.make_urgent()
        self.metrics.save_requests.labels(reason=reason).inc()
        log.info("save requested: id=%s reason=%s stop=%s", request_id, reason, stop)
        return request_id

    def withdraw_stale_stops(self, generation: int) -> list[str]:
        """Before generation `generation`'s trainer starts in this pod: withdraw the stop requests its
        predecessor never answered. The operator asks every worker for the final save at once; the
        trainers agree on the first request any of them sees and stop, so a request that landed after
        its trainer's last poll stays pending, and the next generation's trainer (a fresh process, or a
        kept one) would take it for its own stop (goodput seed 2, 2026-12-07: a whole generation lost
        to it 20 s after an in-place restart). A plain save request stays: any generation may serve it."""
        stale = [rid for rid, (_, _, stop) in self.pending.items()
                 if stop and control.read_result(self.config.control_dir, rid) is None]
        for request_id in stale:
            control.withdraw_request(self.config.control_dir, request_id)
            del self.pending[request_id]
            log.info("save request %s withdrawn: unanswered by the trainer before generation %d", request_id,
                     generation)
        if self.last_stop_request in stale:
            self.last_stop_request = None
        return stale

    def save_outcome(self, request_id: str) -> dict[str, Any] | None:
        """The outcome of a request: its result, `pending`, or None when unknown."""
        result = control.read_result(self.config.control_dir, request_id)
        if result is not None:
            status = "committed" if result.committed else "failed"
            return {"status": status, **result.to_json(), "persisted": self._persisted(result)}
        if request_id in self.pending or control.request_pending(self.config.control_dir, request_id):
            return {
                "id": request_id,
                "status": "pending",
                "step": None,
                "committed": False,
                "error": None,
                "persisted": False,
            }
        return None

    def _persisted(self, result: control.SaveResult) -> bool:
        """Whether the saved step is in the persistent tier: at once without a local tier; with one,
        once the uploader has it committed there."""
        if not result.committed or result.step is None:
            return False
        if not self.config.uploads:
            return True
        return self.uploader is not None and self.uploader.is_persisted(result.step)

    async def watch_requests(self) -> None:
        """Time each pending request until its result appears; wake the uploader when one commits."""
        while True:
            await asyncio.sleep(_WATCH_SECONDS)
            for request_id, (started, reason, _stop) in list(self.pending.items()):
                result = control.read_result(self.config.control_dir, request_id)
                if result is None:
                    continue
                del self.pending[request_id]
                seconds = time.monotonic() - started
                if result.committed:
                    self.metrics.save_request_seconds.observe(seconds)
                    log.info("save %s (%s) committed step %s after %.2f s", request_id, reason, result.step, seconds)
                    if self.uploader is not None:
                        if result.step is not None:
                            self.uploader.requested_steps.add(result.step)
                        self.uploader.wake()
                else:
                    log.warning("save %s (%s) failed after %.2f s: %s", request_id, reason, seconds, result.error)

    # ---- in-place restarts (trainer_control.py) ----------------------------------------------------

    def apply_assignment(self, assignment: tc.Assignment | None = None) -> None:
        """Take the generation-dependent settings of the newest assignment (given, or `assignment.json`)
        when it is newer than the settings' generation: `/v1/state`, the uploader's duties and the peer
        calls then speak for the new generation. Raises ConfigError for bad values (checked first)."""
        if assignment is None:
            assignment = tc.read_assignment(str(self.config.control_dir))
        if assignment is None or assignment.generation <= self.config.generation:
            return
        config = self.config.with_generation_env({**assignment.env, "RESILAX_GENERATION": str(assignment.generation)})
        with self._config_lock:  # against the uploader being created meanwhile (open_storage)
            self.config = config
            if self.uploader is not None:
                self.uploader.set_config(config)
        log.info("assignment of generation %d: now %s", assignment.generation, config.describe())

    # ---- state ---------------------------------------------------------------------------------

    def _newest_persisted(self) -> int | None:
        """Without an uploader: the persistent tier's newest visible committed step (direct_view.py)."""
        if self.store is None:
            return None
        saves = (read_trainer_figures(str(self.config.control_dir)) or {}).get("saves")
        return self._direct_view.look(self.store, time.monotonic(), saves, self.stopping, self.config.poll_seconds)

    async def state_json(self) -> dict[str, Any]:
        cfg = self.config
        state: dict[str, Any] = {
            "process_id": cfg.process_id,
            "num_processes": cfg.num_processes,
            "generation": cfg.generation,
            "local_tier": cfg.local_dir is not None,
            "persistent_tier": cfg.checkpoint_dir,
            "stopping": self.stopping,
            "pending_requests": sorted(self.pending),
            # What the trainer's last restore did: {"step", "skipped": [{"step", "reason"}], "generation",
            # "source"} or None.
            "restore": read_restore_report(str(cfg.control_dir)),
            # The trainer's figures (resilax_ckpt.control.trainer_metrics): its step, step rate, save/restore times.
            "trainer": (trainer := read_trainer_figures(str(cfg.control_dir))),
            # Peer replicas this host keeps: origin process -> step, and the last replication error.
            "peer_replicas": {str(p): s for p, s in sorted(self.replicator.held.items())} if self.replicator else {},
            "peer_last_error": self.replicator.last_error if self.replicator else None,
            # The supervisor's incarnation.json (None: no supervisor) and the newest start asked.
            "trainer_process": tc.read_incarnation(str(cfg.control_dir)),
            "assignment": {"generation": a.generation} if (a := tc.read_assignment(str(cfg.control_dir))) else None,
            # The pod's health check (its health.json: {"passed", "failed_part", "reason"}), None: none ran.
            "health_check": v.to_json() if (v := read_verdict(str(cfg.control_dir))) else None,
        }
        self.compile_cache_log.note(trainer)
        if self.uploader is not None:
            state.update(self.uploader.state.to_json())
        else:
            state.update(
                {
                    "newest_local_step": None,
                    "upload_in_flight": None,
                    "last_error": None,
                    "last_error_time": None,
                }
            )
            try:
                state["newest_persisted_step"] = await asyncio.to_thread(self._newest_persisted)
                state["branch"] = self._direct_view.branch
            except OSError as e:
                state["newest_persisted_step"] = state["branch"] = None
                state["last_error"] = str(e)
        return state

    def readiness_problem(self) -> str | None:
        """Why the sidecar is not ready, or None."""
        if self.stopping:
            return "stopping: waiting for the final save"
        if not self.storage_ready.is_set():
            return self.storage_error or f"opening the persistent tier {self.config.checkpoint_dir}"
        if not self.config.control_dir.is_dir():
            return f"RESILAX_CONTROL_DIR={self.config.control_dir} is not a folder"
        return None

    # ---- the persistent tier and the uploader thread ------------------------------------------------

    def make_urgent(self) -> None:
        """A final save is coming: newer local steps supersede an upload in flight."""
        self._urgent = True
        if self.uploader is not None:
            self.uploader.urgent.set()

    def open_storage(self) -> None:
        """Open the persistent tier (retrying with back-off), then start the uploader. Blocking: runs
        on its own daemon thread."""
        cfg = self.config
        if cfg.checkpoint_dir is None:
            self.storage_ready.set()
            return
        delay = cfg.retry_initial_seconds
        while not self._uploader_stop.is_set():
            try:
                self.store = open_store(cfg.checkpoint_dir)
                break
            except Exception as e:  # bad credentials, no network: keep serving, keep trying
                self.storage_error = f"opening RESILAX_CHECKPOINT_DIR={cfg.checkpoint_dir}: {type(e).__name__}: {e}"
                log.error("%s; retrying in %.0f s", self.storage_error, delay)
                self._uploader_stop.wait(delay)
                delay = min(delay * 2, cfg.retry_max_seconds)
        else:
            return
        self.storage_error = None
        if cfg.uploads:
            with self._config_lock:
                self.uploader = Uploader(self.config, self.store, self.metrics)  # an assignment's, if one came
            if self._urgent:
                self.uploader.urgent.set()
            self._uploader_thread = threading.Thread(
                target=self.uploader.run_forever, args=(self._uploader_stop,), name="uploader", daemon=True
            )
            self._uploader_thread.start()
        self.storage_ready.set()
        log.info("persistent tier %s open%s", cfg.checkpoint_dir, "; uploader started" if cfg.uploads else "")

    def start_uploader(self) -> None:
        threading.Thread(target=self.open_storage, name="open-storage", daemon=True).start()
        cfg = self.config
        if cfg.local_dir is not None and cfg.job is not None:
            # Marks the node folder as this job's, for the node sweep once the job is deleted.
            try:
                node_sweep.write_owner_marker(cfg.local_dir, *cfg.job)
            except OSError as e:
                log.warning("local tier %s: cannot write its ownership marker (%s); the node sweep will "
                            "keep the folder after the job is deleted", cfg.local_dir, e)
        if cfg.local_dir is not None and cfg.peer_replicas:
            self.replicator = Replicator(cfg.local_dir, cfg.control_dir, self.read_token,
                                         cfg.peer_bytes_per_second, cfg.poll_seconds,
                                         self.metrics.peer_bytes.labels(purpose="replica", direction="received").inc,
                                         generation=self.peer_generation)
            threading.Thread(target=self.replicator.run_forever, args=(self._uploader_stop,),
                             name="peer-replicator", daemon=True).start()

    replicator: Replicator | None = None

    def peer_generation(self) -> int:
        """The generation whose peers this pod may call (peer_list.current_peers): its own, or the newer one a
        stop already asked for (the old generation's peers are then on their way out)."""
        stop = tc.read_stop(str(self.config.control_dir))
        return max(self.config.generation, stop.generation if stop is not None else 0)

    def stop_uploader(self) -> None:
        self._uploader_stop.set()
        if self.uploader is not None:
            self.uploader.wake()

    # ---- SIGTERM -----------------------------------------------------------------------------------

    async def leave_last_words(self) -> None:
        """What the operator should still know once this container is gone, as its termination message:
        the trainer's last figures, the newest steps, the final save's outcome (last_words.py)."""
        path = self.config.termination_log
        if path is None:
            return
        try:
            state = await self.state_json()
        except Exception as e:  # best effort: the final save must go on whatever failed here
            log.warning("last words without the state: %s", e)
            state = {}
        request = self.final_request or self.last_stop_request
        try:
            outcome = await asyncio.to_thread(self.save_outcome, request) if request else None
        except Exception as e:  # as above
            log.warning("last words without the final save: %s", e)
            outcome = None
        await asyncio.to_thread(write_last_words, path, build_last_words(state, outcome))

    async def final_save(self) -> bool:
        """Ask for a save with stop, wait for its commit (and its upload) within the grace period
        (shutdown.final_save). True when the final step is durable in the tier that matters."""
        return await shutdown.final_save(self)


async def serve(config: SidecarConfig, ready: asyncio.Event | None = None) -> int:
    """Run the sidecar until SIGTERM (final save) or SIGINT (at once); the exit code."""
    sidecar = Sidecar(config)
    config.control_dir.mkdir(parents=True, exist_ok=True)
    try:
        sidecar.apply_assignment()  # a restarted sidecar of a pod kept by an in-place restart
    except ConfigError as e:
        log.error("ignoring assignment.json: %s", e)
    app = build_app(sidecar)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        log.error(
            "cannot listen on RESILAX_SIDECAR_HOST=%s RESILAX_SIDECAR_PORT=%d: %s", config.host, config.port, e
        )
        return 1
    addresses = [f"{a[0]}:{a[1]}" for a in runner.addresses if isinstance(a, tuple)]
    log.info("resilax sidecar listening on %s; %s", ", ".join(addresses), config.describe())
    sidecar.start_uploader()
    watcher = asyncio.create_task(sidecar.watch_requests())
    loop = asyncio.get_running_loop()
    terminate = asyncio.Event()
    interrupt = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, terminate.set)
    loop.add_signal_handler(signal.SIGINT, interrupt.set)
    if ready is not None:
        ready.set()
    waits = [asyncio.create_task(terminate.wait()), asyncio.create_task(interrupt.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    if terminate.is_set() and not interrupt.is_set():
        await sidecar.leave_last_words()  # in case the grace runs out (SIGKILL) while it waits
        final = asyncio.create_task(sidecar.final_save())
        stop_waiting = asyncio.create_task(interrupt.wait())
        await asyncio.wait([final, stop_waiting], return_when=asyncio.FIRST_COMPLETED)
        stop_waiting.cancel()
        if not final.done():
            final.cancel()
    await sidecar.leave_last_words()
    sidecar.stop_uploader()
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    await runner.cleanup()
    log.info("resilax sidecar exiting")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `resilax sidecar`. Settings come from the environment (docs/sidecar.md)."""
    parser = argparse.ArgumentParser(
        prog="resilax sidecar",
        description="The checkpoint sidecar of a worker pod; configured by RESILAX_* variables (docs/sidecar.md).",
    )
    parser.add_argument(
        "--check-config", action="store_true", help="validate the environment, print the settings and exit"
    )
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        config = SidecarConfig.from_env()
    except ConfigError as e:
        print(f"resilax sidecar: {e}", file=sys.stderr)
        return 2
    configure_logging(log_level_number(config.log_level), config.log_format)
    if args.check_config:
        print(config.describe())
        return 0
    return asyncio.run(serve(config))
