"""The worker template held to the restricted Pod Security profile, plus what the operator refuses besides.

The profile, field by field, is Kubernetes' "Pod Security Standards" page
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, the Baseline and Restricted
tables), checked against the API server's own implementation of it, `k8s.io/pod-security-admission`
v0.37.2 (`policy/check_*.go`, the version the local cluster runs). Every control of both tables is
here, each with its restricted fields and allowed values:

| control (level)                  | fields                                                | allowed                        |
|----------------------------------|-------------------------------------------------------|--------------------------------|
| HostProcess (B)                  | [*.]securityContext.windowsOptions.hostProcess        | unset, false                   |
| Host namespaces (B)              | hostNetwork, hostPID, hostIPC                         | unset, false                   |
| Privileged containers (B)        | <container>.securityContext.privileged                | unset, false                   |
| Capabilities (R)                 | <container>.securityContext.capabilities.add          | NET_BIND_SERVICE               |
|                                  | <container>.securityContext.capabilities.drop         | must include ALL (injected)    |
| HostPath volumes (B)             | volumes[*].hostPath                                   | unset                          |
| Host ports (B)                   | <container>.ports[*].hostPort                         | unset, 0                       |
| Host probes / lifecycle (B 1.34) | <container>.{liveness,readiness,startup}Probe.{httpGet,tcpSocket}.host, lifecycle.{postStart,preStop}.{httpGet,tcpSocket}.host | unset, "" |
| AppArmor (B)                     | [*.]securityContext.appArmorProfile.type              | RuntimeDefault, Localhost      |
|                                  | annotations container.apparmor.security.beta.kubernetes.io/* | runtime/default, localhost/* |
| SELinux (B)                      | [*.]securityContext.seLinuxOptions.type               | "", container_t, container_init_t, container_kvm_t, container_engine_t |
|                                  | [*.]securityContext.seLinuxOptions.user, .role        | unset, ""                      |
| /proc mount type (R 1.35)        | <container>.securityContext.procMount                 | unset, Default                 |
| Seccomp (R)                      | [*.]securityContext.seccompProfile.type               | RuntimeDefault, Localhost (injected when unset) |
| Sysctls (B)                      | securityContext.sysctls[*].name                       | the safe set below             |
| Volume types (R)                 | volumes[*]                                            | configMap, csi, downwardAPI, emptyDir, ephemeral, image, persistentVolumeClaim, projected, secret |
| Privilege escalation (R)         | <container>.securityContext.allowPrivilegeEscalation  | false (injected when unset)    |
| Running as non-root (R)          | [*.]securityContext.runAsNonRoot                      | true (injected when unset)     |
| Running as non-root user (R)     | [*.]securityContext.runAsUser                         | unset, non-zero                |

`[*.]` is the pod's `securityContext` and every container's; `<container>` every container, init
container and ephemeral container. Stricter than the profile in one place: the profile lets a pod in a
user namespace (`hostUsers: false`) run as root, the operator does not (it injects `runAsNonRoot: true`
into every container, which root could not start under). The profile's "Non-root groups" control is
optional and the API server does not enforce it; neither does the operator.

What the builders inject (`RESTRICTED_CONTAINER`, `RESTRICTED_POD`, the template's own securityContext
merged over them by `merge_security_context`, which always keeps `drop: [ALL]`) satisfies the "must"
rows, so a template that says nothing passes; a template is refused only for what it sets. Beyond the profile
the operator also refuses, as issue 25 asks: `nodeName` (it places the workers), `shareProcessNamespace`
(the trainer would see the sidecar's processes and files) and tolerations that tolerate every taint
(`operator: Exists` without a key: workers would land on nodes being drained or unreachable).

All of it applies unless the operator allows host access (settings.allow_host_access). Pure.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from typing import Any, Final

from ..errors import SpecProblem

PAGE: Final = "https://kubernetes.io/docs/concepts/security/pod-security-standards/"
POLICY: Final = ("the operator holds worker templates to the restricted Pod Security profile unless it allows "
                 "host access (chart value operator.allowHostAccess: true, environment "
                 "RESILAX_OPERATOR_ALLOW_HOST_ACCESS=true)")

CONTAINER_LISTS: Final = ("initContainers", "containers", "ephemeralContainers")
ALLOWED_CAPABILITIES: Final = ("NET_BIND_SERVICE",)
ALLOWED_SECCOMP: Final = ("RuntimeDefault", "Localhost")
ALLOWED_APPARMOR: Final = ("RuntimeDefault", "Localhost")
APPARMOR_ANNOTATION_PREFIX: Final = "container.apparmor.security.beta.kubernetes.io/"
ALLOWED_SELINUX_TYPES: Final = ("", "container_t", "container_init_t", "container_kvm_t", "container_engine_t")
ALLOWED_PROC_MOUNT: Final = ("Default",)
#: The profile's safe sysctls (pod-security-admission v0.37.2, `sysctlsAllowedV1Dot37`).
SAFE_SYSCTLS: Final = (
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range",
    "net.ipv4.ip_unprivileged_port_start", "net.ipv4.ip_local_reserved_ports", "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl", "net.ipv4.tcp_keepalive_probes",
    "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.ipv4.tcp_slow_start_after_idle", "net.ipv4.tcp_notsent_lowat",
)
#: Inline volume sources the restricted profile allows (a volume naming none is an emptyDir).
ALLOWED_VOLUMES: Final = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image", "persistentVolumeClaim",
                          "projected", "secret")
#: Every other inline volume source of core/v1 Volume (what a volume may name instead).
REFUSED_VOLUMES: Final = (
    "hostPath", "gcePersistentDisk", "awsElasticBlockStore", "gitRepo", "nfs", "iscsi", "glusterfs", "rbd",
    "flexVolume", "cinder", "cephfs", "flocker", "fc", "azureFile", "vsphereVolume", "quobyte", "azureDisk",
    "portworxVolume", "photonPersistentDisk", "scaleIO", "storageos",
)
PROBES: Final = ("livenessProbe", "readinessProbe", "startupProbe")
HOOKS: Final = ("postStart", "preStop")
#: What the profile requires of every container, injected by the builders into each container and init
#: container of the template (and the sidecar), the template's own securityContext merged over it.
RESTRICTED_CONTAINER: Final = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                               "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
#: The same at the pod level.
RESTRICTED_POD: Final = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def check_pod_security(template: Mapping[str, Any], path: str = "spec.template") -> list[SpecProblem]:
    """Every field of `template` the restricted profile (or the operator's own rules above) refuses,
    each naming the field, the value and what is allowed. Nulls are absent."""
    pod = template.get("spec")
    if not isinstance(pod, Mapping):
        return []
    p = f"{path}.spec"
    out: list[SpecProblem] = []
    out += _pod_fields(pod, p)
    out += _context(_obj(pod.get("securityContext")), f"{p}.securityContext", container=False)
    for key in CONTAINER_LISTS:
        for i, c in _items(pod.get(key)):
            out += _container(c, f"{p}.{key}[{i}]")
    out += _volumes(pod.get("volumes"), p)
    annotations = _obj(_obj(template.get("metadata")).get("annotations"))
    for key, value in sorted(annotations.items()):
        if key.startswith(APPARMOR_ANNOTATION_PREFIX) and value not in (None, "", "runtime/default") \
                and not str(value).startswith("localhost/"):
            out.append(_refused(f"{path}.metadata.annotations[{key}]", value, "runtime/default, localhost/<profile>"))
    return out


def fit_root_user(pod: dict[str, Any], template: Mapping[str, Any]) -> None:
    """Where a container (or the pod) runs as root, user 0 (only with host access: the restricted
    checks refuse it otherwise), the `runAsNonRoot: true` the operator injected is turned to false, so
    the kubelet does not refuse the pod ("container has runAsNonRoot and image will run as root"): the
    sidecar and the local-tier init of a root trainer's `scope: Node` folder, a container that inherits
    the pod's `runAsUser: 0`. A `runAsNonRoot` the template sets itself is kept as written. In place."""
    own_pod = template.get("securityContext") or {}
    pod_ctx = pod.get("securityContext") or {}
    if _is_root(pod_ctx.get("runAsUser")) and "runAsNonRoot" not in own_pod and pod_ctx.get("runAsNonRoot"):
        pod_ctx["runAsNonRoot"] = False
    written = {str(c.get("name")): c.get("securityContext") or {}
               for c in [*(template.get("containers") or []), *(template.get("initContainers") or [])]}
    for c in [*(pod.get("containers") or []), *(pod.get("initContainers") or [])]:
        ctx = c.get("securityContext")
        if not isinstance(ctx, dict) or not ctx.get("runAsNonRoot"):
            continue
        user = ctx["runAsUser"] if "runAsUser" in ctx else pod_ctx.get("runAsUser")
        if _is_root(user) and "runAsNonRoot" not in written.get(str(c.get("name")), {}):
            ctx["runAsNonRoot"] = False


def _is_root(user: object) -> bool:
    return user == 0 and not isinstance(user, bool)


def restricted_context(context: Mapping[str, Any] | None) -> dict[str, Any]:
    """A container's securityContext: the restricted profile's defaults with the user's merged in deeply."""
    return merge_security_context(RESTRICTED_CONTAINER, context or {})


def merge_security_context(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> dict[str, Any]:
    """`theirs` merged into `ours` key by key, objects recursively, `theirs` winning for values, nulls
    absent; `capabilities.drop` is the union, ALL first: a user's `capabilities` adds to the injected
    `drop: [ALL]`, it never replaces it (issue 25)."""
    out = copy.deepcopy(dict(ours))
    for key, value in theirs.items():
        if value is None:
            continue
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_security_context(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    kept, merged = ours.get("capabilities"), out.get("capabilities")
    if isinstance(kept, Mapping) and isinstance(merged, dict) and isinstance(merged.get("drop"), list):
        must = list(kept.get("drop") or [])
        merged["drop"] = [*must, *(d for d in merged["drop"] if d not in must)]
    return out


def _pod_fields(pod: Mapping[str, Any], p: str) -> Iterator[SpecProblem]:
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key) is True:
            yield _refused(f"{p}.{key}", True, "false (the pod's own namespaces)")
    if pod.get("shareProcessNamespace") is True:
        yield _refused(f"{p}.shareProcessNamespace", True, "false (the trainer must not see the sidecar's processes "
                       "and files)")
    for i, t in _items(pod.get("tolerations")):
        if t.get("operator") == "Exists" and not t.get("key"):
            yield _refused(f"{p}.tolerations[{i}]", dict(t), "a toleration naming its taint key (one with "
                           "operator Exists and no key tolerates every taint: nodes being drained, unreachable, "
                           "the control plane's)")
    for i, sysctl in _items(_obj(pod.get("securityContext")).get("sysctls")):
        name = sysctl.get("name")
        if name is not None and name not in SAFE_SYSCTLS:
            yield _refused(f"{p}.securityContext.sysctls[{i}].name", name, ", ".join(SAFE_SYSCTLS))


def _context(ctx: Mapping[str, Any], p: str, *, container: bool) -> Iterator[SpecProblem]:
    """The securityContext rows shared by the pod and its containers (and, with `container`, theirs)."""
    if _obj(ctx.get("windowsOptions")).get("hostProcess") is True:
        yield _refused(f"{p}.windowsOptions.hostProcess", True, "false")
    selinux = _obj(ctx.get("seLinuxOptions"))
    if selinux.get("type") not in (None, *ALLOWED_SELINUX_TYPES):
        yield _refused(f"{p}.seLinuxOptions.type", selinux.get("type"), ", ".join(map(repr, ALLOWED_SELINUX_TYPES)))
    for key in ("user", "role"):
        if selinux.get(key) not in (None, ""):
            yield _refused(f"{p}.seLinuxOptions.{key}", selinux.get(key), "unset or \"\"")
    seccomp = _obj(ctx.get("seccompProfile")).get("type")
    if seccomp is not None and seccomp not in ALLOWED_SECCOMP:
        yield _refused(f"{p}.seccompProfile.type", seccomp, ", ".join(ALLOWED_SECCOMP))
    apparmor = _obj(ctx.get("appArmorProfile")).get("type")
    if apparmor is not None and apparmor not in ALLOWED_APPARMOR:
        yield _refused(f"{p}.appArmorProfile.type", apparmor, ", ".join(ALLOWED_APPARMOR))
    if ctx.get("runAsNonRoot") is False:
        yield _refused(f"{p}.runAsNonRoot", False, "true (or unset: the operator sets true)")
    if ctx.get("runAsUser") == 0 and not isinstance(ctx.get("runAsUser"), bool):
        yield _refused(f"{p}.runAsUser", 0, "a non-zero user id, or unset (the image's USER)")
    if not container:
        return
    if ctx.get("privileged") is True:
        yield _refused(f"{p}.privileged", True, "false")
    if ctx.get("allowPrivilegeEscalation") is True:
        yield _refused(f"{p}.allowPrivilegeEscalation", True, "false (or unset: the operator sets false)")
    added = _obj(ctx.get("capabilities")).get("add")
    for i, cap in _items(added, objects=False):
        if cap not in ALLOWED_CAPABILITIES:
            yield _refused(f"{p}.capabilities.add[{i}]", cap, ", ".join(ALLOWED_CAPABILITIES) +
                           " (every other capability is dropped: drop [ALL] is always kept)")
    if ctx.get("procMount") not in (None, *ALLOWED_PROC_MOUNT):
        yield _refused(f"{p}.procMount", ctx.get("procMount"), ", ".join(ALLOWED_PROC_MOUNT))


def _container(c: Mapping[str, Any], p: str) -> Iterator[SpecProblem]:
    yield from _context(_obj(c.get("securityContext")), f"{p}.securityContext", container=True)
    for i, port in _items(c.get("ports")):
        if port.get("hostPort") not in (None, 0):
            yield _refused(f"{p}.ports[{i}].hostPort", port.get("hostPort"), "unset or 0 (a port of the pod, not "
                           "of the node)")
    handlers = [(f"{p}.{probe}", _obj(c.get(probe))) for probe in PROBES]
    lifecycle = _obj(c.get("lifecycle"))
    handlers += [(f"{p}.lifecycle.{hook}", _obj(lifecycle.get(hook))) for hook in HOOKS]
    for where, handler in handlers:
        for kind in ("httpGet", "tcpSocket"):
            host = _obj(handler.get(kind)).get("host")
            if host not in (None, ""):
                yield _refused(f"{where}.{kind}.host", host, "unset or \"\" (the pod's own IP)")


def _volumes(volumes: Any, p: str) -> Iterator[SpecProblem]:
    for i, v in _items(volumes):
        for key in REFUSED_VOLUMES:
            if v.get(key) is not None:
                yield _refused(f"{p}.volumes[{i}].{key}", f"a {key} volume", ", ".join(ALLOWED_VOLUMES) +
                               " volumes (a storage class behind a persistentVolumeClaim for anything else)")


def _refused(path: str, value: Any, allowed: str) -> SpecProblem:
    shown = value if isinstance(value, str) and value.startswith("a ") else json.dumps(value, default=str)
    return SpecProblem(path, f"{shown} is refused; allowed: {allowed}. The restricted Pod Security profile "
                             f"({PAGE}); {POLICY}")


def _obj(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _items(value: Any, *, objects: bool = True) -> Iterator[tuple[int, Any]]:
    """(index, item) of a list, skipping nulls (and, with `objects`, items that are not objects)."""
    if not isinstance(value, list):
        return
    for i, item in enumerate(value):
        if item is None or (objects and not isinstance(item, Mapping)):
            continue
        yield i, item
