"""Cross-process coordination through jax.distributed's coordination service.

No device collectives: barriers and key-value exchanges are gRPC calls to the coordinator, so they
can run on a background thread while the training loop keeps the devices busy.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Protocol

from resilax_ckpt.control.trainer_metrics import count_jax_event
from resilax_ckpt.errors import SaveError, StorageError, StorageInUseError
from resilax_ckpt.options import InvalidOptionsError


class Coordinator(Protocol):
    """Barriers and a key-value store shared by all processes of one generation."""

    process_index: int
    process_count: int

    def barrier(self, name: str, timeout_s: float) -> None: ...
    def publish(self, key: str, value: str) -> None: ...
    def fetch(self, key: str, timeout_s: float) -> str: ...
    def fetch_dir(self, prefix: str) -> dict[str, str]: ...
    def delete(self, key: str) -> None: ...


class SingleProcessCoordinator:
    """One process: barriers are no-ops, the key-value store is a dict."""

    process_index = 0
    process_count = 1

    def __init__(self) -> None:
        self._kv: dict[str, str] = {}

    def barrier(self, name: str, timeout_s: float) -> None:
        pass

    def publish(self, key: str, value: str) -> None:
        self._kv[key] = value

    def fetch(self, key: str, timeout_s: float) -> str:
        return self._kv[key]

    def fetch_dir(self, prefix: str) -> dict[str, str]:
        return {k: v for k, v in self._kv.items() if k.startswith(prefix)}

    def delete(self, key: str) -> None:
        for k in [k for k in self._kv if k.startswith(key)]:
            del self._kv[k]


class JaxCoordinator:
    """The coordination service of `jax.distributed.initialize`."""

    def __init__(self, client: Any, process_index: int, process_count: int) -> None:
        self._client = client
        self.process_index = process_index
        self.process_count = process_count

    def barrier(self, name: str, timeout_s: float) -> None:
        try:
            self._client.wait_at_barrier(name, int(timeout_s * 1000))
        except Exception as e:
            raise SaveError(f"barrier {name!r} failed after up to {timeout_s:.0f} s: {e}") from e

    def publish(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value, allow_overwrite=True)

    def fetch(self, key: str, timeout_s: float) -> str:
        try:
            return str(self._client.blocking_key_value_get(key, int(timeout_s * 1000)))
        except Exception as e:
            raise SaveError(f"waiting for key {key!r} failed after up to {timeout_s:.0f} s: {e}") from e

    def fetch_dir(self, prefix: str) -> dict[str, str]:
        return dict(self._client.key_value_dir_get(prefix))

    def delete(self, key: str) -> None:
        self._client.key_value_delete(key)


def current_coordinator() -> Coordinator:
    """The coordinator of this process: JAX's when jax.distributed is initialized with several
    processes, otherwise a single-process stand-in."""
    import jax
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None or jax.process_count() == 1:
        return SingleProcessCoordinator()
    return JaxCoordinator(client, jax.process_index(), jax.process_count())


#: Seconds a process that raised an unhandled exception may spend exiting (`arm_exit_watchdog`).
EXIT_GRACE_SECONDS = 10.0
#: Its exit code: Python's own for an unhandled exception (the operator counts it as the worker's failure).
EXIT_CODE_UNHANDLED = 1
#: Exit code of a process whose peer of the same generation is gone (a collective or the coordination
#: service lost it): not its own failure. The operator does not count it and learns the cause from the
#: cluster (a node down: NodeLoss at once). sysexits' EX_PROTOCOL ("remote error in protocol").
EXIT_CODE_PEER_LOST = 76
#: What JAX's runtime says when a peer process of a collective or the coordination service is gone
#: (gloo's TCP pairs, gRPC to a dead coordinator, the service's heartbeat verdict); matched in the
#: messages of an unhandled exception and of its causes, unless the error is a storage one (below).
PEER_LOST_MARKERS = (
    "connection closed by peer", "connection reset by peer", "broken pipe",  # gloo's TCP pairs
    "failed to connect to all addresses", "socket closed", "unavailable:",  # gRPC to the coordinator
    "heartbeat", "has been set to error", "coordination service has stopped",  # the service's verdict
)
#: Modules whose exceptions are storage (or HTTP client) errors, never JAX's peer loss: gcsfs over
#: aiohttp says "[Errno 104] Connection reset by peer" and "[Errno 32] Broken pipe" when GCS drops a
#: connection; google-api-core's 503 is `ServiceUnavailable: 503 failed to connect to all addresses`.
STORAGE_ERROR_MODULES = ("aiohttp", "gcsfs", "fsspec", "google.api_core", "google.cloud", "google.resumable_media",
                         "google.auth", "requests", "urllib3", "tensorstore")
#: What tensorstore's storage errors (plain ValueErrors) carry: its HTTP and curl annotations, the
#: kvstore's "Error reading/writing" with the key, the spec it prints.
STORAGE_ERROR_SIGNS = ("http_response_code", "curl error", "curl_code", "error reading", "error writing",
                       "error opening", "tensorstore_spec", "local file", "gs://", "storage.googleapis.com")
#: Exit code of a process whose job may not use its checkpoint storage: a live JAXJob of another uid
#: holds it (errors.StorageInUseError). The operator reports StorageInUse and does not restart it.
#: sysexits' EX_CONFIG ("configuration error").
EXIT_CODE_STORAGE_IN_USE = 78
_watchdog_armed = False
#: Called (best effort, in order) just before the watchdog's os._exit: the last writes a process owes
#: (the trainer figures' last step, which the sidecar's last words carry to the operator).
_exit_hooks: list[Callable[[], None]] = []


def add_exit_hook(hook: Callable[[], None]) -> None:
    """Run `hook` before the exit watchdog ends the process (os._exit skips atexit and finally)."""
    _exit_hooks.append(hook)


def remove_exit_hook(hook: Callable[[], None]) -> None:
    with contextlib.suppress(ValueError):
        _exit_hooks.remove(hook)


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and the exceptions it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def _text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".lower()


def is_storage_error(e: BaseException) -> bool:
    """Whether one exception comes from storage: the library's StorageError, an exception of a
    storage or HTTP client library (STORAGE_ERROR_MODULES), or a message with tensorstore's storage
    annotations (STORAGE_ERROR_SIGNS) (pure)."""
    module = type(e).__module__ or ""
    if isinstance(e, StorageError) or any(module == m or module.startswith(m + ".") for m in STORAGE_ERROR_MODULES):
        return True
    text = _text(e)
    return any(sign in text for sign in STORAGE_ERROR_SIGNS)


def is_peer_loss(error: BaseException) -> bool:
    """Whether `error` (or an exception it was raised from) says a peer process is gone: one of
    PEER_LOST_MARKERS in a message of the chain, and no exception of the chain a storage error
    (`is_storage_error`: a GCS 503, a connection GCS reset, a tensorstore read), which is the trainer's
    own failure whatever its words. A plain OSError (the trainer's own socket or file) is never JAX's
    peer loss either: JAX reports those as runtime errors (pure)."""
    chain = _chain(error)
    if any(is_storage_error(e) for e in chain):
        return False
    return any(not isinstance(e, OSError) and any(marker in _text(e) for marker in PEER_LOST_MARKERS)
               for e in chain)


def arm_exit_watchdog(grace_seconds: float = EXIT_GRACE_SECONDS) -> bool:
    """After an unhandled exception the process exits promptly, whatever its exit waits for:
    * the exception says a peer process is gone (`is_peer_loss`): at once, with EXIT_CODE_PEER_LOST
      (76); jax.distributed's shutdown could only wait for the dead peer;
    * the job may not use its checkpoint storage (`StorageInUseError`): at once, with
      EXIT_CODE_STORAGE_IN_USE (78);
    * any other: with code 1 within `grace_seconds` (the exit's own clean-up may run meanwhile).
    Without it, a trainer that raises while its peers wait for it (in a collective, a barrier), or
    whose peer died, hangs at exit in jax.distributed's shutdown, which waits for every peer up to its
    shutdown timeout (300 s): its pod stays Running and the operator sees nothing wrong. The traceback
    is printed first (the previous `sys.excepthook`). Returns whether it armed (once per process; a
    grace <= 0 disarms). Called on: all processes (`initialize_distributed_from_env` does, after
    `jax.distributed.initialize`)."""
    global _watchdog_armed
    if _watchdog_armed or grace_seconds <= 0:
        return False
    _watchdog_armed = True
    previous = sys.excepthook

    def on_unhandled(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        if is_peer_loss(value):
            _exit_now(EXIT_CODE_PEER_LOST, f"{kind.__name__}: a peer process of this generation is gone")
        if isinstance(value, StorageInUseError):
            _exit_now(EXIT_CODE_STORAGE_IN_USE, f"{kind.__name__}: {value}")
        _exit_after(grace_seconds, EXIT_CODE_UNHANDLED, f"unhandled {kind.__name__}")

    sys.excepthook = on_unhandled
    return True


def _exit_now(code: int, why: str) -> None:
    print(f"resilax: {why}; exiting with code {code} (jax.distributed's shutdown would wait for it)",
          file=sys.stderr, flush=True)
    for hook in list(_exit_hooks):
        with contextlib.suppress(Exception):
            hook()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(code)


def _exit_after(seconds: float, code: int, why: str) -> None:
    def fire() -> None:
        _exit_now(code, f"{why}: the process did not exit within {seconds:g} s (jax.distributed's shutdown waits "
                        "for peers that wait for it)")

    timer = threading.Timer(seconds, fire)
    timer.daemon = True  # runs on while the interpreter's exit (atexit: jax's shutdown) waits
    timer.start()


def bind_stack_dumps() -> None:
    """SIGUSR1 writes every thread's Python stack to stderr (the pod log), unless the program has a
    SIGUSR1 handler of its own. Called on: each process."""
    if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


_counting_cache = False


def count_compilation_cache() -> None:
    """Count JAX's persistent compilation cache requests and hits (`trainer_metrics.COMPILATION_CACHE`,
    written into trainer.json); once per process. Called on: each process."""
    global _counting_cache
    if _counting_cache:
        return
    import jax.monitoring

    jax.monitoring.register_event_listener(count_jax_event)
    _counting_cache = True


#: JAX's own `initialization_timeout` when none is given (jax.distributed.initialize).
JAX_INIT_TIMEOUT_SECONDS = 300
#: How soon a process other than the coordinator tries the coordinator's port again (`wait_for_coordinator`):
#: 50 ms at first, x1.5 per refused try, at most 0.5 s (a DNS name asked by every host of a big job).
COORDINATOR_POLL_SECONDS = 0.05
COORDINATOR_POLL_MAX_SECONDS = 0.5


def parse_coordinator_address(address: str) -> tuple[str, int] | None:
    """`host:port` or `[v6 address]:port` to (host, port); None for anything else, which
    `jax.distributed.initialize` then reports itself (pure)."""
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit():
        return None
    return host, int(port)


def wait_for_coordinator(address: str, timeout_s: float, poll_s: float = COORDINATOR_POLL_SECONDS) -> float:
    """Block until the coordinator's port accepts a TCP connection (closed at once), or `timeout_s`
    passed; returns the seconds it waited. Why: a process whose `jax.distributed.initialize` finds the
    coordination service not yet listening retries on gRPC's reconnect backoff (1 s, then x1.6 each
    try, jittered), so it joins up to a whole backoff step after the service is up: 1.6-4 s on the
    CPU test bed when process 0 came 1-10 s later, 10 s in a generation start under load
    (docs/architecture.md, "Joining the coordinator"). Called on: each process but the coordinator."""
    where = parse_coordinator_address(address)
    began = time.monotonic()
    if where is None:
        return 0.0
    while True:
        left = timeout_s - (time.monotonic() - began)
        if left <= 0:
            return time.monotonic() - began
        try:
            socket.create_connection(where, timeout=min(1.0, left)).close()
            return time.monotonic() - began
        except OSError:  # refused (not listening yet), unresolvable (its DNS name not yet), unreachable
            time.sleep(min(poll_s, max(0.0, timeout_s - (time.monotonic() - began))))
            poll_s = min(COORDINATOR_POLL_MAX_SECONDS, poll_s * 1.5)


def initialize_distributed_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Call `jax.distributed.initialize` from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID (set by the operator) when there are several processes, and arm the exit watchdog
    (`arm_exit_watchdog`; RESILAX_EXIT_GRACE_SECONDS, default 10, 0: off; in a one-process worker of a
    JAXJob, RESILAX_JOB_UID set, too: StorageInUseError exits 78 there as well). Returns whether it
    initialized. RESILAX_INIT_TIMEOUT_SECONDS, when set, is how long to wait for the other processes
    (the operator sets it when workers may wait for nodes that do not exist yet or for a queue's
    admission; JAX's default is 300 s). SIGUSR1 then writes every thread's stack to stderr (faulthandler),
    which `resilax run` asks for before it stops a hung trainer, and the persistent compilation cache's
    requests and hits are counted into trainer.json. It first starts the restore prefetch (prefetch.py:
    this process's checkpoint is read into host memory while JAX starts; RESILAX_RESTORE_PREFETCH=0: off).
    A process other than the coordinator (JAX_PROCESS_ID not 0) first waits until the coordinator's port
    accepts connections (`wait_for_coordinator`), within the same timeout, so that it joins as soon as
    the coordination service is up rather than on gRPC's next reconnect try.
    Called on: all processes, before any other JAX call."""
    env = os.environ if env is None else env
    from resilax_ckpt.restoring import prefetch  # JAX-free; imported here, as the sidecar imports this module

    prefetch.start_prefetch(env)
    bind_stack_dumps()
    count_compilation_cache()
    address = env.get("JAX_COORDINATOR_ADDRESS", "").strip()
    count = env.get("JAX_NUM_PROCESSES", "").strip()
    raw = env.get("RESILAX_EXIT_GRACE_SECONDS", "").strip()
    try:
        grace = float(raw) if raw else EXIT_GRACE_SECONDS
    except ValueError:
        raise InvalidOptionsError(f"RESILAX_EXIT_GRACE_SECONDS={raw!r} is not a number of seconds; allowed: "
                                  "a number >= 0 (0: no exit watchdog)") from None
    if not address or not count or int(count) <= 1:
        if env.get("RESILAX_JOB_UID"):  # a one-process worker of a JAXJob: its exit codes tell the operator
            arm_exit_watchdog(grace)
        return False
    import jax

    process_id = int(env.get("JAX_PROCESS_ID", "0"))
    kwargs: dict[str, Any] = {"coordinator_address": address, "num_processes": int(count), "process_id": process_id}
    timeout = env.get("RESILAX_INIT_TIMEOUT_SECONDS", "").strip()
    limit = int(timeout) if timeout else JAX_INIT_TIMEOUT_SECONDS
    waited = wait_for_coordinator(address, limit) if process_id != 0 else 0.0
    if timeout or waited >= 1:
        kwargs["initialization_timeout"] = max(1, int(limit - waited))
    jax.distributed.initialize(**kwargs)
    arm_exit_watchdog(grace)
    return True
