"""Racks and a spine for the local network: one bridge per rack, joined through a spine bridge.

[Note: racks and a spine]
With racks, the hosts are split into R contiguous blocks (host ``k`` is in rack ``k // (N / R)``).
Each rack ``j`` has its own bridge ``<tag>-b<j>``, whose ports are its hosts' veths; the rack's
uplink is one veth pair, ``<tag>-u<j>`` (a port of the rack's bridge) to ``<tag>-s<j>`` (a port of
the spine bridge ``<tag>-br``). Bridges and veths make one L2 segment, so every host keeps its address
in the same /24 and nothing is routed; the only path between two racks is through their two uplinks,
and a rack's whole traffic to the other racks crosses its own uplink.

Shaping the spine (``tc``): ``tbf`` at the spine rate on both ends of every uplink, so each rack has a
full-duplex uplink of that rate, whatever its hosts' own links are (``--inter-node-bandwidth``).
Latency uses ``netem`` on the spine side of each uplink (traffic entering a rack), so it is added once
per packet between two racks.

Counters are the kernel's own, ``/sys/class/net/<tag>-u<j>/statistics/{tx,rx}_bytes`` of the rack
side of each uplink: ``tx`` is what rack ``j`` sent to the spine, ``rx`` what it received from it.
Bridges flood broadcasts (ARP) and frames to not yet learned addresses, so traffic inside a rack adds
a few hundred bytes there, never its payload.

Cutting the spine sets every uplink down (both ends): the racks lose each other, the hosts inside
each rack still reach each other. Restoring sets them up again.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Sequence

logger = logging.getLogger(__name__)

__all__ = ["POD", "RackSpec", "Spine", "bytes_text", "check_racks", "network_path", "rack_of"]

POD = "pod0"
"""The one level above the racks in every host's network path."""
SYSFS_NET = "/sys/class/net"

Run = Callable[..., object]
"""The netns module's command runner (``argv, *, check=True``)."""
RunTc = Callable[[list[str], str], None]


def check_racks(num_hosts: int, racks: int) -> None:
    """Raise ``ValueError`` unless ``racks`` splits ``num_hosts`` into equal blocks."""
    if racks < 1:
        raise ValueError(f"expected --racks >= 1, found {racks}; pass the number of racks, e.g. --racks 2")
    if num_hosts % racks != 0:
        raise ValueError(
            f"expected --nodes to be a multiple of --racks, found --nodes {num_hosts} --racks {racks}; "
            f"pass --nodes {racks * max(1, num_hosts // racks)} or a --racks that divides {num_hosts}"
        )


def rack_of(host_index: int, num_hosts: int, racks: int) -> int:
    return host_index // (num_hosts // racks)


def network_path(rack: int) -> str:
    """``HYBRIDSHARD_NETWORK_PATH`` of a host in ``rack``: ``pod0/rack<rack>``."""
    return f"{POD}/rack{rack}"


@dataclass(frozen=True)
class RackSpec:
    index: int
    path: str
    """``pod0/rack<index>``: what its hosts get as ``HYBRIDSHARD_NETWORK_PATH``."""
    bridge: str
    uplink: str
    """The rack-side end of the uplink (a port of :attr:`bridge`); its counters are the rack's."""
    uplink_spine: str
    """The spine-side end (a port of the spine bridge)."""
    hosts: tuple[int, ...]


def _tbf(rate: str) -> list[str]:
    return ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]


class Spine:
    """The rack bridges, the spine bridge and the uplinks of one local network; see [Note: racks and a spine]."""

    def __init__(self, tag: str, num_hosts: int, racks: int, *, rate: str | None = None,
                 latency: str | None = None) -> None:
        check_racks(num_hosts, racks)
        self.bridge = f"{tag}-br"
        self.rate = rate
        self.latency = latency
        per_rack = num_hosts // racks
        self.racks = tuple(
            RackSpec(index=j, path=network_path(j), bridge=f"{tag}-b{j}", uplink=f"{tag}-u{j}",
                     uplink_spine=f"{tag}-s{j}", hosts=tuple(range(j * per_rack, (j + 1) * per_rack)))
            for j in range(racks)
        )

    def up(self, run: Run, run_tc: RunTc) -> None:
        """Create the spine bridge, every rack's bridge and uplink, and shape the uplinks."""
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        run(["ip", "link", "set", self.bridge, "up"])
        for r in self.racks:
            run(["ip", "link", "add", r.bridge, "type", "bridge"])
            run(["ip", "link", "set", r.bridge, "up"])
            run(["ip", "link", "add", r.uplink, "type", "veth", "peer", "name", r.uplink_spine])
            run(["ip", "link", "set", r.uplink, "master", r.bridge])
            run(["ip", "link", "set", r.uplink_spine, "master", self.bridge])
            for end in (r.uplink, r.uplink_spine):
                run(["ip", "link", "set", end, "up"])
            self._shape(r, run_tc)

    def _shape(self, r: RackSpec, run_tc: RunTc) -> None:
        if self.latency:
            run_tc(["tc", "qdisc", "add", "dev", r.uplink_spine, "root", "handle", "1:", "netem", "delay",
                    self.latency], "--spine-latency")
            if self.rate:
                run_tc(["tc", "qdisc", "add", "dev", r.uplink_spine, "parent", "1:1", "handle", "10:",
                        *_tbf(self.rate)], "--spine-rate")
        elif self.rate:
            run_tc(["tc", "qdisc", "add", "dev", r.uplink_spine, "root", *_tbf(self.rate)], "--spine-rate")
        if self.rate:
            run_tc(["tc", "qdisc", "add", "dev", r.uplink, "root", *_tbf(self.rate)], "--spine-rate")

    def set_rate(self, rate: str, run_tc: RunTc) -> None:
        """Change every uplink's rate now (``tc qdisc change``; ``add`` when the spine was not shaped)."""
        verb = "change" if self.rate else "add"
        for r in self.racks:
            if self.latency:
                run_tc(["tc", "qdisc", verb, "dev", r.uplink_spine, "parent", "1:1", "handle", "10:", *_tbf(rate)],
                       "--spine-rate")
            else:
                run_tc(["tc", "qdisc", verb, "dev", r.uplink_spine, "root", *_tbf(rate)], "--spine-rate")
            run_tc(["tc", "qdisc", verb, "dev", r.uplink, "root", *_tbf(rate)], "--spine-rate")
        self.rate = rate
        logger.info("spine rate now %s", rate)

    def set_links(self, up: bool, run: Run) -> None:
        """Set every uplink (both ends) up or down: down cuts the spine, see the note."""
        for r in self.racks:
            for end in (r.uplink, r.uplink_spine):
                run(["ip", "link", "set", end, "up" if up else "down"])
        logger.info("spine %s", "restored" if up else "cut")

    def bytes(self, read: Callable[[str], int] | None = None) -> dict[int, tuple[int, int]]:
        """Rack -> ``(tx, rx)`` bytes of its uplink since it was made: what the rack sent to the spine and
        received from it (the kernel's counters of the uplink's rack-side end)."""
        read = read or _read_counter
        return {r.index: (read(os.path.join(SYSFS_NET, r.uplink, "statistics", "tx_bytes")),
                          read(os.path.join(SYSFS_NET, r.uplink, "statistics", "rx_bytes")))
                for r in self.racks}

    def rack_of_host(self, host_index: int) -> RackSpec:
        return next(r for r in self.racks if host_index in r.hosts)

    def host_ports(self) -> dict[int, str]:
        """Host index -> the bridge its veth joins."""
        return {k: r.bridge for r in self.racks for k in r.hosts}


def _read_counter(path: str) -> int:
    with open(path) as f:
        return int(f.read().strip())


def bytes_text(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]],
               racks: Sequence[RackSpec]) -> str:
    """``pod0/rack0 tx 1234 rx 5678 B; ...``: the bytes each uplink moved between two readings."""
    return "; ".join(f"{r.path} tx {after[r.index][0] - before[r.index][0]} rx "
                     f"{after[r.index][1] - before[r.index][1]} B" for r in racks)
