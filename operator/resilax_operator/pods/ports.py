"""The ports a worker pod leaves to the TPU runtime, and the ports Resilax uses instead (pure, no imports
but the standard library: the sidecar's config checks its port against the same list).

The containers of a worker pod share one network namespace (the node's, with hostNetwork): the
trainer's libtpu and Megascale runtime, JAX's coordination service on process 0, and the Resilax
sidecar all bind in it. What the TPU side binds, with where it is written down:

| port(s)   | bound by                                                        | source |
|-----------|-----------------------------------------------------------------|--------|
| 8471      | libtpu's TPU process port (`TPU_PROCESS_PORT`'s default); the "slice builder" port xpk opens on every TPU container | AI-Hypercomputer/xpk `src/xpk/core/docker_resources.py` (`add_container_ports`: 8471 and 8080); Ray `ray.util.tpu.get_jax_env_vars` ("TPU_PROCESS_PORT ... falling back to 8471"); the JobSet examples of GKE's "Deploy TPU Multislices in GKE" open 8471 and 8080 |
| 8080      | Megascale (multislice over the data-center network, `MEGASCALE_PORT`) | xpk `add_container_ports` ("megascale container ports"); GKE multislice examples |
| 8081      | Megascale as Ray-based launchers configure it (`MEGASCALE_PORT=8081`) | stanford-crfm/levanter `src/levanter/infra/ray_tpu.py` (`run_on_pod_multislice`) |
| 8431      | libtpu's runtime metrics gRPC server (HBM use, duty cycle)      | https://cloud.google.com/tpu/docs/tpu-info-cli; AI-Hypercomputer/cloud-accelerator-diagnostics `tpu_info` ("Connected to libtpu at grpc://localhost:8431") |
| 8476-8479 | `TPU_PROCESS_PORT` / `TPU_PROCESS_ADDRESSES` when one host runs a process per chip or chip group | https://gist.github.com/skye/f82ba45d2445bb19d53545538754f9a3 (a JAX maintainer's recipe; "localhost:8476", "pick a unique port per process") |

Resilax's own ports avoid all of them: the sidecar listens on 8490, JAX's coordination service on 8482
(the port JAX itself picks on Cloud TPU and GKE, `jax/_src/clusters/cloud_tpu_cluster.py`
`coordinator_port`), and the Megascale coordinator address the operator writes uses Megascale's own
8080, with `MEGASCALE_PORT` set to the same. The operator's own pod (health 8080, metrics 9090) never
runs on a TPU node and shares no namespace with a worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

#: Port → what binds it on a TPU worker (the table above).
TPU_RESERVED_PORTS: Final[Mapping[int, str]] = {
    8471: "libtpu's TPU process port (TPU_PROCESS_PORT default; xpk opens it on every TPU container)",
    8080: "Megascale (MEGASCALE_PORT; xpk opens it on every TPU container)",
    8081: "Megascale as Ray-based launchers configure it (MEGASCALE_PORT=8081)",
    8431: "libtpu's runtime metrics server (tpu-info reads grpc://localhost:8431)",
    8476: "libtpu's TPU_PROCESS_PORT of the first process when a host runs several",
    8477: "libtpu's TPU_PROCESS_PORT of the second process when a host runs several",
    8478: "libtpu's TPU_PROCESS_PORT of the third process when a host runs several",
    8479: "libtpu's TPU_PROCESS_PORT of the fourth process when a host runs several",
}
#: The Megascale runtime's own port: the operator's Megascale setting may (should) use it.
MEGASCALE_PORTS: Final = (8080, 8081)

DEFAULT_SIDECAR_PORT: Final = 8490
#: JAX's own coordinator port on Cloud TPU (jax/_src/clusters/cloud_tpu_cluster.py).
DEFAULT_COORDINATOR_PORT: Final = 8482
DEFAULT_MEGASCALE_PORT: Final = 8080


def reserved_port_problem(name: str, port: int) -> str | None:
    """A message when `port`, configured as `name`, is one the TPU runtime binds in a worker pod; else None."""
    use = TPU_RESERVED_PORTS.get(port)
    if use is None:
        return None
    free = ", ".join(str(p) for p in sorted(TPU_RESERVED_PORTS))
    return (f"{name}={port} is the TPU runtime's port on every TPU worker ({use}); choose a port outside "
            f"{free} (see resilax_operator/pods/ports.py)")
