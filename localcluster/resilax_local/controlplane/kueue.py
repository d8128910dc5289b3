"""Kueue in the local cluster: its manager as a process on 127.0.0.1, its CRDs, its webhooks and the
default queue. `LocalCluster.start_kueue()` and `resilax local up --kueue` use it.

    kueue = Kueue(run_dir, client)
    kueue.start()   # returns once the manager is ready and its webhooks answer (the default queue exists)
    kueue.stop()    # the manager stops and its webhook configurations go (pods are created without it)

What it runs and why is kueue_manifests.py's docstring (no internal cert manager, URL webhooks on
127.0.0.1, only the pod integration). Its files, under `<run_dir>/kueue/`: `config.yaml`, `kubeconfig`
(a client certificate of the cluster's CA, in system:masters), `certs/` (the webhooks' serving
certificate for 127.0.0.1), `launch.json` and, in the cluster's `logs/`, `kueue.log`.

The manager reads a metrics certificate from the fixed path /etc/kueue/metrics/certs whenever internal
cert management is off (its metrics server is off here, but the file must exist): it starts through
`resilax_local.launch` as a container would, with `certs/` bound read-only at that path in a mount
namespace of its own (launch.py creates the empty mount point once, as a runtime creates mount points).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
import yaml

from ..binaries import KueueBinary, ensure_kueue
from ..errors import KubeAPIError, StartError
from ..kubeapi import Credentials, KubeClient, write_kubeconfig
from ..processes import alive, free_port, spawn, stop_group
from . import kueue_manifests as km
from .pki import CertificateAuthority

log = logging.getLogger(__name__)

#: Where the manager reads its metrics certificate when internal cert management is off (cmd/kueue).
METRICS_CERT_PATH = "/etc/kueue/metrics/certs"


@dataclass(frozen=True)
class KueueState:
    """What `cluster.json` keeps of a running Kueue (for `LocalCluster.attach` and `stop_dir`)."""

    pid: int
    version: str
    webhook_port: int
    health_port: int

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "version": self.version, "webhook_port": self.webhook_port,
                "health_port": self.health_port}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> KueueState:
        return cls(int(raw["pid"]), str(raw["version"]), int(raw["webhook_port"]), int(raw["health_port"]))


class Kueue:
    """The Kueue manager of the cluster in `run_dir` (its CA in `<run_dir>/pki`)."""

    def __init__(self, run_dir: Path, client: KubeClient, server: str, binary: KueueBinary | None = None) -> None:
        self.run_dir = run_dir
        self.dir = run_dir / "kueue"
        self.client = client
        self.server = server
        self.binary = binary
        self.proc: subprocess.Popen[bytes] | None = None
        self.state: KueueState | None = None

    @property
    def log_path(self) -> Path:
        return self.run_dir / "logs" / "kueue.log"

    def start(self, timeout: float = 180.0) -> KueueState:
        """Install the CRDs, start the manager, register its webhooks, create the default queue."""
        binary = self.binary or ensure_kueue()
        deadline = time.monotonic() + timeout
        self.dir.mkdir(parents=True, exist_ok=True)
        ca = CertificateAuthority(self.run_dir / "pki")
        serving = ca.issue("kueue-webhook", "kueue-webhook", server=True, hosts=("127.0.0.1", "localhost"))
        certs = self.dir / "certs"
        certs.mkdir(exist_ok=True)
        (certs / "tls.crt").write_bytes(serving.cert.read_bytes())
        (certs / "tls.key").write_bytes(serving.key.read_bytes())
        client_pair = ca.issue("kueue", "kueue-manager", "system:masters")
        kubeconfig = write_kubeconfig(self.dir / "kubeconfig", Credentials(
            self.server, str(ca.cert_path), str(client_pair.cert), str(client_pair.key)))
        ca_bundle = base64.b64encode(ca.cert_path.read_bytes()).decode()
        health_port, webhook_port = free_port(), free_port()
        base_url = f"https://127.0.0.1:{webhook_port}"

        self._ensure({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": km.NAMESPACE}},
                     "/api/v1/namespaces")
        manifests = binary.manifests / "config" / "components"
        kustomization = yaml.safe_load((manifests / "crd" / "kustomization.yaml").read_text())
        crds = [yaml.safe_load(p.read_text()) for p in sorted((manifests / "crd" / "bases").glob("*.yaml"))]
        for crd in km.build_crds(crds, km.conversion_crds(kustomization), base_url, ca_bundle):
            self._apply(crd, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions")
        for crd in crds:
            self._wait_established(crd["metadata"]["name"], deadline)

        config = self.dir / "config.yaml"
        config.write_text(yaml.safe_dump(km.build_config(health_port=health_port, webhook_port=webhook_port,
                                                         cert_dir=str(certs))))
        spec = self.dir / "launch.json"
        spec.write_text(json.dumps({
            "argv": [str(binary.manager), f"--config={config}", f"--kubeconfig={kubeconfig}", "--zap-log-level=2"],
            "env": {"PATH": "/usr/bin:/bin"}, "cwd": str(self.dir), "hostname": "",
            "mounts": [{"source": str(certs), "target": METRICS_CERT_PATH, "read_only": True}]}, indent=1))
        self.proc = spawn([sys.executable, "-m", "resilax_local.launch", str(spec)], self.log_path)
        self.state = KueueState(self.proc.pid, binary.version, webhook_port, health_port)
        try:
            self._wait_ready(health_port, deadline)
            webhooks = list(yaml.safe_load_all((manifests / "webhook" / "manifests.yaml").read_text()))
            for doc in km.build_webhook_configurations(webhooks, base_url, ca_bundle):
                self._apply(doc, km.object_path(doc))
            self._create_default_queue(deadline)
        except BaseException:
            self.stop()
            raise
        log.info("Kueue %s up: webhooks at %s, log %s", binary.version, base_url, self.log_path)
        return self.state

    def stop(self, pid: int | None = None) -> None:
        """Stop the manager (this one's, or `pid` of an attached cluster's) and delete its webhook
        configurations, so pods with a queue label are created again without it."""
        target = pid if pid is not None else (self.proc.pid if self.proc is not None else None)
        if target is not None and alive(target):
            stop_group(target, timeout=10.0, proc=self.proc)
        for kind, name in (("mutatingwebhookconfigurations", km.MUTATING_NAME),
                           ("validatingwebhookconfigurations", km.VALIDATING_NAME)):
            with contextlib.suppress(KubeAPIError, urllib3.exceptions.HTTPError):
                self.client.delete(f"/apis/admissionregistration.k8s.io/v1/{kind}/{name}")
        self.proc = None

    # ---- steps ----------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace").splitlines()[-25:]
            raise StartError(f"Kueue's manager exited with {self.proc.returncode} while starting; its log ends:\n"
                             + "\n".join(tail))

    def _ensure(self, doc: dict[str, Any], path: str) -> None:
        try:
            self.client.create(path, doc)
        except KubeAPIError as e:
            if e.status != 409:
                raise

    def _apply(self, doc: dict[str, Any], collection: str) -> None:
        """Create `doc`, or replace the object of its name (a cluster restarted with another version)."""
        try:
            self.client.create(collection, doc)
        except KubeAPIError as e:
            if e.status != 409:
                raise
            path = f"{collection}/{doc['metadata']['name']}"
            current = self.client.get(path)
            doc = {**doc, "metadata": {**doc["metadata"], "resourceVersion": current["metadata"]["resourceVersion"]}}
            self.client.put(path, doc)

    def _wait_established(self, name: str, deadline: float) -> None:
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
        while time.monotonic() < deadline:
            crd = self.client.get(path)
            if any(c["type"] == "Established" and c["status"] == "True"
                   for c in (crd.get("status") or {}).get("conditions") or []):
                return
            time.sleep(0.2)
        raise StartError(f"Kueue's CRD {name} was not Established in time")

    def _wait_ready(self, port: int, deadline: float) -> None:
        http = urllib3.PoolManager(retries=False)
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                resp = http.request("GET", f"http://127.0.0.1:{port}/readyz", timeout=2)
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}: {resp.data[:200]!r}"
            except urllib3.exceptions.HTTPError as e:
                last = repr(e)
            time.sleep(0.5)
        raise StartError(f"Kueue's manager was not ready in time (last: {last}); see {self.log_path}")

    def _create_default_queue(self, deadline: float) -> None:
        """The default flavor, ClusterQueue and LocalQueue (in `default`); through the webhooks, which
        the API server may take a moment to call after their configuration is created."""
        docs = [km.build_resource_flavor(), km.build_cluster_queue(), km.build_local_queue("default")]
        for doc in docs:
            while True:
                self._check_alive()
                try:
                    self._ensure(doc, km.object_path(doc))
                    break
                except KubeAPIError as e:
                    if time.monotonic() >= deadline:
                        raise StartError(f"creating Kueue's {doc['kind']} {doc['metadata']['name']}: {e}") from e
                    time.sleep(0.5)
