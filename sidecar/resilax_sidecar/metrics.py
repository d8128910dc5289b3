"""Every metric of the sidecar, defined once, on one registry per process.

Names follow `resilax_sidecar_<what>_<unit>`; labels are bounded (a reason from a fixed set, a tier),
never a step or a path. The trainer's figures (`resilax_trainer_*`, from the control folder's
trainer.json: resilax_ckpt.control.trainer_metrics) are exported here too, read at each scrape. Which job and
pod a series belongs to comes from the scrape's target labels (`jaxjob`, `namespace`, `pod`: the
chart's PodMonitor), not from labels of the sidecar's own. `resilax_build_info{version,component}` is
the sidecar's own series of the build-info metric the operator also exports (`component="operator"`).
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from resilax_ckpt.control import trainer_control as tc
from resilax_ckpt.control.trainer_metrics import read_trainer_figures
from resilax_ckpt.trainer import kept

SAVE_REASONS = ("manual", "preemption", "resize")
"""The reasons a save request may give (the `reason` label's whole range)."""

TIERS = ("local", "persistent")

PEER_PURPOSES = ("replica", "restore")
"""Why bytes moved between sidecars: a peer replica, or a restore (a whole step or chunk files)."""
PEER_DIRECTIONS = ("sent", "received")

CONTENT_TYPE = CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class SidecarMetrics:
    """The sidecar's Prometheus metrics. One instance per process, passed explicitly."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.uploads = Counter(
            "resilax_sidecar_uploads_total", "Steps this sidecar uploaded to the persistent tier.", registry=r
        )
        self.upload_bytes = Counter(
            "resilax_sidecar_upload_bytes_total", "Bytes copied to the persistent tier.", registry=r
        )
        self.upload_seconds = Histogram(
            "resilax_sidecar_upload_seconds",
            "Time to upload one step (copy, verify, marker).",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.upload_failures = Counter(
            "resilax_sidecar_upload_failures_total",
            "Upload attempts that failed and will be retried (storage errors, verify mismatches).",
            registry=r,
        )
        self.commits = Counter(
            "resilax_sidecar_commits_total",
            "Persistent _COMMIT markers this sidecar wrote (the one that saw every process's upload).",
            registry=r,
        )
        self.lag_steps = Gauge(
            "resilax_sidecar_lag_steps",
            "Newest step in the local tier minus newest committed step in the persistent tier.",
            registry=r,
        )
        self.newest_step = Gauge(
            "resilax_sidecar_newest_step",
            "Newest committed step per tier (-1: none).",
            ["tier"],
            registry=r,
        )
        self.save_requests = Counter(
            "resilax_sidecar_save_requests_total", "Save requests accepted, by reason.", ["reason"], registry=r
        )
        self.save_request_seconds = Histogram(
            "resilax_sidecar_save_request_seconds",
            "Time from a save request to its committed result.",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.retention_deletes = Counter(
            "resilax_sidecar_retention_deletes_total",
            "Steps deleted by retention, by tier.",
            ["tier"],
            registry=r,
        )
        self.build_info = Gauge(
            "resilax_build_info", "Always 1: the running component and its version.", ["version", "component"],
            registry=r,
        )
        self.http_unauthorized = Counter(
            "resilax_sidecar_http_unauthorized_total",
            "Mutating HTTP calls refused (missing or wrong token).",
            registry=r,
        )
        self.peer_bytes = Counter(
            "resilax_sidecar_peer_bytes_total",
            "Bytes this sidecar sent to or received from other sidecars, by purpose (replica, restore).",
            ["purpose", "direction"],
            registry=r,
        )
        self.build_info.labels(version=package_version(), component="sidecar").set(1)
        for purpose in PEER_PURPOSES:
            for direction in PEER_DIRECTIONS:
                self.peer_bytes.labels(purpose=purpose, direction=direction)
        for reason in SAVE_REASONS:
            self.save_requests.labels(reason=reason)
        for tier in TIERS:
            self.newest_step.labels(tier=tier).set(-1)
            self.retention_deletes.labels(tier=tier)

    def export_trainer(self, control_dir: str) -> None:
        """Export the trainer's figures from `control_dir`/trainer.json at each scrape."""
        self.registry.register(TrainerCollector(control_dir))
        self.registry.register(TrainerRestartsCollector(control_dir))

    def render(self) -> bytes:
        """The text exposition format, for /metrics."""
        return generate_latest(self.registry)


def package_version() -> str:
    """The installed `resilax` distribution's version ("unknown" when run from a bare checkout)."""
    try:
        return importlib.metadata.version("resilax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def steps_done(figures: dict[str, object]) -> int:
    """Steps the trainer process made since it started: from the first step it reached to the newest
    (0 before its first step). A counter: a new trainer process starts again from 0."""
    step, first = figures.get("step"), figures.get("first_step")
    if not isinstance(step, int) or not isinstance(first, int):
        return 0
    return max(0, step - first + 1)


class TrainerCollector(Collector):
    """`resilax_trainer_*` from the trainer's trainer.json; no series before the trainer wrote one."""

    def __init__(self, control_dir: str) -> None:
        self.control_dir = control_dir

    def collect(self) -> Iterator[Metric]:
        f = read_trainer_figures(self.control_dir)
        if f is None:
            return
        try:
            if f.get("step") is not None:
                yield GaugeMetricFamily("resilax_trainer_step", "The step the training loop reached.",
                                        value=float(f["step"]))
            yield CounterMetricFamily(
                "resilax_trainer_steps",
                "Training steps the trainer process made since it started (rate(...[5m]): steps per second).",
                value=float(steps_done(f)))
            yield CounterMetricFamily("resilax_trainer_saves", "Saves the trainer started.",
                                      value=float(f.get("saves", 0)))
            yield CounterMetricFamily(
                "resilax_trainer_save_blocking_seconds",
                "Seconds the training loop was blocked inside save() calls that saved.",
                value=float(f.get("save_blocking_seconds", 0.0)))
            yield GaugeMetricFamily("resilax_trainer_last_save_blocking_seconds",
                                    "Seconds the loop was blocked by the last save.",
                                    value=float(f.get("last_save_blocking_seconds", 0.0)))
            if f.get("saves"):
                device = GaugeMetricFamily(
                    "resilax_trainer_last_save_device_bytes",
                    "Device memory (HBM on an accelerator) the last save's on-device copy held until drained; "
                    "device_copy: how it took its shards off the devices (on_device, host_transfer, none).",
                    labels=["device_copy"])
                device.add_metric([str(f.get("last_save_device_copy") or "none")],
                                  float(f.get("last_save_device_bytes", 0)))
                yield device
            yield CounterMetricFamily("resilax_trainer_restores", "Restores the trainer did.",
                                      value=float(f.get("restores", 0)))
            yield GaugeMetricFamily("resilax_trainer_restore_seconds", "Seconds the last restore took.",
                                    value=float(f.get("last_restore_seconds", 0.0)))
            if f.get("step_seconds") is not None:
                yield GaugeMetricFamily(
                    "resilax_trainer_step_seconds",
                    "This host's own time per step: the median over recent steps of the time between two steps "
                    "less the wait at the request agreement's barrier (a straggler's is the longest).",
                    value=float(f["step_seconds"]))
            yield CounterMetricFamily(
                "resilax_trainer_barrier_wait_seconds",
                "Seconds the training loop waited at the request agreement's barrier for the other processes.",
                value=float(f.get("barrier_wait_seconds", 0.0)))
            requests, hits = int(f.get("compilation_cache_requests", 0)), int(f.get("compilation_cache_hits", 0))
            generation = [str(f.get("generation") if f.get("generation") is not None else "")]
            for name, what, value in (("hits", "served by", hits), ("misses", "not found in", requests - hits)):
                family = CounterMetricFamily(
                    f"resilax_trainer_compilation_cache_{name}",
                    f"Compilations {what} JAX's persistent compilation cache (this trainer process).",
                    labels=["generation"])
                family.add_metric(generation, float(value))
                yield family
        except (TypeError, ValueError):
            return  # a malformed file: no trainer series this scrape


class TrainerRestartsCollector(Collector):
    """`resilax_trainer_restarts_total{kind,reason}` from the supervisor's incarnation.json (`restarts`):
    restarts that kept the trainer process (`kind="kept"`) and fresh ones by kept.REASONS key; no series
    without a supervisor (docs/architecture.md, "Keep what can be kept")."""

    def __init__(self, control_dir: str) -> None:
        self.control_dir = control_dir

    def collect(self) -> Iterator[Metric]:
        record = tc.read_incarnation(self.control_dir)
        restarts = record.get("restarts") if record else None
        if not isinstance(restarts, dict):
            return
        family = CounterMetricFamily(
            "resilax_trainer_restarts",
            "Restarts of the supervised trainer: kind kept (the same process ran the next incarnation) or fresh "
            "(a new process; reason: why it was not kept).", labels=["kind", "reason"])
        count = restarts.get("kept")
        family.add_metric(["kept", ""], float(count) if isinstance(count, int) else 0.0)
        raw = restarts.get("fresh")
        fresh: dict[str, Any] = raw if isinstance(raw, dict) else {}
        for reason in kept.REASONS:  # bounded labels: only the known keys
            value = fresh.get(reason)
            if isinstance(value, int) and value > 0:
                family.add_metric(["fresh", reason], float(value))
        yield family


class CompileCacheLog:
    """One log line per trainer generation, once its trainer reached its first step: how many of the
    compilations so far JAX's persistent compilation cache served (the figures of
    `resilax_trainer_compilation_cache_{hits,misses}_total`; docs/architecture.md "Compilation cache").
    Fed by the sidecar's reads of trainer.json (`/v1/state`)."""

    def __init__(self) -> None:
        self._told: set[Any] = set()

    def note(self, figures: dict[str, Any] | None) -> None:
        if not figures or figures.get("first_step") is None or figures.get("generation") in self._told:
            return
        self._told.add(figures.get("generation"))
        try:  # a malformed file must not fail /v1/state, which calls this
            requests, hits = int(figures.get("compilation_cache_requests", 0)), int(figures.get("compilation_cache_hits", 0))
        except (TypeError, ValueError):
            return
        log.info("trainer of generation %s reached step %s: the compilation cache served %d of its %d compilations",
                 figures.get("generation"), figures.get("first_step"), hits, requests)
