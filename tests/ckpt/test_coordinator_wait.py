"""A process joins the coordinator as soon as its service listens (multihost.wait_for_coordinator):
`initialize_distributed_from_env` on a process other than 0 calls `jax.distributed.initialize` only
once the coordinator's port accepts connections, so gRPC's reconnect backoff (1 s, x1.6 per try) never
starts; process 0 (the coordinator itself) never waits. Real sockets on 127.0.0.1; JAX's initialize
is replaced by a recorder (the order is what is asserted, not a time)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import jax
import pytest
import resilax_ckpt as rc
from resilax_ckpt import multihost
from resilax_local.processes import free_port


def _env(port: int, process_id: int, **extra: str) -> dict[str, str]:
    return {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(process_id), "RESILAX_EXIT_GRACE_SECONDS": "0", **extra}


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """What happened, in order: refused connection tries, the listener's start, JAX's initialize."""
    seen: list[tuple[str, Any]] = []
    connect = socket.create_connection

    def counting(address: Any, *args: Any, **kwargs: Any) -> socket.socket:
        try:
            return connect(address, *args, **kwargs)
        except OSError:
            seen.append(("refused", address))
            raise

    monkeypatch.setattr(socket, "create_connection", counting)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: seen.append(("initialize", kw)))
    return seen


def test_a_process_calls_initialize_only_once_the_coordinator_listens(calls: list[tuple[str, Any]]) -> None:
    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))  # bound, not listening: a connection is refused, as before JAX's service starts
    done: list[bool] = []
    joiner = threading.Thread(target=lambda: done.append(rc.initialize_distributed_from_env(_env(port, 1))))
    joiner.start()
    try:
        # the joiner tries (and is refused), or (without the wait) calls initialize at once
        for _ in range(600):
            if calls:
                break
            threading.Event().wait(0.05)
        calls.append(("listening", port))
        server.listen()
        joiner.join(timeout=60)
    finally:
        server.close()
    kinds = [k for k, _ in calls]
    assert kinds[0] == "refused", calls
    assert kinds.index("listening") < kinds.index("initialize"), calls
    assert done == [True]
    kw = calls[-1][1]
    assert kw["process_id"] == 1 and kw["coordinator_address"] == f"127.0.0.1:{port}", kw


def test_the_coordinator_itself_never_waits(calls: list[tuple[str, Any]]) -> None:
    port = free_port()  # nothing listens there: process 0 is the one that will
    assert rc.initialize_distributed_from_env(_env(port, 0)) is True
    assert [k for k, _ in calls] == ["initialize"], calls
    assert "initialization_timeout" not in calls[0][1]  # JAX's default, as before


def test_a_coordinator_that_never_listens_leaves_the_error_to_jax_within_the_same_timeout(
        calls: list[tuple[str, Any]]) -> None:
    port = free_port()
    assert rc.initialize_distributed_from_env(_env(port, 1, RESILAX_INIT_TIMEOUT_SECONDS="1")) is True
    kinds = [k for k, _ in calls]
    assert kinds[-1] == "initialize" and set(kinds[:-1]) == {"refused"} and kinds.count("refused") >= 1, calls
    assert calls[-1][1]["initialization_timeout"] == 1  # at least 1 s is left to JAX to say what failed


@pytest.mark.parametrize(("address", "parsed"), [
    ("10.0.0.5:8482", ("10.0.0.5", 8482)),
    ("job-g2-s0-h0.job-workers:8482", ("job-g2-s0-h0.job-workers", 8482)),
    ("[fd00::5]:8482", ("fd00::5", 8482)),
    ("no-port", None),
    (":8482", None),
    ("host:port", None),
], ids=["ipv4", "dns-name", "ipv6", "no-port", "no-host", "port-not-a-number"])
def test_parse_coordinator_address(address: str, parsed: tuple[str, int] | None) -> None:
    assert multihost.parse_coordinator_address(address) == parsed


def test_an_address_it_cannot_parse_is_not_waited_for(calls: list[tuple[str, Any]]) -> None:
    assert multihost.wait_for_coordinator("no-port", 30) == 0.0
    assert calls == []
