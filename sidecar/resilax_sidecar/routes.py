"""The sidecar's HTTP API (aiohttp): JSON in and out, JSON errors, bearer token on mutating calls.

| method | path | auth | answer |
|---|---|---|---|
| POST | /v1/save | token | 202 `{"id", "status": "pending"}` |
| GET | /v1/save/{id} | - | `{"id", "status": "pending"|"committed"|"failed", "step", "committed", "error"}` |
| GET | /v1/state | - | tiers, newest steps, upload in flight, last error, generation |
| GET | /healthz, /readyz | - | `{"status": ...}` (readyz 503 until ready) |
| GET | /metrics | - | Prometheus text format |
Errors: `{"error": {"code": "<slug>", "message": "..."}}` with the HTTP status; never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from resilax_sidecar import control
from resilax_sidecar.errors import SidecarError
from resilax_sidecar.metrics import CONTENT_TYPE, SAVE_REASONS

if TYPE_CHECKING:
    from resilax_sidecar.app import Sidecar

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SIDECAR_KEY: web.AppKey[Sidecar] = web.AppKey("sidecar")

_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "request_too_large",
    415: "unsupported_media_type",
    503: "unavailable",
}


class ApiError(SidecarError):
    """An error answer with a stable code; raised by handlers, rendered by the middleware."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status, headers=headers)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as JSON: our ApiErrors, aiohttp's own (404, 405, ...), and crashes (500,
    logged here with the traceback, answered without it)."""
    try:
        return await handler(request)
    except ApiError as e:
        return error_response(e.status, e.code, e.message, e.headers)
    except web.HTTPException as e:
        if e.status_code < 400:
            raise
        code = _STATUS_CODES.get(e.status_code, "http_error")
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        return error_response(e.status_code, code, e.reason or code, headers or None)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, "internal", "internal error; see the sidecar's log")


def _require_token(request: web.Request) -> None:
    """Constant-time bearer check against the token file; 401 without a token, 403 with a wrong one.
    Never logs the token."""
    sidecar = request.app[SIDECAR_KEY]
    header = request.headers.get("Authorization", "")
    scheme, _, provided = header.partition(" ")
    if not header or scheme.lower() != "bearer" or not provided.strip():
        sidecar.metrics.http_unauthorized.inc()
        raise ApiError(
            401,
            "unauthorized",
            "this call needs 'Authorization: Bearer <token>' (the token in RESILAX_SIDECAR_TOKEN_FILE)",
            headers={"WWW-Authenticate": 'Bearer realm="resilax-sidecar"'},
        )
    expected = sidecar.read_token()
    if expected is None:
        sidecar.metrics.http_unauthorized.inc()
        raise ApiError(
            403,
            "forbidden",
            "mutating calls are disabled: RESILAX_SIDECAR_TOKEN_FILE is not set or not readable",
        )
    if not hmac.compare_digest(provided.strip().encode(), expected.encode()):
        sidecar.metrics.http_unauthorized.inc()
        log.warning("refused %s %s from %s: wrong token", request.method, request.path, request.remote)
        raise ApiError(403, "forbidden", "the bearer token is not the one this sidecar accepts")


async def _json_body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    if request.content_length is not None and request.content_length > 64 * 1024:
        raise ApiError(413, "request_too_large", "the body must be under 64 KiB")
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(400, "bad_request", f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, "bad_request", f"the body must be a JSON object, not {type(body).__name__}")
    return body


async def post_save(request: web.Request) -> web.Response:
    _require_token(request)
    sidecar = request.app[SIDECAR_KEY]
    body = await _json_body(request)
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


def build_app(sidecar: Sidecar) -> web.Application:
    """The aiohttp application for one sidecar."""
    app = web.Application(middlewares=[json_errors], client_max_size=64 * 1024)
    app[SIDECAR_KEY] = sidecar
    app.router.add_post("/v1/save", post_save)
    app.router.add_get("/v1/save/{id}", get_save)
    app.router.add_get("/v1/state", get_state)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    return app
