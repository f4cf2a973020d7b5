"""Which NIC carries this rank's job traffic, asked once when the straggler report starts.

[Note: the job's NIC]
The interface the kernel routes the job's traffic through is the one that answers: a UDP socket
"connected" to the store's host (``MASTER_ADDR``; connecting a datagram socket only picks a route
and a local address, no packet is sent) has a local address, and the interface holding that address
(``psutil.net_if_addrs()``) is the NIC. A route over loopback (the store on this host, as under a
fault-tolerant launch's one-node jobs) names no NIC, so then ``NCCL_SOCKET_IFNAME`` /
``GLOO_SOCKET_IFNAME`` are read (an exact name or a prefix, never an exclusion list ``^docker``),
then the node's NICs as :func:`hybridshard.topology.probe.probe_nics` finds them (the up ones, RDMA
first). The route names the interface of the store's traffic: with NCCL over InfiniBand the
collectives may use another (``NCCL_IB_HCA``), which the report cannot see.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from hybridshard.topology.records import NetInterface

logger = logging.getLogger(__name__)

__all__ = ["JobNic", "env_nic", "interface_of", "job_nic", "local_address", "probed_nics"]

SOCKET_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


@dataclass(frozen=True)
class JobNic:
    """The NIC and where its name came from."""

    name: str
    """``"eth0"``; several candidates from the probe joined with ``", "``; empty when nothing says."""
    source: str
    """``"route to 10.0.0.1"``, ``"NCCL_SOCKET_IFNAME"``, ``"probe"``, or empty."""


def local_address(host: str) -> str | None:
    """The local address the kernel picks to reach ``host``; ``None`` when it cannot resolve or route it."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, kind, proto, _, address in infos:
        try:
            with socket.socket(family, kind, proto) as s:
                s.connect(address)  # a datagram socket's connect sends nothing: see [Note: the job's NIC]
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def interface_of(address: str, if_addrs: Mapping[str, Sequence[Any]]) -> str | None:
    """The interface holding ``address`` in ``psutil.net_if_addrs()``'s answer (``"fe80::1%eth0"`` matches ``"fe80::1"``)."""
    for name, addrs in sorted(if_addrs.items()):
        if any(str(a.address).split("%")[0] == address.split("%")[0] for a in addrs):
            return name
    return None


def env_nic(env: Mapping[str, str]) -> tuple[str, str] | None:
    """``(name, variable)`` from the socket variables; ``None`` when unset or an exclusion list."""
    for var in SOCKET_VARS:
        raw = env.get(var, "").strip()
        if raw and not raw.startswith("^"):
            return raw.lstrip("=").split(",")[0].strip(), var
    return None


def probed_nics(nics: Sequence[NetInterface]) -> str:
    """The up NICs of a probe, RDMA ones first, joined with ``", "`` (empty when none is up)."""
    up = [n for n in nics if n.is_up]
    return ", ".join(n.name for n in sorted(up, key=lambda n: (not n.is_rdma, n.name)))


def job_nic(host: str | None, *, env: Mapping[str, str] | None = None,
            if_addrs: Callable[[], Mapping[str, Sequence[Any]]] | None = None,
            route: Callable[[str], str | None] = local_address,
            nics: Callable[[], Sequence[NetInterface]] | None = None) -> JobNic:
    """This rank's NIC towards ``host`` (the store's); see [Note: the job's NIC]. Never raises."""
    env = os.environ if env is None else env
    if host:
        address = route(host)
        if address is not None:
            try:
                name = interface_of(address, (if_addrs or _if_addrs)())
            except (OSError, RuntimeError) as err:  # psutil's errors derive from these
                logger.debug("could not list the interfaces' addresses: %s", err)
                name = None
            if name and name != "lo" and not address.startswith("127.") and address != "::1":
                return JobNic(name, f"route to {host}")
    named = env_nic(env)
    if named is not None:
        return JobNic(*named)
    try:
        found = probed_nics((nics or _probe_nics)())
    except (OSError, RuntimeError) as err:
        logger.debug("could not probe the node's NICs: %s", err)
        found = ""
    return JobNic(found, "probe" if found else "")


def _if_addrs() -> Mapping[str, Sequence[Any]]:
    import psutil

    return psutil.net_if_addrs()


def _probe_nics() -> Sequence[NetInterface]:
    import psutil

    from hybridshard.topology.probe import probe_nics

    return probe_nics(Path("/sys"), psutil.net_if_stats())
