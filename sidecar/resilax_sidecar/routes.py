"""The sidecar's HTTP API (aiohttp): JSON in and out, JSON errors, the job's token on mutating calls
(`Authorization: Bearer <token>`, or `X-Resilax-Token: <token>` through the API server's pod proxy).

| method | path | auth | answer |
|---|---|---|---|
| POST | /v1/save | token | 202 `{"id", "status": "pending"}` |
| GET | /v1/save/{id} | - | `{"id", "status": "pending"|"committed"|"failed", "step", "committed", "error"}` |
| GET | /v1/state | - | tiers, newest steps, upload in flight, last error, generation |
| GET | /healthz, /readyz | - | `{"status": ...}` (readyz 503 until ready) |
| GET | /metrics | - | Prometheus text format |
| GET | /v1/peer/{origin}/newest | token | `{"step", "save"}` of this host's newest local step (peers.py) |
| GET | /v1/peer/{origin}/{step}/manifest | token | the files of a local step or a held replica, with crc32c |
| GET | /v1/peer/{origin}/{step}/files/{path} | token | one file of it, streamed |
| POST | /v1/peer/fetch | token | `{"origin", "step", "sources"}`: fetch this process's step from peers into the local tier (cancelled when the caller disconnects) |
| GET | /v1/chunks/{step}/{folder}/{path}?save= | token | one file of what this node holds of a step: `local` or a replica `p<origin>` (peer_chunks.py) |
| POST | /v1/peer/fetch-chunks | token | `{"step", "save", "dest", "files"}`: fetch chunk files from the holders, checksummed, into `<local>/<dest>/` |
| POST | /v1/trainer/stop | token | `{"generation", "reason", "stacks"}`: stop an older trainer (trainer_control.py) |
| POST | /v1/trainer/start | token | `{"generation", "env"}`: start the generation's trainer once none lives |
| GET | /v1/trainer/ready | - | 200 while the current incarnation runs, else 503 (the trainer's readinessProbe) |
| POST | /v1/peers/lost | token | `{"generation", "processes"}`: the operator proved these processes lost (nodes down); a final upload stops waiting for their markers |
Errors: `{"error": {"code": "<slug>", "message": "..."}}` with the HTTP status; never a traceback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web
from resilax_ckpt import layout
from resilax_ckpt.control import trainer_control as tc

from resilax_sidecar import control, peer_chunks, peer_list, peers
from resilax_sidecar import trainer_control as trainer
from resilax_sidecar.api_base import (
    FETCH_BODY_CAP,
    SIDECAR_KEY,
    ApiError,
    json_body,
    json_errors,
    require_token,
)
from resilax_sidecar.errors import ConfigError
from resilax_sidecar.metrics import CONTENT_TYPE, SAVE_REASONS
from resilax_sidecar.peer_auth import credential_for

if TYPE_CHECKING:
    from resilax_sidecar.app import Sidecar

log = logging.getLogger(__name__)

async def post_save(request: web.Request) -> web.Response:
    require_token(request)
    sidecar = request.app[SIDECAR_KEY]
    body = await json_body(request)
    unknown = sorted(set(body) - {"reason", "stop"})
    reason = body.get("reason", "manual")
    stop = body.get("stop", False)
    problems = []
    if unknown:
        problems.append(f"unknown fields {unknown}; allowed: reason, stop")
    if reason not in SAVE_REASONS:
        problems.append(f"reason: {reason!r} is not one of {', '.join(SAVE_REASONS)}")
    if not isinstance(stop, bool):
        problems.append(f"stop: {stop!r} must be true or false")
    if problems:
        raise ApiError(400, "bad_request", "; ".join(problems))
    request_id = await sidecar.request_save(reason, stop)
    return web.json_response({"id": request_id, "status": "pending"}, status=202)


async def get_save(request: web.Request) -> web.Response:
    sidecar = request.app[SIDECAR_KEY]
    request_id = request.match_info["id"]
    if not control.valid_request_id(request_id):
        raise ApiError(400, "bad_request", f"{request_id!r} is not a save request id")
    outcome = await asyncio.to_thread(sidecar.save_outcome, request_id)
    if outcome is None:
        raise ApiError(404, "not_found", f"no save request {request_id!r}")
    return web.json_response(outcome)


async def get_state(request: web.Request) -> web.Response:
    sidecar = request.app[SIDECAR_KEY]
    return web.json_response(await sidecar.state_json())


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    sidecar = request.app[SIDECAR_KEY]
    problem = sidecar.readiness_problem()
    if problem:
        raise ApiError(503, "unavailable", problem)
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    sidecar = request.app[SIDECAR_KEY]
    body = sidecar.metrics.render()
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE
    return response


def _peer_target(request: web.Request) -> tuple[int, int | None]:
    """(origin, step) of a peer call, after the token check; 404 without a local tier."""
    require_token(request, peer=True)
    sidecar = request.app[SIDECAR_KEY]
    if sidecar.config.local_dir is None:
        raise ApiError(404, "not_found", "this sidecar has no local tier (RESILAX_LOCAL_DIR), so no peer replicas")
    origin, step = request.match_info["origin"], request.match_info.get("step")
    if not origin.isdigit() or (step is not None and not step.isdigit()):
        raise ApiError(400, "bad_request", f"origin {origin!r} and step {step!r} must be non-negative integers")
    return int(origin), None if step is None else int(step)


async def get_peer_newest(request: web.Request) -> web.Response:
    origin, _ = _peer_target(request)
    cfg = request.app[SIDECAR_KEY].config
    assert cfg.local_dir is not None
    if origin != cfg.process_id:
        raise ApiError(404, "not_found", f"this sidecar serves the newest step of process {cfg.process_id} only")
    uploader = request.app[SIDECAR_KEY].uploader  # its view: the steps not bad, on the current branch
    current = None if uploader is None else set(await asyncio.to_thread(uploader.view.scan_local))
    newest = await asyncio.to_thread(peers.newest_own_step, cfg.local_dir, cfg.process_id, current)
    if newest is None:
        return web.json_response({"step": None, "save": None})
    files = await asyncio.to_thread(peers.data_files, cfg.local_dir / layout.step_name(newest[0]))
    return web.json_response({"step": newest[0], "save": newest[1], "files": files})


async def _served_folder(request: web.Request) -> tuple[Any, int, int]:
    origin, step = _peer_target(request)
    assert step is not None
    cfg = request.app[SIDECAR_KEY].config
    assert cfg.local_dir is not None
    folder = await asyncio.to_thread(peers.served_folder, cfg.local_dir, cfg.process_id, origin, step)
    if folder is None:
        raise ApiError(404, "not_found", f"no committed step {step} of process {origin} on this host")
    return folder, origin, step


async def get_peer_manifest(request: web.Request) -> web.Response:
    folder, origin, step = await _served_folder(request)
    cfg = request.app[SIDECAR_KEY].config
    manifest = await asyncio.to_thread(peers.served_manifest, folder, cfg.process_id, origin, step)
    if manifest is None:
        raise ApiError(404, "not_found", f"step {step} of process {origin} went away while being read")
    return web.json_response(manifest)


async def get_peer_file(request: web.Request) -> web.StreamResponse:
    folder, _, _ = await _served_folder(request)
    path = peers.served_file(folder, request.match_info["path"])
    if path is None:
        raise ApiError(404, "not_found", f"{request.match_info['path']!r} is not a file of this step")
    purpose = "restore" if request.query.get("purpose") == "restore" else "replica"
    return _send_file(request, path, purpose)


def _send_file(request: web.Request, path: Any, purpose: str) -> web.StreamResponse:
    request.app[SIDECAR_KEY].metrics.peer_bytes.labels(purpose=purpose, direction="sent").inc(path.stat().st_size)
    return web.FileResponse(path, chunk_size=peers.CHUNK_BYTES)


async def get_chunk_file(request: web.Request) -> web.StreamResponse:
    require_token(request, peer=True)
    cfg = request.app[SIDECAR_KEY].config
    if cfg.local_dir is None:
        raise ApiError(404, "not_found", "this sidecar has no local tier (RESILAX_LOCAL_DIR)")
    step, folder, save = request.match_info["step"], request.match_info["folder"], request.query.get("save")
    if not step.isdigit() or save is None:
        raise ApiError(400, "bad_request", f"step {step!r} must be a non-negative integer and save= given")
    base = await asyncio.to_thread(peer_chunks.served_chunk_folder, cfg.local_dir, int(step), folder, save)
    path = None if base is None else peers.served_file(base, request.match_info["path"])
    if path is None:
        raise ApiError(404, "not_found", f"no file {request.match_info['path']!r} of step {step} (save {save!r}) "
                                         f"in {folder!r} on this node")
    return _send_file(request, path, "restore")


async def post_fetch_chunks(request: web.Request) -> web.Response:
    require_token(request)
    sidecar = request.app[SIDECAR_KEY]
    cfg = sidecar.config
    if cfg.local_dir is None:
        raise ApiError(404, "not_found", "this sidecar has no local tier (RESILAX_LOCAL_DIR)")
    body = await json_body(request, FETCH_BODY_CAP)
    problems = peer_chunks.check_request(body)
    if not problems:
        addresses = sorted({str(s["address"]) for f in body["files"] for s in f["sources"]})
        refused = await asyncio.to_thread(peer_list.refuse_sources, addresses, cfg.control_dir, sidecar.peer_generation())
        if refused is not None:
            problems.append(refused)
    if problems:
        raise ApiError(400, "bad_request", "; ".join(problems))
    received = sidecar.metrics.peer_bytes.labels(purpose="restore", direction="received")
    local_dir = cfg.local_dir
    answer = await _cancellable(request, f"chunk fetch of step {body['step']}", lambda cancel: peer_chunks.fetch_chunks(
        local_dir, body, credential_for(sidecar.read_token(), sidecar.peer_generation()),
        peers.Pacer(cfg.peer_bytes_per_second, sleep=cancel.wait, on_bytes=received.inc), cancel))
    return web.json_response(answer)


async def _cancellable(request: web.Request, what: str, work: Callable[[threading.Event], Any]) -> Any:
    """Run `work(cancel)` on a thread of its own (not the loop's default executor: a slow fetch never
    delays the threads that /v1/save and /v1/state wait in); `cancel` is set when the caller goes
    away (it timed out and closed the connection). 499 when cancelled, 409 on a PeerError."""
    cancel = threading.Event()
    own_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="peer-fetch")
    future = asyncio.get_running_loop().run_in_executor(own_thread, work, cancel)
    own_thread.shutdown(wait=False)
    try:
        while not (await asyncio.wait({future}, timeout=CALLER_CHECK_SECONDS))[0]:
            if caller_gone(request) and not cancel.is_set():
                cancel.set()
                log.warning("%s: its caller went away; cancelling it", what)
    except asyncio.CancelledError:
        cancel.set()
        raise
    try:
        return future.result()
    except peers.FetchCancelled as e:
        log.info("%s cancelled, nothing installed: %s", what, e)
        raise ApiError(499, "cancelled", str(e)) from e
    except peers.PeerError as e:
        raise ApiError(409, "peer_failed", str(e)) from e


async def post_peer_fetch(request: web.Request) -> web.Response:
    require_token(request)
    sidecar = request.app[SIDECAR_KEY]
    cfg = sidecar.config
    if cfg.local_dir is None:
        raise ApiError(404, "not_found", "this sidecar has no local tier (RESILAX_LOCAL_DIR)")
    body = await json_body(request)
    step, sources = body.get("step"), body.get("sources")
    problems = []
    if body.get("origin") != cfg.process_id:
        problems.append(f"origin: {body.get('origin')!r} must be this sidecar's process {cfg.process_id}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        problems.append(f"step: {step!r} must be a non-negative integer")
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) and s for s in sources):
        problems.append(f"sources: {sources!r} must be a non-empty list of 'host:port'")
    if not problems:
        refused = await asyncio.to_thread(peer_list.refuse_sources, list(sources or []), cfg.control_dir,
                                          sidecar.peer_generation())
        if refused is not None:
            problems.append(refused)
    if problems:
        raise ApiError(400, "bad_request", "; ".join(problems))
    assert isinstance(step, int) and isinstance(sources, list)
    received = sidecar.metrics.peer_bytes.labels(purpose="restore", direction="received")
    local_dir = cfg.local_dir
    source, manifest = await _cancellable(request, f"peer fetch of step {step}", lambda cancel: peers.fetch_for_restore(
        local_dir, cfg.process_id, step, sources, credential_for(sidecar.read_token(), sidecar.peer_generation()),
        peers.Pacer(cfg.peer_bytes_per_second, sleep=cancel.wait, on_bytes=received.inc), cancel))
    return web.json_response({"origin": cfg.process_id, "step": step, "source": source,
                              "files": len(manifest["files"]),
                              "bytes": sum(int(f["size"]) for f in manifest["files"])})


async def _trainer_call(request: web.Request) -> tuple[Sidecar, dict[str, Any], str]:
    """Token, body, and 409 `not_supervised` when no supervisor runs the trainer."""
    require_token(request)
    sidecar = request.app[SIDECAR_KEY]
    body = await json_body(request)
    control_dir = str(sidecar.config.control_dir)
    if await asyncio.to_thread(tc.read_incarnation, control_dir) is None:
        raise ApiError(409, "not_supervised", "this pod's trainer does not run under `resilax run` "
                       f"(no {tc.INCARNATION_FILE} in RESILAX_CONTROL_DIR): it cannot be stopped or started in place")
    return sidecar, body, control_dir


def _parsed(parse: Callable[[object, str], Any], body: dict[str, Any], allowed: set[str]) -> Any:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, "bad_request", f"unknown fields {unknown}; allowed: {', '.join(sorted(allowed))}")
    try:
        return parse(body, "body")
    except tc.InvalidControlFileError as e:
        raise ApiError(400, "bad_request", str(e)) from e


def _answer(verdict: trainer.Verdict, body: dict[str, Any]) -> web.Response:
    if verdict.code is not None:
        raise ApiError(verdict.status, verdict.code, verdict.message)
    return web.json_response(body, status=verdict.status)


async def post_trainer_stop(request: web.Request) -> web.Response:
    _sidecar, body, control_dir = await _trainer_call(request)
    stop: tc.StopRequest = _parsed(tc.parse_stop, body, {"generation", "reason", "stacks"})
    verdict = trainer.decide_stop(await asyncio.to_thread(tc.read_stop, control_dir), stop)
    if verdict.write:
        await asyncio.to_thread(tc.write_json, control_dir, tc.STOP_FILE, stop.to_json())
        log.info("trainer stop asked for generation %d (%s, stacks %s)", stop.generation, stop.reason, stop.stacks)
    return _answer(verdict, {"generation": stop.generation, "status": "stopping",
                             "trainer_process": await asyncio.to_thread(tc.read_incarnation, control_dir)})


async def post_trainer_start(request: web.Request) -> web.Response:
    sidecar, body, control_dir = await _trainer_call(request)
    assignment: tc.Assignment = _parsed(tc.parse_assignment, body, {"generation", "env"})
    refused = trainer.refuse_start_env(assignment.env)
    if refused is not None:
        log.warning("refused a trainer start from %s: %s", request.remote, refused)
        raise ApiError(400, "bad_request", refused)
    verdict = trainer.decide_start(await asyncio.to_thread(tc.read_assignment, control_dir), assignment)
    if verdict.write:
        try:
            sidecar.config.with_generation_env(assignment.env)  # refuse bad values before the trainer sees them
        except ConfigError as e:
            raise ApiError(400, "bad_request", "; ".join(e.problems)) from e
        await asyncio.to_thread(sidecar.withdraw_stale_stops, assignment.generation)  # before the trainer starts
        await asyncio.to_thread(tc.write_json, control_dir, tc.ASSIGNMENT_FILE, assignment.to_json())
        sidecar.apply_assignment(assignment)
        log.info("trainer start asked for generation %d", assignment.generation)
    return _answer(verdict, {"generation": assignment.generation, "status": "starting",
                             "trainer_process": await asyncio.to_thread(tc.read_incarnation, control_dir)})


#: The most processes one `POST /v1/peers/lost` names.
MAX_LOST_PROCESSES = 4096


def parse_lost_peers(body: Mapping[str, Any]) -> tuple[int, list[int]]:
    """`{"generation": G >= 1, "processes": [i >= 0, ...]}` (1 to MAX_LOST_PROCESSES of them) -> (G,
    the processes sorted); ApiError 400 naming the field, the value and what is allowed."""
    problems = []
    unknown = sorted(set(body) - {"generation", "processes"})
    if unknown:
        problems.append(f"unknown fields {unknown}; allowed: generation, processes")
    generation = body.get("generation")
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 1:
        problems.append(f"generation: {generation!r} must be an integer >= 1 (the generation the processes ran in)")
    processes = body.get("processes")
    if not isinstance(processes, list) or not 1 <= len(processes) <= MAX_LOST_PROCESSES or not all(
            isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in processes):
        shown = repr(processes)
        problems.append(f"processes: {shown[:80] + '...' if len(shown) > 80 else shown} must be a list of 1 to "
                        f"{MAX_LOST_PROCESSES} process indices (integers >= 0)")
    if problems:
        raise ApiError(400, "bad_request", "; ".join(problems))
    assert isinstance(generation, int) and isinstance(processes, list)
    return generation, sorted(set(processes))


async def post_peers_lost(request: web.Request) -> web.Response:
    require_token(request)
    sidecar = request.app[SIDECAR_KEY]
    generation, processes = parse_lost_peers(await json_body(request))
    known = sidecar.note_lost_peers(generation, processes)
    return web.json_response({"generation": generation, "processes": sorted(known)})


async def get_trainer_ready(request: web.Request) -> web.Response:
    control_dir = str(request.app[SIDECAR_KEY].config.control_dir)
    incarnation = await asyncio.to_thread(tc.read_incarnation, control_dir)
    ready, why = trainer.trainer_ready(incarnation, await asyncio.to_thread(tc.read_stop, control_dir))
    if not ready:
        raise ApiError(503, "unavailable", why)
    return web.json_response({"status": "ready", "trainer_process": incarnation})


CALLER_CHECK_SECONDS = 0.2
"""How often a long request (a peer fetch) checks that its caller is still connected."""


def caller_gone(request: web.Request) -> bool:
    """Whether the client of `request` closed its connection (aiohttp drops the transport)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def build_app(sidecar: Sidecar) -> web.Application:
    """The aiohttp application for one sidecar."""
    app = web.Application(middlewares=[json_errors], client_max_size=FETCH_BODY_CAP)  # a fetch-chunks body lists files
    app[SIDECAR_KEY] = sidecar
    app.router.add_post("/v1/save", post_save)
    app.router.add_get("/v1/save/{id}", get_save)
    app.router.add_get("/v1/state", get_state)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/peer/{origin}/newest", get_peer_newest)
    app.router.add_get("/v1/peer/{origin}/{step}/manifest", get_peer_manifest)
    app.router.add_get("/v1/peer/{origin}/{step}/files/{path:.+}", get_peer_file)
    app.router.add_post("/v1/peer/fetch", post_peer_fetch)
    app.router.add_post("/v1/peer/fetch-chunks", post_fetch_chunks)
    app.router.add_get("/v1/chunks/{step}/{folder}/{path:.+}", get_chunk_file)
    app.router.add_post("/v1/trainer/stop", post_trainer_stop)
    app.router.add_post("/v1/trainer/start", post_trainer_start)
    app.router.add_get("/v1/trainer/ready", get_trainer_ready)
    app.router.add_post("/v1/peers/lost", post_peers_lost)
    return app
