"""Cross-process coordination through jax.distributed's coordination service.

No device collectives: barriers and key-value exchanges are gRPC calls to the coordinator, so they
can run on a background thread while the training loop keeps the devices busy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from resilax_ckpt.errors import SaveError


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


def initialize_distributed_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Call `jax.distributed.initialize` from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID (set by the operator) when there are several processes. Returns whether it did.
    RESILAX_INIT_TIMEOUT_SECONDS, when set, is how long to wait for the other processes (the operator
    sets it when workers may wait for nodes that do not exist yet or for a queue's admission; JAX's
    default is 300 s). Called on: all processes, before any other JAX call."""
    env = os.environ if env is None else env
    address = env.get("JAX_COORDINATOR_ADDRESS", "").strip()
    count = env.get("JAX_NUM_PROCESSES", "").strip()
    if not address or not count or int(count) <= 1:
        return False
    import jax

    timeout = env.get("RESILAX_INIT_TIMEOUT_SECONDS", "").strip()
    if timeout:
        jax.distributed.initialize(coordinator_address=address, num_processes=int(count),
                                   process_id=int(env.get("JAX_PROCESS_ID", "0")), initialization_timeout=int(timeout))
    else:
        jax.distributed.initialize(coordinator_address=address, num_processes=int(count),
                                   process_id=int(env.get("JAX_PROCESS_ID", "0")))
    return True
