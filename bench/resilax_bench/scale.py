"""The operator at fleet scale: ``python -m resilax_bench.scale [--jobs 100] [--hosts 16] [--variants before,after]``.

One local cluster (real etcd, kube-apiserver, controller manager, scheduler; resilax_local) with one CPU
node and `(jobs + spare) × hosts` TPU hosts in the node agent's no-process mode: pods bound to them are
reported Running at once and nothing runs, so a 2-core machine can hold thousands. Each JAXJob asks for
one slice of `hosts` hosts (tpu-v5-lite-podslice, 4 chips per host). The operator sees a job Running
from its pods' phases; pod 0's sidecar never answers (nothing listens on the pod IPs), which costs the
operator one refused local connection per reconcile and no API request.

For each variant (the operator's code before the watch cache, `--before-ref`, extracted from git; and
the checkout's own), in turn, on the same cluster:
1. a namespace, the chart's RBAC (charts/resilax/files/operator-rules.yaml) bound to a ServiceAccount,
   a KopfPeering; one operator process (``resilax operator --namespace NS --peering resilax``) with that
   ServiceAccount's token, through `operator_probe` (each reconcile timed);
2. `jobs` JAXJobs created at once → seconds until every one is Running;
3. after `--settle-seconds`, a steady window of `--steady-seconds`: the operator's own API requests (the
   API server's audit log, filtered by its user; watches counted apart), its CPU and RSS, reconcile
   latency;
4. one host of job 0 is killed (Lease stops) → seconds from its Ready condition going Unknown (polled
   every 0.1 s) to the first pod of job 0's next generation; the generations of all jobs before and after;
5. the jobs are deleted (the operator removes its finalizers), the operator stopped, the node restored.

Writes the raw figures as JSON (`--json`) and prints the table docs/benchmarks.md carries.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from resilax_local import LocalCluster
from resilax_local.controlplane.audit import read_request_count, service_account_user
from resilax_local.controlplane.plane import ControlPlaneSettings
from resilax_local.controlplane.rbac import build_operator_rbac
from resilax_local.errors import KubeAPIError
from resilax_local.kubeapi import KubeClient
from resilax_local.node.profiles import build_cpu_node, build_tpu_slice

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "bench"
CRD_DIR = ROOT / "charts" / "resilax" / "crds"
RULES_FILE = ROOT / "charts" / "resilax" / "files" / "operator-rules.yaml"
GROUP, VERSION, PLURAL = "resilax.dev", "v1alpha1", "jaxjobs"
ACCELERATOR, MACHINE_TYPE = "tpu-v5-lite-podslice", "ct5lp-hightpu-4t"
#: hosts per slice → the tpu-v5-lite-podslice topology (4 chips per host)
TOPOLOGY_BY_HOSTS = {1: "2x2", 2: "2x4", 4: "4x4", 8: "4x8", 16: "8x8", 32: "8x16", 64: "16x16"}
ACCOUNT, PEERING = "resilax-operator", "resilax"
BEFORE_REF = "22f70f6^"  # the commit before the watch cache (operator: a watch cache ... 22f70f6)


@dataclass(frozen=True)
class ScaleConfig:
    jobs: int = 100
    hosts: int = 16
    spare_slices: int = 1
    variants: tuple[str, ...] = ("after", "before")
    before_ref: str = BEFORE_REF
    settle_seconds: float = 15.0
    steady_seconds: float = 60.0
    node_loss_grace_seconds: int = 5
    #: How often each no-process node renews its Lease; None: `lease_seconds_for(nodes)`.
    lease_seconds: float | None = None
    #: The node lifecycle controller's grace; None: `grace_seconds_for(lease)`.
    node_monitor_grace_seconds: int | None = None
    running_timeout_seconds: float = 600.0
    timeout_seconds: float = 900.0


#: Lease renewals per second the node agent asks of the API server at most (by default): at 1,617 nodes
#: every 20 s (80/s) a loaded 2-core machine fell behind the grace and nodes flapped.
LEASE_RENEWALS_PER_SECOND = 40


def lease_seconds_for(nodes: int) -> float:
    """Each node's Lease every 20 s, or less often so that all of them make ≤ LEASE_RENEWALS_PER_SECOND."""
    return float(max(20, round(nodes / LEASE_RENEWALS_PER_SECOND)))


def grace_seconds_for(lease_seconds: float) -> int:
    """The node lifecycle controller's grace: 5 renewals (kube's own ratio is 40 s / 10 s = 4), ≥ 90 s."""
    return max(90, int(5 * lease_seconds))


def log(text: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S}] {text}", file=sys.stderr, flush=True)


def jobs_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    return f"{base}/{name}" if name else base


def pool_name(i: int) -> str:
    return f"pool-{i:03d}"


def job_name(i: int) -> str:
    return f"job-{i:03d}"


def build_job(name: str, hosts: int, storage: str, grace: int) -> dict[str, Any]:
    """A JAXJob of one slice of `hosts` hosts whose workers never run (no-process nodes)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "JAXJob", "metadata": {"name": name},
        "spec": {
            "slices": {"accelerator": ACCELERATOR, "topology": TOPOLOGY_BY_HOSTS[hosts], "count": 1,
                       "machineType": MACHINE_TYPE},
            "checkpoint": {"storage": storage, "every": {"steps": 100}},
            "recovery": {"maxRestarts": 10, "backoffSeconds": 1, "nodeLossGraceSeconds": grace},
            "template": {"spec": {"containers": [{"name": "trainer", "image": "resilax-worker:local",
                                                  "command": ["python", "train.py"]}]}},
        },
    }


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def wait_for(check: Callable[[], Any], timeout: float, interval: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


# ---- processes ---------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> dict[str, float]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


def extract_before(ref: str, target: Path) -> Path:
    """The operator package as it was at `ref` (git archive), for PYTHONPATH; returns its parent folder."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref, "operator/resilax_operator"],
                             check=True, capture_output=True).stdout
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(target, filter="data")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], check=True,
                            capture_output=True, text=True).stdout.strip()
    (target / "COMMIT").write_text(commit + "\n")
    return target / "operator"


def apply_crds(kube: KubeClient) -> None:
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                with contextlib.suppress(KubeAPIError):
                    kube.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", doc)
                name = doc["metadata"]["name"]

                def established(name: str = name) -> bool:
                    crd = kube.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
                    return any(c["type"] == "Established" and c["status"] == "True"
                               for c in (crd.get("status") or {}).get("conditions") or [])

                wait_for(established, 60, 0.5, f"CRD {name} Established")


class Operator:
    """One `resilax operator` process as the chart's ServiceAccount in `namespace`, reconciles timed."""

    def __init__(self, cluster: LocalCluster, kube: KubeClient, namespace: str, code: Path | None, out: Path) -> None:
        self.cluster, self.kube, self.namespace, self.code, self.out = cluster, kube, namespace, code, out
        self.role = f"resilax-operator-{namespace}"
        self.reconcile_log = out / f"reconciles-{namespace}.txt"
        self.log_file = out / f"operator-{namespace}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def user(self) -> str:
        return service_account_user(self.namespace, ACCOUNT)

    def install(self) -> Path:
        kube, ns = self.kube, self.namespace
        kube.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        wait_for(lambda: _exists(kube, f"/api/v1/namespaces/{ns}/serviceaccounts/default"), 60, 0.5,
                 f"default ServiceAccount in {ns}")
        account, role, binding = build_operator_rbac(ns, ACCOUNT, self.role, yaml.safe_load(RULES_FILE.read_text()))
        kube.create(f"/api/v1/namespaces/{ns}/serviceaccounts", account)
        kube.create("/apis/rbac.authorization.k8s.io/v1/clusterroles", role)
        kube.create("/apis/rbac.authorization.k8s.io/v1/clusterrolebindings", binding)
        kube.create(f"/apis/kopf.dev/v1/namespaces/{ns}/kopfpeerings",
                    {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING}})
        return self.cluster.service_account_kubeconfig(ns, ACCOUNT, path=self.out / f"kubeconfig-{ns}")

    def start(self, kubeconfig: Path) -> None:
        paths = [str(self.code)] if self.code else []
        env = {**os.environ, "KUBECONFIG": str(kubeconfig),
               "PYTHONPATH": os.pathsep.join([*paths, str(BENCH_DIR), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        cmd = [sys.executable, "-m", "resilax_bench.operator_probe", str(self.reconcile_log), "--",
               "--namespace", self.namespace, "--peering", PEERING, "--kubeconfig", str(kubeconfig)]
        with self.log_file.open("wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        wait_for(lambda: self._check_alive() and "configured" in self.log_file.read_text(errors="replace"), 120, 0.5,
                 f"operator in {self.namespace} started")
        imported = self.reconcile_log.read_text().splitlines()[0]
        expected = str(self.code) if self.code else str(ROOT / "operator")
        if expected not in imported:
            raise RuntimeError(f"operator in {self.namespace} imported {imported!r}, expected code under {expected}")

    def _check_alive(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            tail = self.log_file.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"operator in {self.namespace} exited; its log ends:\n{tail}")
        return True

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def reconciles(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        out = []
        for line in self.reconcile_log.read_text().splitlines():
            if line.startswith("#"):
                continue
            t, took = line.split()
            if start <= float(t) < end:
                out.append(float(took))
        return out

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def uninstall(self) -> None:
        for path in (f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{self.role}",
                     f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{self.role}",
                     f"/api/v1/namespaces/{self.namespace}"):
            with contextlib.suppress(KubeAPIError):
                self.kube.delete(path)


def _exists(kube: KubeClient, path: str) -> bool:
    try:
        kube.get(path)
    except KubeAPIError as e:
        if e.status == 404:
            return False
        raise
    return True


# ---- one variant -------------------------------------------------------------------------------------
def job_states(kube: KubeClient, namespace: str) -> dict[str, dict[str, Any]]:
    items = kube.get(jobs_path(namespace))["items"]
    return {j["metadata"]["name"]: dict(j.get("status") or {}) for j in items}


def job_pods(kube: KubeClient, namespace: str, job: str | None = None) -> list[dict[str, Any]]:
    selector = f"resilax.dev/job={job}" if job else "resilax.dev/job"
    return list(kube.get(f"/api/v1/namespaces/{namespace}/pods", labelSelector=selector)["items"])


def node_ready(kube: KubeClient, name: str) -> str:
    node = kube.get(f"/api/v1/nodes/{name}")
    return next((c["status"] for c in node.get("status", {}).get("conditions") or [] if c["type"] == "Ready"), "?")


def nodes_marked_not_ready(kube: KubeClient) -> int:
    """How often the node lifecycle controller has marked a node not Ready so far (its NodeNotReady
    events on Nodes, with their counts): besides the one node the bench kills, each is a node whose
    Lease renewals fell behind the grace (a flap)."""
    items = kube.get("/api/v1/events", fieldSelector="reason=NodeNotReady,involvedObject.kind=Node")["items"]
    return sum(int(e.get("count") or 1) for e in items)


def _epoch(stamp: str | None) -> float | None:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None


def pod_startup(pods: list[dict[str, Any]], created: float) -> dict[str, Any]:
    """Where the jobs' start-up went, from the pods' own API timestamps (1 s resolution), in seconds
    after the jobs were created: each pod's creation (the operator), its binding (PodScheduled: the
    scheduler) and its containers' start (the node agent); first, median and last of each."""
    stages: dict[str, list[float]] = {"created": [], "scheduled": [], "started": []}
    for pod in pods:
        status = pod.get("status") or {}
        scheduled = next((c.get("lastTransitionTime") for c in status.get("conditions") or []
                          if c.get("type") == "PodScheduled" and c.get("status") == "True"), None)
        starts = [_epoch(((c.get("state") or {}).get("running") or {}).get("startedAt"))
                  for c in status.get("containerStatuses") or []]
        known = [t for t in starts if t is not None]
        started = max(known) if known and len(known) == len(starts) else None
        for stage, at in (("created", _epoch(pod["metadata"].get("creationTimestamp"))),
                          ("scheduled", _epoch(scheduled)), ("started", started)):
            if at is not None:
                stages[stage].append(at - created)
    summary: dict[str, Any] = {"pods": len(pods)}
    for stage, v in stages.items():
        summary[stage] = {"count": len(v), "first": round(min(v), 1), "median": round(statistics.median(v), 1),
                          "last": round(max(v), 1)} if v else None
    return summary


def run_variant(cluster: LocalCluster, kube: KubeClient, variant: str, code: Path | None, cfg: ScaleConfig,
                out: Path, last: bool) -> dict[str, Any]:
    namespace = f"scale-{variant}"
    op = Operator(cluster, kube, namespace, code, out)
    result: dict[str, Any] = {"variant": variant, "namespace": namespace,
                              "code": str(code) if code else "checkout", "user": op.user}
    kubeconfig = op.install()
    not_ready_before = nodes_marked_not_ready(kube)
    try:
        op.start(kubeconfig)
        log(f"{variant}: operator up (pid {op.pid}); creating {cfg.jobs} jobs of {cfg.hosts} hosts")
        names = [job_name(i) for i in range(cfg.jobs)]
        created = time.time()
        for name in names:
            kube.create(jobs_path(namespace), build_job(name, cfg.hosts, str(out / "ckpt" / name),
                                                        cfg.node_loss_grace_seconds))
        running_at: dict[str, float] = {}

        def all_running() -> bool:
            op._check_alive()
            now = time.time()
            for name, status in job_states(kube, namespace).items():
                if status.get("phase") == "Running":
                    running_at.setdefault(name, now)
            return len(running_at) == cfg.jobs

        try:
            wait_for(all_running, cfg.running_timeout_seconds, 1.0, f"{variant}: {cfg.jobs} jobs Running")
            result["all_running_seconds"] = round(max(running_at.values()) - created, 1)
            log(f"{variant}: all {cfg.jobs} jobs Running after {result['all_running_seconds']} s")
        except TimeoutError:
            result["all_running_seconds"] = None
            log(f"{variant}: {len(running_at)} of {cfg.jobs} jobs Running after {cfg.running_timeout_seconds:.0f} s")
        result["running_jobs"] = len(running_at)
        result["first_running_seconds"] = round(min(running_at.values()) - created, 1) if running_at else None
        result["running_after_seconds"] = {name: round(t - created, 1) for name, t in sorted(running_at.items())}
        result["pod_startup"] = pod_startup(job_pods(kube, namespace), created)
        log(f"{variant}: pod start-up {json.dumps(result['pod_startup'])}")

        time.sleep(cfg.settle_seconds)
        result["steady"] = measure_steady(cluster, op, cfg)
        log(f"{variant}: steady state {json.dumps(result['steady'])}")
        victims = sorted(running_at)
        if victims:
            result["node_loss"] = measure_node_loss(cluster, kube, op, cfg, namespace, names, victims[0])
            log(f"{variant}: node loss {json.dumps({k: v for k, v in result['node_loss'].items() if 'generations' not in k})}")
        else:
            result["node_loss"] = None
            log(f"{variant}: no job is Running: no node loss to measure")
        all_times = op.reconciles()
        result["reconciles_total"] = len(all_times)
        result["reconcile_p99_whole_run_seconds"] = _round(percentile(all_times, 0.99))
        result["reconcile_max_whole_run_seconds"] = _round(max(all_times) if all_times else None)
        result["memory_mib_end"] = memory_mib(op.pid)
        result["nodes_marked_not_ready"] = nodes_marked_not_ready(kube) - not_ready_before
        log(f"{variant}: nodes marked not Ready during the variant: {result['nodes_marked_not_ready']} "
            "(1 = the node killed)")
        if not last:  # the last variant's jobs go with the cluster
            teardown(kube, op, namespace, cfg)
    finally:
        op.stop()
        op.uninstall()
    return result


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def measure_steady(cluster: LocalCluster, op: Operator, cfg: ScaleConfig) -> dict[str, Any]:
    apiserver = int(cluster._state["pids"]["kube-apiserver"])
    cpu0, api0, t0 = cpu_seconds(op.pid), cpu_seconds(apiserver), time.time()
    load0 = os.getloadavg()[0]
    time.sleep(cfg.steady_seconds)
    cpu1, api1, t1 = cpu_seconds(op.pid), cpu_seconds(apiserver), time.time()
    load1 = os.getloadavg()[0]
    op._check_alive()
    time.sleep(2.0)  # the audit log's last lines of the window
    counted = read_request_count(cluster.run_dir / "logs", op.user, t0, t1)
    window = t1 - t0
    times = op.reconciles(t0, t1)
    return {
        "window_seconds": round(window, 1),
        "requests": counted.requests,
        "requests_per_second": round(counted.requests / window, 3),
        "requests_per_job_per_minute": round(counted.requests / window * 60 / cfg.jobs, 3),
        "watches_opened": counted.watches_opened,
        "by_verb": counted.by_verb,
        "reconciles": len(times),
        "reconcile_p50_seconds": _round(percentile(times, 0.50)),
        "reconcile_p99_seconds": _round(percentile(times, 0.99)),
        "reconcile_mean_seconds": _round(statistics.fmean(times) if times else None),
        "operator_cpu_percent": round(100 * (cpu1 - cpu0) / window, 1),
        "apiserver_cpu_percent": round(100 * (api1 - api0) / window, 1),
        "operator_memory_mib": memory_mib(op.pid),
        "load_average": [round(load0, 1), round(load1, 1)],
    }


def measure_node_loss(cluster: LocalCluster, kube: KubeClient, op: Operator, cfg: ScaleConfig, namespace: str,
                      names: list[str], victim_job: str) -> dict[str, Any]:
    before = {name: int(s.get("generation") or 0) for name, s in job_states(kube, namespace).items()}
    pods = job_pods(kube, namespace, victim_job)
    generation = before[victim_job]
    hosts = sorted(p["spec"]["nodeName"] for p in pods
                   if p["metadata"]["labels"].get("resilax.dev/generation") == str(generation))
    node = hosts[-1]
    jobs_on_node = sorted({p["metadata"]["labels"]["resilax.dev/job"] for p in job_pods(kube, namespace)
                           if p["spec"].get("nodeName") == node and not p["metadata"].get("deletionTimestamp")})
    log(f"killing {node} (job {victim_job} generation {generation})")
    killed = time.time()
    cluster.kill_node(node)
    unknown = created = None
    deadline = time.monotonic() + (cfg.node_monitor_grace_seconds or 90) + 120
    while created is None and time.monotonic() < deadline:
        now = time.time()
        if unknown is None and node_ready(kube, node) != "True":
            unknown = now
        if any(p["metadata"]["labels"].get("resilax.dev/generation") == str(generation + 1)
               for p in job_pods(kube, namespace, victim_job)):
            created = now
        time.sleep(0.1)
    running = None
    if created is not None:
        def moved_and_running() -> bool:
            s = job_states(kube, namespace)[victim_job]
            return int(s.get("generation") or 0) == generation + 1 and s.get("phase") == "Running"

        with contextlib.suppress(TimeoutError):
            wait_for(moved_and_running, 120, 0.2, f"{victim_job} Running again")
            running = time.time()
    time.sleep(5.0)  # would another job move on its own?
    after = {name: int(s.get("generation") or 0) for name, s in job_states(kube, namespace).items()}
    cluster.restore_node(node)
    moved = sorted(name for name in names if after.get(name) != before.get(name))
    return {
        "node": node, "jobs_on_node": jobs_on_node, "victim_job": victim_job,
        "node_loss_grace_seconds": cfg.node_loss_grace_seconds,
        "kill_to_unknown_seconds": _round(unknown - killed, 2) if unknown else None,
        "unknown_to_new_generation_seconds": _round(created - unknown, 2) if created and unknown else None,
        "unknown_to_running_seconds": _round(running - unknown, 2) if running and unknown else None,
        "moved_jobs": moved, "generations_before": before, "generations_after": after,
    }


def teardown(kube: KubeClient, op: Operator, namespace: str, cfg: ScaleConfig) -> None:
    """Delete the jobs while the operator runs (it removes its finalizer) and wait for their pods to go."""
    for name in list(job_states(kube, namespace)):
        with contextlib.suppress(KubeAPIError):
            kube.delete(jobs_path(namespace, name))
    wait_for(lambda: not job_states(kube, namespace) and not job_pods(kube, namespace), cfg.timeout_seconds, 2.0,
             f"{namespace}: jobs and pods deleted")


# ---- the run -----------------------------------------------------------------------------------------
def build_nodes(cfg: ScaleConfig) -> list[Any]:
    topology = TOPOLOGY_BY_HOSTS[cfg.hosts]
    nodes = [build_cpu_node("cpu-0")]
    for i in range(cfg.jobs + cfg.spare_slices):
        nodes += build_tpu_slice(pool_name(i), ACCELERATOR, topology, run_pods=False)
    return nodes


def run(cfg: ScaleConfig, run_dir: Path) -> dict[str, Any]:
    if cfg.hosts not in TOPOLOGY_BY_HOSTS:
        raise SystemExit(f"--hosts {cfg.hosts}: not a tpu-v5-lite-podslice slice size; valid: "
                         f"{', '.join(map(str, TOPOLOGY_BY_HOSTS))}")
    out = run_dir / "out"
    out.mkdir(parents=True, exist_ok=True)
    codes: dict[str, Path | None] = {"after": None}
    if "before" in cfg.variants:
        codes["before"] = extract_before(cfg.before_ref, out / "before")
    nodes = build_nodes(cfg)
    lease = cfg.lease_seconds or lease_seconds_for(len(nodes))
    cfg = replace(cfg, lease_seconds=lease,
                  node_monitor_grace_seconds=cfg.node_monitor_grace_seconds or grace_seconds_for(lease))
    settings = ControlPlaneSettings(audit_service_accounts=True,
                                    node_monitor_grace_seconds=cfg.node_monitor_grace_seconds)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": asdict(cfg), "nodes": len(nodes), "checkout": head,
        "before_commit": (out / "before" / "COMMIT").read_text().strip() if "before" in cfg.variants else None,
        "machine": {"cpus": os.cpu_count(), "load_at_start": os.getloadavg()[0], "python": platform.python_version()},
        "variants": {},
    }
    log(f"starting a local cluster with {len(nodes)} nodes in {run_dir / 'cluster'}")
    started = time.monotonic()
    with LocalCluster(run_dir / "cluster", nodes=nodes, settings=settings,
                      no_process_lease_seconds=cfg.lease_seconds).start(timeout=cfg.timeout_seconds) as cluster:
        result["cluster_start_seconds"] = round(time.monotonic() - started, 1)
        kube = cluster.client()
        apply_crds(kube)
        for i, variant in enumerate(cfg.variants):
            result["variants"][variant] = run_variant(cluster, kube, variant, codes[variant], cfg, out,
                                                      last=i == len(cfg.variants) - 1)
            (out / "partial.json").write_text(json.dumps(result, indent=1))
        result["machine"]["load_at_end"] = os.getloadavg()[0]
    return result


def render_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    variants = [v for v in ("before", "after") if v in result["variants"]]
    labels = {"before": f"before the watch cache ({result.get('before_commit')})",
              "after": f"watch cache ({result.get('checkout')})"}
    lines = ["| | " + " | ".join(labels.get(v, v) for v in variants) + " | goal |",
             "|---|" + "---|" * len(variants) + "---|"]

    def row(label: str, get: Callable[[dict[str, Any]], Any], goal: str = "") -> None:
        cells = []
        for v in variants:
            try:
                value = get(result["variants"][v])
            except (KeyError, TypeError):
                value = None
            cells.append("–" if value is None else str(value))
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {goal} |")

    jobs = cfg["jobs"]
    row("API requests/s at steady state (besides watches)", lambda r: r["steady"]["requests_per_second"],
        f"≤ {jobs / 60:.2f} ({jobs} jobs × 1/min)")
    row("… per job per minute", lambda r: r["steady"]["requests_per_job_per_minute"], "≤ 1")
    row("watches opened in the window", lambda r: r["steady"]["watches_opened"])
    row("reconcile latency p50 (s)", lambda r: r["steady"]["reconcile_p50_seconds"])
    row("reconcile latency p99 (s)", lambda r: r["steady"]["reconcile_p99_seconds"], "< 1")
    row("reconciles in the window", lambda r: r["steady"]["reconciles"])
    row("operator CPU (% of one core)", lambda r: r["steady"]["operator_cpu_percent"])
    row("operator RSS (MiB)", lambda r: r["steady"]["operator_memory_mib"]["VmRSS"])
    row("kube-apiserver CPU (% of one core, all clients)", lambda r: r["steady"]["apiserver_cpu_percent"])
    grace = cfg["node_loss_grace_seconds"]
    row("node Unknown → new generation's pods created (s)",
        lambda r: r["node_loss"]["unknown_to_new_generation_seconds"], f"< {5 + grace} (5 + nodeLossGraceSeconds {grace})")
    row("node Unknown → that job Running again (s)", lambda r: r["node_loss"]["unknown_to_running_seconds"])
    row("jobs that moved after the node loss", lambda r: ", ".join(r["node_loss"]["moved_jobs"]) or "none")
    row("nodes marked not Ready in the variant (1 = the node killed)", lambda r: r["nodes_marked_not_ready"])
    row("load average (1 min) at the window's start, end", lambda r: " → ".join(map(str, r["steady"]["load_average"])))
    def stage_times(stage: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: " / ".join(str(r["pod_startup"][stage][k]) for k in ("first", "median", "last"))

    for stage, what in (("created", "created (the operator)"), ("scheduled", "bound (the scheduler)"),
                        ("started", "started (the node agent)")):
        row(f"pods {what}: first / median / last (s after the jobs)", stage_times(stage))
    row(f"{jobs} jobs created → all Running (s)",
        lambda r: r["all_running_seconds"] if r["all_running_seconds"] is not None
        else f"{r['running_jobs']} of {jobs} after {cfg['running_timeout_seconds']:.0f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[ScaleConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="python -m resilax_bench.scale", description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, default=100)
    p.add_argument("--hosts", type=int, default=16, help="hosts per job (one slice): 1, 2, 4, 8, 16, 32 or 64")
    p.add_argument("--spare-slices", type=int, default=1, help="free slices a job that lost a node moves to")
    p.add_argument("--variants", default="after,before",
                   help="in this order: after (this checkout), before (--before-ref's operator)")
    p.add_argument("--before-ref", default=BEFORE_REF)
    p.add_argument("--settle-seconds", type=float, default=15.0)
    p.add_argument("--steady-seconds", type=float, default=60.0)
    p.add_argument("--node-loss-grace-seconds", type=int, default=5, help="the jobs' recovery.nodeLossGraceSeconds")
    p.add_argument("--lease-seconds", type=float, default=None,
                   help="how often no-process nodes renew their Leases; default: every 20 s, or less often so that "
                        f"all of them make at most {LEASE_RENEWALS_PER_SECOND} renewals/s")
    p.add_argument("--node-monitor-grace-seconds", type=int, default=None,
                   help="the node lifecycle controller's grace (≥ 3 × --lease-seconds); default: 5 renewals, ≥ 90 s")
    p.add_argument("--running-timeout-seconds", type=float, default=600.0,
                   help="how long to wait for every job to be Running before measuring with those that are")
    p.add_argument("--timeout-seconds", type=float, default=900.0)
    p.add_argument("--run-dir", type=Path, default=None, help="default: a temporary folder, removed afterwards")
    p.add_argument("--json", type=Path, default=None, help="write the raw result here")
    a = p.parse_args(argv)
    variants = tuple(v for v in a.variants.split(",") if v)
    bad = [v for v in variants if v not in ("before", "after")]
    if bad:
        p.error(f"--variants: {', '.join(bad)} not known; valid: before, after")
    cfg = ScaleConfig(jobs=a.jobs, hosts=a.hosts, spare_slices=a.spare_slices, variants=variants,
                      before_ref=a.before_ref, settle_seconds=a.settle_seconds, steady_seconds=a.steady_seconds,
                      node_loss_grace_seconds=a.node_loss_grace_seconds, lease_seconds=a.lease_seconds,
                      node_monitor_grace_seconds=a.node_monitor_grace_seconds,
                      running_timeout_seconds=a.running_timeout_seconds, timeout_seconds=a.timeout_seconds)
    return cfg, a


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="resilax-scale-"))
    try:
        result = run(cfg, run_dir)
    finally:
        if args.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(render_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
