"""A small Kubernetes REST client on urllib3: dicts in, dicts out, watches as iterators.

The node agent, the control plane's health checks and the tests use it. Why not the `kubernetes`
package (a dependency of the operator extra): the agent plays a kubelet and writes status, Leases,
Events and merge patches exactly as the JSON the manifests and the tests are written in, and reads
objects whole. The package's generated models would turn each body into typed objects and back
(snake_case attributes, and fields a model does not know are dropped when deserialising), and its raw
mode (`_preload_content=False`) is this module's urllib3 call with more layers. About 150 lines of
plain REST (GET, LIST, WATCH with bookmarks, create, merge patch, delete with preconditions) cost less
than a second model of every object.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3
import yaml

from .errors import KubeAPIError

log = logging.getLogger(__name__)

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how to prove who we are: a client certificate or a bearer token."""

    server: str
    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    token: str | None = None


def read_kubeconfig(path: Path) -> Credentials:
    """Credentials of the current context of a kubeconfig whose certificates are files (as we write them)."""
    config = yaml.safe_load(Path(path).read_text())
    context_name = config["current-context"]
    context = next(c["context"] for c in config["contexts"] if c["name"] == context_name)
    cluster = next(c["cluster"] for c in config["clusters"] if c["name"] == context["cluster"])
    user = next(u["user"] for u in config["users"] if u["name"] == context["user"])
    return Credentials(server=cluster["server"], ca_file=cluster["certificate-authority"],
                       cert_file=user.get("client-certificate"), key_file=user.get("client-key"),
                       token=user.get("token"))


def write_kubeconfig(path: Path, creds: Credentials, name: str = "resilax-local") -> Path:
    """A kubeconfig with one cluster, user and context, all called `name`."""
    user: dict[str, str] = {}
    if creds.cert_file:
        user = {"client-certificate": creds.cert_file, "client-key": creds.key_file or ""}
    if creds.token:
        user["token"] = creds.token
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": name, "preferences": {},
        "clusters": [{"name": name, "cluster": {"server": creds.server, "certificate-authority": creds.ca_file}}],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


class KubeClient:
    """JSON over HTTPS to one API server. Thread-safe (urllib3 pools are)."""

    def __init__(self, creds: Credentials, timeout: float = 30.0) -> None:
        self.creds = creds
        self.timeout = timeout
        self._pool = urllib3.PoolManager(
            num_pools=4, maxsize=32, block=False, ca_certs=creds.ca_file, cert_reqs="CERT_REQUIRED",
            cert_file=creds.cert_file, key_file=creds.key_file, retries=False,
        )
        self._headers = {"Accept": "application/json"}
        if creds.token:
            self._headers["Authorization"] = f"Bearer {creds.token}"

    @classmethod
    def from_kubeconfig(cls, path: Path, timeout: float = 30.0) -> KubeClient:
        return cls(read_kubeconfig(path), timeout)

    def _url(self, path: str, params: dict[str, Any] | None) -> str:
        url = self.creds.server.rstrip("/") + path
        if params:
            url += "?" + urlencode({k: v for k, v in params.items() if v is not None})
        return url

    def request(self, method: str, path: str, body: Any = None, params: dict[str, Any] | None = None,
                content_type: str = "application/json", timeout: float | None = None) -> dict[str, Any]:
        headers = dict(self._headers)
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        resp = self._pool.request(method, self._url(path, params), body=data, headers=headers,
                                  timeout=urllib3.Timeout(total=timeout or self.timeout))
        text = resp.data.decode(errors="replace")
        try:
            parsed = json.loads(text) if text else {}
        except json.JSONDecodeError:
            parsed = {"message": text}
        if resp.status >= 400:
            message = parsed.get("message", text) if isinstance(parsed, dict) else text
            raise KubeAPIError(resp.status, f"{method} {path}: {message}", parsed if isinstance(parsed, dict) else None)
        return parsed if isinstance(parsed, dict) else {"items": parsed}

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        return self.request("GET", path, params=params or None)

    def get_text(self, path: str) -> str:
        resp = self._pool.request("GET", self._url(path, None), headers=self._headers,
                                  timeout=urllib3.Timeout(total=self.timeout))
        return str(resp.status) + " " + resp.data.decode(errors="replace")

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body)

    def patch(self, path: str, body: dict[str, Any], strategic: bool = False) -> dict[str, Any]:
        return self.request("PATCH", path, body, content_type=STRATEGIC_MERGE_PATCH if strategic else MERGE_PATCH)

    def put(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.request("PUT", path, body)

    def delete(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("DELETE", path, body)

    def watch(self, path: str, resource_version: str, timeout_seconds: int = 60,
              **params: Any) -> Iterator[dict[str, Any]]:
        """Events (`{"type": ..., "object": ...}`) of one watch request; ends after `timeout_seconds`."""
        query = {"watch": "true", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                 "timeoutSeconds": timeout_seconds, **params}
        resp = self._pool.request("GET", self._url(path, query), headers=self._headers, preload_content=False,
                                  timeout=urllib3.Timeout(connect=10, read=timeout_seconds + 30))
        try:
            if resp.status >= 400:
                raise KubeAPIError(resp.status, f"WATCH {path}: {resp.data.decode(errors='replace')}")
            buffer = b""
            for chunk in resp.stream(65536, decode_content=True):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
        finally:
            resp.release_conn()
