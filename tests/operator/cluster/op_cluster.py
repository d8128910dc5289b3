"""Helpers of the operator's end-to-end tests (the fixtures are in conftest.py): the operator as a
process, JAXJob manifests and reads, the workers' loss lines, the recovery time breakdown."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from resilax_local.cluster import LocalCluster
from resilax_local.kubeapi import KubeAPIError, KubeClient
from resilax_local.testing import wait_for

ROOT = Path(__file__).resolve().parents[3]
CRD_DIR = ROOT / "charts" / "resilax" / "crds"
RULES_FILE = ROOT / "charts" / "resilax" / "files" / "operator-rules.yaml"
EXAMPLE = ROOT / "examples" / "train.py"
GROUP, VERSION, PLURAL = "resilax.dev", "v1alpha1", "jaxjobs"


def jobs_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    return f"{base}/{name}" if name else base


class OperatorRBAC:
    def __init__(self, namespace: str, account: str, role: str, peering: str, kubeconfig: Path) -> None:
        self.namespace, self.account, self.role, self.peering, self.kubeconfig = (
            namespace, account, role, peering, kubeconfig)


class OperatorProcess:
    """`resilax operator` as a separate process authenticated as the operator's ServiceAccount."""

    def __init__(self, rbac: OperatorRBAC, log_dir: Path) -> None:
        self.rbac = rbac
        self.log_dir = log_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self.metrics_port = 0
        #: Operator settings (RESILAX_OPERATOR_*) for the next start, over the tests' defaults.
        self.settings_env: dict[str, str] = {}

    @property
    def log_file(self) -> Path:
        return self.log_dir / f"operator-{self.runs}.log"

    def start(self) -> OperatorProcess:
        self.runs += 1
        env = {**os.environ, "RESILAX_OPERATOR_GROW_BACK_SETTLE_SECONDS": "20",
               "RESILAX_OPERATOR_STUCK_TERMINATING_SECONDS": "30", **self.settings_env}
        env.pop("KUBECONFIG", None)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.metrics_port = s.getsockname()[1]
        cmd = [str(Path(sys.executable).parent / "resilax"), "operator", "--namespace", self.rbac.namespace,
               "--peering", self.rbac.peering, "--peering-lifetime", "15", "--kubeconfig", str(self.rbac.kubeconfig),
               "--metrics-bind-address", f"127.0.0.1:{self.metrics_port}"]
        with self.log_file.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> OperatorProcess:
        self.kill()
        return self.start()

    def logs(self) -> str:
        return "\n".join((self.log_dir / f"operator-{i}.log").read_text(errors="replace")
                         for i in range(1, self.runs + 1) if (self.log_dir / f"operator-{i}.log").exists())

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return str(r.read().decode())


TRAINER_ENV = "RESILAX_E2E_TRAINER_ENV"
"""`K=V,K=V` added to every e2e trainer's environment: a measurement switches one thing in the trainers
(bench/e2e_ab, e.g. RESILAX_RESTORE_PREFETCH=0) and compares the recorded recovery figures."""


def trainer_env_override(raw: str | None = None) -> dict[str, str]:
    """TRAINER_ENV parsed; a malformed entry is an error naming it."""
    raw = os.environ.get(TRAINER_ENV, "") if raw is None else raw
    env: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{TRAINER_ENV}: {item!r} is not KEY=VALUE (entries are comma-separated)")
        env[key] = value
    return env


def worker_template(*, steps: int, step_seconds: float, devices: int = 2, command: list[str] | None = None,
                    extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo", "PYTHONUNBUFFERED": "1", **trainer_env_override(),
           **(extra_env or {})}
    cmd = command or [sys.executable, str(EXAMPLE), "--steps", str(steps), "--step-seconds", str(step_seconds)]
    return {"spec": {"containers": [{"name": "trainer", "image": "resilax-worker:local", "command": cmd,
                                     "env": [{"name": k, "value": v} for k, v in env.items()]}]}}


def job_manifest(name: str, storage: Path, *, count: int = 2, elastic: dict[str, Any] | None = None,
                 every_steps: int = 4, steps: int = 30, step_seconds: float = 0.5,
                 recovery: dict[str, Any] | None = None, template: dict[str, Any] | None = None,
                 final_save_timeout: int = 60) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "slices": {"accelerator": "tpu-v5-lite-podslice", "topology": "2x4", "count": count,
                   "machineType": "ct5lp-hightpu-4t"},
        "checkpoint": {"storage": str(storage), "every": {"steps": every_steps},
                       "finalSave": {"onPreemption": True, "onResize": True, "timeoutSeconds": final_save_timeout}},
        "recovery": {"maxRestarts": 3, "backoffSeconds": 2, "nodeLossGraceSeconds": 5, **(recovery or {})},
        "template": template or worker_template(steps=steps, step_seconds=step_seconds),
    }
    if elastic is not None:
        spec["elastic"] = elastic
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "JAXJob", "metadata": {"name": name}, "spec": spec}


class Jobs:
    """Create and watch JAXJobs of one namespace; read the workers' loss lines."""

    def __init__(self, kube: KubeClient, cluster: LocalCluster, namespace: str) -> None:
        self.kube, self.cluster, self.namespace = kube, cluster, namespace

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        return self.kube.create(jobs_path(self.namespace), manifest)

    def get(self, name: str) -> dict[str, Any]:
        return self.kube.get(jobs_path(self.namespace, name))

    def exists(self, name: str) -> bool:
        """Whether the JAXJob `name` is still there (a 404 says no; any other error raises)."""
        try:
            self.get(name)
        except KubeAPIError as e:
            if e.status == 404:
                return False
            raise
        return True

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.get(name).get("status") or {})

    def patch_spec(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        return self.kube.patch(jobs_path(self.namespace, name), {"spec": spec})

    def delete(self, name: str) -> None:
        self.kube.delete(jobs_path(self.namespace, name))

    def scale(self, name: str, replicas: int) -> subprocess.CompletedProcess[str]:
        """`kubectl scale jj/NAME --replicas N` (the /scale subresource: spec.slices.count), as a user would."""
        kubectl = shutil.which("kubectl")
        assert kubectl, "kubectl is needed (the test runs `kubectl scale` against the local cluster)"
        return subprocess.run([kubectl, "--kubeconfig", str(self.cluster.kubeconfig), "-n", self.namespace,
                               "scale", f"jj/{name}", f"--replicas={replicas}"],
                              capture_output=True, text=True, timeout=60)

    def wait_status(self, name: str, predicate: Any, timeout: float, message: str) -> dict[str, Any]:
        """The job's first status that satisfies `predicate`, read from a watch: every status the
        operator writes is seen, also one it replaces a second later (a poll can miss those)."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.get(name)
            status = dict(job.get("status") or {})
            if predicate(status):
                return status
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{name}: {message} not met within {timeout:.0f} s\n"
                                   f"status: {json.dumps(self.status(name), indent=1)[:4000]}\n"
                                   f"pods: {self.pod_summary(name)}")
            with contextlib.suppress(KubeAPIError):  # 410 Gone and the like: read the job again
                for event in self.kube.watch(jobs_path(self.namespace), job["metadata"]["resourceVersion"],
                                             timeout_seconds=max(1, min(30, int(left))),
                                             fieldSelector=f"metadata.name={name}"):
                    if event["type"] in ("ADDED", "MODIFIED"):
                        status = dict(event["object"].get("status") or {})
                        if predicate(status):
                            return status
                    elif event["type"] == "ERROR":
                        break

    def pods(self, name: str, generation: int | None = None) -> list[dict[str, Any]]:
        selector = f"resilax.dev/job={name}"
        if generation is not None:
            selector += f",resilax.dev/generation={generation}"
        return list(self.kube.get(f"/api/v1/namespaces/{self.namespace}/pods", labelSelector=selector)["items"])

    def pod_summary(self, name: str) -> list[tuple[str, str, str | None, bool]]:
        return [(p["metadata"]["name"], p.get("status", {}).get("phase", ""), p["spec"].get("nodeName"),
                 bool(p["metadata"].get("deletionTimestamp"))) for p in self.pods(name)]

    def events(self, name: str) -> list[dict[str, Any]]:
        items = self.kube.get(f"/api/v1/namespaces/{self.namespace}/events",
                              fieldSelector=f"involvedObject.name={name}")["items"]
        return sorted(items, key=lambda e: e.get("eventTime") or e.get("lastTimestamp") or "")

    def event_reasons(self, name: str, *wanted: str, timeout: float = 60) -> list[str]:
        """The reasons of the job's events, once every reason in `wanted` is among them: kopf posts
        events from a queue of its own, so an event may land a moment after the status it goes with."""
        def reasons() -> list[str] | None:
            out = [e["reason"] for e in self.events(name)]
            return out if all(w in out for w in wanted) else None
        try:
            return wait_for(reasons, timeout=timeout, interval=0.5, message=f"{name}: events {wanted}")
        except TimeoutError:
            return [e["reason"] for e in self.events(name)]  # the caller's assert shows what is there

    def pod_logs(self, pod: str, container: str) -> list[str]:
        """Every run's log of `container` in the pod named `pod` (deleted pods' too: their folders stay),
        oldest pod of that name first."""
        root = self.cluster.run_dir / "pods" / self.namespace
        folders = sorted((d for d in root.glob(f"{glob.escape(pod)}-*")
                          if re.fullmatch(rf"{re.escape(pod)}-[0-9a-f]{{8}}", d.name)), key=lambda d: d.stat().st_mtime)
        return [run.read_text(errors="replace") for folder in folders
                for run in sorted((folder / "logs" / container).glob("*.log"), key=lambda p: int(p.stem))]

    def trainer_logs(self, name: str) -> list[str]:
        """Every trainer log (each run) of every worker pod of `name` that ran on this cluster, deleted
        pods' too, oldest pod first. Which pod holds process 0 of a generation is not told by its name:
        an in-place restart keeps the survivors' pods (and their names) across generations."""
        root = self.cluster.run_dir / "pods" / self.namespace
        worker = re.compile(rf"{re.escape(name)}-g\d+-s\d+-h\d+-[0-9a-f]{{8}}")
        folders = sorted((d for d in root.glob(f"{glob.escape(name)}-g*") if worker.fullmatch(d.name)),
                         key=lambda d: d.stat().st_mtime)
        out = []
        for folder in folders:
            runs = sorted((folder / "logs" / "trainer").glob("*.log"), key=lambda p: int(p.stem))
            out.extend(run.read_text(errors="replace") for run in runs)
        return out

    def trainer_records(self, name: str, generation: int, key: str) -> list[dict[str, Any]]:
        """The JSON lines carrying `key` that the trainers of `generation` printed (examples/train.py names
        the generation in each), wherever they ran."""
        out = []
        for text in self.trainer_logs(name):
            for line in text.splitlines():
                if line.startswith("{") and f'"{key}"' in line:
                    with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError, ValueError):
                        record = json.loads(line)
                        if key in record and int(record["generation"]) == generation:
                            out.append(record)
        return out

    def losses(self, name: str, generation: int) -> dict[int, dict[str, Any]]:
        """Process 0's JSON loss lines of `generation` (step → record): only process 0 prints them."""
        return {int(r["step"]): r for r in self.trainer_records(name, generation, "loss")}

    def restores(self, name: str, generation: int) -> dict[int, dict[str, Any]]:
        """Each process's `{"restored", "from", "sources", "process", "node", ...}` line of `generation`
        (process id → record)."""
        return {int(r["process"]): r for r in self.trainer_records(name, generation, "restored")}


def committed_steps(storage: Path) -> list[int]:
    """Steps with a commit marker in a folder checkpoint root."""
    if not storage.exists():
        return []
    return sorted(int(p.name) for p in storage.iterdir() if p.name.isdigit() and (p / "_COMMIT").exists())


def unique_name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:4]}"


def now() -> float:
    return time.time()


def parse_k8s_time(raw: str | None) -> float | None:
    if not raw:
        return None
    from datetime import datetime

    return datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()


def event_time(event: dict[str, Any]) -> float:
    return parse_k8s_time(event.get("eventTime") or event.get("lastTimestamp") or event.get("firstTimestamp")) or 0.0


def recovery_breakdown(jobs: Jobs, name: str, generation: int, fault_time: float, detect_reasons: tuple[str, ...],
                       ) -> dict[str, float | None]:
    """Fault → first step of `generation`, split into detection (fault → the operator's transition event),
    teardown (→ the new generation created), scheduling (→ every new pod bound), process launch (→ every
    trainer container started) and JAX start-up + restore (→ the first loss line of the new generation).
    Event and pod times have whole seconds; the loss lines have sub-second times."""
    events = [e for e in jobs.events(name) if event_time(e) >= int(fault_time)]
    detected = next((event_time(e) for e in events if e.get("reason") in detect_reasons), None)
    created = next((event_time(e) for e in events if e.get("reason") == "GenerationCreated"
                    and str(e.get("message", "")).startswith(f"generation {generation}:")), None)
    scheduled: list[float] = []
    started: list[float] = []
    for pod in jobs.pods(name, generation):
        cond = next((c for c in pod.get("status", {}).get("conditions") or [] if c["type"] == "PodScheduled"), None)
        if cond and cond.get("status") == "True":
            scheduled.append(parse_k8s_time(cond.get("lastTransitionTime")) or 0.0)
        for cs in pod.get("status", {}).get("containerStatuses") or []:
            if cs["name"] == "trainer":
                state = cs.get("state") or {}
                t = (state.get("running") or state.get("terminated") or {}).get("startedAt")
                if t:
                    started.append(parse_k8s_time(t) or 0.0)
    losses = jobs.losses(name, generation)
    first_step = min((r["time"] for r in losses.values()), default=None)
    marks = {"fault": fault_time, "detected": detected, "created": created,
             "scheduled": max(scheduled) if scheduled else None, "started": max(started) if started else None,
             "first_step": first_step}

    def span(a: str, b: str) -> float | None:
        x, y = marks[a], marks[b]
        return None if x is None or y is None else round(y - x, 1)

    out = {"detection": span("fault", "detected"), "teardown": span("detected", "created"),
           "scheduling": span("created", "scheduled"), "process_launch": span("scheduled", "started"),
           "jax_startup_and_restore": span("started", "first_step"), "total": span("fault", "first_step")}
    print(f"\nrecovery of {name} into generation {generation}: " +
          ", ".join(f"{k} {v if v is not None else '?'} s" for k, v in out.items()))
    return out


def steps_lost_observed(operator: OperatorProcess) -> tuple[int, float]:
    """(recoveries observed, steps lost in all) of `resilax_operator_steps_lost`, over every kind."""
    from prometheus_client.parser import text_string_to_metric_families

    count, total = 0, 0.0
    for family in text_string_to_metric_families(operator.metrics()):
        for sample in family.samples:
            if sample.name == "resilax_operator_steps_lost_count":
                count += int(sample.value)
            elif sample.name == "resilax_operator_steps_lost_sum":
                total += sample.value
    return count, total


def goodput_metrics(operator: OperatorProcess, name: str) -> dict[str, float]:
    """The operator's resilax_operator_goodput_* samples of job `name`: {"ratio": r, <bucket>: seconds}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(operator.metrics()):
        for sample in family.samples:
            if sample.labels.get("jaxjob") != name:
                continue
            if sample.name == "resilax_operator_goodput_ratio":
                out["ratio"] = sample.value
            elif sample.name == "resilax_operator_goodput_seconds":
                out[sample.labels["bucket"]] = sample.value
    return out
