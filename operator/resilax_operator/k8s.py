"""The only module that talks to the outside world: the Kubernetes API and the workers' sidecars.

Dicts in, dicts out (the JSON the API speaks; the pure modules parse it). Synchronous: kopf runs sync
handlers and daemons in its thread pool. The `kubernetes` client only loads the configuration and
carries the requests (`ApiClient.call_api`), so every body stays the camelCase JSON of the manifests.

Errors: 404 on a delete and 409 on a create are success (every action is idempotent); 5xx, 429,
timeouts and refused connections are transient (`kopf.TemporaryError`, retried by the next
reconcile); anything else is a `KubeError` with the API's message.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import kopf
import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from . import api
from .builders import Manifest, build_token_secret, build_token_secret_name
from .errors import NameConflictError, ResilaxOperatorError
from .ownership import describe_owner, owner_uid

log = logging.getLogger(__name__)

MERGE_PATCH: Final = "application/merge-patch+json"
#: Seconds for one API request.
API_TIMEOUT: Final = 20.0
#: Seconds to connect to a sidecar.
SIDECAR_CONNECT_SECONDS: Final = 2.0
#: Seconds for one whole sidecar request: connect, send, the answer's headers and body.
TOKEN_RECHECK_SECONDS: Final = api.TOKEN_RECHECK_SECONDS


def token_recheck_due(uid: str, read_at: float | None, now: float, period: float = TOKEN_RECHECK_SECONDS) -> bool:
    """Whether a job's token Secret is read again (pure): once per `period`, at the job's own phase of it
    (from its uid), so that jobs started together do not all read at once."""
    if read_at is None:
        return True
    phase = zlib.crc32(uid.encode()) % max(1, int(period))
    return (now + phase) // period > (read_at + phase) // period
TOKEN_GRACE_SECONDS: Final = 600.0
"""How long after a rotation the operator still tries the previous token on a sidecar that refuses the
new one (403): the kubelet refreshes a mounted Secret's file within about a minute; until then that
sidecar knows only the old token."""
SIDECAR_DEADLINE_SECONDS: Final = 10.0
#: The most bytes of a sidecar's answer the operator reads (`/v1/state` is a few KiB).
SIDECAR_MAX_ANSWER_BYTES: Final = 1 << 20
TRANSIENT_STATUSES: Final = frozenset({429, 500, 502, 503, 504})


class KubeError(ResilaxOperatorError, RuntimeError):
    """An API call that failed for a reason retrying will not fix (403, 422, ...)."""

    def __init__(self, status: int, message: str, api_message: str = "") -> None:
        self.status = status
        #: The API server's own message (without the request line), e.g. Pod Security's refusal.
        self.api_message = api_message or message
        super().__init__(message)


class SidecarError(ResilaxOperatorError, ConnectionError):
    """A sidecar that did not answer, or answered an error."""


def load_api_client(kubeconfig: str | None = None) -> kubernetes.client.ApiClient:
    """In-cluster configuration when running in a pod (and no kubeconfig is given), else the kubeconfig."""
    if kubeconfig is None:
        try:
            kubernetes.config.load_incluster_config()
            return kubernetes.client.ApiClient()
        except kubernetes.config.ConfigException:
            pass
    return kubernetes.config.new_client_from_config(config_file=kubeconfig)


class Kube:
    """The API calls the operator makes. Thread-safe (the client's urllib3 pool is)."""

    def __init__(self, client: kubernetes.client.ApiClient) -> None:
        self.client = client
        #: A sidecar call's whole time and the most bytes of its answer read (`request_bounded`).
        self.sidecar_deadline_seconds = SIDECAR_DEADLINE_SECONDS
        self.sidecar_max_answer_bytes = SIDECAR_MAX_ANSWER_BYTES
        self._tokens: dict[str, str] = {}  # job uid -> sidecar bearer token
        self._token_read_at: dict[str, float] = {}  # job uid -> when its Secret was last read (monotonic)
        self._rotated_from: dict[str, tuple[str, float]] = {}  # new token -> (the one it replaced, when)
        self.clock = time.monotonic

    # ---- raw requests ----------------------------------------------------------------------
    def request(self, method: str, path: str, body: Any = None, *, query: Mapping[str, Any] | None = None,
                content_type: str = "application/json", ok: tuple[int, ...] = ()) -> dict[str, Any] | None:
        """One API request; returns the parsed JSON answer, or None for a status listed in `ok`."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            method_, url, headers_, body_, _ = self.client.param_serialize(
                method, path, query_params=list((query or {}).items()), header_params=headers, body=body,
                auth_settings=["BearerToken"])
            response = self.client.call_api(method_, url, header_params=headers_, body=body_,
                                            _request_timeout=API_TIMEOUT)
            data = response.read()
        except ApiException as e:  # the client's own transport errors (status 0)
            raise kopf.TemporaryError(f"{method} {path}: {e}", delay=2) from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise kopf.TemporaryError(f"{method} {path}: {e}", delay=2) from e
        status = int(response.status)
        if status >= 400:
            if status in ok:
                return None
            message = _api_message(data) or str(response.reason)
            if status in TRANSIENT_STATUSES:
                raise kopf.TemporaryError(f"{method} {path}: {status} {message}", delay=2)
            raise KubeError(status, f"{method} {path}: {status} {message}", message)
        parsed = json.loads(data) if data else {}
        return parsed if isinstance(parsed, dict) else {}

    # ---- reading the world: list once, then watch (observed/cache.py) --------------------------------
    def get_job(self, namespace: str, name: str) -> dict[str, Any] | None:
        """A JAXJob the watch cache has not seen yet (None: it does not exist)."""
        return self.request("GET", _job_path(namespace, name), ok=(404,))

    def get_node_lease(self, node: str) -> dict[str, Any] | None:
        """A node's Lease in kube-node-lease (None: none). Read only for a NotReady node hosting a worker,
        so a reconcile issues no request while every node is Ready."""
        return self.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}",
                            ok=(404,))

    def list_page(self, path: str, query: Mapping[str, Any]) -> dict[str, Any]:
        """One LIST (the informers' initial and 410 re-lists; never per reconcile)."""
        return self.request("GET", path, query=query) or {}

    def watch(self, path: str, query: Mapping[str, Any], timeout_seconds: int,
              stop: threading.Event) -> Iterator[dict[str, Any]]:
        """A watch's events, one parsed JSON object per line, until the server ends it
        (`timeoutSeconds`), the connection drops (the error propagates) or `stop` is set."""
        params = {**query, "watch": "true", "timeoutSeconds": str(timeout_seconds)}
        method_, url, headers_, body_, _ = self.client.param_serialize(
            "GET", path, query_params=list(params.items()), header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"])
        try:
            response = self.client.call_api(method_, url, header_params=headers_, body=body_,
                                            _request_timeout=(10.0, timeout_seconds + 30.0))
        except (ApiException, urllib3.exceptions.HTTPError, OSError) as e:
            raise kopf.TemporaryError(f"watch {path}: {e}", delay=2) from e
        raw = response.response
        try:
            if int(response.status) >= 400:
                data = response.read()
                raise KubeError(int(response.status), f"watch {path}: {response.status} {_api_message(data)}")
            for line in raw:
                if stop.is_set():
                    return
                if line.strip():
                    yield json.loads(line)
        finally:
            raw.release_conn()

    # ---- writing ---------------------------------------------------------------------------
    def patch_job_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> dict[str, Any] | None:
        """Returns the JAXJob as written (cache.WorldCache.remember keeps the status fresh)."""
        return self.request("PATCH", _job_path(namespace, name) + "/status", {"status": dict(status)},
                     content_type=MERGE_PATCH)

    def create(self, manifest: Manifest) -> dict[str, Any] | None:
        """Create a namespaced core/v1 object: the object as created, or None if it already existed."""
        kind = str(manifest["kind"]).lower() + "s"
        namespace = manifest["metadata"]["namespace"]
        return self.request("POST", f"/api/v1/namespaces/{namespace}/{kind}", manifest, ok=(409,))

    def create_owned(self, manifest: Manifest, uid: str) -> tuple[dict[str, Any], bool]:
        """Create an object the JAXJob of `uid` owns: (the object as created, True); when one of its name
        exists (409) and is that job's, (the existing one, False). One that is not the job's is a
        NameConflictError: it is never adopted."""
        made = self.create(manifest)
        if made is not None:
            return made, True
        kind, meta = str(manifest["kind"]), manifest["metadata"]
        existing = self.request("GET", f"/api/v1/namespaces/{meta['namespace']}/{kind.lower()}s/{meta['name']}",
                                ok=(404,))
        if existing is None:  # gone since the 409: the next reconcile creates it
            raise kopf.TemporaryError(f"{kind} {meta['name']}: already exists, then gone; retrying", delay=1)
        if not uid or owner_uid(existing) != uid:
            raise NameConflictError(kind, str(meta["name"]), describe_owner(existing))
        return existing, False

    def delete_pod(self, namespace: str, name: str, *, force: bool = False, grace_seconds: int | None = None,
                   uid: str = "") -> bool:
        """Delete a pod: with its own grace period, `grace_seconds`, or at once (`force`: no kubelet
        will confirm it). `uid`: only the pod of that uid (a precondition; another pod of the name since,
        409, stays). False when no pod of the name exists (404)."""
        body: dict[str, Any] = {"gracePeriodSeconds": 0} if force else (
            {} if grace_seconds is None else {"gracePeriodSeconds": grace_seconds})
        if uid:
            body["preconditions"] = {"uid": uid}
        try:
            self.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}", body or None, ok=(409,))
        except KubeError as e:
            if e.status == 404:
                return False
            raise
        return True

    def delete_job(self, namespace: str, name: str, uid: str) -> None:
        """Delete the JAXJob of `uid` (a precondition: a job re-created under the name since stays);
        its finalizer's cleanup and the owner references take its objects."""
        self.request("DELETE", _job_path(namespace, name), {"preconditions": {"uid": uid},
                                                            "propagationPolicy": "Background"}, ok=(404, 409))

    def delete_service(self, namespace: str, name: str) -> None:
        self.request("DELETE", f"/api/v1/namespaces/{namespace}/services/{name}", ok=(404,))

    def delete_owned_secret(self, namespace: str, name: str, uid: str) -> None:
        """Delete a Secret only if the JAXJob of `uid` owns it (read, then delete with the uid of what was
        read as the precondition: what was checked is what goes)."""
        path = f"/api/v1/namespaces/{namespace}/secrets/{name}"
        existing = self.request("GET", path, ok=(404,))
        if existing is None:
            return
        if not uid or owner_uid(existing) != uid:
            log.info("secret %s/%s is not this job's (%s): left alone", namespace, name, describe_owner(existing))
            return
        self.request("DELETE", path, {"preconditions": {"uid": (existing.get("metadata") or {}).get("uid")}},
                     ok=(404, 409))

    def patch_pod_metadata(self, namespace: str, name: str, labels: Mapping[str, str],
                           annotations: Mapping[str, str]) -> dict[str, Any] | None:
        """Merge labels and annotations into a pod's; None when the pod is gone."""
        return self.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}",
                            {"metadata": {"labels": dict(labels), "annotations": dict(annotations)}},
                            content_type=MERGE_PATCH, ok=(404,))

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        self.request("PATCH", f"/api/v1/namespaces/{namespace}/pods/{name}",
                     {"metadata": {"annotations": dict(annotations)}}, content_type=MERGE_PATCH)

    def annotate_owned(self, kind: str, namespace: str, name: str, uid: str,
                       annotations: Mapping[str, str | None]) -> dict[str, Any] | None:
        """Merge annotations (None removes one) into the JAXJob (`kind` "jaxjob") or pod of `uid` (the
        uid in the patch is a precondition); the object as written, or None when it is gone or another
        object holds its name (404, 409)."""
        path = _job_path(namespace, name) if kind == "jaxjob" else f"/api/v1/namespaces/{namespace}/pods/{name}"
        return self.request("PATCH", path, {"metadata": {"uid": uid, "annotations": dict(annotations)}},
                            content_type=MERGE_PATCH, ok=(404, 409))

    def suspend_job(self, namespace: str, name: str, uid: str, suspend: bool,
                    annotations: Mapping[str, str | None]) -> dict[str, Any] | None:
        """Merge `spec.suspend` and annotations into the JAXJob of `uid` (a precondition); the object as
        written, or None when it is gone or another object holds its name (404, 409)."""
        return self.request("PATCH", _job_path(namespace, name), {
            "metadata": {"uid": uid, "annotations": dict(annotations)}, "spec": {"suspend": suspend}},
            content_type=MERGE_PATCH, ok=(404, 409))

    def create_event(self, job: Mapping[str, Any], type_: str, reason: str, message: str, now: datetime) -> None:
        """A core/v1 Event on the JAXJob (what `kubectl describe jaxjob` shows)."""
        meta = job.get("metadata") or {}
        namespace, name = meta.get("namespace", ""), meta.get("name", "")
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        micro = now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": namespace},
            "involvedObject": {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": name,
                               "namespace": namespace, "uid": meta.get("uid"),
                               "resourceVersion": meta.get("resourceVersion")},
            "type": type_, "reason": reason, "message": message[:1024],
            "firstTimestamp": stamp, "lastTimestamp": stamp, "eventTime": micro, "count": 1,
            "action": reason, "reportingComponent": "resilax-operator",
            "reportingInstance": "resilax-operator", "source": {"component": "resilax-operator"},
        }
        self.request("POST", f"/api/v1/namespaces/{namespace}/events", event)

    # ---- the sidecars' token ---------------------------------------------------------------
    def ensure_token_secret(self, job: Any, *, check: bool = False) -> str:
        """The job's sidecar token, from its Secret, read again when `check` or when the copy here is
        due again (`token_recheck_due`). A missing Secret (deleted: that is how a token is rotated,
        docs/sidecar.md "Auth") is created with a new random token, never the one known here: the
        kubelet passes it on to the sidecars' mounted file, and the old token stops working there. A
        Secret of that name that the job does not own is a NameConflictError: its token is never used.
        `check`: before creating pods that mount it (a deleted Secret would leave them starting
        forever). `job` is a builders.JobRef."""
        cached = self._tokens.get(job.uid)
        if cached and not check and not token_recheck_due(job.uid, self._token_read_at.get(job.uid), self.clock()):
            return cached
        name = build_token_secret_name(job.name)
        secret = self.request("GET", f"/api/v1/namespaces/{job.namespace}/secrets/{name}", ok=(404,))
        if secret is None:
            secret, created = self.create_owned(build_token_secret(job, secrets.token_urlsafe(32)), job.uid)
            log.info("token secret %s/%s %s", job.namespace, name,
                     "created with a new token" + (" (the old one was deleted: rotated)" if cached else "")
                     if created else "was created meanwhile")
        elif not job.uid or owner_uid(secret) != job.uid:
            self._tokens.pop(job.uid, None)
            raise NameConflictError("Secret", name, describe_owner(secret))
        raw = (secret.get("data") or {}).get(api.TOKEN_KEY)
        if not raw:
            raise KubeError(422, f"secret {job.namespace}/{name} has no key {api.TOKEN_KEY!r}")
        token = base64.b64decode(raw).decode().strip()
        if cached and token != cached:
            self._rotated_from[token] = (cached, self.clock())
        self._tokens[job.uid] = token
        self._token_read_at[job.uid] = self.clock()
        return token

    def forget_token(self, uid: str) -> None:
        token = self._tokens.pop(uid, None)
        self._token_read_at.pop(uid, None)
        if token is not None:
            self._rotated_from.pop(token, None)

    def _previous_token(self, token: str) -> str | None:
        """The token `token` replaced, while a sidecar may still know only that one (TOKEN_GRACE_SECONDS)."""
        previous = self._rotated_from.get(token)
        if previous is None:
            return None
        if self.clock() - previous[1] > TOKEN_GRACE_SECONDS:
            self._rotated_from.pop(token, None)
            return None
        return previous[0]

    # ---- the sidecars' HTTP API (docs/sidecar.md) ------------------------------------------
    def sidecar(self, method: str, ip: str, port: int, path: str, body: Mapping[str, Any] | None = None,
                token: str | None = None) -> dict[str, Any]:
        """One call to a worker's sidecar: its JSON answer. The whole call (connect, send, headers,
        body) ends within `sidecar_deadline_seconds` and reads at most `sidecar_max_answer_bytes`: a
        sidecar that trickles or answers too much costs one reconcile a bounded wait, never the operator."""
        host = f"[{ip}]" if ":" in ip else ip
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        where = f"sidecar {host}:{port} {method} {path}"
        sent = None if body is None else json.dumps(body).encode()
        status, data = request_bounded(where, method, ip, port, path, sent, headers,
                                       deadline_seconds=self.sidecar_deadline_seconds,
                                       max_bytes=self.sidecar_max_answer_bytes)
        previous = self._previous_token(token) if status == 403 and token is not None else None
        if previous is not None:  # rotated, and this sidecar's mounted file is not refreshed yet
            headers["Authorization"] = f"Bearer {previous}"
            status, data = request_bounded(where, method, ip, port, path, sent, headers,
                                           deadline_seconds=self.sidecar_deadline_seconds,
                                           max_bytes=self.sidecar_max_answer_bytes)
        try:
            answer = json.loads(data or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError):
            answer = {"error": {"message": data[:200].decode(errors="replace")}}
        if status >= 400:
            error = (answer.get("error") or {}).get("message") if isinstance(answer, dict) else answer
            raise SidecarError(f"{where}: {status} {error}")
        return answer if isinstance(answer, dict) else {}


#: Sidecars one `ask_sidecars` asks at once.
SIDECAR_CALLS_AT_ONCE: Final = 16


@dataclass(frozen=True)
class SidecarCall:
    """One request to one worker's sidecar (`ask_sidecars`)."""

    pod: str
    ip: str
    method: str
    path: str
    body: Mapping[str, Any] | None = None


def ask_sidecars(kube: Kube, calls: Sequence[SidecarCall], port: int,
                 token: str | None = None) -> dict[str, dict[str, Any] | SidecarError]:
    """Each call's answer, or its SidecarError, by pod: the calls made at once (SIDECAR_CALLS_AT_ONCE in
    flight), so a sidecar that accepts and never answers costs a reconcile one `sidecar_deadline_seconds`,
    not one per pod asked after it. Any other error is raised, as from one call."""
    def one(call: SidecarCall) -> dict[str, Any] | SidecarError:
        try:
            return kube.sidecar(call.method, call.ip, port, call.path, call.body, token=token)
        except SidecarError as e:
            return e

    if len(calls) <= 1:
        return {c.pod: one(c) for c in calls}
    with ThreadPoolExecutor(max_workers=min(len(calls), SIDECAR_CALLS_AT_ONCE), thread_name_prefix="sidecar") as pool:
        return dict(zip((c.pod for c in calls), pool.map(one, calls), strict=True))


def request_bounded(where: str, method: str, ip: str, port: int, path: str, body: bytes | None,
                    headers: Mapping[str, str], *, deadline_seconds: float, max_bytes: int) -> tuple[int, bytes]:
    """One plain HTTP request bounded in time and size: (status, body). A watchdog shuts the socket down
    when `deadline_seconds` have passed since the start, whatever stage the request is at (a per-read
    timeout alone lets a peer that sends a byte now and then hold the caller forever); an answer longer
    than `max_bytes` (by its Content-Length, or once that many bytes came) is refused unread.
    Raises SidecarError."""
    conn = http.client.HTTPConnection(ip, port, timeout=min(SIDECAR_CONNECT_SECONDS, deadline_seconds))
    expired = threading.Event()
    began = time.monotonic()

    def expire() -> None:
        expired.set()
        sock = conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(deadline_seconds, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.connect()
        if expired.is_set():
            raise TimeoutError("connect")
        conn.sock.settimeout(deadline_seconds)
        conn.request(method, path, body=body, headers=dict(headers))
        response = conn.getresponse()
        length = response.getheader("Content-Length")
        if length is not None and length.strip().isdigit() and int(length) > max_bytes:
            raise SidecarError(f"{where}: the answer is {int(length):,} bytes; at most {max_bytes:,} are read")
        data = response.read(max_bytes + 1)
        if len(data) > max_bytes:
            raise SidecarError(f"{where}: the answer is longer than {max_bytes:,} bytes; at most that many are read")
        if expired.is_set():
            raise TimeoutError("read")
        return int(response.status), data
    except (OSError, http.client.HTTPException, ValueError) as e:
        # the socket's own timeout (the deadline too) may fire before the watchdog thread got to run
        if expired.is_set() or time.monotonic() - began >= deadline_seconds:
            raise SidecarError(f"{where}: no complete answer within {deadline_seconds:g} s") from e
        raise SidecarError(f"{where}: {e}") from e
    finally:
        watchdog.cancel()
        conn.close()


def _job_path(namespace: str, name: str) -> str:
    return f"/apis/{api.GROUP}/{api.VERSION}/namespaces/{namespace}/{api.PLURAL}/{name}"


def _api_message(data: bytes | None) -> str:
    try:
        answer = json.loads(data or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return (data or b"")[:200].decode(errors="replace")
    return str(answer.get("message") or "") if isinstance(answer, dict) else ""
