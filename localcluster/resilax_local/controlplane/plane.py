"""The upstream Kubernetes control plane as local processes: etcd, kube-apiserver,
kube-controller-manager and kube-scheduler on 127.0.0.1, each on a free port (several clusters on one
machine do not collide), TLS with a generated CA, RBAC and Node authorization.

Modelled on controller-runtime's envtest (pkg/internal/testing/controlplane), plus the controller
manager and scheduler that envtest leaves out.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import urllib3

from ..binaries import Binaries
from ..errors import KubeAPIError, StartError
from ..kubeapi import Credentials, KubeClient, write_kubeconfig
from ..processes import free_port, spawn, stop_group
from . import audit
from .pki import CertificateAuthority, write_service_account_keys

log = logging.getLogger(__name__)

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"


@dataclass(frozen=True)
class ControlPlaneSettings:
    """How the control plane is configured; the defaults suit tests (fast node-loss detection)."""

    node_monitor_grace_seconds: int = 16
    """Without a Lease renewal for this long, the node lifecycle controller marks a node Unknown."""
    node_monitor_period_seconds: int = 2
    """How often the node lifecycle controller looks at the nodes."""
    node_eviction_rate: float = 10.0
    """Nodes per second the lifecycle controller may taint NoExecute (upstream default 0.1)."""
    etcd_unsafe_no_fsync: bool = True
    """Skip etcd's fsyncs: throwaway clusters, much faster on slow disks."""
    audit_service_accounts: bool = False
    """Write `logs/audit.log`: every request of a ServiceAccount outside kube-system (audit.py), to count
    one client's requests (the scale benchmark counts the operator's)."""


@dataclass
class ControlPlane:
    """One control plane under `run_dir` (certs in `pki/`, etcd data in `etcd/`, logs in `logs/`)."""

    run_dir: Path
    binaries: Binaries
    settings: ControlPlaneSettings = field(default_factory=ControlPlaneSettings)
    ports: dict[str, int] = field(default_factory=dict)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def pki_dir(self) -> Path:
        return self.run_dir / "pki"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (client certificate in group system:masters)."""
        return self.run_dir / "kubeconfig"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def _component_kubeconfig(self, ca: CertificateAuthority, stem: str, user: str, group: str | None) -> Path:
        pair = ca.issue(stem, user, group)
        creds = Credentials(self.server, str(ca.cert_path), str(pair.cert), str(pair.key))
        return write_kubeconfig(self.pki_dir / f"{stem}.kubeconfig", creds)

    def start(self, timeout: float = 180.0, after_api: Callable[[], None] | None = None) -> None:
        """Start all four components and return once the API server is ready and controllers run.

        `after_api` is called as soon as the API server is ready, while the controllers start (the
        cluster starts its node agent there, to overlap their start-ups)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for name in ("etcd_client", "etcd_peer", "apiserver", "controller_manager", "scheduler"):
            self.ports.setdefault(name, free_port())
        ca = CertificateAuthority(self.pki_dir)
        serving = ca.issue("apiserver", "kube-apiserver", server=True, hosts=(
            "127.0.0.1", "localhost", "10.96.0.1", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
            "kubernetes.default.svc.cluster.local"))
        admin = ca.issue("admin", "resilax-admin", "system:masters")
        front_proxy = ca.issue("front-proxy-client", "front-proxy-client")
        sa = write_service_account_keys(self.pki_dir)
        write_kubeconfig(self.kubeconfig, Credentials(self.server, str(ca.cert_path), str(admin.cert), str(admin.key)))
        kcm_config = self._component_kubeconfig(ca, "controller-manager", "system:kube-controller-manager", None)
        scheduler_config = self._component_kubeconfig(ca, "scheduler", "system:kube-scheduler", None)
        logs = self.run_dir / "logs"
        p = self.ports
        s = self.settings
        deadline = time.monotonic() + timeout

        etcd_argv = [
            str(self.binaries.etcd), "--name=default", f"--data-dir={self.run_dir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{p['etcd_client']}",
            f"--advertise-client-urls=http://127.0.0.1:{p['etcd_client']}",
            f"--listen-peer-urls=http://127.0.0.1:{p['etcd_peer']}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{p['etcd_peer']}",
            f"--initial-cluster=default=http://127.0.0.1:{p['etcd_peer']}",
            "--log-level=warn",
        ]
        if s.etcd_unsafe_no_fsync:
            etcd_argv.append("--unsafe-no-fsync")
        self.processes["etcd"] = spawn(etcd_argv, logs / "etcd.log")
        self._wait_http("etcd", f"http://127.0.0.1:{p['etcd_client']}/health", deadline)

        audit_flags = []
        if s.audit_service_accounts:
            policy = self.run_dir / "audit-policy.json"
            policy.write_text(json.dumps(audit.POLICY, indent=1))
            audit_flags = [f"--audit-policy-file={policy}", f"--audit-log-path={logs / audit.AUDIT_LOG}",
                           "--audit-log-format=json", "--audit-log-maxsize=100000"]  # MB: never rotated
        self.processes["kube-apiserver"] = spawn([
            str(self.binaries.kube_apiserver), *audit_flags,
            f"--etcd-servers=http://127.0.0.1:{p['etcd_client']}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={p['apiserver']}",
            f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={ca.cert_path}",
            "--authorization-mode=Node,RBAC", "--enable-admission-plugins=NodeRestriction",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
            f"--service-account-key-file={sa.cert}", f"--service-account-signing-key-file={sa.key}",
            "--allow-privileged=true", "--profiling=false", f"--cert-dir={self.pki_dir / 'apiserver-generated'}",
            "--endpoint-reconciler-type=none",
            "--kubelet-preferred-address-types=InternalIP",  # the node agent's kubelet API (kubectl logs)
            # the aggregation layer (APIService backends such as metrics-server) and its front proxy
            f"--requestheader-client-ca-file={ca.cert_path}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={front_proxy.cert}", f"--proxy-client-key-file={front_proxy.key}",
        ], logs / "kube-apiserver.log")
        admin_client = KubeClient.from_kubeconfig(self.kubeconfig, timeout=10)
        self._wait_api_ready(admin_client, deadline)

        self.processes["kube-controller-manager"] = spawn([
            str(self.binaries.kube_controller_manager),
            f"--kubeconfig={kcm_config}", f"--authentication-kubeconfig={kcm_config}",
            f"--authorization-kubeconfig={kcm_config}",
            "--bind-address=127.0.0.1", f"--secure-port={p['controller_manager']}",
            f"--cert-dir={self.pki_dir / 'controller-manager-generated'}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--root-ca-file={ca.cert_path}", f"--service-account-private-key-file={sa.key}",
            f"--cluster-signing-cert-file={ca.cert_path}", f"--cluster-signing-key-file={ca.key_path}",
            f"--node-monitor-grace-period={s.node_monitor_grace_seconds}s",
            f"--node-monitor-period={s.node_monitor_period_seconds}s",
            f"--node-eviction-rate={s.node_eviction_rate}", f"--secondary-node-eviction-rate={s.node_eviction_rate}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
        ], logs / "kube-controller-manager.log")
        scheduler_argv = [
            str(self.binaries.kube_scheduler),
            f"--kubeconfig={scheduler_config}", f"--authentication-kubeconfig={scheduler_config}",
            f"--authorization-kubeconfig={scheduler_config}",
            "--bind-address=127.0.0.1", f"--secure-port={p['scheduler']}", "--leader-elect=false",
        ]
        self.processes["kube-scheduler"] = spawn(scheduler_argv, logs / "kube-scheduler.log")
        if after_api is not None:
            after_api()
        self._wait_https_health("kube-controller-manager", p["controller_manager"], deadline)
        self._wait_https_health("kube-scheduler", p["scheduler"], deadline)
        self._wait_controllers(admin_client, deadline)

    def _check_alive(self, name: str) -> None:
        proc = self.processes[name]
        if proc.poll() is not None:
            tail = (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace").splitlines()[-25:]
            raise StartError(f"{name} exited with {proc.returncode} while starting; its log ends:\n"
                             + "\n".join(tail))

    def _wait(self, name: str, deadline: float, check: object) -> None:
        last = ""
        while time.monotonic() < deadline:
            self._check_alive(name)
            try:
                if check():  # type: ignore[operator]
                    return
            except Exception as e:
                last = repr(e)
            time.sleep(0.25)
        raise StartError(f"{name} did not become healthy in time (last error: {last}); "
                         f"see {self.run_dir / 'logs' / (name + '.log')}")

    def _wait_http(self, name: str, url: str, deadline: float) -> None:
        http = urllib3.PoolManager(retries=False)
        self._wait(name, deadline, lambda: http.request("GET", url, timeout=2).status == 200)

    def _wait_https_health(self, name: str, port: int, deadline: float) -> None:
        """Their serving certificates are self-signed (in their --cert-dir): health only, no verification."""
        http = urllib3.PoolManager(cert_reqs="CERT_NONE", retries=False)
        url = f"https://127.0.0.1:{port}/healthz"

        def healthy() -> bool:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
                return bool(http.request("GET", url, timeout=2).status == 200)

        self._wait(name, deadline, healthy)

    def _wait_api_ready(self, client: KubeClient, deadline: float) -> None:
        def ready() -> bool:
            return client.get_text("/readyz").startswith("200")

        self._wait("kube-apiserver", deadline, ready)

    def _wait_controllers(self, client: KubeClient, deadline: float) -> None:
        """Controllers are at work once the default ServiceAccount and the root CA ConfigMap exist."""
        def ready() -> bool:
            try:
                client.get("/api/v1/namespaces/default/serviceaccounts/default")
                client.get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt")
            except KubeAPIError:
                return False
            return True

        self._wait("kube-controller-manager", deadline, ready)

    def stop(self) -> None:
        """Stop the components in reverse order of start, each with its whole process group."""
        for name in reversed(list(self.processes)):
            proc = self.processes[name]
            stop_group(proc.pid, timeout=10.0, proc=proc)
        self.processes.clear()
