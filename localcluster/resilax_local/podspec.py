"""Pure helpers that read a pod manifest the way the kubelet does: environment variables (`value`,
`valueFrom`, `envFrom`, `$(VAR)` expansion), downward-API fields, container ordering and restart rules.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping
from typing import Any

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


def restart_backoff(restart_count: int) -> float:
    """Seconds to wait before restart number `restart_count` (1, 2, 4, ... capped at 20; upstream 10 s .. 5 min)."""
    return float(min(20, 2 ** max(0, restart_count - 1)))
