"""The exit watchdog (resilax_ckpt.multihost.arm_exit_watchdog): a trainer that raises while its peers
wait for it exits with code 1 at once, instead of hanging in jax.distributed's shutdown (which waits
for every peer, up to 300 s) with its pod Running. Real JAX processes on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import resilax_ckpt as rc
from resilax_ckpt.multihost import EXIT_CODE_PEER_LOST, EXIT_CODE_UNHANDLED
from resilax_local.processes import free_port

WORKER = Path(__file__).with_name("ckpt_exit_worker.py")
ROOT = Path(__file__).resolve().parents[2]
#: How long process 0 waits for process 1: without the watchdog, process 1 cannot exit before that.
PEER_WAIT_SECONDS = 240


def _start(process_id: int, address: str, grace: str, mode: str = "barrier") -> subprocess.Popen[bytes]:
    env = dict(os.environ, RESILAX_EXIT_GRACE_SECONDS=grace)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "ckpt_lib"), env.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, str(WORKER), str(process_id), address, str(PEER_WAIT_SECONDS * 1000), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def test_a_trainer_that_raises_while_its_peer_waits_exits_with_code_1() -> None:
    address = f"127.0.0.1:{free_port()}"
    procs = [_start(0, address, "2"), _start(1, address, "2")]
    try:
        try:
            out, _ = procs[1].communicate(timeout=PEER_WAIT_SECONDS / 2)
        except subprocess.TimeoutExpired:
            raise AssertionError("process 1 raised but hangs at exit while process 0 waits for it") from None
        text = out.decode(errors="replace")
        assert procs[1].returncode == EXIT_CODE_UNHANDLED == 1, text
        assert "RuntimeError: the trainer's own bug" in text  # the traceback comes first
        assert ("resilax: unhandled RuntimeError: the process did not exit within 2 s (jax.distributed's shutdown "
                "waits for peers that wait for it); exiting with code 1") in text
        assert procs[0].poll() is None  # its peer still waits: the watchdog ended the hang, not the peer
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()  # reaps it and closes its pipe


def test_a_bad_grace_is_refused_naming_the_variable() -> None:
    env = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0",
           "RESILAX_EXIT_GRACE_SECONDS": "soon"}
    with pytest.raises(rc.InvalidOptionsError, match="RESILAX_EXIT_GRACE_SECONDS='soon' is not a number"):
        rc.initialize_distributed_from_env(env)


def test_a_peer_waiting_in_a_collective_exits_76_once_the_failed_one_is_gone() -> None:
    """Process 1 raises (exit 1 after its grace); process 0, waiting for it in an all-gather, gets gloo's
    "connection closed by peer" and exits at once with EXIT_CODE_PEER_LOST: not its own failure."""
    address = f"127.0.0.1:{free_port()}"
    procs = [_start(0, address, "2", "collective"), _start(1, address, "2", "collective")]
    try:
        outs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=PEER_WAIT_SECONDS / 2)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"process {procs.index(p)} hangs at exit") from None
            outs.append(out.decode(errors="replace"))
        assert procs[1].returncode == 1, outs[1]
        assert procs[0].returncode == EXIT_CODE_PEER_LOST == 76, outs[0]
        assert "a peer process of this generation is gone; exiting with code 76" in outs[0]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()


class _GlooError(RuntimeError):
    pass


def _jax_error(message: str) -> BaseException:
    import jax.errors

    return jax.errors.JaxRuntimeError(message)


def _aiohttp_error(errno: int, strerror: str) -> BaseException:
    import aiohttp

    error = aiohttp.ClientOSError(errno, strerror)
    error.__cause__ = (ConnectionResetError if errno == 104 else BrokenPipeError)(errno, strerror)
    return error


def _gcsfs_error(code: int, message: str) -> BaseException:
    from gcsfs.retry import HttpError

    return HttpError({"code": code, "message": message})


def _api_core_error(message: str) -> BaseException:
    from google.api_core.exceptions import ServiceUnavailable

    return ServiceUnavailable(message)


# The storage errors' texts were captured on this machine (2026-12-04) from tensorstore 0.1.86 and
# gcsfs 2026.10 against a local HTTP server answering 503 or resetting/closing the connection
# (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT left on, gcsfs logged the api-core one). Curl on other builds
# names errno 104 ("Connection reset by peer"): that variant is the captured text with the name.
_TS_503 = ("ABORTED: All 1 retry attempts failed: Service Unavailable [http_response_code='503'] "
           "[http_response_body='{\"error\": {\"code\": 503, \"message\": \"Service Unavailable\"}}']")
_TS_RESET = ("ABORTED: All 1 retry attempts failed: CURL error Failure when receiving data from the peer: Recv "
             "failure: Unknown error 104 [curl_code='56']")
STORAGE_ERRORS = {
    "tensorstore-gcs-503": lambda: ValueError(_TS_503),
    "tensorstore-gcs-503-unavailable": lambda: ValueError(_TS_503.replace("ABORTED: All 1 retry attempts failed",
                                                                         "UNAVAILABLE: Error writing \"run/1/x\"")),
    "tensorstore-zarr-open-503": lambda: ValueError(
        "ABORTED: Error opening \"zarr3\" driver: Error reading gs://bkt-1/run/1/w/zarr.json: All 1 retry attempts "
        "failed: Service Unavailable [http_response_code='503']"),
    "tensorstore-gcs-reset": lambda: ValueError(_TS_RESET),
    "tensorstore-gcs-reset-named": lambda: ValueError(_TS_RESET.replace("Unknown error 104", "Connection reset by peer")),
    "tensorstore-truncated-chunk": lambda: ValueError(
        "FAILED_PRECONDITION: Error reading local file \"/ckpt/7/params/w/c/0\": Not enough data: expected at "
        "least 64 or 57 more; at byte 7"),
    "tensorstore-unavailable-read": lambda: ValueError(
        "UNAVAILABLE: Error reading local file \"/ckpt/7/params/w/c/0\": [OS error 11: Resource temporarily "
        "unavailable]"),
    "gcsfs-503": lambda: _gcsfs_error(503, "Service Unavailable"),
    "gcsfs-reset": lambda: _aiohttp_error(104, "Connection reset by peer"),
    "gcsfs-upload-broken-pipe": lambda: _aiohttp_error(32, "Broken pipe"),
    "api-core-503": lambda: _api_core_error(
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:45983: Ssl handshake failed "
        "(TSI_PROTOCOL_FAILURE)"),
    "library-storage-error": lambda: rc.StorageError("gs://bkt-1/run/7/_COMMIT: write failed: broken pipe"),
    "own-socket": lambda: ConnectionResetError(104, "Connection reset by peer"),
}
PEER_LOSSES = {
    "gloo-pair-closed": lambda: _jax_error(
        "UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by peer "
        "[127.0.0.1]:5252"),
    "gloo-broken-pipe": lambda: _jax_error(
        "UNKNOWN: Gloo AllReduce failed: [external/gloo/gloo/transport/tcp/pair.cc:589] Write error "
        "[127.0.0.1]:47652: Broken pipe"),
    "coordinator-unavailable": lambda: _jax_error("UNAVAILABLE: Socket closed"),
    "service-verdict": lambda: _jax_error(
        "INTERNAL: Task /job:jax_worker/replica:0/task:1 has been set to ERROR in coordination service"),
}


@pytest.mark.parametrize("name", sorted(STORAGE_ERRORS))
def test_storage_errors_are_not_peer_loss_whatever_their_words(name: str) -> None:
    """A GCS 503, a connection GCS reset or closed, a tensorstore read error: the trainer's own failure
    (exit 1, counted), though their texts hold `unavailable:`, `broken pipe` or `reset by peer`; also
    when the library wraps them, and when a JAX error is raised while handling one."""
    from resilax_ckpt.multihost import is_peer_loss

    error = STORAGE_ERRORS[name]()
    assert not is_peer_loss(error)
    try:
        try:
            raise error
        except BaseException as e:
            raise rc.SaveError("save of step 7 failed") from e
    except rc.SaveError as wrapped:
        assert not is_peer_loss(wrapped)


@pytest.mark.parametrize("name", sorted(PEER_LOSSES))
def test_jax_peer_losses_are_told_as_such(name: str) -> None:
    from resilax_ckpt.multihost import is_peer_loss

    error = PEER_LOSSES[name]()
    assert is_peer_loss(error)
    try:
        try:
            raise error
        except BaseException as e:
            raise rc.SaveError("save of step 7 failed") from e
    except rc.SaveError as wrapped:
        assert is_peer_loss(wrapped)


def test_a_real_tensorstore_read_error_is_not_peer_loss(tmp_path: Path) -> None:
    """Made here: tensorstore reading a truncated chunk of a zarr3 array on disk."""
    import numpy as np
    import tensorstore as ts
    from resilax_ckpt.multihost import is_peer_loss

    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(tmp_path / "w")}}
    array = ts.open(spec, create=True, dtype=ts.float32, shape=[16],
                    chunk_layout=ts.ChunkLayout(chunk_shape=[16])).result()
    array.write(np.arange(16, dtype=np.float32)).result()
    (tmp_path / "w" / "c" / "0").write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError) as caught:
        ts.open(spec).result().read().result()
    assert "error reading local file" in str(caught.value).lower()
    assert not is_peer_loss(caught.value)


@pytest.mark.parametrize(("error", "lost"), [
    (_GlooError("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:547] Connection closed by "
                "peer [127.0.0.1]:5252"), True),
    (RuntimeError("UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:8476: "
                  "Failed to connect to remote host: Connection refused"), True),
    (RuntimeError("INTERNAL: Task /job:jax_worker/replica:0/task:1 has been set to ERROR in coordination service"), True),
    (ValueError("shapes (8, 4) and (8, 8) do not match"), False),
    (KeyError(0), False),
], ids=["gloo-pair-closed", "coordinator-unreachable", "service-verdict", "own-bug", "key-error"])
def test_a_peer_loss_is_told_from_the_trainers_own_failure(error: BaseException, lost: bool) -> None:
    from resilax_ckpt.multihost import is_peer_loss

    assert is_peer_loss(error) is lost
    try:
        try:
            raise error
        except BaseException as e:
            raise RuntimeError("save failed") from e  # the library wraps it: the cause still tells
    except RuntimeError as wrapped:
        assert is_peer_loss(wrapped) is lost
