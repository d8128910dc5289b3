"""The slice of the kubelet's HTTPS API that `kubectl logs` needs: `GET /containerLogs/<ns>/<pod>/<container>`
(`previous`, `tailLines`, `limitBytes`, `follow`), served by the node agent on each node's address.

The API server reaches it through the node's InternalIP and `daemonEndpoints.kubeletEndpoint.Port`
(`--kubelet-preferred-address-types=InternalIP`); it does not verify a kubelet's serving certificate
unless told to, and this server does not check the caller, as nothing but the API server can reach it
usefully: it is a development cluster.

A container with no log yet is answered as a kubelet answers it (`describe_missing_log`): 400 "is waiting
to start" for a pod the agent runs whose container has not started, 404 for a pod or container it does
not know; the API server passes a 400's text on to the client (`kubectl logs` prints it).
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

log = logging.getLogger(__name__)


def find_pod_dir(run_dir: Path, namespace: str, pod: str) -> Path | None:
    """The newest folder of pod `namespace/pod` (one folder per uid)."""
    candidates = sorted((run_dir / "pods" / namespace).glob(f"{pod}-????????"), key=lambda p: p.stat().st_mtime)
    return candidates[-1] if candidates else None


def container_logs(pod_dir: Path, container: str, previous: bool = False) -> Path | None:
    """The log file of the container's current (or previous) run."""
    runs = sorted((pod_dir / "logs" / container).glob("*.log"), key=lambda p: int(p.stem))
    if previous:
        return runs[-2] if len(runs) >= 2 else None
    return runs[-1] if runs else None


def describe_missing_log(pod: str, container: str, previous: bool,
                         waiting: Mapping[str, str] | None) -> tuple[int, str]:
    """The kubelet's answer (status, text) for a container of `pod` that has no log (of a previous run
    with `previous`): `waiting` is each of the pod's containers with its waiting reason as this agent
    runs the pod, None when it does not run that pod (kubelet server.go getContainerLogs,
    kubelet_pods.go validateContainerLogStatus)."""
    if waiting is None:
        return 404, f'pod "{pod}" does not exist'
    if container not in waiting:
        return 404, f'container "{container}" not found in pod "{pod}"'
    if previous:
        return 400, f'previous terminated container "{container}" in pod "{pod}" not found'
    return 400, f'container "{container}" in pod "{pod}" is waiting to start: {waiting[container] or "PodInitializing"}'


def _handler(run_dir: Path, is_running: Callable[[str, str, str], bool],
             waiting: Callable[[str, str], Mapping[str, str] | None]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("kubelet api: " + format, *args)

        def _error(self, code: int, message: str) -> None:
            data = message.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urlparse(self.path)
            parts = [p for p in url.path.split("/") if p]
            if len(parts) != 4 or parts[0] != "containerLogs":
                self._error(404, f"the local node agent serves only /containerLogs, not {url.path}")
                return
            _, namespace, pod, container = parts
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            pod_dir = find_pod_dir(run_dir, namespace, pod)
            previous = query.get("previous") == "true"
            path = container_logs(pod_dir, container, previous) if pod_dir else None
            if path is None:
                self._error(*describe_missing_log(pod, container, previous, waiting(namespace, pod)))
                return
            data = path.read_bytes()
            if "tailLines" in query:
                lines = data.splitlines(keepends=True)
                data = b"".join(lines[-int(query["tailLines"]):]) if int(query["tailLines"]) > 0 else b""
            if "limitBytes" in query:
                data = data[: int(query["limitBytes"])]
            if query.get("follow") != "true":
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            offset = path.stat().st_size
            try:
                self._chunk(data)
                while True:
                    size = path.stat().st_size
                    if size > offset:
                        with path.open("rb") as f:
                            f.seek(offset)
                            self._chunk(f.read(size - offset))
                        offset = size
                    elif not is_running(namespace, pod, container):
                        break
                    else:
                        time.sleep(0.2)
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                return

        def _chunk(self, data: bytes) -> None:
            if data:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

    return Handler


class KubeletAPI:
    """One TLS server per node address, all on the same port."""

    def __init__(self, run_dir: Path, cert: Path, key: Path, is_running: Callable[[str, str, str], bool],
                 waiting: Callable[[str, str], Mapping[str, str] | None]) -> None:
        self.run_dir = run_dir
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(str(cert), str(key))
        self.handler = _handler(run_dir, is_running, waiting)
        self.port = 0
        self.servers: dict[str, ThreadingHTTPServer] = {}

    def serve(self, address: str) -> int:
        """Serve on `address` (the first call picks the port, later ones reuse it); returns the port."""
        if address in self.servers:
            return self.port
        server = ThreadingHTTPServer((address, self.port), self.handler)
        server.daemon_threads = True
        server.socket = self.context.wrap_socket(server.socket, server_side=True)
        self.port = server.server_address[1]
        self.servers[address] = server
        threading.Thread(target=server.serve_forever, name=f"kubelet-api-{address}", daemon=True).start()
        return self.port

    def stop(self) -> None:
        for server in self.servers.values():
            server.shutdown()
