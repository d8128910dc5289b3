"""Pure helpers that read a pod manifest the way the kubelet does: environment variables (`value`,
`valueFrom`, `envFrom`, `$(VAR)` expansion), downward-API fields, container ordering and restart rules,
the crash-loop and image-pull backoff, the runAsNonRoot check, and the pod's hostname and DNS names.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

Pod = dict[str, Any]
Container = dict[str, Any]

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: known names are replaced, unknown ones left as written, `$$` is `$`."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR.sub(replace, text)


def field_value(pod: Pod, path: str) -> str:
    """The value of a downward-API `fieldPath` (metadata.name, metadata.labels['k'], status.podIP, ...)."""
    meta = pod.get("metadata", {})
    status = pod.get("status", {})
    spec = pod.get("spec", {})
    match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if match:
        return str(meta.get(match.group(1), {}).get(match.group(2), ""))
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1], {}) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    simple = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"), "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs", []) or []),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs", []) or []),
    }
    if path not in simple:
        raise ValueError(f"fieldPath {path!r} is not supported by the local node agent")
    return str(simple[path] or "")


def resource_value(container: Container, resource: str, divisor: str | None) -> str:
    """A `resourceFieldRef` value (limits.cpu, requests.memory, ...), in whole units of the divisor."""
    kind, _, name = resource.partition(".")
    value = container.get("resources", {}).get(kind, {}).get(name)
    if value is None:
        value = {"cpu": "8", "memory": "32Gi"}.get(name, "0")
    quantity = parse_quantity(str(value))
    unit = parse_quantity(divisor or "1")
    return str(max(1, -(-int(quantity * 1000) // int(unit * 1000)))) if quantity else "0"


def parse_quantity(text: str) -> float:
    """`500m` -> 0.5, `2Gi` -> 2*1024**3, `1k` -> 1000."""
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
                "Ti": 2**40}
    for suffix in sorted(suffixes, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * suffixes[suffix]
    return float(text)


Lookup = Callable[[str, str], dict[str, Any] | None]
"""(kind 'configmaps'|'secrets', name) -> the object, or None when it does not exist."""


def object_data(obj: dict[str, Any], kind: str) -> dict[str, str]:
    """A ConfigMap's or Secret's values as text."""
    if kind == "secrets":
        out = {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}
        out.update(obj.get("stringData") or {})
        return out
    out = dict(obj.get("data") or {})
    out.update({k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("binaryData") or {}).items()})
    return out


def build_env(pod: Pod, container: Container, lookup: Lookup, base: Mapping[str, str]) -> dict[str, str]:
    """The container's environment: `base`, then `envFrom`, then `env` in order, with `$(VAR)` expansion.

    Raises ValueError naming the variable when a required ConfigMap/Secret or key is missing.
    """
    env = dict(base)
    declared: dict[str, str] = {}
    for source in container.get("envFrom", []) or []:
        prefix = source.get("prefix", "")
        for kind, key in (("configmaps", "configMapRef"), ("secrets", "secretRef")):
            ref = source.get(key)
            if not ref:
                continue
            obj = lookup(kind, ref["name"])
            if obj is None:
                if ref.get("optional"):
                    continue
                raise ValueError(f"envFrom: {kind[:-1]} {ref['name']!r} not found")
            for k, v in object_data(obj, kind).items():
                declared[prefix + k] = v
    env.update(declared)
    for var in container.get("env", []) or []:
        name = var["name"]
        if "value" in var or "valueFrom" not in var:
            declared[name] = env[name] = expand(var.get("value", "") or "", {**env, **declared})
            continue
        source = var["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            value = resource_value(container, ref["resource"], ref.get("divisor"))
        else:
            kind, key = ("configmaps", "configMapKeyRef") if "configMapKeyRef" in source else ("secrets", "secretKeyRef")
            ref = source[key]
            obj = lookup(kind, ref["name"])
            value = None if obj is None else object_data(obj, kind).get(ref["key"])
            if value is None:
                if ref.get("optional"):
                    continue
                raise ValueError(f"env {name}: key {ref['key']!r} of {kind[:-1]} {ref['name']!r} not found")
        declared[name] = env[name] = value
    return env


def command_line(container: Container, env: Mapping[str, str]) -> list[str]:
    """`command` + `args` with `$(VAR)` expanded; images are not pulled, so a command is required."""
    command = [expand(c, env) for c in container.get("command", []) or []]
    args = [expand(a, env) for a in container.get("args", []) or []]
    if not command:
        raise ValueError(f"container {container['name']!r} has no command: the local node agent does not pull "
                         f"images (image {container.get('image')!r}), so it needs `command`")
    return command + args


def hostname(pod: Pod) -> str:
    """The pod's hostname: `spec.hostname`, else its name (at most 63 characters)."""
    return str(pod["spec"].get("hostname") or pod["metadata"]["name"])[:63]


def dns_names(pod: Pod) -> list[str]:
    """The names cluster DNS would give the pod: `<hostname>.<subdomain>.<ns>.svc.cluster.local` (and its
    search-domain short forms) when it has a subdomain (headless Service), and its hostname."""
    name = hostname(pod)
    subdomain = pod["spec"].get("subdomain")
    names = []
    if subdomain:
        base = f"{name}.{subdomain}.{pod['metadata']['namespace']}"
        names = [f"{base}.svc.cluster.local", f"{base}.svc", base, f"{name}.{subdomain}"]
    return [*names, name]


def is_sidecar(container: Container) -> bool:
    """A native sidecar: an init container with `restartPolicy: Always`."""
    return container.get("restartPolicy") == "Always"


def should_restart(pod_restart_policy: str, exit_code: int) -> bool:
    """Whether a main container that exited with `exit_code` is restarted under the pod's policy."""
    if pod_restart_policy == "Always":
        return True
    if pod_restart_policy == "OnFailure":
        return exit_code != 0
    return False


#: Crash-loop backoff of the local cluster: the kubelet's curve, shortened. Upstream: 10 s doubling to
#: 300 s (1 s to 60 s with the ReduceDefaultCrashLoopBackOffDecay gate), reset when a container ran
#: for 2x the maximum; here 1 s doubling to 20 s, reset after 40 s.
CRASH_BACKOFF_INITIAL: Final = 1.0
CRASH_BACKOFF_MAX: Final = 20.0
#: Image pull backoff: upstream 10 s doubling to 300 s; here 2 s doubling to 20 s.
IMAGE_BACKOFF_INITIAL: Final = 2.0
IMAGE_BACKOFF_MAX: Final = 20.0


@dataclass
class Backoff:
    """The kubelet's `flowcontrol.Backoff` for one key (a container, or an image of a pod), times from
    `time.monotonic()` passed in. The first failure costs nothing; each later one within the window
    doubles the wait up to `maximum`; an event more than 2x `maximum` after the last update starts over.

    The kubelet's crash loop (`doBackOff`): when a container exited at `finished`, restart it now unless
    `in_backoff_since(finished, now)`; on a restart call `next(now)`.
    """

    initial: float
    maximum: float
    delay: float = 0.0
    last_update: float | None = None

    def _expired(self, event: float) -> bool:
        return self.last_update is None or event - self.last_update > 2 * self.maximum

    def in_backoff_since(self, event: float, now: float) -> bool:
        """Whether `now` is still within the backoff counted from `event`."""
        if self._expired(event):
            return False
        return now - event < self.delay

    def next(self, now: float) -> None:
        """Record an attempt: the first (or the first after a long quiet spell) arms `initial`, each
        later one doubles the delay up to `maximum`."""
        self.delay = self.initial if self._expired(now) else min(self.delay * 2, self.maximum)
        self.last_update = now


def go_duration(seconds: float) -> str:
    """A whole number of seconds as Go prints a `time.Duration` (`10s`, `1m20s`, `5m0s`)."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    minutes, rest = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{rest}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{rest}s"


def format_pod(pod: Pod) -> str:
    """The kubelet's name for a pod in messages: `name_namespace(uid)`."""
    meta = pod.get("metadata") or {}
    return f"{meta.get('name', '')}_{meta.get('namespace', '')}({meta.get('uid', '')})"


def effective_security_context(pod: Pod, container: Container) -> dict[str, Any]:
    """The container's securityContext over the pod's (runAsUser, runAsGroup, runAsNonRoot, ...), as
    the kubelet's `DetermineEffectiveSecurityContext` merges them."""
    pod_context = (pod.get("spec") or {}).get("securityContext") or {}
    out = {k: pod_context[k] for k in ("runAsUser", "runAsGroup", "runAsNonRoot", "seLinuxOptions",
                                       "seccompProfile", "appArmorProfile") if k in pod_context}
    out.update(container.get("securityContext") or {})
    return out


def verify_run_as_non_root(pod: Pod, container: Container, uid: int | None, username: str) -> str | None:
    """The kubelet's `verifyRunAsNonRoot` for an image whose user is `uid` (or the name `username`):
    the error message (the container then waits with CreateContainerConfigError), or None."""
    context = effective_security_context(pod, container)
    if not context.get("runAsNonRoot"):
        return None
    where = f'(pod: "{format_pod(pod)}", container: {container["name"]})'
    if context.get("runAsUser") is not None:
        return f"container's runAsUser breaks non-root policy {where}" if int(context["runAsUser"]) == 0 else None
    if uid is None and username:
        return (f"container has runAsNonRoot and image has non-numeric user ({username}), cannot verify user "
                f"is non-root {where}")
    if uid == 0:
        return f"container has runAsNonRoot and image will run as root {where}"
    return None
