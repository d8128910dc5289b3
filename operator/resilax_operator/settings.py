"""The operator's settings: one frozen dataclass, a docstring per field, built once by `from_env()`."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Final

from .errors import InvalidSettingError
from .pods.ports import (
    DEFAULT_COORDINATOR_PORT,
    DEFAULT_MEGASCALE_PORT,
    DEFAULT_SIDECAR_PORT,
    MEGASCALE_PORTS,
    TPU_RESERVED_PORTS,
    reserved_port_problem,
)
from .topology import largest_tpu_slice_hosts

ENV_PREFIX: Final = "RESILAX_OPERATOR_"
#: Slices of the largest TPU slice the default `max_hosts_per_job` allows.
MAX_SLICES_SIZED: Final = 32
MAX_HOSTS_PER_JOB: Final = largest_tpu_slice_hosts() * MAX_SLICES_SIZED
#: Pull policies a container may have (the sidecar's `image_pull_policy`).
PULL_POLICIES: Final = ("Always", "IfNotPresent", "Never")
#: Inclusive bounds of the integer settings (None: no upper bound); any other integer setting is >= 0.
#: The chart's values.schema.json states the same bounds (tests/chart/test_chart_settings.py).
INTEGER_BOUNDS: Final[dict[str, tuple[int, int | None]]] = {
    "sidecar_port": (1, 65535), "coordinator_port": (1, 65535), "megascale_port": (1, 65535),
    "node_loss_guard_percent": (0, 100), "reconcile_threads": (1, None), "max_hosts_per_job": (1, None),
    "hang_floor_seconds": (10, None),
}
#: The port settings: check_ports names their problems (range, the TPU runtime's ports, clashes).
PORT_SETTINGS: Final = ("sidecar_port", "coordinator_port", "megascale_port")


@dataclass(frozen=True)
class OperatorSettings:
    sidecar_image: str = "ghcr.io/resilax/resilax:0.1.0"
    """Image of the checkpoint sidecar (`resilax sidecar`); the chart sets it to its own image."""
    image_pull_policy: str = "IfNotPresent"
    """Pull policy of the sidecar container."""
    sidecar_resources: str = ""
    """Resources of the sidecar container as JSON (`{"requests": {...}, "limits": {...}}`); empty: the
    built-in default (`builders.SIDECAR_RESOURCES`). The chart sets it from `sidecar.resources`."""
    sidecar_log_format: str = "text"
    """The sidecars' log lines (`RESILAX_SIDECAR_LOG_FORMAT`): json (one object per line with a severity;
    the chart passes its `logFormat`, json by default) or text."""
    sidecar_port: int = DEFAULT_SIDECAR_PORT
    """The sidecar's HTTP port inside each worker pod (`RESILAX_SIDECAR_PORT`). Not one of the TPU
    runtime's ports (pods/ports.py: 8471, 8080-8081, 8431, 8476-8479), which the operator refuses at start."""
    coordinator_port: int = DEFAULT_COORDINATOR_PORT
    """Port of JAX's coordination service on process 0 (`JAX_COORDINATOR_ADDRESS`); JAX's own choice on
    Cloud TPU. Not one of the TPU runtime's ports."""
    megascale_port: int = DEFAULT_MEGASCALE_PORT
    """Megascale's port on multislice TPU workers: `MEGASCALE_PORT` and the port of
    `MEGASCALE_COORDINATOR_ADDRESS` (process 0)."""
    termination_margin_seconds: int = 30
    """Added to `finalSave.timeoutSeconds` for the pods' terminationGracePeriodSeconds."""
    grow_back_settle_seconds: int = 60
    """A generation must have run this long, all workers Running, before growBack may resize it up."""
    grow_back_probe_seconds: int = 300
    """Autoscaled grow-back probe (policies/grow_back_probe.py): a job with `capacity.provisioning:
    Autoscaled` and `elastic.growBack`, running settled below its declared shape, keeps placeholder pods
    of the missing slices Pending (the autoscaler's demand); a probe set none of whose pods got a node
    is replaced by a fresh one every this many seconds. 0: no probes (growBack then sees only Ready nodes)."""
    probe_image: str = "registry.k8s.io/pause:3.10"
    """Image of the probe pods (they only hold a place; nothing runs in them but the pause process)."""
    probe_priority_class: str = ""
    """priorityClassName of the probe pods; empty: the cluster's default priority. A class with a low
    value that the cluster autoscaler still scales up for (at least its
    `--expendable-pods-priority-cutoff`, default -10) keeps probes from preempting anything."""
    spare_priority_class: str = ""
    """priorityClassName of the spare slices' placeholder pods (spec.recovery.spareSlices,
    policies/spares.py); empty: the cluster's default priority. The chart ships `resilax-spare` (value
    -10, below every job's, preemptionPolicy Never) and sets it: any pod of a higher priority may take a
    spare's nodes, and the cluster autoscaler still counts the placeholders (its default expendable
    cutoff is -10), so it keeps their nodes. The placeholders run `sleep infinity` in the sidecar's image."""
    stuck_terminating_seconds: int = 60
    """A pod still Terminating this long after its grace period on a Ready node is force-deleted."""
    schedule_timeout_seconds: int = 300
    """A worker still unscheduled this long after its generation started: the generation is replanned."""
    local_tier_root: str = "/var/lib/resilax/local"
    """Node folder under which a `checkpoint.local.scope: Node` job gets `<namespace>_<job>_<job uid>`."""
    local_tier_memory_root: str = "/dev/shm/resilax"
    """The same for `medium: Memory` (a tmpfs on the node)."""
    local_tier_default_uid: int = 65532
    """Owner of a scope Node local tier folder when the template sets no runAsUser (the image's user)."""
    refused_retry_seconds: int = 30
    """How soon to try again after the API server refused a worker pod (PodCreationRefused)."""
    allow_host_access: bool = False
    """Let worker templates go beyond the restricted Pod Security profile (pods/podsecurity.py): privileged
    containers, added capabilities, root, hostNetwork/PID/IPC, hostPath and other volume types, host
    ports, shareProcessNamespace, tolerations of every taint. Off: such a JAXJob gets `InvalidSpec`
    naming each field. (The chart's `operator.allowHostAccess`; `RESILAX_OPERATOR_ALLOW_HOST_ACCESS=true`.)"""
    container_waiting_timeout_seconds: int = 300
    """A worker container still waiting for a reason that is not start-up (ImagePullBackOff,
    CreateContainerConfigError, CrashLoopBackOff, ...) this long after its generation started: the job
    fails (image and configuration errors) or the generation is replaced as a counted failure."""
    pod_loss_backoff_seconds: int = 10
    """Pod-level losses (a pod lost, evicted or deleted, a trainer exiting 75) in a row back off: the
    second waits this long before the next generation, each further one twice as long as the one before."""
    pod_loss_backoff_max_seconds: int = 300
    """The longest pod-loss backoff."""
    max_pod_losses: int = 20
    """Pod-level losses in a row after which the job fails (PodLossesExceeded)."""
    pod_loss_reset_seconds: int = 600
    """A generation all Running this long clears the run of pod-level losses."""
    node_loss_guard_percent: int = 50
    """Disruption guard: when at least this share (percent) of the cluster's nodes are NotReady/Unknown
    at once (and at least `node_loss_guard_min_nodes`), a control-plane or network blip is likelier than
    that many node losses: jobs wait (Degraded=True, NodeLossGuard) instead of tearing down and
    force-deleting. 0 turns the guard off."""
    node_loss_guard_min_nodes: int = 2
    """The guard needs at least this many nodes down at once (a single lost node is never a blip)."""
    peer_lost_timeout_seconds: int = 60
    """Workers that exited 76 (a peer process is gone) and no cause found this long after the first of
    them (no worker's node down, no worker failed on its own): the generation is replaced as a PodLost."""
    hang_floor_seconds: int = 60
    """The least automatic hang timeout (policies/hang.py; a job without `recovery.hangTimeoutSeconds`):
    a training worker is hung after max(this, 10 x its p99 step time) without a step, one inside a save
    after max(this, 5 x its p99 save blocking time) (>= 10, as hangTimeoutSeconds)."""
    straggler_window_seconds: int = 300
    """A worker whose own step time (its sidecar's `resilax_trainer_step_seconds`) stays >= 1.5x the
    median of the generation's hosts this long gets a `StragglerDetected` event (policies/straggler.py)."""
    straggler_sample_seconds: int = 60
    """How often the operator reads every worker's sidecar for the stragglers' step times (seconds; 0:
    never, no straggler detection). Pod 0's is read every reconcile anyway."""
    max_hosts_per_job: int = MAX_HOSTS_PER_JOB
    """The most worker pods (hosts) one JAXJob may ask for: slices × hosts per slice of the largest shape
    its spec allows (`slices`, or `elastic.maxCount` with its largest topology). Default: the largest
    TPU slice in the topology table (tpu7x, 9216 chips: 2304 hosts) × 32 slices = 73,728. A
    larger job gets `InvalidSpec` instead of a generation the operator would spend minutes and
    gigabytes building (every pod is built in memory; docs/operations.md has the figures)."""
    reconcile_threads: int = 32
    """Threads that run the jobs' reconciles (each job's is one at a time; they wait on the API server
    and the sidecars, not the CPU). Python's default for the operator's loop would be 6 on 2 cores:
    100 jobs starting together would queue behind them."""
    goodput_status_seconds: int = 300
    """status.goodput is written with every status change and a generation's new marks; the trainer's
    progress alone refreshes it at most this often (seconds; 0: never alone), time alone never. The
    metrics follow every reconcile."""

    def __post_init__(self) -> None:
        problems = check_bounds(self) + check_ports(self)
        if self.sidecar_resources:
            try:  # fails at start, not at the first pod
                sidecar_resources_from_json(self.sidecar_resources)
            except InvalidSettingError as e:
                problems.append(str(e))
        if self.sidecar_log_format not in ("json", "text"):
            problems.append(f"{ENV_PREFIX}SIDECAR_LOG_FORMAT={self.sidecar_log_format!r}: allowed: json, text")
        if self.image_pull_policy not in PULL_POLICIES:
            problems.append(f"{ENV_PREFIX}IMAGE_PULL_POLICY={self.image_pull_policy!r}: allowed: "
                            + ", ".join(PULL_POLICIES))
        if problems:
            raise InvalidSettingError("; ".join(problems))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorSettings:
        """Read `RESILAX_OPERATOR_<FIELD>` (upper-case field names) over the defaults. Every bad
        variable is named in one InvalidSettingError, with its value and what is allowed."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        problems: list[str] = []
        for f in fields(cls):
            name = ENV_PREFIX + f.name.upper()
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            try:
                if f.type in ("bool", bool):
                    values[f.name] = _boolean(name, raw)
                else:
                    values[f.name] = _integer(name, raw, f.name) if f.type in ("int", int) else raw
            except InvalidSettingError as e:
                problems.append(str(e))
        try:
            settings = cls(**values)  # type: ignore[arg-type]
        except InvalidSettingError as e:
            problems.append(str(e))
        if problems:
            raise InvalidSettingError("; ".join(problems))
        return settings


def allowed_integers(field: str) -> str:
    """What an integer setting allows, as the error messages say it."""
    low, high = INTEGER_BOUNDS.get(field, (0, None))
    return f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"


def check_bounds(settings: OperatorSettings) -> list[str]:
    """Each integer setting within INTEGER_BOUNDS (>= 0 when it has no entry); the ports: check_ports."""
    out = []
    for f in fields(settings):
        if f.type not in ("int", int) or f.name in PORT_SETTINGS:
            continue
        value = getattr(settings, f.name)
        low, high = INTEGER_BOUNDS.get(f.name, (0, None))
        if value < low or (high is not None and value > high):
            out.append(f"{ENV_PREFIX}{f.name.upper()}={value}: allowed: {allowed_integers(f.name)}")
    return out


def check_ports(settings: OperatorSettings) -> list[str]:
    """The worker pods' ports: the sidecar's and the coordinator's outside the TPU runtime's (pods/ports.py),
    Megascale's one of Megascale's own, all three different, each 1-65535."""
    named = {"sidecar_port": settings.sidecar_port, "coordinator_port": settings.coordinator_port,
             "megascale_port": settings.megascale_port}
    out = [f"{ENV_PREFIX}{name.upper()}={port} is not a port number; allowed: 1-65535"
           for name, port in named.items() if not 1 <= port <= 65535]
    for name in ("sidecar_port", "coordinator_port"):
        problem = reserved_port_problem(ENV_PREFIX + name.upper(), named[name])
        if problem:
            out.append(problem)
    if settings.megascale_port in TPU_RESERVED_PORTS and settings.megascale_port not in MEGASCALE_PORTS:
        out.append(reserved_port_problem(ENV_PREFIX + "MEGASCALE_PORT", settings.megascale_port) or "")
    if len(set(named.values())) < len(named):
        out.append(f"{ENV_PREFIX}SIDECAR_PORT={settings.sidecar_port}, COORDINATOR_PORT={settings.coordinator_port} "
                   f"and MEGASCALE_PORT={settings.megascale_port} must differ (one network namespace per pod)")
    return out


def _integer(name: str, raw: str, field: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise InvalidSettingError(f"{name}={raw!r} is not an integer; allowed: {allowed_integers(field)}") from None


def _boolean(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise InvalidSettingError(f"{name}={raw!r} is not a boolean; allowed: true, false")


def sidecar_resources_from_json(raw: str) -> dict[str, dict[str, str | int | float]]:
    """The sidecar's resources from `RESILAX_OPERATOR_SIDECAR_RESOURCES`; a clear error when malformed."""
    name = ENV_PREFIX + "SIDECAR_RESOURCES"
    allowed = "a JSON object with only 'requests' and 'limits', each a map of resource name to quantity"
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise InvalidSettingError(f"{name}={raw!r} is not JSON ({e}); allowed: {allowed}") from None
    if not isinstance(value, dict) or not set(value) <= {"requests", "limits"} or not all(
            isinstance(v, dict) and all(isinstance(q, str | int | float) for q in v.values())
            for v in value.values()):
        raise InvalidSettingError(f"{name}={raw!r}: allowed: {allowed}")
    return value
