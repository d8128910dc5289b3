"""The chart, statically: `helm lint --strict`, and the objects `helm template` renders with the default
values, in namespaced mode, with a ServiceMonitor, with GKE's managed Prometheus, and with features off; values.schema.json rejects bad
values with a message that names the field."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import (
    CHART,
    RELEASE,
    RELEASE_NAMESPACE,
    by_kind,
    is_node_sweeper,
    one,
    operator_rules,
    write_values,
)

CLUSTER_SCOPED = {"nodes", "leases", "namespaces", "customresourcedefinitions", "clusterkopfpeerings"}
RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                           "projected", "secret"}
NAMESPACED_VALUES = {"operator": {"watchNamespaces": ["team-a", "team-b"]}}


def restricted_violations(pod_spec: dict[str, Any]) -> list[str]:
    """What keeps a pod spec from the `restricted` Pod Security Standard (the checks of v1.30+)."""
    problems = []
    pod_sc = pod_spec.get("securityContext") or {}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(flag):
            problems.append(f"{flag} is true")
    for volume in pod_spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            problems.append(f"volume {volume['name']} is of type {sorted(kinds)}")
    for container in (pod_spec.get("initContainers") or []) + pod_spec["containers"]:
        sc = container.get("securityContext") or {}
        where = f"container {container['name']}"
        if sc.get("privileged"):
            problems.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{where}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            problems.append(f"{where}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            problems.append(f"{where}: adds capabilities {caps['add']}")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            problems.append(f"{where}: runAsNonRoot is not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append(f"{where}: runAsUser is 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{where}: seccompProfile is {seccomp!r}")
        if any(p.get("hostPort") for p in container.get("ports") or []):
            problems.append(f"{where}: hostPort")
    return problems


def deployment_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = one(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def rbac_rules(objects: list[dict[str, Any]], kind: str) -> list[list[dict[str, Any]]]:
    return [o["rules"] for o in by_kind(objects, kind)]


# ---- helm lint ------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{}, NAMESPACED_VALUES, {"metrics": {"serviceMonitor": {"enabled": True}}},
                                    {**NAMESPACED_VALUES, "metrics": {"managedPrometheus": {"enabled": True, "rules": True}}}],
                         ids=["default", "namespaced", "servicemonitor", "managed-prometheus"])
def test_helm_lint_strict(helm, tmp_path: Path, values: dict[str, Any]) -> None:
    proc = helm("lint", "--strict", str(CHART), "-f", str(write_values(tmp_path / "v.yaml", values)))
    assert proc.returncode == 0, f"helm lint --strict:\n{proc.stdout}{proc.stderr}"
    assert "0 chart(s) failed" in proc.stdout


# ---- default values -------------------------------------------------------------------------------


@pytest.fixture
def default_objects(render) -> list[dict[str, Any]]:
    return render()


def test_default_renders_the_expected_objects(default_objects: list[dict[str, Any]]) -> None:
    kinds = sorted(o["kind"] for o in default_objects)
    assert kinds == sorted([
        "CustomResourceDefinition", "CustomResourceDefinition", "CustomResourceDefinition",
        "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ClusterKopfPeering",
        "PriorityClass",
    ])
    for obj in default_objects:
        labels = obj["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/part-of") == "resilax", (obj["kind"], obj["metadata"]["name"])
        if obj["kind"] in ("ServiceAccount", "Deployment", "Service"):
            assert obj["metadata"]["namespace"] == RELEASE_NAMESPACE


def test_crds_are_the_single_sources(default_objects: list[dict[str, Any]]) -> None:
    crds = {o["metadata"]["name"]: o for o in by_kind(default_objects, "CustomResourceDefinition")}
    assert set(crds) == {"jaxjobs.resilax.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"}
    assert crds["jaxjobs.resilax.dev"] == yaml.safe_load((CHART / "crds" / "jaxjobs.resilax.dev.yaml").read_text())
    peering = list(yaml.safe_load_all((CHART / "crds" / "kopf-peering.yaml").read_text()))
    assert [crds[p["metadata"]["name"]] for p in peering] == peering
    assert crds["clusterkopfpeerings.kopf.dev"]["spec"]["scope"] == "Cluster"
    assert crds["kopfpeerings.kopf.dev"]["spec"]["scope"] == "Namespaced"
    for name in ("kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"):
        (version,) = crds[name]["spec"]["versions"]
        assert version["name"] == "v1" and version["served"] and version["storage"]
        status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
        assert status["x-kubernetes-preserve-unknown-fields"] is True


def test_deployment_runs_the_operator_cluster_wide_with_peering(default_objects: list[dict[str, Any]]) -> None:
    deployment = one(default_objects, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == one(default_objects, "ServiceAccount")["metadata"]["name"] == "resilax-operator"
    container = deployment_container(default_objects)
    assert container["image"] == "ghcr.io/resilax/resilax:0.1.0"  # the chart's appVersion
    assert container["command"] == ["resilax"]
    args = container["args"]
    assert args[0] == "operator"
    assert "--all-namespaces" in args and not any(a.startswith("--namespace") for a in args)
    peering = one(default_objects, "ClusterKopfPeering")
    assert f"--peering={peering['metadata']['name']}" in args
    assert "--liveness=http://$(RESILAX_POD_IP):8080/healthz" in args
    assert "--metrics-bind-address=$(RESILAX_POD_IP):9090" in args
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["RESILAX_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["RESILAX_OPERATOR_SIDECAR_IMAGE"]["value"] == container["image"]
    assert env["RESILAX_OPERATOR_LOCAL_TIER_ROOT"]["value"] == "/var/lib/resilax/local"
    assert env["RESILAX_OPERATOR_LOCAL_TIER_MEMORY_ROOT"]["value"] == "/dev/shm/resilax"
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # JSON log lines by default, the operator's and (passed on) the sidecars' (tests/test_logging.py).
    assert "--log-format=json" in args and env["RESILAX_OPERATOR_SIDECAR_LOG_FORMAT"]["value"] == "json"


def test_log_format_text_reaches_the_operator_the_sidecars_and_the_sweeper(render) -> None:
    objects = render({"logFormat": "text"}, node_sweeper=True)
    container = deployment_container(objects)
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert "--log-format=text" in container["args"] and env["RESILAX_OPERATOR_SIDECAR_LOG_FORMAT"] == "text"
    sweeper = one([o for o in objects if is_node_sweeper(o)], "DaemonSet")["spec"]["template"]["spec"]
    assert "--log-format=text" in sweeper["containers"][0]["args"]


def test_pod_meets_the_restricted_profile(default_objects: list[dict[str, Any]]) -> None:
    pod = one(default_objects, "Deployment")["spec"]["template"]["spec"]
    assert restricted_violations(pod) == []
    assert pod["securityContext"]["runAsUser"] == 65532
    container = deployment_container(default_objects)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["runAsUser"] == 65532
    # The only writable place: an emptyDir on /tmp.
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"] == [{"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}}]


def test_restricted_checker_catches_violations() -> None:
    pod = {"hostNetwork": True, "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
           "containers": [{"name": "c", "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}},
                           "ports": [{"containerPort": 1, "hostPort": 1}]}]}
    problems = restricted_violations(pod)
    assert len(problems) == 9, problems


def test_cluster_role_rules_equal_the_rules_file(default_objects: list[dict[str, Any]]) -> None:
    assert rbac_rules(default_objects, "ClusterRole") == [operator_rules()]
    assert by_kind(default_objects, "Role") == []
    binding = one(default_objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": one(default_objects, "ClusterRole")["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "resilax-operator",
                                    "namespace": RELEASE_NAMESPACE}]


def test_rules_file_is_least_privilege() -> None:
    rules = operator_rules()
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames, no nonResourceURLs
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key] and all("*" not in v for v in rule[key]), f"wildcard in {rule}"
        assert not {"escalate", "bind", "impersonate", "deletecollection"} & set(rule["verbs"]), rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert (group, resource) not in granted, f"{group}/{resource} appears in two rules"
                granted[(group, resource)] = set(rule["verbs"])
    # What the operator needs, and no more (the operator's cluster tests prove it with this role's token).
    assert granted == {
        ("resilax.dev", "jaxjobs"): {"get", "list", "watch", "patch", "delete"},  # delete: ttlSecondsAfterFinished
        ("resilax.dev", "jaxjobs/status"): {"get", "patch"},
        ("", "pods"): {"get", "list", "watch", "create", "delete", "patch"},
        ("", "services"): {"get", "list", "watch", "create", "delete"},
        ("", "secrets"): {"get", "create", "delete"},  # no patch: a rotation re-creates it (issue 40)
        ("", "nodes"): {"get", "list", "watch"},
        ("coordination.k8s.io", "leases"): {"get"},
        ("", "events"): {"create", "patch"},
        ("events.k8s.io", "events"): {"create", "patch"},
        ("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "patch"},
        ("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"},
        ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
        ("", "namespaces"): {"list", "watch"},
    }


def test_every_rule_has_a_comment() -> None:
    """Each rule says why it is there: a comment line right above its `- apiGroups:`."""
    lines = (CHART / "files" / "operator-rules.yaml").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("- apiGroups:")]
    assert len(starts) == len(operator_rules())
    for i in starts:
        assert lines[i - 1].startswith("#"), f"rule at line {i + 1} has no comment above it"


def test_metrics_service_selects_the_operator_pods(default_objects: list[dict[str, Any]]) -> None:
    service = one(default_objects, "Service")
    pod_labels = one(default_objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}]
    ports = {p["name"]: p["containerPort"] for p in deployment_container(default_objects)["ports"]}
    assert ports == {"health": 8080, "metrics": 9090}
    assert by_kind(default_objects, "ServiceMonitor") == []


# ---- namespaced mode ------------------------------------------------------------------------------


def test_namespaced_mode(render) -> None:
    objects = render(NAMESPACED_VALUES)
    args = deployment_container(objects)["args"]
    assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--all-namespaces" not in args

    rules = operator_rules()
    cluster_rules = [r for r in rules if set(r["resources"]) <= CLUSTER_SCOPED]
    namespaced_rules = [r for r in rules if not set(r["resources"]) & CLUSTER_SCOPED]
    assert len(cluster_rules) + len(namespaced_rules) == len(rules)
    assert rbac_rules(objects, "ClusterRole") == [cluster_rules]

    roles = by_kind(objects, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert all(r["rules"] == namespaced_rules for r in roles)
    bindings = by_kind(objects, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for binding in bindings:
        assert binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "resilax-operator",
                                        "namespace": RELEASE_NAMESPACE}]

    peerings = by_kind(objects, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert by_kind(objects, "ClusterKopfPeering") == []
    assert {f"--peering={p['metadata']['name']}" for p in peerings} <= set(args)


# ---- options --------------------------------------------------------------------------------------


def test_service_monitor(render) -> None:
    objects = render({"metrics": {"serviceMonitor": {"enabled": True, "interval": "15s",
                                                     "labels": {"release": "prom"}}}})
    monitor = one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    service = one(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [RELEASE_NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s",
                                             "scrapeTimeout": "10s", "honorLabels": True}]


def test_standby_replicas_need_peering(helm, render, tmp_path: Path) -> None:
    assert one(render({"operator": {"replicas": 2}}), "Deployment")["spec"]["replicas"] == 2
    values = {"operator": {"replicas": 2, "leaderElection": {"enabled": False}}}
    proc = helm("template", RELEASE, str(CHART), "-f", str(write_values(tmp_path / "v.yaml", values)))
    assert proc.returncode != 0
    assert "operator.replicas > 1 needs operator.leaderElection.enabled=true" in proc.stderr


@pytest.mark.parametrize("values", [{}, NAMESPACED_VALUES], ids=["cluster-wide", "namespaced"])
def test_sidecar_pod_monitor(render, values: dict[str, Any]) -> None:
    assert by_kind(render(values), "PodMonitor") == []
    objects = render({**values, "metrics": {"sidecarPodMonitor": {"enabled": True}}})
    monitor = one(objects, "PodMonitor")
    # The operator labels workers resilax.dev/role=worker and names the sidecar's port "sidecar".
    from resilax_operator import api

    assert monitor["spec"]["selector"] == {"matchLabels": {api.LABEL_ROLE: api.ROLE_WORKER}}
    assert monitor["spec"]["podMetricsEndpoints"] == [{
        "port": "sidecar", "path": "/metrics", "interval": "30s",
        "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_label_resilax_dev_job"], "targetLabel": "jaxjob"}]}]
    assert monitor["spec"]["podTargetLabels"] == [api.LABEL_GENERATION, api.LABEL_SLICE, api.LABEL_PROCESS]
    expected = {"matchNames": ["team-a", "team-b"]} if values else {"any": True}
    assert monitor["spec"]["namespaceSelector"] == expected


GMP = "monitoring.googleapis.com/v1"


@pytest.mark.parametrize("values", [{}, NAMESPACED_VALUES], ids=["cluster-wide", "namespaced"])
def test_managed_prometheus_pod_monitorings(render, values: dict[str, Any]) -> None:
    """GKE's managed Prometheus scrapes what the ServiceMonitor and the PodMonitor scrape, with the same
    series labels: the operator without a `namespace` target label (its series keep the job's), the
    sidecars with `jaxjob`, `namespace`, `pod` and the PodMonitor's `resilax_dev_*` names; with `rules`,
    the alerts as a ClusterRules."""
    import re

    from resilax_operator import api

    assert [o for o in render(values) if o["apiVersion"] == GMP] == []
    objects = render({**values, "metrics": {"managedPrometheus": {"enabled": True, "interval": "15s",
                                                                  "labels": {"team": "ml"}}}})
    gmp = [o for o in objects if o["apiVersion"].startswith("monitoring.googleapis.com/")]
    assert all(o["apiVersion"] == GMP and o["metadata"]["labels"]["team"] == "ml" for o in gmp)

    (operator,) = [o for o in gmp if o["metadata"]["name"] == "resilax-operator"]
    assert operator["kind"] == "ClusterPodMonitoring" and "namespace" not in operator["metadata"]
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert operator["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert "metrics" in {p["name"] for p in deployment_container(objects)["ports"]}
    assert operator["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    assert "namespace" not in operator["spec"]["targetLabels"]["metadata"]

    sidecars = [o for o in gmp if o["metadata"]["name"] == "resilax-sidecars"]
    assert len(gmp) == 1 + len(sidecars)
    pod_monitor = one(render({**values, "metrics": {"sidecarPodMonitor": {"enabled": True}}}), "PodMonitor")
    sanitized = [re.sub(r"[^a-zA-Z0-9_]", "_", label) for label in pod_monitor["spec"]["podTargetLabels"]]
    expected_from_pod = [{"from": api.LABEL_JOB, "to": "jaxjob"}] + [
        {"from": label, "to": name} for label, name in zip(pod_monitor["spec"]["podTargetLabels"], sanitized,
                                                          strict=True)]
    for monitor in sidecars:
        spec = monitor["spec"]
        assert spec["selector"] == {"matchLabels": {api.LABEL_ROLE: api.ROLE_WORKER}}
        assert spec["endpoints"] == [{"port": "sidecar", "path": "/metrics", "interval": "15s"}]
        assert spec["targetLabels"]["fromPod"] == expected_from_pod
    if values:
        assert {(m["kind"], m["metadata"]["namespace"]) for m in sidecars} == {
            ("PodMonitoring", "team-a"), ("PodMonitoring", "team-b")}
        # A PodMonitoring always sets `namespace` (its own: the worker's); `metadata` may not name it.
        assert all(m["spec"]["targetLabels"]["metadata"] == ["pod", "container"] for m in sidecars)
    else:
        (monitor,) = sidecars
        assert monitor["kind"] == "ClusterPodMonitoring" and "namespace" not in monitor["metadata"]
        assert monitor["spec"]["targetLabels"]["metadata"] == ["namespace", "pod", "container"]

    # Without the operator's metrics endpoint, only the sidecars are scraped.
    objects = render({**values, "metrics": {"enabled": False, "managedPrometheus": {"enabled": True}}})
    assert {o["metadata"]["name"] for o in objects if o["apiVersion"] == GMP} == {"resilax-sidecars"}

    # With rules: the alerts as a ClusterRules for GMP's rule evaluator, the file's groups as they are.
    objects = render({**values, "metrics": {"managedPrometheus": {"enabled": True, "rules": True}}})
    rules = [o for o in objects if o["apiVersion"] == GMP and o["kind"] == "ClusterRules"]
    assert [r["metadata"]["name"] for r in rules] == ["resilax-alerts"] and "namespace" not in rules[0]["metadata"]
    assert rules[0]["spec"] == {"groups": yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())["groups"]}


def test_service_monitor_needs_metrics(helm, tmp_path: Path) -> None:
    values = {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}}
    proc = helm("template", RELEASE, str(CHART), "-f", str(write_values(tmp_path / "v.yaml", values)))
    assert proc.returncode != 0
    assert "metrics.serviceMonitor.enabled=true needs metrics.enabled=true" in proc.stderr


def test_features_off(render) -> None:
    objects = render({"metrics": {"enabled": False}, "operator": {"leaderElection": {"enabled": False},
                                                                  "healthPort": 0},
                      "rbac": {"create": False}, "serviceAccount": {"create": False, "name": "mine"},
                      "spares": {"priorityClass": {"create": False}}})
    assert sorted({o["kind"] for o in objects}) == ["CustomResourceDefinition", "Deployment"]
    container = deployment_container(objects)
    assert "--standalone" in container["args"]
    assert not any(a.startswith(("--peering", "--liveness", "--metrics")) for a in container["args"])
    assert "ports" not in container and "livenessProbe" not in container
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "mine"


def test_images_and_overrides(render) -> None:
    objects = render({"image": {"repository": "registry.example/resilax", "tag": "1.2.3"},
                      "sidecar": {"image": {"repository": "registry.example/sidecar", "tag": "9"}},
                      "operator": {"extraArgs": ["--verbose"], "env": [{"name": "X", "value": "1"}],
                                   "nodeSelector": {"pool": "system"},
                                   "localTier": {"root": "/mnt/nvme/resilax", "memoryRoot": "/dev/shm/rx"}},
                      "fullnameOverride": "rx"})
    deployment = one(objects, "Deployment")
    assert deployment["metadata"]["name"] == "rx-operator"
    container = deployment_container(objects)
    assert container["image"] == "registry.example/resilax:1.2.3"
    assert container["args"][-1] == "--verbose"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["RESILAX_OPERATOR_SIDECAR_IMAGE"] == "registry.example/sidecar:9" and env["X"] == "1"
    assert env["RESILAX_OPERATOR_LOCAL_TIER_ROOT"] == "/mnt/nvme/resilax"
    assert env["RESILAX_OPERATOR_LOCAL_TIER_MEMORY_ROOT"] == "/dev/shm/rx"
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "system"}
    digest = "sha256:" + "a" * 64
    assert deployment_container(render({"image": {"digest": digest}}))["image"] == f"ghcr.io/resilax/resilax@{digest}"


def test_a_rule_mixing_scopes_fails_the_render(helm, tmp_path: Path) -> None:
    chart = tmp_path / "resilax"
    shutil.copytree(CHART, chart)
    rules = [*operator_rules(), {"apiGroups": [""], "resources": ["nodes", "pods"], "verbs": ["get"]}]
    (chart / "files" / "operator-rules.yaml").write_text(yaml.safe_dump(rules))
    values = write_values(tmp_path / "v.yaml", NAMESPACED_VALUES)
    proc = helm("template", RELEASE, str(chart), "-f", str(values))
    assert proc.returncode != 0
    assert "mixes cluster-scoped and namespaced resources" in proc.stderr


# ---- values.schema.json ---------------------------------------------------------------------------


@pytest.mark.parametrize(("values", "expected"), [
    pytest.param({"operator": {"replicas": "two"}}, ["/operator/replicas", "integer"], id="replicas-string"),
    pytest.param({"operator": {"replicas": -1}}, ["/operator/replicas", "minimum"], id="replicas-negative"),
    pytest.param({"operator": {"replica": 1}}, ["replica"], id="unknown-key"),
    pytest.param({"image": {"pullPolicy": "Sometimes"}}, ["/image/pullPolicy"], id="pull-policy"),
    pytest.param({"operator": {"watchNamespaces": ["Team_A"]}}, ["/operator/watchNamespaces/0"], id="bad-namespace"),
    pytest.param({"operator": {"watchNamespaces": "team-a"}}, ["/operator/watchNamespaces", "array"],
                 id="namespaces-not-a-list"),
    pytest.param({"metrics": {"port": 70000}}, ["/metrics/port"], id="port-range"),
    pytest.param({"metrics": {"serviceMonitor": {"interval": "soon"}}}, ["/metrics/serviceMonitor/interval"],
                 id="duration"),
    pytest.param({"image": {"digest": "latest"}}, ["/image/digest"], id="digest"),
])
def test_schema_rejects_bad_values(helm, tmp_path: Path, values: dict[str, Any], expected: list[str]) -> None:
    proc = helm("template", RELEASE, str(CHART), "-f", str(write_values(tmp_path / "v.yaml", values)))
    assert proc.returncode != 0, f"accepted {values}"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    for fragment in expected:
        assert fragment in proc.stderr, f"{fragment!r} not in:\n{proc.stderr}"


def test_schema_documents_every_default_value() -> None:
    """Every key of values.yaml is in the schema, and every key has a `# --` doc comment above it."""
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(node: dict[str, Any], sub: dict[str, Any], path: str) -> None:
        for key, value in node.items():
            assert key in sub.get("properties", {}), f"{path}{key} is not in values.schema.json"
            prop = sub["properties"][key]
            if isinstance(value, dict) and prop.get("properties"):
                walk(value, prop, f"{path}{key}.")

    walk(values, schema, "")
    # A leaf is documented by a `# --` comment block right above it, or above one of its parents.
    lines = (CHART / "values.yaml").read_text().splitlines()
    stack: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "-")) or ":" not in stripped:
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1
        documented = (j >= 0 and lines[j].strip().startswith("# --")) or any(d for _, d in stack)
        key, _, rest = stripped.partition(":")
        if rest.strip():
            assert documented, f"values.yaml:{i + 1}: {key} has no `# --` doc comment (nor a parent with one)"
        stack.append((indent, documented))


def test_prometheus_rule_and_dashboard_are_optional_and_carry_the_files(render) -> None:
    import json

    assert by_kind(render({}), "PrometheusRule") == []
    assert [c for c in by_kind(render({}), "ConfigMap") if c["metadata"]["name"].endswith("-dashboard")] == []
    objects = render({"metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "prom"}},
                                  "grafanaDashboard": {"enabled": True,
                                                       "annotations": {"grafana_folder": "Training"}}}})
    rule = one(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prom"
    assert rule["spec"] == {"groups": yaml.safe_load((CHART / "files" / "alerts.yaml").read_text())["groups"]}
    dashboard = next(c for c in by_kind(objects, "ConfigMap") if c["metadata"]["name"].endswith("-dashboard"))
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "Training"}
    assert json.loads(dashboard["data"]["resilax.json"]) == json.loads((CHART / "files" / "dashboard.json").read_text())


def test_readiness_probe_pdb_and_sidecar_resources(render) -> None:
    import json

    from resilax_operator.builders import SIDECAR_RESOURCES

    objects = render({})
    container = deployment_container(objects)
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert "PodDisruptionBudget" not in {o["kind"] for o in objects}
    env = {e["name"]: e.get("value") for e in container["env"]}
    # The chart's default is the operator's own default, so the value changes nothing until set.
    assert json.loads(env["RESILAX_OPERATOR_SIDECAR_RESOURCES"]) == SIDECAR_RESOURCES
    wanted = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}}
    objects = render({"sidecar": {"resources": wanted},
                      "operator": {"replicas": 2, "podDisruptionBudget": {"enabled": True}}})
    env = {e["name"]: e.get("value") for e in deployment_container(objects)["env"]}
    assert json.loads(env["RESILAX_OPERATOR_SIDECAR_RESOURCES"]) == wanted
    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == one(objects, "Deployment")["spec"]["selector"]["matchLabels"]


def test_notes_name_no_repository_path(helm, tmp_path: Path) -> None:
    proc = helm("install", RELEASE, str(CHART), "--dry-run", "--namespace", "resilax-system")
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "helm show crds" in notes and "kubectl apply --server-side" in notes
    assert "charts/resilax" not in notes and "docs/" not in notes.replace("/blob/main/docs/", "")


@pytest.mark.parametrize(("values", "said"), [
    ([], ["nodeSweeper.namespace=<namespace>", "nodeSweeper.enabled=false", "Autopilot"]),
    (["--set", "nodeSweeper.namespace=rx-nodes"], ['namespace rx-nodes, which must allow "privileged"']),
    (["--set", "nodeSweeper.enabled=false"], ["You may enforce it on this namespace"]),
], ids=["sweeper-here", "sweeper-elsewhere", "no-sweeper"])
def test_notes_pod_security_advice_names_the_sweepers_exception(helm, values: list[str], said: list[str]) -> None:
    """Enforcing `restricted` on the release namespace, as the notes advise, must not break the sweeper
    (root, hostPath) that runs there by default (issue 41)."""
    proc = helm("install", RELEASE, str(CHART), "--dry-run", "--namespace", "resilax-system", *values)
    assert proc.returncode == 0, proc.stderr
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "pod-security.kubernetes.io/enforce=restricted" in notes
    for text in said:
        assert text in notes, (text, notes)


# ---- the node sweeper (issue 25, item 10) -----------------------------------------------------------


def test_node_sweeper_is_one_daemonset_with_get_on_jaxjobs_only(render) -> None:
    """Default: a DaemonSet on every node (every taint tolerated) mounting the operator's two local-tier
    roots, its own ServiceAccount, and a ClusterRole that may only `get` JAXJobs."""
    objects = [o for o in render(node_sweeper=True) if is_node_sweeper(o)]
    assert sorted(o["kind"] for o in objects) == ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "ServiceAccount"]
    name = one(objects, "ServiceAccount")["metadata"]["name"]
    assert name == "resilax-node-sweeper" and all(o["metadata"]["name"] == name for o in objects)
    assert one(objects, "ClusterRole")["rules"] == [{"apiGroups": ["resilax.dev"], "resources": ["jaxjobs"],
                                                      "verbs": ["get"]}]
    binding = one(objects, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": RELEASE_NAMESPACE}]
    pod = one(objects, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == name and pod["tolerations"] == [{"operator": "Exists"}]
    (container,) = pod["containers"]
    assert container["command"] == ["resilax"]
    assert container["args"] == ["node-sweep", "--root", "/roots/disk", "--root", "/roots/memory", "--log-format=json",
                                 "--every", "600"]
    assert {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]} == {
        "disk-root": "/var/lib/resilax/local", "memory-root": "/dev/shm/resilax"}
    sc = container["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]}
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True


def test_node_sweeper_follows_the_local_tier_roots_and_can_be_turned_off(render) -> None:
    objects = render({"operator": {"localTier": {"root": "/mnt/ssd/rx", "memoryRoot": "/dev/shm/rx"}},
                      "nodeSweeper": {"intervalSeconds": 60}}, node_sweeper=True)
    pod = one([o for o in objects if is_node_sweeper(o)], "DaemonSet")["spec"]["template"]["spec"]
    assert [v["hostPath"]["path"] for v in pod["volumes"]] == ["/mnt/ssd/rx", "/dev/shm/rx"]
    assert pod["containers"][0]["args"][-1] == "60"
    assert not [o for o in render({"nodeSweeper": {"enabled": False}}, node_sweeper=True) if is_node_sweeper(o)]
    # Its own namespace (the operator's may enforce `restricted`, which refuses hostPath).
    moved = [o for o in render({"nodeSweeper": {"namespace": "rx-nodes"}}, node_sweeper=True) if is_node_sweeper(o)]
    assert {o["metadata"].get("namespace") for o in moved if o["kind"] in ("ServiceAccount", "DaemonSet")} == {
        "rx-nodes"}
    assert one(moved, "ClusterRoleBinding")["subjects"][0]["namespace"] == "rx-nodes"


def test_the_spare_priority_class_is_below_every_job_and_named_to_the_operator(
        default_objects: list[dict[str, Any]], render) -> None:
    klass = one(default_objects, "PriorityClass")
    assert klass["metadata"]["name"] == "resilax-spare" and klass["value"] == -10  # <fullname>-spare: one per release
    assert klass["preemptionPolicy"] == "Never" and klass["globalDefault"] is False
    env = {e["name"]: e.get("value") for e in deployment_container(default_objects)["env"]}
    assert env["RESILAX_OPERATOR_SPARE_PRIORITY_CLASS"] == "resilax-spare"
    # the operator needs no access to PriorityClasses (the API server's Priority admission resolves the name)
    rules = one(default_objects, "ClusterRole")["rules"]
    assert not any("priorityclasses" in r.get("resources", []) for r in rules)
    own = render({"spares": {"priorityClass": {"create": False, "name": "team-balloons"}}})
    assert not [o for o in own if o["kind"] == "PriorityClass"]
    env = {e["name"]: e.get("value") for e in deployment_container(own)["env"]}
    assert env["RESILAX_OPERATOR_SPARE_PRIORITY_CLASS"] == "team-balloons"


def test_node_sweeper_carries_the_common_labels_and_the_pull_secrets(render) -> None:
    """Issue 41: the sweeper's objects and pods carry `commonLabels`, its pods `image.pullSecrets` (a
    private registry), as the operator's do; a common label never replaces the selector's labels."""
    objects = render({"commonLabels": {"team": "ml-platform", "app.kubernetes.io/component": "clash"},
                      "image": {"pullSecrets": [{"name": "regcred"}]}}, node_sweeper=True)
    sweeper = [o for o in objects if is_node_sweeper(o)]
    assert sorted(o["kind"] for o in sweeper) == ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "ServiceAccount"]
    for obj in sweeper:
        assert obj["metadata"]["labels"]["team"] == "ml-platform", obj["kind"]
    daemonset = one(sweeper, "DaemonSet")
    template = daemonset["spec"]["template"]
    assert template["metadata"]["labels"]["team"] == "ml-platform"
    assert template["metadata"]["labels"]["app.kubernetes.io/component"] == "node-sweeper"
    assert all(template["metadata"]["labels"][k] == v for k, v in daemonset["spec"]["selector"]["matchLabels"].items())
    assert template["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    operator_pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert operator_pod["imagePullSecrets"] == template["spec"]["imagePullSecrets"]
    # The operator's objects too: the common label is added, the clashing one leaves theirs alone.
    for obj in objects:
        labels = obj["metadata"].get("labels") or {}
        if obj["kind"] != "CustomResourceDefinition" and labels.get("app.kubernetes.io/component"):
            assert labels["app.kubernetes.io/component"] != "clash" and labels["team"] == "ml-platform", obj["kind"]
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    assert "imagePullSecrets" not in one(render(node_sweeper=True), "DaemonSet")["spec"]["template"]["spec"]


def test_managed_prometheus_keeps_only_the_sidecar_series_the_alerts_and_dashboard_read(render) -> None:
    """`metrics.managedPrometheus.sidecarMetrics: alerts` (issue 41, scrape cost): the sidecars'
    PodMonitorings keep by name exactly what files/alerts.yaml and files/dashboard.json read from the
    workers (every such series matches, the histograms' buckets and the rest do not); `all` keeps all."""
    import re

    read = set()
    for name in ("alerts.yaml", "dashboard.json"):
        read |= set(re.findall(r"resilax_(?:sidecar|trainer)_[a-z_]+", (CHART / "files" / name).read_text()))
    assert read, "the alerts and the dashboard read no sidecar series?"
    values = {"metrics": {"managedPrometheus": {"enabled": True, "sidecarMetrics": "alerts"}}}
    for chart_values in (values, {**values, "operator": {"watchNamespaces": ["team-a", "team-b"]}}):
        monitors = [o for o in render(chart_values) if o["kind"] in ("PodMonitoring", "ClusterPodMonitoring")
                    and o["metadata"]["name"].endswith("-sidecars")]
        assert monitors
        for monitor in monitors:
            (endpoint,) = monitor["spec"]["endpoints"]
            (rule,) = endpoint["metricRelabeling"]
            assert (rule["action"], rule["sourceLabels"]) == ("keep", ["__name__"])
            kept = re.compile(rule["regex"])  # Prometheus anchors the regex: fullmatch
            assert not [n for n in read if not kept.fullmatch(n)]
            for dropped in ("resilax_sidecar_upload_seconds_bucket", "resilax_sidecar_requests_total",
                            "resilax_trainer_step_seconds_bucket", "python_gc_objects_collected_total"):
                assert not kept.fullmatch(dropped), dropped
    operator_monitor = next(o for o in render(values) if o["kind"] == "ClusterPodMonitoring"
                            and not o["metadata"]["name"].endswith("-sidecars"))
    assert "metricRelabeling" not in operator_monitor["spec"]["endpoints"][0]
    everything = render({"metrics": {"managedPrometheus": {"enabled": True}}})
    assert all("metricRelabeling" not in o["spec"]["endpoints"][0] for o in everything
               if o["kind"] in ("PodMonitoring", "ClusterPodMonitoring"))
