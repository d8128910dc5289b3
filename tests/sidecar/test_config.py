"""SidecarConfig.from_env: defaults, every variable, and start-up errors that name the problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from resilax_ckpt.saving import retention
from resilax_sidecar.config import SidecarConfig
from resilax_sidecar.errors import ConfigError


def test_defaults_from_a_minimal_environment():
    config = SidecarConfig.from_env({"RESILAX_CONTROL_DIR": "/ctl"})
    assert config.control_dir == Path("/ctl")
    assert config.host == "0.0.0.0" and config.port == 8490
    assert config.local_dir is None and not config.uploads
    assert config.token_file is None and config.keep_last is None
    assert (config.process_id, config.num_processes, config.generation) == (0, 1, 0)


def test_every_variable_is_read():
    env = {
        "RESILAX_CONTROL_DIR": "/ctl",
        "RESILAX_CHECKPOINT_DIR": "gs://bucket/run",
        "RESILAX_LOCAL_DIR": "/local",
        "RESILAX_SIDECAR_HOST": "127.0.0.1",
        "RESILAX_SIDECAR_PORT": "9000",
        "RESILAX_SIDECAR_TOKEN_FILE": "/secret/token",
        "JAX_PROCESS_ID": "3",
        "JAX_NUM_PROCESSES": "4",
        "RESILAX_GENERATION": "7",
        "RESILAX_KEEP_LAST": "2",
        "RESILAX_KEEP_EVERY_STEPS": "1000",
        "RESILAX_KEEP_EVERY_SECONDS": "3600",
        "RESILAX_KEEP_BEST": "3",
        "RESILAX_KEEP_BEST_METRIC": "loss",
        "RESILAX_KEEP_BEST_MODE": "min",
        "RESILAX_SIDECAR_GRACE_SECONDS": "30",
        "RESILAX_SIDECAR_UPLOAD_CONCURRENCY": "16",
        "RESILAX_SIDECAR_POLL_SECONDS": "0.5",
        "RESILAX_SIDECAR_RETRY_INITIAL_SECONDS": "0.5",
        "RESILAX_SIDECAR_RETRY_MAX_SECONDS": "5",
        "RESILAX_SIDECAR_VERIFY": "md5",
        "RESILAX_SIDECAR_LOG_LEVEL": "debug",
    }
    c = SidecarConfig.from_env(env)
    assert c.uploads and c.local_dir == Path("/local") and c.checkpoint_dir == "gs://bucket/run"
    assert (c.host, c.port, c.token_file) == ("127.0.0.1", 9000, Path("/secret/token"))
    assert (c.process_id, c.num_processes, c.generation) == (3, 4, 7)
    assert (c.keep_last, c.keep_every_steps, c.grace_seconds) == (2, 1000, 30.0)
    assert c.retention_rule == retention.RetentionRule(2, 1000, 3600.0, retention.KeepBest(3, "loss", "min"))
    assert (c.upload_concurrency, c.poll_seconds, c.retry_initial_seconds, c.retry_max_seconds) == (16, 0.5, 0.5, 5.0)
    assert (c.verify, c.log_level) == ("md5", "DEBUG")


@pytest.mark.parametrize("port", ["8471", "8080", "8081", "8431", "8476"])
def test_a_tpu_runtime_port_is_refused(port):
    """Issue 25, item 2: the sidecar shares the worker pod's network with libtpu and Megascale."""
    with pytest.raises(ConfigError) as info:
        SidecarConfig.from_env({"RESILAX_CONTROL_DIR": "/ctl", "RESILAX_SIDECAR_PORT": port})
    assert f"RESILAX_SIDECAR_PORT={port} is the TPU runtime's port" in str(info.value)


def test_all_problems_are_reported_at_once_with_variable_value_and_what_is_allowed():
    env = {
        "RESILAX_LOCAL_DIR": "/local",
        "RESILAX_SIDECAR_PORT": "http",
        "JAX_PROCESS_ID": "4",
        "JAX_NUM_PROCESSES": "4",
        "RESILAX_KEEP_LAST": "0",
        "RESILAX_SIDECAR_VERIFY": "sha1",
        "RESILAX_SIDECAR_GRACE_SECONDS": "-1",
        "RESILAX_KEEP_BEST": "2",
        "RESILAX_KEEP_BEST_MODE": "lowest",
        "RESILAX_KEEP_EVERY_SECONDS": "0",
        "RESILAX_SIDECAR_LOG_FORMAT": "xml",
    }
    with pytest.raises(ConfigError) as info:
        SidecarConfig.from_env(env)
    message = str(info.value)
    assert "RESILAX_CONTROL_DIR is not set" in message
    assert "RESILAX_LOCAL_DIR='/local' needs RESILAX_CHECKPOINT_DIR" in message
    assert "RESILAX_SIDECAR_PORT='http': a port number 1-65535" in message
    assert "JAX_PROCESS_ID=4 with JAX_NUM_PROCESSES=4" in message
    assert "RESILAX_KEEP_LAST='0': an integer >= 1" in message
    assert "RESILAX_SIDECAR_VERIFY='sha1': one of size, md5" in message
    assert "RESILAX_SIDECAR_GRACE_SECONDS='-1'" in message
    assert "RESILAX_KEEP_BEST_METRIC='': RESILAX_KEEP_BEST needs the name of a metric" in message
    assert "RESILAX_KEEP_BEST_MODE='lowest': max (higher is better) or min (lower is better)" in message
    assert "RESILAX_KEEP_EVERY_SECONDS='0': a number of seconds > 0" in message
    assert "RESILAX_SIDECAR_LOG_FORMAT='xml': one of json, text" in message

    assert len(info.value.problems) == 11
    assert isinstance(info.value, ValueError)


def test_keep_best_metric_alone_is_refused():
    with pytest.raises(ConfigError, match="RESILAX_KEEP_BEST_METRIC and RESILAX_KEEP_BEST_MODE need RESILAX_KEEP_BEST"):
        SidecarConfig.from_env({"RESILAX_CONTROL_DIR": "/ctl", "RESILAX_KEEP_BEST_METRIC": "loss"})


@pytest.mark.parametrize(
    "url, ok",
    [("gs://bucket/prefix", True), ("/mnt/ckpt", True), ("s3://bucket/x", False), ("gs://", False)],
    ids=["gcs", "path", "s3", "gcs-no-bucket"],
)
def test_checkpoint_dir_must_be_a_path_or_gcs(url, ok):
    env = {"RESILAX_CONTROL_DIR": "/ctl", "RESILAX_CHECKPOINT_DIR": url}
    if ok:
        assert SidecarConfig.from_env(env).checkpoint_dir == url
    else:
        with pytest.raises(ConfigError, match="RESILAX_CHECKPOINT_DIR"):
            SidecarConfig.from_env(env)


def test_the_command_exits_2_with_the_message_and_no_traceback(tmp_path):
    code = "import sys; from resilax_operator.cli import main; sys.exit(main(['sidecar']))"
    env = {"PATH": "/usr/bin:/bin", "RESILAX_CONTROL_DIR": str(tmp_path), "RESILAX_SIDECAR_PORT": "70000"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "RESILAX_SIDECAR_PORT='70000': a port number 1-65535" in run.stderr
    assert "Traceback" not in run.stderr
