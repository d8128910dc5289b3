"""Sample JAXJob specs shared by the operator unit tests."""

from __future__ import annotations

from typing import Any


def good_spec() -> dict[str, Any]:
    return {
        "slices": {"accelerator": "tpu-v5-lite-podslice", "topology": "4x4", "count": 4},
        "elastic": {"minCount": 2, "maxCount": 4, "topologies": ["4x4", "2x4"], "growBack": True},
        "checkpoint": {
            "storage": "gs://bucket/runs/llama",
            "local": {"scope": "Pod", "medium": "Memory", "sizeLimit": "64Gi"},
            "every": {"steps": 1000, "minutes": 30},
            "keep": {"last": 3, "everySteps": 10000},
            "finalSave": {"onPreemption": True, "onResize": True, "timeoutSeconds": 300},
            "restore": {"step": "latest"},
        },
        # inPlace is Auto by default; these samples drive the full replacement's flows (every pod
        # replaced), and test_op_inplace.py / test_op_hang.py drive the in-place ones with Auto.
        "recovery": {"maxRestarts": 20, "backoffSeconds": 10, "nodeLossGraceSeconds": 30, "inPlace": "Never"},
        "template": {"spec": {"containers": [{"name": "trainer", "image": "example/train:1",
                                              "command": ["python", "train.py"]}]}},
    }


def _container(template: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = template["spec"]["containers"][0]
    return container


#: Malformed worker templates (issue 18): id, change to `spec.template`, the field path that must be named.
#: The API server refuses each at apply (test_op_crd_apiserver.py); the operator turns each into
#: InvalidSpec naming the field, never an exception (test_op_podtemplate.py).
MALFORMED_TEMPLATES: list[tuple[str, Any, str]] = [
    ("env-as-map", lambda t: _container(t).update(env={"LR": "0.1"}), "spec.template.spec.containers[0].env"),
    ("security-context-as-string", lambda t: _container(t).update(securityContext="restricted"),
     "spec.template.spec.containers[0].securityContext"),
    ("labels-as-list", lambda t: t.update(metadata={"labels": ["team-a"]}), "spec.template.metadata.labels"),
    ("command-as-string", lambda t: _container(t).update(command="python train.py"),
     "spec.template.spec.containers[0].command"),
    ("ports-as-object", lambda t: _container(t).update(ports={"containerPort": 8080}),
     "spec.template.spec.containers[0].ports"),
    ("resource-limits-as-list", lambda t: _container(t).update(resources={"limits": ["cpu"]}),
     "spec.template.spec.containers[0].resources.limits"),
    ("env-value-as-number", lambda t: _container(t).update(env=[{"name": "LR", "value": 0.1}]),
     "spec.template.spec.containers[0].env[0].value"),
    ("volume-mount-without-path", lambda t: _container(t).update(volumeMounts=[{"name": "data"}]),
     "spec.template.spec.containers[0].volumeMounts[0].mountPath"),
    ("node-selector-as-list", lambda t: t["spec"].update(nodeSelector=["pool-a"]), "spec.template.spec.nodeSelector"),
    ("tolerations-as-object", lambda t: t["spec"].update(tolerations={"key": "x", "operator": "Exists"}),
     "spec.template.spec.tolerations"),
    ("grace-as-string", lambda t: t["spec"].update(terminationGracePeriodSeconds="thirty"),
     "spec.template.spec.terminationGracePeriodSeconds"),
    ("annotation-value-as-number", lambda t: t.update(metadata={"annotations": {"owner": 7}}),
     "spec.template.metadata.annotations.owner"),
]

#: Typos: unknown fields. The API server prunes them (refuses them with `kubectl apply`'s strict field
#: validation); the operator names them when an object stored before the schema has them.
TEMPLATE_TYPOS: list[tuple[str, Any, str]] = [
    ("image-pull-policy-typo", lambda t: _container(t).update(imagePullPolcy="Always"),
     "spec.template.spec.containers[0].imagePullPolcy"),
    ("node-selector-typo", lambda t: t["spec"].update(nodeSelecter={"pool": "a"}), "spec.template.spec.nodeSelecter"),
]

#: Templates asking for the node itself: refused unless the operator allows host access.
HOST_ACCESS_TEMPLATES: list[tuple[str, Any, str]] = [
    ("privileged", lambda t: _container(t).update(securityContext={"privileged": True}),
     "spec.template.spec.containers[0].securityContext.privileged"),
    ("host-network", lambda t: t["spec"].update(hostNetwork=True), "spec.template.spec.hostNetwork"),
    ("host-pid", lambda t: t["spec"].update(hostPID=True), "spec.template.spec.hostPID"),
    ("host-path", lambda t: t["spec"].update(volumes=[{"name": "h", "hostPath": {"path": "/var/run"}}]),
     "spec.template.spec.volumes[0].hostPath"),
]


def _ctx(template: dict[str, Any], **values: Any) -> None:
    """Set fields of the trainer's securityContext."""
    _container(template).setdefault("securityContext", {}).update(values)


def _pod_ctx(template: dict[str, Any], **values: Any) -> None:
    template["spec"].setdefault("securityContext", {}).update(values)


def _init(template: dict[str, Any], **fields: Any) -> None:
    """Add a user init container with these fields."""
    template["spec"]["initContainers"] = [{"name": "prepare", "image": "example/prep:1", **fields}]


C0: str = "spec.template.spec.containers[0]"
POD: str = "spec.template.spec"

#: The restricted Pod Security profile, row by row (issue 25, item 5): id, change to `spec.template`, the
#: field path the InvalidSpec must name, and whether the API server itself refuses the pod the builders
#: make from it in a namespace enforcing `restricted` (test_op_crd_apiserver.py; False: the operator's own
#: rules beyond the profile).
RESTRICTED_TEMPLATES: list[tuple[str, Any, str, bool]] = [
    ("cap-add-sys-admin", lambda t: _ctx(t, capabilities={"add": ["SYS_ADMIN"]}),
     f"{C0}.securityContext.capabilities.add[0]", True),
    ("cap-add-net-admin-beside-allowed", lambda t: _ctx(t, capabilities={"add": ["NET_BIND_SERVICE", "NET_ADMIN"]}),
     f"{C0}.securityContext.capabilities.add[1]", True),
    ("cap-add-sys-ptrace-init", lambda t: _init(t, securityContext={"capabilities": {"add": ["SYS_PTRACE"]}}),
     f"{POD}.initContainers[0].securityContext.capabilities.add[0]", True),
    ("run-as-user-0", lambda t: _ctx(t, runAsUser=0), f"{C0}.securityContext.runAsUser", True),
    ("pod-run-as-user-0", lambda t: _pod_ctx(t, runAsUser=0), f"{POD}.securityContext.runAsUser", True),
    ("run-as-non-root-false", lambda t: _ctx(t, runAsNonRoot=False), f"{C0}.securityContext.runAsNonRoot", True),
    ("pod-run-as-non-root-false", lambda t: _pod_ctx(t, runAsNonRoot=False), f"{POD}.securityContext.runAsNonRoot",
     True),
    ("allow-privilege-escalation", lambda t: _ctx(t, allowPrivilegeEscalation=True),
     f"{C0}.securityContext.allowPrivilegeEscalation", True),
    ("init-allow-privilege-escalation", lambda t: _init(t, securityContext={"allowPrivilegeEscalation": True}),
     f"{POD}.initContainers[0].securityContext.allowPrivilegeEscalation", True),
    ("seccomp-unconfined", lambda t: _ctx(t, seccompProfile={"type": "Unconfined"}),
     f"{C0}.securityContext.seccompProfile.type", True),
    ("pod-seccomp-unconfined", lambda t: _pod_ctx(t, seccompProfile={"type": "Unconfined"}),
     f"{POD}.securityContext.seccompProfile.type", True),
    ("apparmor-unconfined", lambda t: _ctx(t, appArmorProfile={"type": "Unconfined"}),
     f"{C0}.securityContext.appArmorProfile.type", True),
    ("pod-apparmor-unconfined", lambda t: _pod_ctx(t, appArmorProfile={"type": "Unconfined"}),
     f"{POD}.securityContext.appArmorProfile.type", True),
    ("apparmor-annotation-unconfined", lambda t: t.setdefault("metadata", {}).update(
        annotations={"container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}),
     "spec.template.metadata.annotations[container.apparmor.security.beta.kubernetes.io/trainer]", True),
    ("proc-mount-unmasked", lambda t: _ctx(t, procMount="Unmasked"), f"{C0}.securityContext.procMount", True),
    ("privileged", lambda t: _ctx(t, privileged=True), f"{C0}.securityContext.privileged", True),
    ("init-privileged", lambda t: _init(t, securityContext={"privileged": True}),
     f"{POD}.initContainers[0].securityContext.privileged", True),
    ("host-network", lambda t: t["spec"].update(hostNetwork=True), f"{POD}.hostNetwork", True),
    ("host-pid", lambda t: t["spec"].update(hostPID=True), f"{POD}.hostPID", True),
    ("host-ipc", lambda t: t["spec"].update(hostIPC=True), f"{POD}.hostIPC", True),
    ("host-path", lambda t: t["spec"].update(volumes=[{"name": "h", "hostPath": {"path": "/var/run"}}]),
     f"{POD}.volumes[0].hostPath", True),
    ("nfs-volume", lambda t: t["spec"].update(volumes=[{"name": "n", "nfs": {"server": "nfs.local", "path": "/x"}}]),
     f"{POD}.volumes[0].nfs", True),
    ("host-port", lambda t: _container(t).update(ports=[{"containerPort": 9000, "hostPort": 9000}]),
     f"{C0}.ports[0].hostPort", True),
    ("unsafe-sysctl", lambda t: _pod_ctx(t, sysctls=[{"name": "kernel.msgmax", "value": "65536"}]),
     f"{POD}.securityContext.sysctls[0].name", True),
    ("selinux-type", lambda t: _ctx(t, seLinuxOptions={"type": "spc_t"}), f"{C0}.securityContext.seLinuxOptions.type",
     True),
    ("pod-selinux-user", lambda t: _pod_ctx(t, seLinuxOptions={"user": "system_u"}),
     f"{POD}.securityContext.seLinuxOptions.user", True),
    ("windows-host-process", lambda t: _ctx(t, windowsOptions={"hostProcess": True}),
     f"{C0}.securityContext.windowsOptions.hostProcess", True),
    ("probe-host", lambda t: _container(t).update(
        readinessProbe={"httpGet": {"host": "169.254.169.254", "path": "/", "port": 80}}),
     f"{C0}.readinessProbe.httpGet.host", True),
    ("lifecycle-host", lambda t: _container(t).update(
        lifecycle={"preStop": {"tcpSocket": {"host": "10.0.0.1", "port": 80}}}),
     f"{C0}.lifecycle.preStop.tcpSocket.host", True),
    # Beyond the profile (issue 25): the API server would take these.
    ("share-process-namespace", lambda t: t["spec"].update(shareProcessNamespace=True),
     f"{POD}.shareProcessNamespace", False),
    ("tolerate-every-taint", lambda t: t["spec"].update(tolerations=[{"operator": "Exists"}]),
     f"{POD}.tolerations[0]", False),
    ("user-namespace-root", lambda t: (t["spec"].update(hostUsers=False), _ctx(t, runAsUser=0)),
     f"{C0}.securityContext.runAsUser", False),
]

#: Refused whatever the operator allows: id, change, path.
ALWAYS_REFUSED_TEMPLATES: list[tuple[str, Any, str]] = [
    ("node-name", lambda t: t["spec"].update(nodeName="node-7"), f"{POD}.nodeName"),
    ("ephemeral-containers", lambda t: t["spec"].update(
        ephemeralContainers=[{"name": "debug", "image": "busybox", "securityContext": {"privileged": True}}]),
     f"{POD}.ephemeralContainers"),
]

#: What the restricted profile allows, at its edges: accepted by the operator and, built into pods, by
#: the API server enforcing `restricted`.
RESTRICTED_ALLOWED_TEMPLATES: list[tuple[str, Any]] = [
    ("cap-add-net-bind-service", lambda t: _ctx(t, capabilities={"add": ["NET_BIND_SERVICE"], "drop": ["NET_RAW"]})),
    ("run-as-user-1000", lambda t: (_ctx(t, runAsUser=1000, runAsGroup=1000),
                                    _pod_ctx(t, runAsUser=1000, fsGroup=1000, supplementalGroups=[1000]))),
    ("seccomp-localhost", lambda t: _ctx(t, seccompProfile={"type": "Localhost", "localhostProfile": "train.json"})),
    ("apparmor-runtime-default", lambda t: _pod_ctx(t, appArmorProfile={"type": "RuntimeDefault"})),
    ("safe-sysctls", lambda t: _pod_ctx(t, sysctls=[{"name": "net.ipv4.tcp_keepalive_time", "value": "60"},
                                                    {"name": "net.ipv4.ip_local_port_range", "value": "1024 65000"}])),
    ("restricted-volume-types", lambda t: t["spec"].update(volumes=[
        {"name": "a", "configMap": {"name": "c"}}, {"name": "b", "secret": {"secretName": "s"}},
        {"name": "c", "downwardAPI": {"items": [{"path": "l", "fieldRef": {"fieldPath": "metadata.labels"}}]}},
        {"name": "d", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}},
        {"name": "e", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "volumeAttributes": {"bucketName": "b"}}},
        {"name": "f", "ephemeral": {"volumeClaimTemplate": {"spec": {
            "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}}},
        {"name": "g", "persistentVolumeClaim": {"claimName": "data"}}, {"name": "h", "emptyDir": {}},
        {"name": "i"}])),
    ("host-port-0", lambda t: _container(t).update(ports=[{"containerPort": 9000, "hostPort": 0}])),
    ("selinux-container-t", lambda t: _ctx(t, seLinuxOptions={"type": "container_t", "level": "s0:c1,c2"})),
    ("proc-mount-default", lambda t: _ctx(t, procMount="Default")),
    ("keyed-toleration", lambda t: t["spec"].update(tolerations=[{"key": "team", "operator": "Exists"}])),
    ("probe-without-host", lambda t: _container(t).update(
        readinessProbe={"httpGet": {"path": "/", "port": 80}}, lifecycle={"preStop": {"sleep": {"seconds": 1}}})),
    ("init-container", lambda t: _init(t, securityContext={"runAsUser": 1000})),
    ("apparmor-annotation-runtime-default", lambda t: t.setdefault("metadata", {}).update(
        annotations={"container.apparmor.security.beta.kubernetes.io/trainer": "runtime/default"})),
]
