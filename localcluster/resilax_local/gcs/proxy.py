"""A small HTTP proxy in front of fake-gcs-server (server.py) for tests: it counts the JSON-API requests
clients make (what GCS bills) and can lose the answer to chosen requests after forwarding them, as a
dropped connection or a gateway's 503 does, so the client retries a request the store already carried out.

    proxy = GcsProxy(gcs.url)
    os.environ.update(STORAGE_EMULATOR_HOST=proxy.url, TENSORSTORE_GCS_HTTP_URL=proxy.url)
    proxy.lose_answer_once(lambda r: r.method == "POST" and b'/_COMMIT"' in r.body)
    ...
    proxy.counts["list"], proxy.listed      # LISTs of a bucket's objects, and their prefixes
"""

from __future__ import annotations

import http.client
import http.server
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProxiedRequest:
    method: str
    path: str
    query: dict[str, list[str]]
    body: bytes
    """The request's body (an upload's object name is in it: gcsfs sends uploads as multipart)."""


Match = Callable[[ProxiedRequest], bool]
"""Whether a rule applies to a request."""


def request_kind(method: str, path: str) -> str:
    """The kind a request is counted as: `list` for a GET of a bucket's object collection
    (`/storage/v1/b/<bucket>/o`, a class A operation), else the method in lower case."""
    return "list" if method == "GET" and path.rstrip("/").endswith("/o") else method.lower()


class GcsProxy:
    """Forwards every request to `upstream` (one request per connection) and counts them by
    `request_kind`; `listed` holds every LIST's `prefix`. `lose_answer_once(match)`: the next request
    that matches is forwarded and carried out, then answered 503 (gcsfs and tensorstore retry it)."""

    def __init__(self, upstream: str) -> None:
        target = urllib.parse.urlsplit(upstream)
        self.counts: Counter[str] = Counter()
        self.listed: list[str] = []
        self.lost: list[str] = []
        """The requests whose answer was lost (method and path)."""
        self._lose: list[Match] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # one request per connection: none left open at shutdown

            def forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                split = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(split.query)
                lose = proxy._take_rule(ProxiedRequest(self.command, split.path, query, body or b""))
                conn = http.client.HTTPConnection(target.hostname or "127.0.0.1", target.port, timeout=60)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                    conn.request(self.command, self.path, body=body, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                    if lose:
                        self.send_response(503)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(response.status)
                    for key, value in response.getheaders():
                        if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                            self.send_header(key, value)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on this connection; nothing to answer
                finally:
                    conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = forward

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _take_rule(self, request: ProxiedRequest) -> bool:
        """Count the request; whether its answer is to be lost (a matching rule, used up)."""
        kind = request_kind(request.method, request.path)
        with self._lock:
            self.counts[kind] += 1
            if kind == "list":
                self.listed.append(request.query.get("prefix", [""])[0])
            for n, match in enumerate(self._lose):
                if match(request):
                    del self._lose[n]
                    self.lost.append(f"{request.method} {request.path}")
                    return True
        return False

    def lose_answer_once(self, match: Match) -> None:
        """Forward the next request `match` accepts, then answer it 503 instead of the store's answer."""
        with self._lock:
            self._lose.append(match)

    def reset(self) -> None:
        """Forget the counts so far."""
        with self._lock:
            self.counts.clear()
            self.listed.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
