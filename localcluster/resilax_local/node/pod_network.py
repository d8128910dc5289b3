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

Each cluster holds its octet `o` alone (`hold_octet`): a lock file per octet, held while its node agent
lives (the kernel releases it when the agent dies), and no address of the block already on the loopback
interface (a cluster of an older version, or one killed before it removed them). Two clusters that drew
the same octet shared their pods' addresses, and the first to stop flushed the other's: goodput seed 2
of 2026-12-07 lost every pod's address that way in mid-run (its trainers aborted, its sidecars fell
silent).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

#: The first octet of a proxyable pod block (class E), and of the fallback (loopback).
PROXYABLE_OCTET: Final = 240
LOOPBACK_OCTET: Final = 127
#: The octets a cluster may draw (its pods 240.<o>.x.y, its nodes 127.<o>.0.n): [first, last).
OCTETS: Final = (32, 250)
#: Where the node agents hold their octets' locks (`hold_octet`), shared by every user of this host.
OCTET_LOCK_DIR: Final = Path(tempfile.gettempdir()) / "resilax-local-octets"


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


def block_in_use(second: int) -> bool:
    """Whether an address of 240.<second>.0.0/16 is on the loopback interface already (False without `ip`)."""
    if shutil.which("ip") is None:
        return False
    proc = _ip(["ip", "-4", "-o", "addr", "show", "dev", "lo", "to", PodBlock(PROXYABLE_OCTET, second).cidr])
    return proc.returncode == 0 and bool(proc.stdout.strip())


def lock_octet(second: int, lock_dir: Path = OCTET_LOCK_DIR) -> int | None:
    """The open file descriptor holding `second`'s lock (flock, exclusive; close it to release), or None
    when another cluster holds it (or another user's lock file cannot be opened)."""
    path = lock_dir / f"{second}.lock"
    try:
        with _umask(0):  # shared by every user of the host: the folder sticky and open to all, as /tmp
            lock_dir.mkdir(mode=0o1777, parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    except PermissionError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return None
        raise
    return fd


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def hold_octet(draw: Callable[[int, int], int], lock_dir: Path = OCTET_LOCK_DIR,
               in_use: Callable[[int], bool] = block_in_use, tries: int = 200) -> tuple[int, int]:
    """(octet, the file descriptor of its lock) of an octet no other local cluster on this host holds:
    drawn (`draw(start, stop)`, a `random.Random().randrange`) from OCTETS until one's lock is free and no
    address of its block is on the loopback interface. Keep the descriptor open while the cluster lives."""
    for _ in range(tries):
        second = draw(*OCTETS)
        fd = lock_octet(second, lock_dir)
        if fd is None:
            continue
        if in_use(second):
            os.close(fd)
            continue
        return second, fd
    raise RuntimeError(f"no free octet for a local cluster's addresses after {tries} draws from {OCTETS[0]}.."
                       f"{OCTETS[1] - 1}: locks in {lock_dir}, addresses on `ip addr show dev lo`")


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
