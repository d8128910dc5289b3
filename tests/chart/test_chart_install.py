"""The chart installed with helm into the local cluster (the real API server, RBAC on).

Checks: the CRDs are Established, the objects exist as rendered, the ServiceAccount's token is allowed
exactly what files/operator-rules.yaml grants (SelfSubjectAccessReviews as that ServiceAccount), and the
operator pod is scheduled and taken up by the node agent (it reports the container's status). Each release has its own name, so the
cluster-scoped objects (ClusterRole, ClusterKopfPeering) never collide with other tests'.

The operator runs in namespaced mode watching only the test's namespace, so it never acts on other
tests' JAXJobs. Once `resilax operator` exists (resilax_operator.main), the test also waits for the pod
to run and for kopf to join the peering (its keep-alive in the KopfPeering's status), which proves the
chart's command line, peering CRDs and RBAC work for the real operator.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_helpers import CHART, ROOT, doc_jaxjobs, operator_rules, write_values
from resilax_local.errors import KubeAPIError
from resilax_local.kubeapi import KubeClient
from resilax_local.testing import wait_for
from resilax_operator.api import LABEL_JOB
from resilax_operator.handlers import FINALIZER

pytestmark = pytest.mark.cluster

CRDS = ("jaxjobs.resilax.dev", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev")


def canonical(rules: list[dict[str, Any]]) -> list[str]:
    """Rules as sorted JSON strings: the API server may return a rule's keys in another order."""
    return sorted(json.dumps(rule, sort_keys=True) for rule in rules)


def established(kube: KubeClient, name: str) -> bool:
    crd = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
    return any(c["type"] == "Established" and c["status"] == "True"
               for c in crd.get("status", {}).get("conditions") or [])


def can(client: KubeClient, verb: str, group: str, resource: str, namespace: str | None) -> bool:
    """A SelfSubjectAccessReview: may the client's identity do this?"""
    subresource = ""
    if "/" in resource:
        resource, subresource = resource.split("/", 1)
    attributes: dict[str, Any] = {"verb": verb, "group": group, "resource": resource, "subresource": subresource}
    if namespace:
        attributes["namespace"] = namespace
    review = client.create("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": attributes}})
    return bool(review["status"]["allowed"])


@pytest.fixture
def release(helm, cluster, namespace: str, tmp_path: Path):
    """Install the chart (namespaced mode: the test's namespace) as a fresh release; uninstall after."""
    name = f"rx-{uuid.uuid4().hex[:6]}"
    values = write_values(tmp_path / "values.yaml", {"operator": {"watchNamespaces": [namespace]}})
    kubeconfig = str(cluster.kubeconfig)
    proc = helm("install", name, str(CHART), "--namespace", namespace, "--kubeconfig", kubeconfig,
                "-f", str(values), "--timeout", "180s")
    assert proc.returncode == 0, f"helm install failed:\n{proc.stdout}{proc.stderr}"
    assert "resilax" in proc.stdout  # NOTES.txt rendered
    yield name
    if helm("status", name, "--namespace", namespace, "--kubeconfig", kubeconfig).returncode == 0:
        # (A test may have uninstalled it itself, following docs/uninstall.md.)
        proc = helm("uninstall", name, "--namespace", namespace, "--kubeconfig", kubeconfig, "--timeout", "120s")
        assert proc.returncode == 0, f"helm uninstall failed:\n{proc.stdout}{proc.stderr}"
    # The release's objects are gone; the CRDs stay (helm never deletes crds/), and so do users' JAXJobs.
    kube = cluster.client()
    with pytest.raises(KubeAPIError) as gone:
        kube.get(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{name}-resilax-operator")
    assert gone.value.status == 404
    assert established(kube, "jaxjobs.resilax.dev")


def test_chart_installs_into_the_local_cluster(cluster, kube: KubeClient, namespace: str, release: str) -> None:
    for crd in CRDS:
        wait_for(lambda crd=crd: established(kube, crd), timeout=60, message=f"CRD {crd} Established")

    # The JAXJobs the README and the user guide show are accepted by the API server (schema + CEL).
    for doc in (ROOT / "README.md", ROOT / "docs" / "user-guide.md"):
        for job in doc_jaxjobs(doc):
            job["metadata"]["namespace"] = namespace
            kube.request("POST", f"/apis/resilax.dev/v1alpha1/namespaces/{namespace}/jaxjobs", job,
                         params={"dryRun": "All"})

    operator = f"{release}-resilax-operator"
    deployment = kube.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{operator}")
    assert deployment["spec"]["replicas"] == 1
    kube.get(f"/api/v1/namespaces/{namespace}/serviceaccounts/{operator}")
    kube.get(f"/api/v1/namespaces/{namespace}/services/{operator}-metrics")
    kube.get(f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings/{release}-resilax")

    rules = operator_rules()
    cluster_role = kube.get(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{operator}")
    role = kube.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles/{operator}")
    assert canonical(cluster_role["rules"] + role["rules"]) == canonical(rules)
    kube.get(f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{operator}")
    kube.get(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings/{operator}")

    # The ServiceAccount's own token: allowed every granted verb, refused what the rules do not grant.
    as_operator = KubeClient.from_kubeconfig(cluster.service_account_kubeconfig(namespace, operator))
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert can(as_operator, verb, group, resource, namespace), f"{verb} {group}/{resource}"
    for verb, group, resource, ns in [
        ("list", "", "secrets", namespace), ("watch", "", "secrets", namespace),
        ("create", "", "pods/exec", namespace), ("delete", "", "nodes", None), ("patch", "", "nodes", None),
        ("create", "resilax.dev", "jaxjobs", namespace), ("update", "resilax.dev", "jaxjobs", namespace),
        ("create", "rbac.authorization.k8s.io", "clusterroles", None),
        ("list", "", "pods", "kube-system"),  # namespaced mode: only the watched namespaces
        ("deletecollection", "", "pods", namespace),
    ]:
        assert not can(as_operator, verb, group, resource, ns), f"{verb} {group}/{resource} in {ns}"

    # The scheduler places the operator pod and the node agent takes it up (reports its container).
    def operator_pod() -> dict[str, Any] | None:
        pods = kube.get(f"/api/v1/namespaces/{namespace}/pods",
                        labelSelector=f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator")
        started = [p for p in pods["items"] if p["spec"].get("nodeName") and p.get("status", {}).get("containerStatuses")]
        return started[0] if started else None

    pod = wait_for(operator_pod, timeout=120, message="operator pod scheduled, container reported")
    assert pod["spec"]["serviceAccountName"] == operator

    name = pod["metadata"]["name"]

    def log_tail() -> str:
        try:
            return str(cluster.logs(namespace, name, "operator"))[-3000:]
        except Exception as e:  # the diagnostics must not hide the failure
            return f"(no log: {e})"

    def joined_peering() -> bool:
        peering = kube.get(f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings/{release}-resilax")
        return any(key.startswith(operator) for key in (peering.get("status") or {}))

    try:
        wait_for(joined_peering, timeout=120, message="the operator's keep-alive in its KopfPeering")
    except TimeoutError as e:
        status = (operator_pod() or {}).get("status", {}).get("containerStatuses")
        raise AssertionError(f"{e}\ncontainer: {status}\noperator log:\n{log_tail()}") from e


def test_cluster_wide_mode_grants_the_rules_in_one_cluster_role(helm, cluster, kube: KubeClient, namespace: str,
                                                                tmp_path: Path) -> None:
    """All-namespaces mode, operator scaled to 0 (it would act on every test's JAXJobs): RBAC only."""
    name = f"rx-{uuid.uuid4().hex[:6]}"
    values = write_values(tmp_path / "values.yaml", {"operator": {"replicas": 0}})
    kubeconfig = str(cluster.kubeconfig)
    proc = helm("install", name, str(CHART), "--namespace", namespace, "--kubeconfig", kubeconfig, "-f", str(values))
    assert proc.returncode == 0, f"helm install failed:\n{proc.stdout}{proc.stderr}"
    try:
        operator = f"{name}-resilax-operator"
        cluster_role = kube.get(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{operator}")
        assert canonical(cluster_role["rules"]) == canonical(operator_rules())
        kube.get(f"/apis/kopf.dev/v1/clusterkopfpeerings/{name}-resilax")
        as_operator = KubeClient.from_kubeconfig(cluster.service_account_kubeconfig(namespace, operator))
        assert can(as_operator, "watch", "resilax.dev", "jaxjobs", None)  # cluster-wide
        assert can(as_operator, "create", "", "pods", "kube-system")
        assert not can(as_operator, "list", "", "secrets", None)
    finally:
        helm("uninstall", name, "--namespace", namespace, "--kubeconfig", kubeconfig)


def test_node_sweeper_may_only_get_jaxjobs_and_sweeps_with_that_against_the_api_server(
        cluster, kube: KubeClient, namespace: str, release: str, tmp_path: Path) -> None:
    """The node sweeper's ServiceAccount (issue 25, item 10): its token may `get` JAXJobs in any
    namespace and nothing else; with that token alone `sweep_root` asks the real API server and
    removes the folders of a deleted job and of a job of the same name but another uid, keeping the
    live job's folder and the unmarked one."""
    from resilax_sidecar.node_sweep import (
        OWNER_MARKER,
        ApiJobLookup,
        GoneSightings,
        sweep_root,
        write_owner_marker,
    )

    sweeper = f"{release}-resilax-node-sweeper"
    role = kube.get(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{sweeper}")
    assert role["rules"] == [{"apiGroups": ["resilax.dev"], "resources": ["jaxjobs"], "verbs": ["get"]}]
    kube.get(f"/apis/apps/v1/namespaces/{namespace}/daemonsets/{sweeper}")
    as_sweeper = KubeClient.from_kubeconfig(cluster.service_account_kubeconfig(namespace, sweeper))
    assert can(as_sweeper, "get", "resilax.dev", "jaxjobs", "any-namespace")
    for verb, group, resource, ns in [
        ("list", "resilax.dev", "jaxjobs", "any-namespace"), ("watch", "resilax.dev", "jaxjobs", None),
        ("delete", "resilax.dev", "jaxjobs", namespace), ("patch", "resilax.dev", "jaxjobs", namespace),
        ("get", "", "secrets", namespace), ("get", "", "pods", namespace), ("list", "", "nodes", None),
    ]:
        assert not can(as_sweeper, verb, group, resource, ns), f"{verb} {group}/{resource} in {ns}"

    # The DaemonSet's pods run `resilax node-sweep` in-cluster (its token, the API server's CA) and pass.
    def swept() -> str | None:
        pods = kube.get(f"/api/v1/namespaces/{namespace}/pods",
                        labelSelector=f"app.kubernetes.io/instance={release},app.kubernetes.io/component=node-sweeper")
        for pod in pods["items"]:
            if pod["spec"].get("nodeName") and pod.get("status", {}).get("containerStatuses"):
                try:
                    text = str(cluster.logs(namespace, pod["metadata"]["name"], "node-sweep"))
                except Exception:  # not started yet
                    continue
                if "node sweep of /roots/memory" in text:
                    return text
        return None

    try:
        log_text = wait_for(swept, timeout=120, message="a node-sweep pod's first pass in its log")
    except TimeoutError as e:
        ds = kube.get(f"/apis/apps/v1/namespaces/{namespace}/daemonsets/{sweeper}").get("status")
        pods = kube.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector="app.kubernetes.io/component=node-sweeper")
        events = kube.get(f"/api/v1/namespaces/{namespace}/events")["items"]
        logs = []
        for pod in pods["items"][:2]:
            try:
                logs.append(str(cluster.logs(namespace, pod["metadata"]["name"], "node-sweep"))[-1500:])
            except Exception as err:
                logs.append(f"(no log: {err})")
        raise AssertionError(f"{e}\ndaemonset: {ds}\npods: {[(p['metadata']['name'], p['spec'].get('nodeName'), p.get('status')) for p in pods['items']][:2]}\n"
                             f"events: {[ev.get('message') for ev in events if 'sweep' in str(ev)][-5:]}\nlogs: {logs}") from e
    assert "Traceback" not in log_text and "keeping its folder" not in log_text, log_text

    # A JAXJob in a namespace this release's operator does not watch (it stays as created).
    other = f"sweep-{uuid.uuid4().hex[:6]}"
    kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}})
    try:
        job = doc_jaxjobs(ROOT / "README.md")[0]
        job["metadata"] = {"name": "live", "namespace": other}
        uid = kube.create(f"/apis/resilax.dev/v1alpha1/namespaces/{other}/jaxjobs", job)["metadata"]["uid"]
        root = tmp_path / "root"
        folders = {"live": (other, "live", uid), "recreated": (other, "live", str(uuid.uuid4())),
                   "deleted": (other, "gone", str(uuid.uuid4()))}
        for ns, name, job_uid in folders.values():
            folder = root / f"{ns}_{name}_{job_uid}"
            (folder / "7").mkdir(parents=True)
            write_owner_marker(folder, ns, name, job_uid)
        unmarked = root / f"{other}_gone_{uuid.uuid4()}"
        (unmarked / "7").mkdir(parents=True)

        token = tmp_path / "token"
        token.write_text(cluster.service_account_token(namespace, sweeper))
        lookup, sightings = ApiJobLookup(cluster.server, token, Path(cluster.ca_file)), GoneSightings(apart=60)
        assert sweep_root(root, lookup, sightings, now=0) == []  # said gone once; removed on the second answer
        removed = sweep_root(root, lookup, sightings, now=60)
        assert sorted(removed) == sorted("{}_{}_{}".format(*folders[k]) for k in ("recreated", "deleted"))
        assert (root / "{}_{}_{}".format(*folders["live"]) / OWNER_MARKER).is_file()
        assert (unmarked / "7").is_dir()

        # A token that may not read JAXJobs (the namespace's default ServiceAccount): 403, nothing removed.
        token.write_text(cluster.service_account_token(namespace, "default"))
        (root / "{}_{}_{}".format(*folders["deleted"])).mkdir()
        write_owner_marker(root / "{}_{}_{}".format(*folders["deleted"]), *folders["deleted"])
        for now in (120, 180):
            assert sweep_root(root, ApiJobLookup(cluster.server, token, Path(cluster.ca_file)), sightings, now) == []
        assert (root / "{}_{}_{}".format(*folders["deleted"]) / OWNER_MARKER).is_file()
    finally:
        kube.delete(f"/api/v1/namespaces/{other}")


def kubectl(cluster, *args: str, stdin: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """kubectl, as the docs run it, against the local cluster."""
    binary = shutil.which("kubectl")
    assert binary, "kubectl is needed (the test runs the commands docs/uninstall.md and the chart's NOTES give)"
    return subprocess.run([binary, "--kubeconfig", str(cluster.kubeconfig), *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, check=False)


def upgraded_chart(into: Path) -> Path:
    """A copy of the chart one release later whose JAXJob CRD changed: a new optional field
    (`spec.upgradeProbe`) and an edited description (a value the first install's field manager owns,
    which `kubectl apply --server-side` refuses to take over without --force-conflicts)."""
    chart = into / "resilax"
    shutil.copytree(CHART, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta["version"], meta["appVersion"] = "0.1.1-upgrade", "0.1.1-upgrade"
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    path = chart / "crds" / "jaxjobs.resilax.dev.yaml"
    crd = yaml.safe_load(path.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    spec["suspend"]["description"] += " (edited by the upgrade)"
    spec["upgradeProbe"] = {"type": "string", "description": "A field the upgraded CRD adds."}
    path.write_text(yaml.safe_dump(crd))
    return chart


def schema_fields(kube: KubeClient) -> dict[str, Any]:
    crd = kube.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/jaxjobs.resilax.dev")
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"])


def test_crd_upgrade_and_uninstall_with_live_jaxjobs_follow_the_docs_and_leave_nothing_terminating(
        helm, cluster, kube: KubeClient, namespace: str, release: str, tmp_path: Path) -> None:
    """Issue 41: a chart upgrade that changes the CRD (CRDs first with `--force-conflicts`, as NOTES.txt
    and docs/api-versioning.md say, then `helm upgrade`), then docs/uninstall.md with two live JAXJobs:
    one running is deleted while the operator runs (its finalizer goes, its pods go), one suspended is
    kept past `helm uninstall`, shows Terminating when deleted with no operator, and goes with the
    documented finalizer patch. Step 4 (deleting the CRDs) is not run: the cluster is shared by the
    session's tests."""
    kubeconfig = str(cluster.kubeconfig)
    operator = f"{release}-resilax-operator"
    jobs_path = f"/apis/resilax.dev/v1alpha1/namespaces/{namespace}/jaxjobs"
    operator_pods = f"app.kubernetes.io/instance={release},app.kubernetes.io/component=operator"
    wait_for(lambda: kube.get(f"/apis/kopf.dev/v1/namespaces/{namespace}/kopfpeerings/{release}-resilax").get("status"),
             timeout=120, message="the operator's keep-alive in its KopfPeering")

    def job(name: str, suspend: bool) -> dict[str, Any]:
        body = doc_jaxjobs(ROOT / "README.md")[0]
        body["metadata"] = {"name": name, "namespace": namespace}
        body["spec"]["slices"] = {"accelerator": "tpu-v5-lite-podslice", "topology": "2x4", "count": 1,
                                 "machineType": "ct5lp-hightpu-4t"}
        body["spec"].pop("elastic", None)
        # finalSave 1 s: the sleeper never announces itself to its sidecar (no trainer.lock), so a sidecar
        # told to stop waits this long for a final save nobody will answer before its pod goes
        body["spec"]["checkpoint"] = {"storage": str(tmp_path / name), "every": {"steps": 10},
                                      "finalSave": {"timeoutSeconds": 1}}
        body["spec"]["template"] = {"spec": {"containers": [{
            "name": "trainer", "image": "resilax-worker:local",
            "command": [sys.executable, "-c", "import time; time.sleep(3600)"]}]}}
        body["spec"]["suspend"] = suspend
        return body

    kube.create(jobs_path, job("running", suspend=False))
    kube.create(jobs_path, job("kept", suspend=True))

    def phase(name: str) -> str | None:
        body = kube.get(f"{jobs_path}/{name}")
        assert FINALIZER in (body["metadata"].get("finalizers") or []) or not body.get("status"), body["metadata"]
        return (body.get("status") or {}).get("phase")

    def wait_phase(name: str, wanted: str) -> None:
        try:
            wait_for(lambda: phase(name) == wanted, timeout=120, message=f"job {name!r} {wanted}")
        except TimeoutError as e:
            pods = kube.get(f"/api/v1/namespaces/{namespace}/pods")["items"]
            raise AssertionError(f"{e}\nstatus: {kube.get(f'{jobs_path}/{name}').get('status')}\npods: "
                                 f"{[(p['metadata']['name'], p.get('status', {}).get('phase')) for p in pods]}") from e

    wait_phase("running", "Running")
    wait_phase("kept", "Suspended")
    assert kube.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"{LABEL_JOB}=running")["items"]

    # The upgrade: CRDs first. Without --force-conflicts the server-side apply is refused on the fields
    # the install's manager owns; with it the new schema is served.
    chart = upgraded_chart(tmp_path)
    crds = helm("show", "crds", str(chart))
    assert crds.returncode == 0, crds.stderr
    original = helm("show", "crds", str(CHART)).stdout
    try:
        refused = kubectl(cluster, "apply", "--server-side", "-f", "-", stdin=crds.stdout)
        assert refused.returncode != 0 and "conflict" in refused.stderr.lower(), refused
        applied = kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", "-", stdin=crds.stdout)
        assert applied.returncode == 0, applied.stderr
        wait_for(lambda: "upgradeProbe" in schema_fields(kube), timeout=30, message="the new CRD schema")
        probe = job("probe", suspend=True)
        probe["spec"]["upgradeProbe"] = "kept"
        served = wait_for(lambda: kube.request("POST", jobs_path, probe, params={"dryRun": "All"})["spec"].get("upgradeProbe"),
                          timeout=30, message="the new field kept (not pruned) on a write")
        assert served == "kept"

        proc = helm("upgrade", release, str(chart), "--namespace", namespace, "--kubeconfig", kubeconfig,
                    "--reuse-values", "--timeout", "180s")
        assert proc.returncode == 0, f"helm upgrade failed:\n{proc.stdout}{proc.stderr}"
        deployment = kube.get(f"/apis/apps/v1/namespaces/{namespace}/deployments/{operator}")
        assert deployment["spec"]["template"]["spec"]["containers"][0]["image"].endswith(":0.1.1-upgrade")

        def upgraded_pod_only() -> bool:
            pods = kube.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector=operator_pods)["items"]
            return bool(pods) and all(p["spec"]["containers"][0]["image"].endswith(":0.1.1-upgrade")
                                      and (p.get("status") or {}).get("phase") == "Running" for p in pods)

        wait_for(upgraded_pod_only, timeout=180, message="the upgraded operator pod alone, Running")
        assert phase("running") == "Running" and phase("kept") == "Suspended"  # the jobs lived through it

        # docs/uninstall.md step 2b: delete the running job while the operator runs.
        deleted = kubectl(cluster, "-n", namespace, "delete", "jj", "running", "--wait", "--timeout=180s",
                          timeout=240)
        assert deleted.returncode == 0, deleted
        def job_pods() -> list[dict[str, Any]]:
            return list(kube.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector=f"{LABEL_JOB}=running")["items"])

        try:
            wait_for(lambda: not job_pods(), timeout=180, message="the deleted job's pods gone")
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{[(p['metadata'], p.get('status')) for p in job_pods()]}") from e

        # Step 3: helm uninstall; the suspended job stays (the CRDs stay), with the finalizer.
        proc = helm("uninstall", release, "--namespace", namespace, "--kubeconfig", kubeconfig, "--timeout", "120s")
        assert proc.returncode == 0, f"helm uninstall failed:\n{proc.stdout}{proc.stderr}"
        wait_for(lambda: not kube.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector=operator_pods)["items"],
                 timeout=120, message="the operator pod gone")
        kept = kube.get(f"{jobs_path}/kept")
        assert kept["metadata"]["finalizers"] == [FINALIZER]

        # "Jobs stuck in Terminating after the operator is gone": a delete now waits on the finalizer ...
        assert kubectl(cluster, "-n", namespace, "delete", "jj", "kept", "--wait=false").returncode == 0
        stuck = kube.get(f"{jobs_path}/kept")
        assert stuck["metadata"].get("deletionTimestamp") and stuck["metadata"]["finalizers"] == [FINALIZER]
        # ... and the documented patch lets it go.
        patched = kubectl(cluster, "-n", namespace, "patch", "jaxjobs.resilax.dev", "kept", "--type=merge",
                          "-p", '{"metadata":{"finalizers":null}}')
        assert patched.returncode == 0, patched
        wait_for(lambda: not kube.get(jobs_path)["items"], timeout=30, message="no JAXJob left")
        left = kube.get(f"/api/v1/namespaces/{namespace}/pods")["items"]
        assert not [p["metadata"]["name"] for p in left if p["metadata"].get("deletionTimestamp")]
    finally:
        # The session's other tests use the chart's CRD as it is: put it back (the new field goes with
        # the manager that applied it).
        restored = kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", "-", stdin=original)
        assert restored.returncode == 0, restored.stderr
    assert "upgradeProbe" not in schema_fields(kube)
