"""The API calls of `kubectl resilax` (kubectl/plugin.py), with kubectl's kubeconfig and the user's own
RBAC: the only module of the plugin that talks to the cluster.

What each command needs (docs/operations.md, "kubectl resilax"):
- status, goodput, timeline: `get` jaxjobs, `list` events;  web: `list` jaxjobs (`-A`: in every namespace);
- suspend, resume: `patch` jaxjobs;
- save: `get` jaxjobs, `list` pods, `get` the job's token Secret `<job>-resilax-token`, and `create` +
  `get` on `pods/proxy` (the request goes through the API server's pod proxy to the sidecar);
- rotate-token: `get` jaxjobs, `get` and `delete` the job's token Secret.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Iterator
from typing import Any, Final
from urllib.parse import quote

from .. import api
from ..generation import build_token_secret_name

#: The header that carries the job's sidecar token through the API server's pod proxy. The API server
#: removes `Authorization` from a proxied request once it has authenticated the caller with it, so the
#: sidecar accepts its token in this header too (docs/sidecar.md, "Auth").
TOKEN_HEADER: Final = api.SIDECAR_TOKEN_HEADER
PROXY_TIMEOUT_SECONDS: Final = 30.0
#: The most bytes of one answer read: an API list (pods, events, jaxjobs), and a sidecar's answer
#: through the pod proxy (a few hundred bytes; the sidecar is the job's, not the user's).
API_ANSWER_CAP: Final = 64 << 20
SIDECAR_ANSWER_CAP: Final = 1 << 20


class PluginError(Exception):
    """An answer the user must see (the job is missing, the API refused): printed, exit 1. `status` and
    `reason` are the API's answer where there was one (an HTTP status, the API's message)."""

    def __init__(self, message: str, status: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


def _api_message(data: bytes | str | None) -> str | None:
    with contextlib.suppress(TypeError, ValueError, AttributeError):
        body = json.loads(data or "")
        if isinstance(body, dict):
            error = body.get("error")
            if isinstance(error, dict) and error.get("message"):  # the sidecar's JSON errors
                return str(error["message"])
            if body.get("message"):
                return str(body["message"])
    return None


class JobAPI:
    """The few calls the plugin makes, through the kubernetes client and kubectl's kubeconfig."""

    def __init__(self, kubeconfig: str | None, context: str | None) -> None:
        try:
            import kubernetes
        except ImportError as e:
            raise PluginError("needs the kubernetes client: pip install 'resilax[cli]'") from e

        self._kubernetes = kubernetes
        try:
            self.client = kubernetes.config.new_client_from_config(config_file=kubeconfig, context=context)
            contexts, active = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
        except (kubernetes.config.ConfigException, OSError) as e:  # no kubeconfig, an unknown context
            where = kubeconfig or "$KUBECONFIG or ~/.kube/config"
            raise PluginError(f"kubeconfig {where}: {e}; allowed: a kubeconfig with a current context "
                              "(or --kubeconfig/--context)") from None
        chosen = next((c for c in contexts if c["name"] == context), active) if context else active
        self.default_namespace = str(((chosen or {}).get("context") or {}).get("namespace") or "default")

    def _call(self, what: str, call: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return call(*args, **kwargs)
        except self._kubernetes.client.ApiException as e:
            message = _api_message(e.body) or e.reason
            raise PluginError(f"{what}: {e.status} {message}", e.status, str(message or "")) from e

    def request(self, what: str, method: str, path: str, body: Any = None, *, query: dict[str, str] | None = None,
                headers: dict[str, str] | None = None, timeout: float = PROXY_TIMEOUT_SECONDS,
                cap: int = API_ANSWER_CAP) -> Any:
        """One request to the API server (`path` already quoted); the parsed JSON answer, of at most
        `cap` bytes (a longer one is an error, never read further). `headers` are sent as given and
        never logged nor printed (the save's token is one)."""
        sent = {"Accept": "application/json", **(headers or {})}
        if body is not None:
            sent["Content-Type"] = "application/json"
        try:
            method_, url, headers_, body_, _ = self.client.param_serialize(
                method, path, query_params=list((query or {}).items()), header_params=sent, body=body,
                auth_settings=["BearerToken"])
            response = self.client.call_api(method_, url, header_params=headers_, body=body_,
                                            _request_timeout=timeout)
            data = response.response.read(cap + 1)  # the client streams: nothing read beyond this
            response.response.release_conn()
        except Exception as e:  # transport: refused, reset, timed out (never the headers in the message)
            raise PluginError(f"{what}: {type(e).__name__}: {e}") from e
        if len(data) > cap:
            raise PluginError(f"{what}: the answer is over {cap} bytes; not read")
        if int(response.status) >= 400:
            raise PluginError(f"{what}: {response.status} {_api_message(data) or response.reason}")
        return json.loads(data) if data else {}

    def get_job(self, namespace: str, name: str) -> dict[str, Any]:
        objects = self._kubernetes.client.CustomObjectsApi(self.client)
        job: dict[str, Any] = self._call(f"jaxjob {namespace}/{name}", objects.get_namespaced_custom_object,
                                         api.GROUP, api.VERSION, namespace, api.PLURAL, name)
        return job

    def list_jobs(self, namespace: str | None) -> list[dict[str, Any]]:
        """The JAXJobs of `namespace`, or of every namespace with None."""
        objects = self._kubernetes.client.CustomObjectsApi(self.client)
        if namespace is None:
            listed = self._call("jaxjobs of every namespace", objects.list_cluster_custom_object,
                                api.GROUP, api.VERSION, api.PLURAL)
        else:
            listed = self._call(f"jaxjobs of {namespace}", objects.list_namespaced_custom_object,
                                api.GROUP, api.VERSION, namespace, api.PLURAL)
        items: list[dict[str, Any]] = listed.get("items") or []
        return items

    def job_events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        selector = f"involvedObject.kind={api.KIND},involvedObject.name={name}"
        answer = self.request(f"events of {namespace}/{name}", "GET", f"/api/v1/namespaces/{namespace}/events",
                              query={"fieldSelector": selector})
        items: list[dict[str, Any]] = answer.get("items") or []
        return items

    def job_names(self, namespace: str) -> list[str]:
        return sorted(item["metadata"]["name"] for item in self.list_jobs(namespace))

    def namespace_names(self) -> list[str]:
        core = self._kubernetes.client.CoreV1Api(self.client)
        listed = self._call("namespaces", core.list_namespace)
        return sorted(item.metadata.name for item in listed.items)

    def patch_job(self, namespace: str, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        objects = self._kubernetes.client.CustomObjectsApi(self.client)
        job: dict[str, Any] = self._call(f"patching jaxjob {namespace}/{name}",
                                         objects.patch_namespaced_custom_object,
                                         api.GROUP, api.VERSION, namespace, api.PLURAL, name, patch)
        return job

    def worker_pods(self, namespace: str, job: str, generation: int) -> list[dict[str, Any]]:
        """The pods of one generation of `job` (its labels), as JSON."""
        selector = f"{api.LABEL_JOB}={job},{api.LABEL_GENERATION}={generation}"
        answer = self.request(f"pods of {namespace}/{job}", "GET", f"/api/v1/namespaces/{namespace}/pods",
                              query={"labelSelector": selector})
        items: list[dict[str, Any]] = answer.get("items") or []
        return items

    def pod_log(self, namespace: str, pod: str, container: str, follow: bool) -> Iterator[str]:
        """The container's log lines (`follow`: until the container ends); the stream ending early (the
        pod deleted under it) ends the lines."""
        core = self._kubernetes.client.CoreV1Api(self.client)
        response = self._call(f"log of {namespace}/{pod}", core.read_namespaced_pod_log, pod, namespace,
                              container=container, follow=follow, _preload_content=False)
        pending = b""
        try:
            for chunk in response.stream(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.decode(errors="replace")
        except Exception:  # the connection dropped with the pod: what came is printed, the caller looks again
            pass
        finally:
            response.release_conn()
        if pending:
            yield pending.decode(errors="replace")

    def sidecar_token(self, namespace: str, job: str) -> str:
        """The job's sidecar token, from its Secret (`get` secrets). Never printed."""
        name = build_token_secret_name(job)
        secret = self.request(f"secret {namespace}/{name}", "GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
        raw = (secret.get("data") or {}).get(api.TOKEN_KEY)
        if not raw:
            raise PluginError(f"secret {namespace}/{name} has no key {api.TOKEN_KEY!r}")
        return base64.b64decode(raw).decode().strip()

    def delete_token_secret(self, namespace: str, job: str, uid: str) -> str:
        """Delete the job's token Secret, only when the JAXJob of `uid` owns it (and only that very
        Secret: a uid precondition). The operator then writes a new token (k8s.Kube.ensure_token_secret).
        The Secret's name."""
        from ..ownership import describe_owner, owner_uid

        name = build_token_secret_name(job)
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/secrets/{quote(name, safe='')}"
        secret = self.request(f"secret {namespace}/{name}", "GET", path)
        if not uid or owner_uid(secret) != uid:
            raise PluginError(f"secret {namespace}/{name} is not jaxjob {namespace}/{job}'s ({describe_owner(secret)}); "
                              "not deleted")
        self.request(f"deleting secret {namespace}/{name}", "DELETE", path,
                     {"preconditions": {"uid": (secret.get("metadata") or {}).get("uid")}})
        return name

    def sidecar(self, namespace: str, pod: str, port: int, method: str, path: str, body: Any = None,
                token: str | None = None) -> Any:
        """A call to a worker's sidecar through the API server's pod proxy (`pods/proxy`); `path` is
        the plugin's own, its parts already checked or quoted (never a value the sidecar chose, raw)."""
        headers = {TOKEN_HEADER: token} if token else {}
        proxy = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(pod, safe='')}:{int(port)}/proxy"
        return self.request(f"{method} {path} on the sidecar of {namespace}/{pod}", method, proxy + path, body,
                            headers=headers, cap=SIDECAR_ANSWER_CAP)
