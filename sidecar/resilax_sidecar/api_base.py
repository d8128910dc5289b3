"""The common parts of the sidecar's HTTP API (the handlers are in routes.py): the application key,
errors as JSON with a stable code (never a traceback), the job's token on mutating calls (a
constant-time check; never logged) and JSON bodies read within a bound."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from resilax_sidecar.errors import SidecarError
from resilax_sidecar.peer_auth import accepts_peer_credential

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


#: The sidecar's own token header, accepted beside `Authorization: Bearer <token>`: the API server's pod
#: proxy removes `Authorization` from a request once it has authenticated the caller with it, so a call
#: through `pods/proxy` (`kubectl resilax save`) carries the token here. Same name as the operator's
#: resilax_operator.api.SIDECAR_TOKEN_HEADER.
TOKEN_HEADER = "X-Resilax-Token"


def presented_token(headers: Mapping[str, str]) -> str | None:
    """The token a request presents: `Authorization: Bearer <token>`, else the X-Resilax-Token header;
    None without one (a malformed Authorization counts as none)."""
    scheme, _, bearer = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and bearer.strip():
        return bearer.strip()
    own = headers.get(TOKEN_HEADER, "").strip()
    return own or None


def require_token(request: web.Request, peer: bool = False) -> None:
    """Constant-time check of the presented token (presented_token) against the token file; 401 without
    a token, 403 with a wrong one. Never logs the token. `peer`: a read-only peer endpoint, which also
    takes the peer credential of this sidecar's generation (peer_auth.py)."""
    sidecar = request.app[SIDECAR_KEY]
    provided = presented_token(request.headers)
    if provided is None:
        sidecar.metrics.http_unauthorized.inc()
        raise ApiError(
            401,
            "unauthorized",
            f"this call needs 'Authorization: Bearer <token>' or '{TOKEN_HEADER}: <token>' "
            "(the token in RESILAX_SIDECAR_TOKEN_FILE)",
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
    if peer and accepts_peer_credential(provided, expected, sidecar.peer_generation()):
        return
    if not hmac.compare_digest(provided.encode(), expected.encode()):
        sidecar.metrics.http_unauthorized.inc()
        log.warning("refused %s %s from %s: wrong token", request.method, request.path, request.remote)
        raise ApiError(403, "forbidden", "the token is not the one this sidecar accepts")


BODY_CAP = 64 * 1024
"""The most bytes of a request body read (a fetch-chunks body, which lists files: FETCH_BODY_CAP)."""
FETCH_BODY_CAP = 16 << 20


async def json_body(request: web.Request, cap: int = BODY_CAP) -> dict[str, Any]:
    """The request's JSON object, read up to `cap` bytes whether its length is announced or it comes
    chunked (413 beyond: never read further)."""
    if not request.can_read_body:
        return {}
    too_large = ApiError(413, "request_too_large", f"the body must be at most {cap} bytes")
    if request.content_length is not None and request.content_length > cap:
        raise too_large
    raw = await request.content.read(cap + 1)
    while len(raw) <= cap and not request.content.at_eof():
        piece = await request.content.read(cap + 1 - len(raw))
        if not piece:
            break
        raw += piece
    if len(raw) > cap:
        raise too_large
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise ApiError(400, "bad_request", f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, "bad_request", f"the body must be a JSON object, not {type(body).__name__}")
    return body
