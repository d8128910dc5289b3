"""The pod network of a local cluster: the block of addresses its pods get.

Pods are processes on this one host, each with an address of its own that it binds (the sidecar, the JAX
coordinator, gloo). The API server proxies to a pod (`pods/<name>/proxy`, what `kubectl resilax save`
goes through) only when its IP is global unicast: k8s.io/kubernetes v1.37.2,
pkg/registry/core/pod/strategy.go, `ResourceLocation` answers "address not allowed" otherwise, and no
127.x address is. So each cluster takes one /16 of 240.0.0.0/4 (IPv4's reserved "class E": no real
network uses it, and Go counts it as global unicast) and puts each process pod's address on the
loopback interface (`ip addr add 240.<o>.x.y/32 dev lo`): it then binds and connects on this host as
127.x does. An address of its own on an interface, not one route for the block: gloo (JAX's CPU
collectives) looks up the interface that holds its address and fails without one. Pods of no-process
nodes get an address of the block without it (nothing binds it). The cluster's addresses are removed
when it stops. Node addresses stay 127.<o>.0.n.

Adding an address needs CAP_NET_ADMIN (root, as the pods' mount namespaces already do); where it is
refused, the cluster keeps 127.<o>.0.0/16 for its pods and logs why: everything works but the pod proxy.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass
from typing import Final

log = logging.getLogger(__name__)

#: The first octet of a proxyable pod block (class E), and of the fallback (loopback).
PROXYABLE_OCTET: Final = 240
LOOPBACK_OCTET: Final = 127


@dataclass(frozen=True)
class PodBlock:
    """The cluster's pods' /16: `<first>.<second>.0.0/16`."""

    first: int
    second: int

    @property
    def cidr(self) -> str:
        return f"{self.first}.{self.second}.0.0/16"

    @property
    def needs_addresses(self) -> bool:
        """Whether each pod's address must be put on the loopback interface (127/8 is there already)."""
        return self.first != LOOPBACK_OCTET

    def address(self, index: int) -> str:
        """The index-th address of the block (index < 65536)."""
        return f"{self.first}.{self.second}.{index // 256}.{index % 256}"


def build_address_command(action: str, address: str) -> list[str]:
    """`ip addr add|del <address>/32 dev lo`."""
    return ["ip", "addr", action, f"{address}/32", "dev", "lo"]


def build_flush_command(block: PodBlock) -> list[str]:
    """Remove every address of the block from the loopback interface."""
    return ["ip", "-4", "addr", "flush", "dev", "lo", "to", block.cidr]


def _ip(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)


def claim_pod_block(second: int) -> PodBlock:
    """The 240.<second>.0.0/16 block when this host lets us add loopback addresses (tried with the block's
    first address, .0.1, then removed), else 127.<second>.0.0/16."""
    block = PodBlock(PROXYABLE_OCTET, second)
    if shutil.which("ip") is None:
        log.warning("pod IPs from 127.%d.0.0/16: no `ip` command to add %s addresses (pods/proxy will refuse "
                    "them)", second, block.cidr)
        return PodBlock(LOOPBACK_OCTET, second)
    probe = block.address(1)
    proc = _ip(build_address_command("add", probe))
    if proc.returncode != 0 and "File exists" not in proc.stderr:
        log.warning("pod IPs from 127.%d.0.0/16: `%s` failed: %s (pods/proxy will refuse them)", second,
                    " ".join(build_address_command("add", probe)), proc.stderr.strip())
        return PodBlock(LOOPBACK_OCTET, second)
    _ip(build_address_command("del", probe))
    return block


def add_pod_address(block: PodBlock, address: str) -> None:
    """Put a process pod's address on the loopback interface (nothing for the 127 block)."""
    if not block.needs_addresses:
        return
    proc = _ip(build_address_command("add", address))
    if proc.returncode != 0 and "File exists" not in proc.stderr:
        log.warning("`%s` failed: %s", " ".join(build_address_command("add", address)), proc.stderr.strip())


def release_pod_block(block: PodBlock) -> None:
    """Remove the block's addresses from the loopback interface (the cluster is going away)."""
    if block.needs_addresses:
        _ip(build_flush_command(block))
