"""The sidecar's settings: one frozen dataclass built once from the `RESILAX_*` environment.

The operator sets these variables in every worker pod (see docs/architecture.md and docs/sidecar.md).
`SidecarConfig.from_env()` checks every variable and reports all problems at once, each naming the
variable, the value found and what is allowed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from resilax_ckpt.saving import retention
from resilax_operator.pods.ports import DEFAULT_SIDECAR_PORT, reserved_port_problem

from resilax_sidecar.errors import ConfigError
from resilax_sidecar.log_format import LOG_FORMATS

T = TypeVar("T")

VERIFY_MODES = ("size", "md5")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class SidecarConfig:
    """Everything the sidecar needs to run; see `from_env` for the variables."""

    control_dir: Path
    """`RESILAX_CONTROL_DIR` (required): folder shared with the trainer; save requests go to
    `requests/<id>.json`, the trainer answers in `results/<id>.json`."""

    checkpoint_dir: str | None = None
    """`RESILAX_CHECKPOINT_DIR`: the persistent tier, a local path or `gs://bucket/prefix`. Required
    when `local_dir` is set (the uploader copies steps there)."""

    local_dir: Path | None = None
    """`RESILAX_LOCAL_DIR`: this host's fast tier. When set, the uploader moves each locally committed
    step to `checkpoint_dir`; when unset, the trainer writes to `checkpoint_dir` directly."""

    host: str = "0.0.0.0"
    """`RESILAX_SIDECAR_HOST`: address the HTTP API binds to (default all interfaces, the pod network)."""

    port: int = DEFAULT_SIDECAR_PORT
    """`RESILAX_SIDECAR_PORT`: the HTTP API's port, 1-65535 (0 picks a free port; tests only), never one of
    the TPU runtime's (8471, 8080-8081, 8431, 8476-8479: resilax_operator/pods/ports.py)."""

    token_file: Path | None = None
    """`RESILAX_SIDECAR_TOKEN_FILE`: file whose stripped contents is the bearer token mutating calls
    must present. It is read at every call, so a rotated Secret takes effect at once. Unset: every
    mutating call is refused with 403."""

    process_id: int = 0
    """`JAX_PROCESS_ID`: this worker's process id; names its `_UPLOADED.<id>` marker."""

    num_processes: int = 1
    """`JAX_NUM_PROCESSES`: processes in the generation; `_COMMIT` needs this many `_UPLOADED.*`."""

    generation: int = 0
    """`RESILAX_GENERATION`: the generation this pod belongs to; reported by `/v1/state`, written
    into upload markers."""

    job: tuple[str, str, str] | None = None
    """`RESILAX_NAMESPACE`, `RESILAX_JOB_NAME`, `RESILAX_JOB_UID`: the JAXJob this pod belongs to (all
    three set, else None); named in the local tier's ownership marker (node_sweep.py)."""

    keep_last: int | None = None
    """`RESILAX_KEEP_LAST`: keep this many newest committed steps on each tier (empty: keep all)."""

    keep_every_steps: int | None = None
    """`RESILAX_KEEP_EVERY_STEPS`: in the persistent tier also keep every step divisible by this."""

    keep_every_seconds: float | None = None
    """`RESILAX_KEEP_EVERY_SECONDS`: in the persistent tier also keep one step per this many seconds of
    save time (resilax_ckpt.saving.retention)."""

    keep_best: retention.KeepBest | None = None
    """`RESILAX_KEEP_BEST`, `RESILAX_KEEP_BEST_METRIC`, `RESILAX_KEEP_BEST_MODE`: in the persistent tier
    also keep the N steps with the best value of that metric (from each step's `_METADATA.json`)."""

    persist_every_steps: int | None = None
    """`RESILAX_PERSIST_EVERY_STEPS`: with a local tier, upload only the local steps divisible by this
    (and the steps that answered a save request); empty: every step."""

    local_keep_last: int | None = None
    """`RESILAX_LOCAL_KEEP_LAST`: committed steps kept in the local tier (empty: `keep_last`). The newest
    local step not yet persisted is always kept."""

    grace_seconds: float = 300.0
    """`RESILAX_SIDECAR_GRACE_SECONDS`: after SIGTERM, how long to wait for the final save to be
    committed (and uploaded, with a local tier) before exiting anyway."""

    upload_concurrency: int = 8
    """`RESILAX_SIDECAR_UPLOAD_CONCURRENCY`: files copied at once, 1-256."""

    poll_seconds: float = 1.0
    """`RESILAX_SIDECAR_POLL_SECONDS`: how often the uploader looks at both tiers."""

    retry_initial_seconds: float = 1.0
    """`RESILAX_SIDECAR_RETRY_INITIAL_SECONDS`: first back-off after a failed upload; doubles each
    failure up to `retry_max_seconds`."""

    retry_max_seconds: float = 60.0
    """`RESILAX_SIDECAR_RETRY_MAX_SECONDS`: longest back-off between upload attempts."""

    verify: str = "size"
    """`RESILAX_SIDECAR_VERIFY`: how each copied file is checked: `size` (default) or `md5` (the
    persistent copy's MD5 against the local file's)."""

    peer_bytes_per_second: float | None = 200e6
    """`RESILAX_PEER_BYTES_PER_SECOND`: the pace of peer replica transfers (peers.py), bytes per second
    (empty: 200 MB/s; `0`: unpaced). One transfer holds one 1 MiB piece in memory at a time."""

    peer_replicas: bool = True
    """`RESILAX_PEER_REPLICAS`: `true` (default) keeps replicas of peers' newest local steps (the
    operator sets it from `checkpoint.local.peerReplicas`); `false` keeps none. Restores still read
    chunks from the other hosts' local tiers either way."""

    log_level: str = "INFO"
    """`RESILAX_SIDECAR_LOG_LEVEL`: DEBUG, INFO, WARNING or ERROR."""
    log_format: str = "text"
    """`RESILAX_SIDECAR_LOG_FORMAT`: json (one object per line with a severity: the chart's default, which
    the operator passes on) or text."""

    termination_log: Path | None = None
    """`RESILAX_SIDECAR_TERMINATION_LOG`: the file its container's termination message is read from
    (the operator sets `/dev/termination-log`); the sidecar leaves its last words there (last_words.py).
    Empty: none."""

    @property
    def retention_rule(self) -> retention.RetentionRule:
        """The persistent tier's retention (resilax_ckpt.saving.retention); the local tier keeps `local_keep_last`."""
        return retention.RetentionRule(self.keep_last, self.keep_every_steps, self.keep_every_seconds, self.keep_best)

    @property
    def uploads(self) -> bool:
        """Whether this sidecar runs the uploader (a local tier is configured)."""
        return self.local_dir is not None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SidecarConfig:
        """Build the settings from `env` (default `os.environ`); raise `ConfigError` listing every bad
        variable."""
        env = os.environ if env is None else env
        problems: list[str] = []

        def get(name: str, parse: Callable[[str], T], default: T, allowed: str) -> T:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            try:
                return parse(raw)
            except ValueError:
                problems.append(f"{name}={raw!r}: {allowed}")
                return default

        def int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
            def parse(raw: str) -> int:
                value = int(raw)
                if value < lo or (hi is not None and value > hi):
                    raise ValueError(raw)
                return value

            return parse

        def positive_float(raw: str) -> float:
            value = float(raw)
            if not value > 0 or value == float("inf"):
                raise ValueError(raw)
            return value

        def non_negative_float(raw: str) -> float:
            value = float(raw)
            if not value >= 0 or value == float("inf"):
                raise ValueError(raw)
            return value

        def choice(options: tuple[str, ...], upper: bool = False) -> Callable[[str], str]:
            def parse(raw: str) -> str:
                value = raw.upper() if upper else raw.lower()
                if value not in options:
                    raise ValueError(raw)
                return value

            return parse

        control = env.get("RESILAX_CONTROL_DIR", "").strip()
        if not control:
            problems.append("RESILAX_CONTROL_DIR is not set: a folder shared with the trainer is required")
        checkpoint_dir = env.get("RESILAX_CHECKPOINT_DIR", "").strip() or None
        local = env.get("RESILAX_LOCAL_DIR", "").strip()
        if local and not checkpoint_dir:
            problems.append(
                f"RESILAX_LOCAL_DIR={local!r} needs RESILAX_CHECKPOINT_DIR (the persistent tier to upload to)"
            )
        if checkpoint_dir and "://" in checkpoint_dir and not checkpoint_dir.startswith("gs://"):
            problems.append(f"RESILAX_CHECKPOINT_DIR={checkpoint_dir!r}: a local path or gs://bucket/prefix")
        elif checkpoint_dir and checkpoint_dir.startswith("gs://") and len(checkpoint_dir) <= len("gs://"):
            problems.append(f"RESILAX_CHECKPOINT_DIR={checkpoint_dir!r}: gs:// needs a bucket name")
        token = env.get("RESILAX_SIDECAR_TOKEN_FILE", "").strip()

        keep_best: retention.KeepBest | None = None
        best = get("RESILAX_KEEP_BEST", int_in(1), None, "an integer >= 1, or empty for none")
        metric = env.get("RESILAX_KEEP_BEST_METRIC", "").strip()
        mode = env.get("RESILAX_KEEP_BEST_MODE", "").strip()
        if best is not None:
            keep_best = retention.KeepBest(best, metric, mode)
            if not metric:
                problems.append("RESILAX_KEEP_BEST_METRIC='': RESILAX_KEEP_BEST needs the name of a metric the "
                                "trainer passes to save(metrics=)")
            if mode not in retention.MODES:
                problems.append(f"RESILAX_KEEP_BEST_MODE={mode!r}: max (higher is better) or min (lower is better)")
        elif metric or mode:
            problems.append("RESILAX_KEEP_BEST_METRIC and RESILAX_KEEP_BEST_MODE need RESILAX_KEEP_BEST "
                            "(how many of the best steps to keep)")

        process_id = get("JAX_PROCESS_ID", int_in(0), 0, "an integer >= 0")
        num_processes = get("JAX_NUM_PROCESSES", int_in(1), 1, "an integer >= 1")
        if process_id >= num_processes:
            problems.append(
                f"JAX_PROCESS_ID={process_id} with JAX_NUM_PROCESSES={num_processes}: the id must be below the count"
            )
        retry_initial = get(
            "RESILAX_SIDECAR_RETRY_INITIAL_SECONDS", positive_float, 1.0, "a number of seconds > 0"
        )
        retry_max = get("RESILAX_SIDECAR_RETRY_MAX_SECONDS", positive_float, 60.0, "a number of seconds > 0")
        if retry_max < retry_initial:
            problems.append(
                f"RESILAX_SIDECAR_RETRY_MAX_SECONDS={retry_max} is below "
                f"RESILAX_SIDECAR_RETRY_INITIAL_SECONDS={retry_initial}"
            )
        port = get("RESILAX_SIDECAR_PORT", int_in(0, 65535), DEFAULT_SIDECAR_PORT, "a port number 1-65535")
        reserved = reserved_port_problem("RESILAX_SIDECAR_PORT", port)
        if reserved:
            problems.append(reserved)
        config = cls(
            control_dir=Path(control),
            checkpoint_dir=checkpoint_dir,
            local_dir=Path(local) if local else None,
            host=env.get("RESILAX_SIDECAR_HOST", "").strip() or "0.0.0.0",
            port=port,
            token_file=Path(token) if token else None,
            process_id=process_id,
            num_processes=num_processes,
            generation=get("RESILAX_GENERATION", int_in(0), 0, "an integer >= 0"),
            job=job_identity(env),
            keep_last=get("RESILAX_KEEP_LAST", int_in(1), None, "an integer >= 1, or empty to keep all"),
            keep_every_steps=get(
                "RESILAX_KEEP_EVERY_STEPS", int_in(1), None, "an integer >= 1, or empty for none"
            ),
            keep_every_seconds=get("RESILAX_KEEP_EVERY_SECONDS", positive_float, None,
                                   "a number of seconds > 0, or empty for none"),
            keep_best=keep_best,
            persist_every_steps=get(
                "RESILAX_PERSIST_EVERY_STEPS", int_in(1), None, "an integer >= 1, or empty for every step"
            ),
            local_keep_last=get(
                "RESILAX_LOCAL_KEEP_LAST", int_in(1), None, "an integer >= 1, or empty to use RESILAX_KEEP_LAST"
            ),
            grace_seconds=get("RESILAX_SIDECAR_GRACE_SECONDS", positive_float, 300.0, "a number of seconds > 0"),
            upload_concurrency=get("RESILAX_SIDECAR_UPLOAD_CONCURRENCY", int_in(1, 256), 8, "an integer 1-256"),
            poll_seconds=get("RESILAX_SIDECAR_POLL_SECONDS", positive_float, 1.0, "a number of seconds > 0"),
            retry_initial_seconds=retry_initial,
            retry_max_seconds=retry_max,
            peer_bytes_per_second=get("RESILAX_PEER_BYTES_PER_SECOND", non_negative_float, 200e6,
                                      "a number of bytes per second (0: unpaced)") or None,
            peer_replicas=get("RESILAX_PEER_REPLICAS", choice(("true", "false")), "true", "true or false") == "true",
            verify=get("RESILAX_SIDECAR_VERIFY", choice(VERIFY_MODES), "size", f"one of {', '.join(VERIFY_MODES)}"),
            termination_log=Path(t) if (t := env.get("RESILAX_SIDECAR_TERMINATION_LOG", "").strip()) else None,
            log_level=get(
                "RESILAX_SIDECAR_LOG_LEVEL", choice(LOG_LEVELS, upper=True), "INFO", f"one of {', '.join(LOG_LEVELS)}"
            ),
            log_format=get("RESILAX_SIDECAR_LOG_FORMAT", choice(LOG_FORMATS), "text", f"one of {', '.join(LOG_FORMATS)}"),
        )
        if problems:
            raise ConfigError(problems)
        return config

    def with_generation_env(self, env: Mapping[str, str]) -> SidecarConfig:
        """These settings with the generation-dependent ones (`JAX_PROCESS_ID`, `JAX_NUM_PROCESSES`,
        `RESILAX_GENERATION`) taken from an in-place restart's assignment where it sets them; raise
        `ConfigError` listing every bad value (each as `env.<NAME>`)."""
        problems: list[str] = []

        def number(name: str, lowest: int, default: int) -> int:
            raw = env.get(name, "").strip()
            if not raw:
                return default
            if not raw.isdigit() or int(raw) < lowest:
                problems.append(f"env.{name}={raw!r}: an integer >= {lowest}")
                return default
            return int(raw)

        process_id = number("JAX_PROCESS_ID", 0, self.process_id)
        num_processes = number("JAX_NUM_PROCESSES", 1, self.num_processes)
        generation = number("RESILAX_GENERATION", 0, self.generation)
        if not problems and process_id >= num_processes:
            problems.append(f"env.JAX_PROCESS_ID={process_id} with JAX_NUM_PROCESSES={num_processes}: the id must "
                            "be below the count")
        if problems:
            raise ConfigError(problems)
        return replace(self, process_id=process_id, num_processes=num_processes, generation=generation)

    def describe(self) -> str:
        """One line for the start-up log (no secrets: the token file's path only)."""
        return (
            f"process {self.process_id}/{self.num_processes} generation {self.generation} "
            f"control={self.control_dir} local={self.local_dir} persistent={self.checkpoint_dir} "
            f"listen={self.host}:{self.port} token_file={self.token_file} keep_last={self.keep_last}"
        )


def job_identity(env: Mapping[str, str]) -> tuple[str, str, str] | None:
    """(namespace, job, uid) from the operator's variables, or None unless all three are set (pure)."""
    names = ("RESILAX_NAMESPACE", "RESILAX_JOB_NAME", "RESILAX_JOB_UID")
    values = tuple(env.get(n, "").strip() for n in names)
    return (values[0], values[1], values[2]) if all(values) else None


def log_level_number(name: str) -> int:
    """The `logging` level for one of `LOG_LEVELS`."""
    return int(logging.getLevelName(name))
