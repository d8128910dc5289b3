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
        "recovery": {"maxRestarts": 20, "backoffSeconds": 10, "nodeLossGraceSeconds": 30},
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
