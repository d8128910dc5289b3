"""The CRD on a real kube-apiserver (v1.37.2, etcd + API server only, started here): accepted and
Established, defaults applied, bad JAXJobs rejected with their field paths, and the operator's status
body round-trips through the status subresource."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from op_samples import (
    MALFORMED_TEMPLATES,
    RESTRICTED_ALLOWED_TEMPLATES,
    RESTRICTED_TEMPLATES,
    TEMPLATE_TYPOS,
    good_spec,
)
from resilax_operator import api
from resilax_operator import status as st
from resilax_operator.spec import Shape
from resilax_operator.status_fields.checkpoint import CheckpointBranch

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
BASE = f"/apis/{api.GROUP}/{api.VERSION}/namespaces/default/{api.PLURAL}"
Raw = dict[str, Any]


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from resilax_local import binaries
    from resilax_local.controlplane.pki import CertificateAuthority, write_service_account_keys
    from resilax_local.kubeapi import Credentials, KubeClient
    from resilax_local.processes import free_port, spawn, stop_group

    apiserver = binaries._assets_binary("kube-apiserver") or binaries.kubernetes_dir() / "kube-apiserver"
    if not apiserver.is_file():
        pytest.fail(f"missing {apiserver}: run `resilax local binaries` (scripts/test does) to build it")
    etcd = binaries.ensure_etcd(build=False)
    run = tmp_path_factory.mktemp("apiserver")
    etcd_client, etcd_peer, port = free_port(), free_port(), free_port()
    ca = CertificateAuthority(run / "pki")
    serving = ca.issue("apiserver", "kube-apiserver", server=True, hosts=("127.0.0.1", "localhost"))
    admin = ca.issue("admin", "resilax-admin", "system:masters")
    sa = write_service_account_keys(run / "pki")
    procs = [spawn([str(etcd), f"--data-dir={run / 'etcd'}", f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                    f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                    f"--initial-cluster=default=http://127.0.0.1:{etcd_peer}", "--unsafe-no-fsync",
                    "--log-level=warn"], run / "etcd.log")]
    try:
        procs.append(spawn([
            str(apiserver), f"--etcd-servers=http://127.0.0.1:{etcd_client}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={port}", f"--tls-cert-file={serving.cert}",
            f"--tls-private-key-file={serving.key}", f"--client-ca-file={ca.cert_path}", "--authorization-mode=RBAC",
            "--service-cluster-ip-range=10.96.0.0/16", "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={sa.cert}", f"--service-account-signing-key-file={sa.key}",
            f"--cert-dir={run / 'generated'}", "--endpoint-reconciler-type=none"], run / "kube-apiserver.log"))
        client = KubeClient(Credentials(f"https://127.0.0.1:{port}", str(ca.cert_path), str(admin.cert),
                                        str(admin.key)), timeout=10)
        _wait(lambda: client.get_text("/readyz").strip() == "200 ok", 180, f"kube-apiserver (log: {run})")
        crd = yaml.safe_load((ROOT / api.CRD_FILE).read_text())
        client.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)

        def established() -> bool:
            got = client.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{api.CRD_NAME}")
            conditions = (got.get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

        _wait(established, 60, "CRD Established")
        _wait(lambda: bool(client.get(BASE)), 60, "JAXJob endpoint served")
        yield client
    finally:
        for p in reversed(procs):
            stop_group(p.pid, proc=p)


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception as e:  # not up yet
            last = e
        time.sleep(0.25)
    raise TimeoutError(f"{what} not ready within {timeout}s (last: {last!r})")


def _job(name: str, mutate: Callable[[Raw], Any] | None = None) -> Raw:
    spec = good_spec()
    if mutate is not None:
        mutate(spec)
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name}, "spec": spec}


def test_good_job_gets_defaults(kube: Any) -> None:
    minimal = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "minimal"}, "spec": {
        "slices": {"accelerator": "cpu", "topology": "1x4"}, "checkpoint": {"storage": "/ckpt"},
        "template": {"spec": {"containers": [{"name": "trainer", "image": "x"}]}}}}
    spec = kube.create(BASE, minimal)["spec"]
    assert spec["slices"]["count"] == 1
    assert spec["recovery"] == {"maxRestarts": 20, "backoffSeconds": 10, "nodeLossGraceSeconds": 120,
                                "inPlace": "Auto", "inPlaceStopTimeoutSeconds": 30}
    assert spec["checkpoint"]["finalSave"] == {"onPreemption": True, "onResize": True, "timeoutSeconds": 300}
    assert spec["checkpoint"]["restore"] == {"step": "latest"}
    assert spec["capacity"] == {"provisioning": "Ready"} and spec["suspend"] is False
    full = kube.create(BASE, _job("full", lambda s: s["checkpoint"]["restore"].update(step=1200)))["spec"]
    assert full["checkpoint"]["restore"]["step"] == 1200 and full["elastic"]["growBack"] is True


BAD = [
    ("count-above-max", lambda s: s["slices"].update(count=5), "spec.slices.count"),
    ("min-above-max", lambda s: s["elastic"].update(minCount=5), "spec.elastic.minCount"),
    ("v5e-4x3", lambda s: s["slices"].update(topology="4x3"), "spec.slices.topology"),
    ("v4-2d", lambda s: (s["slices"].update(accelerator="tpu-v4-podslice", topology="4x4"), s.pop("elastic")),
     "spec.slices.topology"),
    ("elastic-topology-invalid", lambda s: s["elastic"].update(topologies=["3x3"]), "spec.elastic.topologies"),
    ("sidecar-name", lambda s: s["template"]["spec"]["containers"][0].update(name="resilax-sidecar"),
     "spec.template.spec.containers"),
    ("no-containers", lambda s: s["template"]["spec"].update(containers=[]), "spec.template.spec.containers"),
    ("no-template", lambda s: s.pop("template"), "spec.template"),
    ("no-storage", lambda s: s["checkpoint"].pop("storage"), "spec.checkpoint.storage"),
    ("restore-word", lambda s: s["checkpoint"]["restore"].update(step="yesterday"), "spec.checkpoint.restore.step"),
    ("restore-negative", lambda s: s["checkpoint"]["restore"].update(step=-1), "spec.checkpoint.restore.step"),
    ("negative-backoff", lambda s: s["recovery"].update(backoffSeconds=-1), "spec.recovery.backoffSeconds"),
    ("negative-grace", lambda s: s["recovery"].update(nodeLossGraceSeconds=-1), "spec.recovery.nodeLossGraceSeconds"),
    ("zero-keep", lambda s: s["checkpoint"]["keep"].update(last=0), "spec.checkpoint.keep.last"),
    ("zero-minutes", lambda s: s["checkpoint"]["every"].update(minutes=0), "spec.checkpoint.every.minutes"),
    ("zero-timeout", lambda s: s["checkpoint"]["finalSave"].update(timeoutSeconds=0),
     "spec.checkpoint.finalSave.timeoutSeconds"),
    ("s3-storage", lambda s: s["checkpoint"].update(storage="s3://x"), "spec.checkpoint.storage"),
    ("size-limit", lambda s: s["checkpoint"]["local"].update(sizeLimit="lots"), "spec.checkpoint.local.sizeLimit"),
    ("medium", lambda s: s["checkpoint"]["local"].update(medium="SSD"), "spec.checkpoint.local.medium"),
    ("unknown-accelerator", lambda s: s["slices"].update(accelerator="tpu-v9"), "spec.slices.accelerator"),
    ("machine-type-on-cpu", lambda s: (s["slices"].update(accelerator="cpu", topology="2x4", machineType="n2"),
                                       s["elastic"].update(topologies=[])), "spec.slices.machineType"),
    ("restart-always", lambda s: s["template"]["spec"].update(restartPolicy="Always"), "spec.template.spec.restartPolicy"),
    ("zero-count", lambda s: s["slices"].update(count=0), "spec.slices.count"),
    ("provisioning-unknown", lambda s: s.update(capacity={"provisioning": "Eventually"}),
     "spec.capacity.provisioning"),
    ("shrink-negative", lambda s: s.update(capacity={"provisioning": "Autoscaled", "shrinkAfterSeconds": -1}),
     "spec.capacity.shrinkAfterSeconds"),
    ("shrink-without-autoscaled", lambda s: s.update(capacity={"shrinkAfterSeconds": 60}),
     "spec.capacity.shrinkAfterSeconds"),
    ("suspend-not-bool", lambda s: s.update(suspend="yes"), "spec.suspend"),
    ("in-place-unknown", lambda s: s["recovery"].update(inPlace="Always"), "spec.recovery.inPlace"),
    ("in-place-stop-timeout-zero", lambda s: s["recovery"].update(inPlaceStopTimeoutSeconds=0),
     "spec.recovery.inPlaceStopTimeoutSeconds"),
    ("rule-action-unknown", lambda s: s["recovery"].update(failureRules=[{"action": "Ignore", "exitCodes": [3]}]),
     "spec.recovery.failureRules[0].action"),
    ("rule-protocol-code", lambda s: s["recovery"].update(failureRules=[{"action": "FailJob", "exitCodes": [75]}]),
     "spec.recovery.failureRules[0].exitCodes"),
    ("keep-mode-unknown", lambda s: s["checkpoint"]["keep"].update(best=2, metric="loss", mode="lowest"),
     "spec.checkpoint.keep.mode"),
    ("keep-best-without-mode", lambda s: s["checkpoint"]["keep"].update(best=2, metric="loss"), "spec.checkpoint.keep"),
    ("keep-every-minutes-zero", lambda s: s["checkpoint"]["keep"].update(everyMinutes=0),
     "spec.checkpoint.keep.everyMinutes"),
    ("hang-timeout-too-short", lambda s: s["recovery"].update(hangTimeoutSeconds=5),
     "spec.recovery.hangTimeoutSeconds"),
    ("hang-timeout-negative", lambda s: s["recovery"].update(hangTimeoutSeconds=-1),
     "spec.recovery.hangTimeoutSeconds"),
    ("health-check-timeout-zero", lambda s: s["recovery"].update(healthCheck={"enabled": True, "timeoutSeconds": 0}),
     "spec.recovery.healthCheck.timeoutSeconds"),
    ("health-check-enabled-not-bool", lambda s: s["recovery"].update(healthCheck={"enabled": "yes"}),
     "spec.recovery.healthCheck.enabled"),
    ("spare-slices-too-many", lambda s: s["recovery"].update(spareSlices=9), "spec.recovery.spareSlices"),
    ("spare-slices-on-cpu", lambda s: (s["slices"].update(accelerator="cpu", topology="2x4"), s.pop("elastic"),
                                       s["recovery"].update(spareSlices=1)), "spec.recovery.spareSlices"),
]


@pytest.mark.parametrize(("mutate", "path"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_job_rejected_with_field_path(kube: Any, mutate: Callable[[Raw], Any], path: str) -> None:
    from resilax_local.errors import KubeAPIError

    with pytest.raises(KubeAPIError) as info:
        kube.create(BASE, _job("bad", mutate))
    assert info.value.status == 422 and path in str(info.value)


@pytest.mark.parametrize(("change", "path"), [m[1:] for m in MALFORMED_TEMPLATES], ids=[m[0] for m in MALFORMED_TEMPLATES])
def test_malformed_template_refused_at_apply(kube: Any, change: Callable[[Raw], Any], path: str) -> None:
    """Kubernetes' own PodTemplateSpec schema in the CRD (issue 18): the API server names the field."""
    from resilax_local.errors import KubeAPIError

    with pytest.raises(KubeAPIError) as info:
        kube.create(BASE, _job("bad-template", lambda s: change(s["template"])))
    assert info.value.status == 422 and path in str(info.value), info.value


@pytest.mark.parametrize(("change", "path"), [m[1:] for m in TEMPLATE_TYPOS], ids=[m[0] for m in TEMPLATE_TYPOS])
def test_template_typo_refused_with_strict_field_validation(kube: Any, change: Callable[[Raw], Any], path: str) -> None:
    """`kubectl apply` validates fields strictly: a misspelt field is refused, not silently dropped."""
    from resilax_local.errors import KubeAPIError

    body = _job("typo", lambda s: change(s["template"]))
    with pytest.raises(KubeAPIError) as info:
        kube.request("POST", BASE, body, params={"fieldValidation": "Strict"})
    assert info.value.status in (400, 422) and f'unknown field "{path}"' in str(info.value), info.value
    created = kube.create(BASE, body)  # without strict validation: pruned, never stored
    assert path.rsplit(".", 1)[-1] not in json.dumps(created["spec"]["template"])
    kube.delete(f"{BASE}/typo")


def test_explain_documents_the_template(kube: Any) -> None:
    """What `kubectl explain jaxjob.spec.template.spec.containers.env` reads: the published OpenAPI v3."""
    doc = kube.get(f"/openapi/v3/apis/{api.GROUP}/{api.VERSION}")
    job = next(v for k, v in doc["components"]["schemas"].items() if k.endswith(f".{api.KIND}"))
    pod = job["properties"]["spec"]["properties"]["template"]["properties"]["spec"]
    container = pod["properties"]["containers"]["items"]
    assert container["properties"]["env"]["type"] == "array"
    assert "environment variables" in container["properties"]["env"]["description"]
    assert container["properties"]["env"]["items"]["properties"]["valueFrom"]["properties"]["fieldRef"]
    assert {"volumes", "affinity", "tolerations", "securityContext"} <= set(pod["properties"])


@pytest.mark.parametrize(("name", "message"), [("x" * 41, "at most 40"), ("9lives", "start with a letter")],
                         ids=["too-long", "digit-first"])
def test_bad_names_rejected(kube: Any, name: str, message: str) -> None:
    from resilax_local.errors import KubeAPIError

    with pytest.raises(KubeAPIError, match=message):
        kube.create(BASE, _job(name))


def test_status_round_trip(kube: Any) -> None:
    kube.create(BASE, _job("status"))
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    full = st.JobStatus(phase=api.PHASE_SAVING, generation=2, shape=Shape("4x4", 3), hosts=12, pools=("a", "b", "c"),
                        restore_step="latest", restore_asked="800", generation_start_time=t0, workers_created=True,
                        restarts=1, planned_from="x/y", observed_generation=1,
                        transition=st.Transition(st.PREEMPTION, 2, t0, "m", "status-g2-preemption", t0),
                        checkpoint=st.CheckpointInfo(1200, t0, branch=CheckpointBranch(1, 2, 800)))
    from resilax_operator.status_fields import goodput as gp

    ledger = gp.advance(gp.advance(None, gp.GenerationMarks(1, created=10.0, running=12.5, first_step=1,
                                                             first_step_time=20.25, last_step=30, last_step_time=50.0,
                                                             blocking_seconds=1.5, detected=70.0)),
                        gp.GenerationMarks(2, created=75.0))
    # as the operator reads it back (the ledger's seconds have 3 decimals on the wire)
    full = replace(full, goodput=st.parse_goodput(st.build_goodput(st.GoodputRecord(ledger, datetime.fromtimestamp(80, UTC)))))
    full = st.set_condition(full, api.COND_READY, False, api.PREEMPTION_NOTICE.name, "m", t0)
    # status.history (issue 28): every field of an entry kept as written, none pruned or nulled
    from resilax_operator.status_fields.history import HistoryEntry

    ended = HistoryEntry(1, t0, "4x4", 4, 16, ("a", "b", "c", "d"), False, t0, "NodeLost", "node n1 ...", 90,
                         "peer", 1, 130, 40, (("detection", 12.5), ("productive", 100.0)), (100, 120))
    full = replace(full, history=(ended, HistoryEntry(2, t0, "4x4", 3, 12, ("a", "b", "c"), True)),
                   transition=replace(full.transition, reason=api.PREEMPTION_NOTICE.name),  # type: ignore[arg-type]
                   in_place=st.InPlace(3, 2, st.IN_PLACE_STOPPING, t0, t0, kind=st.NODE_LOSS, reason="NodeLost",
                                       message="m"))
    from resilax_operator.pods.spares import SpareStatus

    full = replace(full, spares=SpareStatus(2, 1, ("d",), "", 2, ("c",), 1))
    got = kube.patch(f"{BASE}/status/status", {"status": st.build_status(full)})
    assert st.parse_status(got["status"]) == full
    assert got["status"]["history"] == st.build_status(full)["history"]
    assert got["status"]["goodput"] == st.build_status(full)["goodput"] | {"ledger": got["status"]["goodput"]["ledger"]}
    assert got["status"]["goodput"]["ledger"]["current"] == {"generation": 2, "created": 75.0, "blockingSeconds": 0.0}
    # A suspended job that waited for a queue and for nodes: the new phase, kinds, pools "" and times.
    waiting = replace(full, phase=api.PHASE_SUSPENDED, pools=("a", "", ""), admitted_time=t0,
                      transition=st.Transition(st.SUSPEND, 2, t0, "m"))
    waiting = st.set_condition(waiting, api.COND_SUSPENDED, True, api.SUSPENDED.name, "m", t0)
    got = kube.patch(f"{BASE}/status/status", {"status": st.build_status(waiting)})
    assert st.parse_status(got["status"]) == waiting
    got = kube.patch(f"{BASE}/status/status", {"status": st.build_status(
        replace(waiting, transition=st.Transition(st.SHRINK, 2, t0, "m")))})
    assert got["status"]["transition"]["kind"] == st.SHRINK
    got = kube.patch(f"{BASE}/status/status", {"status": st.build_status(st.JobStatus(phase=api.PHASE_RUNNING, generation=3))})
    assert "transition" not in got["status"] and "shape" not in got["status"]
    assert st.parse_status(got["status"]) == st.JobStatus(phase=api.PHASE_RUNNING, generation=3)


def test_status_patches_of_what_changed_apply_as_decided(kube: Any) -> None:
    """The operator writes a merge patch of what changed (status.build_status_patch): applied by the API
    server, it gives the decided status, the copy of the spec in lastValidSpec included (a member gone
    from the spec goes from the copy: arbitrary fields survive the schema, x-kubernetes-preserve-unknown-fields)."""
    spec = kube.create(BASE, _job("patches"))["spec"]
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    first = st.set_condition(st.JobStatus(phase=api.PHASE_RUNNING, generation=1, observed_generation=1,
                                          last_valid_spec=st.SpecRecord(1, spec)),
                             api.COND_INVALID_SPEC, False, api.SPEC_VALID.name, api.SPEC_VALID.message, t0)
    got = kube.patch(f"{BASE}/patches/status", {"status": st.build_status_patch({}, first)})
    assert st.parse_status(got["status"]) == first
    trimmed = {k: v for k, v in spec.items() if k != "elastic"} | {"suspend": True}
    second = st.set_condition(replace(first, observed_generation=2, last_valid_spec=st.SpecRecord(2, trimmed)),
                              api.COND_INVALID_SPEC, True, api.SPEC_INVALID_KEPT.name, "m", t0)
    patch = st.build_status_patch(got["status"], second)
    assert set(patch) == {"observedGeneration", "lastValidSpec", "conditions"}
    got = kube.patch(f"{BASE}/patches/status", {"status": patch})
    assert st.parse_status(got["status"]) == second and "elastic" not in got["status"]["lastValidSpec"]["spec"]
    assert st.build_status_patch(got["status"], second) == {}
    # a new job's first status: what the parse would default (phase Pending, generation 0) is written too
    kube.create(BASE, _job("fresh"))
    got = kube.patch(f"{BASE}/fresh/status", {"status": st.build_status_patch({}, st.JobStatus())})
    assert got["status"]["phase"] == api.PHASE_PENDING and got["status"]["generation"] == 0, got["status"]


def _restricted_namespace(kube: Any, ns: str = "restricted") -> str:
    """A namespace whose Pod Security admission enforces `restricted` (latest), with its default
    ServiceAccount (no controller-manager here makes one)."""
    from resilax_local.errors import KubeAPIError

    try:
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {
            "name": ns, "labels": {"pod-security.kubernetes.io/enforce": "restricted",
                                   "pod-security.kubernetes.io/enforce-version": "latest"}}})
        kube.create(f"/api/v1/namespaces/{ns}/serviceaccounts",
                    {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})
    except KubeAPIError as e:
        if e.status != 409:
            raise
    return ns


@pytest.mark.parametrize("variant", ["tpu", "cpu", "gpu", "pvc"])
def test_worker_manifests_pass_the_api_server_and_restricted_pod_security(kube: Any, variant: str) -> None:
    """The builders' Service, Secret and Pods, created with dryRun in a namespace that enforces the
    restricted Pod Security Standard (the API server's own admission)."""
    from resilax_operator.builders import (
        GenerationPlan,
        JobRef,
        build_pods,
        build_service,
        build_token_secret,
    )
    from resilax_operator.settings import OperatorSettings
    from resilax_operator.validation import validate_spec

    ns = _restricted_namespace(kube)
    raw = good_spec()
    raw["slices"], raw["elastic"] = {
        "tpu": (raw["slices"], raw["elastic"]),
        "cpu": ({"accelerator": "cpu", "topology": "2x4", "count": 2, "chipsPerHost": 4}, {"minCount": 1, "maxCount": 2}),
        "gpu": ({"accelerator": "nvidia-l4", "topology": "1x2", "count": 2}, {"minCount": 1, "maxCount": 2}),
        "pvc": (raw["slices"], raw["elastic"]),
    }[variant]
    if variant == "pvc":
        raw["checkpoint"]["storage"] = "pvc://ckpt/runs"
    spec = validate_spec(raw)
    job = JobRef("llama", ns, "00000000-0000-0000-0000-000000000001")
    plan = GenerationPlan(3, Shape(spec.slices.topology, 2), ("a", "b"))
    settings = OperatorSettings(sidecar_image="resilax:test")
    dry = "?dryRun=All"
    kube.create(f"/api/v1/namespaces/{ns}/secrets{dry}", build_token_secret(job, "t"))
    kube.create(f"/api/v1/namespaces/{ns}/services{dry}", build_service(job, settings))
    pods = [*build_pods(job, spec, plan, settings, coordinator_ip=None),
            *build_pods(job, spec, plan, settings, coordinator_ip="10.0.0.1")]
    for pod in pods:
        created = kube.create(f"/api/v1/namespaces/{ns}/pods{dry}", pod)
        assert created["spec"]["initContainers"][0]["restartPolicy"] == "Always"



def _generation_pods(raw: Raw, ns: str, *, queue: str = "", policy: bool = True) -> list[Raw]:
    """Every pod the builders make for the job's spec shape and its smallest elastic one (pod 0 alone,
    then all; with a Kueue queue, all at once). `policy=False` skips the operator's template policy."""
    from resilax_operator.builders import GenerationPlan, JobRef, build_pods
    from resilax_operator.settings import OperatorSettings
    from resilax_operator.validation import validate_spec

    settings = OperatorSettings(sidecar_image="resilax:test")
    spec = validate_spec(raw, settings=settings if policy else None)
    job = JobRef("job", ns, "00000000-0000-0000-0000-000000000002", queue)
    pods = []
    for count in sorted({spec.slices.count, spec.count_bounds[0]}):
        for g, pools in ((1, ("a",) * count), (2, ("",) * count)):
            plan = GenerationPlan(g, Shape(spec.slices.topology, count), pools)
            pods += build_pods(job, spec, plan, settings, coordinator_ip=None)
            pods += build_pods(job, spec, plan, settings, coordinator_ip="10.0.0.1")
    return pods


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_every_pod_of_the_examples_passes_restricted_pod_security(kube: Any, example: str) -> None:
    """Issue 25, item 5: the API server enforcing `restricted` takes every pod the builders make for the
    examples/ jobs (dry run: admission runs, nothing is stored)."""
    job = yaml.safe_load((ROOT / "examples" / example).read_text())
    ns = _restricted_namespace(kube)
    queue = ((job["metadata"].get("labels") or {}).get(api.KUEUE_QUEUE_LABEL)) or ""
    pods = _generation_pods(job["spec"], ns, queue=queue)
    assert len(pods) >= 4
    for pod in pods:
        kube.create(f"/api/v1/namespaces/{ns}/pods?dryRun=All", pod)


@pytest.mark.parametrize("change", [r[1] for r in RESTRICTED_ALLOWED_TEMPLATES],
                         ids=[r[0] for r in RESTRICTED_ALLOWED_TEMPLATES])
def test_what_the_operator_allows_the_restricted_api_server_takes(kube: Any, change: Any) -> None:
    raw = good_spec()
    change(raw["template"])
    ns = _restricted_namespace(kube)
    for pod in _generation_pods(raw, ns)[:2]:
        kube.create(f"/api/v1/namespaces/{ns}/pods?dryRun=All", pod)


REFUSED_BY_THE_PROFILE = [r for r in RESTRICTED_TEMPLATES if r[3]]
#: Rows the API server's validation refuses before Pod Security admission sees them (422): privileged
#: without --allow-privileged, procMount Unmasked without hostUsers false, hostProcess on a Linux pod.
VALIDATION_FIRST = ("privileged", "init-privileged", "proc-mount-unmasked", "windows-host-process")


@pytest.mark.parametrize(("name", "change"), [r[:2] for r in REFUSED_BY_THE_PROFILE], ids=[r[0] for r in REFUSED_BY_THE_PROFILE])
def test_what_the_operator_refuses_as_restricted_the_api_server_refuses_too(kube: Any, name: str, change: Any) -> None:
    """The operator's table is the profile the API server enforces: each row, built into a pod without
    the operator's policy, is refused by the API server's Pod Security admission (or, for a few, by its
    validation first)."""
    from resilax_local.errors import KubeAPIError

    raw = good_spec()
    change(raw["template"])
    ns = _restricted_namespace(kube)
    pod = _generation_pods(raw, ns, policy=False)[0]
    with pytest.raises(KubeAPIError) as info:
        kube.create(f"/api/v1/namespaces/{ns}/pods?dryRun=All", pod)
    if name in VALIDATION_FIRST:
        assert info.value.status == 422, info.value
    else:
        assert info.value.status == 403 and 'violates PodSecurity "restricted:latest"' in str(info.value), info.value
