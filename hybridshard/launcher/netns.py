"""A private network of N "hosts" on one machine: network namespaces on a bridge, optionally shaped.

[Note: local network]
Each host ``hostK`` is a network namespace ``<tag>-nK`` whose only interface, ``eth0``, is one end of
a veth pair; the other end (``<tag>-vK``) is a port of the bridge ``<tag>-br``. Addresses come from
one private /24 (:data:`SUBNET`) and exist only inside the namespaces: the bridge itself has no
address, so the machine's own routing never sees them. Host names resolve inside the hosts because
``ip netns exec`` mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``; each program also gets its
own UTS namespace so ``hostname`` answers ``hostK``, exactly what node discovery reads.

With racks (``racks=R``, ``--racks``), each rack has a bridge of its own and the racks' bridges are
joined through a spine bridge: [Note: racks and a spine] in :mod:`hybridshard.launcher.spine`.

Shaping (``tc``): ``tbf`` limits the rate on both ends of every veth (the namespace side shapes what a
host sends, the bridge side what it receives), so each host has a full-duplex link of the given rate
and traffic between ranks of one host (loopback) is not shaped. Latency uses ``netem`` on the bridge
side, so it is added once per packet between two hosts.

[Note: cleanup]
Every name starts with ``<tag> = hslc<pid in hex>``, so a run's objects are found by name alone. The
teardown is idempotent and runs on every exit path; it kills every process still inside a namespace
before deleting it. :func:`remove_leftovers` deletes objects whose owning pid no longer exists
(a run killed with SIGKILL), and never touches those of a live run.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

from hybridshard.launcher.inject import shape_command
from hybridshard.launcher.spine import Spine

logger = logging.getLogger(__name__)

__all__ = ["RATE_RE", "SUBNET", "Shaping", "HostSpec", "LocalNetwork", "NetState", "check_rights", "remove_leftovers",
           "run_tag", "list_own_objects"]

SUBNET = "10.213.7"
"""The private /24 used inside the namespaces (``10.213.7.1`` is host0)."""
NAME_PREFIX = "hslc"
IFNAME = "eth0"
ETC_NETNS = "/etc/netns"
MAX_HOSTS = 200
_NAME_RE = re.compile(rf"^{NAME_PREFIX}([0-9a-f]+)-")
RATE_RE = re.compile(r"^\d+(\.\d+)?(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps|tbps)$", re.IGNORECASE)
_DELAY_RE = re.compile(r"^\d+(\.\d+)?(us|ms|s)$")
_BRIDGE_RE = re.compile(r"-(br|b\d+)$")
"""The spine's (or the one) bridge ``<tag>-br`` and the rack bridges ``<tag>-b<j>``."""
_CMD_TIMEOUT_S = 20.0
_SET_HOSTNAME = "import os,socket,sys; socket.sethostname(sys.argv[1]); os.execvp(sys.argv[2], sys.argv[2:])"


def run_tag(pid: int | None = None) -> str:
    return f"{NAME_PREFIX}{(os.getpid() if pid is None else pid):x}"


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess:
    logger.debug("net: %s", " ".join(argv))
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed (exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
    return done


@dataclass(frozen=True)
class Shaping:
    """How the links between hosts are shaped; ``None`` leaves that property alone."""

    rate: str | None = None
    """A ``tc`` rate such as ``1gbit`` or ``50mbit``: each host's link in each direction."""
    latency: str | None = None
    """A ``tc`` time such as ``200us``: one-way delay added between two hosts."""

    def __post_init__(self) -> None:
        if self.rate is not None and not RATE_RE.match(self.rate):
            raise ValueError(f"--inter-node-bandwidth {self.rate!r} is not a tc rate; expected e.g. 1gbit, 200mbit")
        if self.latency is not None and not _DELAY_RE.match(self.latency):
            raise ValueError(f"--latency {self.latency!r} is not a tc time; expected e.g. 200us, 2ms")

    @property
    def active(self) -> bool:
        return self.rate is not None or self.latency is not None


@dataclass(frozen=True)
class HostSpec:
    index: int
    name: str
    """Host name inside the host (``host0`` ...)."""
    netns: str
    address: str
    veth_host: str
    """Bridge-side end of the veth pair."""
    veth_peer: str
    """Namespace-side end before it is renamed to :data:`IFNAME`."""
    network_path: str | None = None
    """``pod0/rack<j>`` with racks (its ``HYBRIDSHARD_NETWORK_PATH``), else ``None``."""


class NetState(str, Enum):
    NEW = "new"
    UP = "up"
    TORN_DOWN = "torn down"


class LocalNetwork:
    """The namespaces, bridge, links and shaping of one run; see [Note: local network]."""

    def __init__(self, num_hosts: int, shaping: Shaping = Shaping(), *, tag: str | None = None,
                 racks: int | None = None, spine: Shaping = Shaping()) -> None:
        """``racks``: split the hosts into that many racks joined by a spine shaped by ``spine`` (see
        [Note: racks and a spine] in :mod:`hybridshard.launcher.spine`); ``None``: one bridge."""
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"--nodes must be 1..{MAX_HOSTS}, found {num_hosts}")
        if racks is None and spine.active:
            raise ValueError("expected --racks with --spine-rate/--spine-latency, found no --racks; "
                             "pass --racks R (the spine joins the racks)")
        self.tag = tag or run_tag()
        self.shaping = shaping
        self.bridge = f"{self.tag}-br"
        self.spine = None if racks is None else Spine(self.tag, num_hosts, racks, rate=spine.rate, latency=spine.latency)
        self.hosts = tuple(
            HostSpec(index=k, name=f"host{k}", netns=f"{self.tag}-n{k}", address=f"{SUBNET}.{k + 1}",
                     veth_host=f"{self.tag}-v{k}", veth_peer=f"{self.tag}-p{k}",
                     network_path=None if self.spine is None else self.spine.rack_of_host(k).path)
            for k in range(num_hosts)
        )
        self.state = NetState.NEW

    def up(self) -> None:
        """Create everything. On failure the caller's teardown removes what was made."""
        assert self.state is NetState.NEW, f"network {self.tag} is {self.state.value}"
        self.state = NetState.UP
        if self.spine is None:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            _run(["ip", "link", "set", self.bridge, "up"])
            ports = {h.index: self.bridge for h in self.hosts}
        else:
            self.spine.up(_run, _run_tc)
            ports = self.spine.host_ports()
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts)
        for h in self.hosts:
            _run(["ip", "netns", "add", h.netns])
            os.makedirs(os.path.join(ETC_NETNS, h.netns), exist_ok=True)
            with open(os.path.join(ETC_NETNS, h.netns, "hosts"), "w") as f:
                f.write(hosts_file)
            _run(["ip", "link", "add", h.veth_host, "type", "veth", "peer", "name", h.veth_peer])
            _run(["ip", "link", "set", h.veth_peer, "netns", h.netns])
            _run(["ip", "link", "set", h.veth_host, "master", ports[h.index]])
            _run(["ip", "link", "set", h.veth_host, "up"])
            _run(["ip", "-n", h.netns, "link", "set", h.veth_peer, "name", IFNAME])
            _run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", IFNAME])
            _run(["ip", "-n", h.netns, "link", "set", IFNAME, "up"])
            _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])
            if self.shaping.active:
                self._shape(h)
        logger.info("local network %s up: %d hosts on %s.0/24%s", self.tag, len(self.hosts), SUBNET,
                    "" if self.spine is None else f" in {len(self.spine.racks)} racks")

    def _shape(self, h: HostSpec) -> None:
        rate, delay = self.shaping.rate, self.shaping.latency
        tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"] if rate else None
        if delay:
            _run_tc(["tc", "qdisc", "add", "dev", h.veth_host, "root", "handle", "1:", "netem", "delay", delay], "--latency")
            if tbf:
                _run_tc(["tc", "qdisc", "add", "dev", h.veth_host, "parent", "1:1", "handle", "10:", *tbf], "--inter-node-bandwidth")
        elif tbf:
            _run_tc(["tc", "qdisc", "add", "dev", h.veth_host, "root", *tbf], "--inter-node-bandwidth")
        if tbf:
            _run_tc(["ip", "netns", "exec", h.netns, "tc", "qdisc", "add", "dev", IFNAME, "root", *tbf], "--inter-node-bandwidth")

    def host_argv(self, host: HostSpec, argv: Sequence[str], python: str = sys.executable) -> list[str]:
        """``argv`` run inside ``host``: its network namespace plus its own UTS namespace and host name."""
        return ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--",
                python, "-c", _SET_HOSTNAME, host.name, *argv]

    def _spine(self) -> Spine:
        if self.spine is None:
            raise ValueError("expected a network with racks, found one bridge; create it with racks=R (--racks R)")
        return self.spine

    def spine_bytes(self) -> dict[int, tuple[int, int]]:
        """Rack -> ``(tx, rx)``: the bytes its uplink sent to and received from the spine so far."""
        return self._spine().bytes()

    def set_spine_rate(self, rate: str) -> None:
        """Shape every uplink to ``rate`` (a tc rate) from now on, while the job runs."""
        Shaping(rate=rate)  # validates
        self._spine().set_rate(rate, _run_tc)

    def set_host_rate(self, host: HostSpec, rate: str) -> None:
        """Shape ``host``'s link to ``rate`` (a tc rate) in each direction from now on, while the job runs:
        ``tc qdisc replace`` on both ends of its veth (under ``--latency``'s netem on the bridge side)."""
        Shaping(rate=rate)  # validates
        tbf = ["tbf", "rate", rate, "burst", "256kb", "latency", "100ms"]
        where = ["parent", "1:1", "handle", "10:"] if self.shaping.latency else ["root"]
        _run_tc(["tc", "qdisc", "replace", "dev", host.veth_host, *where, *tbf], "--set-rate")
        _run_tc(shape_command(host.netns, IFNAME, rate, burst="256kb", latency="100ms", verb="replace"), "--set-rate")
        logger.info("%s's link now %s", host.name, rate)

    def cut_spine(self) -> None:
        """Set every uplink down: the racks lose each other (see [Note: racks and a spine])."""
        self._spine().set_links(False, _run)

    def restore_spine(self) -> None:
        self._spine().set_links(True, _run)

    def kill_host(self, host: HostSpec) -> None:
        """SIGKILL every process in ``host``'s namespace: its launcher, agent and workers (torchrun
        puts workers in sessions of their own, so a process group does not cover them)."""
        _kill_namespace_pids(host.netns)

    def teardown(self) -> list[str]:
        """Remove everything of this run (idempotent); return the problems met, also logged."""
        if self.state is NetState.TORN_DOWN:
            return []
        self.state = NetState.TORN_DOWN
        return remove_objects(self.tag)


def _run_tc(argv: list[str], option: str) -> None:
    done = _run(argv, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"`{' '.join(argv)}` failed: {done.stderr.strip()}; this kernel cannot apply {option} "
            "(the qdisc module may be missing); run without it"
        )


def list_own_objects(tag_prefix: str = NAME_PREFIX) -> dict[str, list[str]]:
    """Namespaces, links and ``/etc/netns`` entries whose names start with ``tag_prefix``."""
    out: dict[str, list[str]] = {"netns": [], "links": [], "etc": []}
    done = _run(["ip", "netns", "list"], check=False)
    out["netns"] = [line.split()[0] for line in done.stdout.splitlines() if line.startswith(tag_prefix)]
    done = _run(["ip", "-o", "link", "show"], check=False)
    for line in done.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if name.startswith(tag_prefix):
                out["links"].append(name)
    if os.path.isdir(ETC_NETNS):
        out["etc"] = [n for n in os.listdir(ETC_NETNS) if n.startswith(tag_prefix)]
    return out


def _kill_namespace_pids(netns: str) -> None:
    done = _run(["ip", "netns", "pids", netns], check=False)
    for pid_text in done.stdout.split():
        try:
            os.kill(int(pid_text), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


def remove_objects(tag: str) -> list[str]:
    """Delete every object whose name starts with ``tag + "-"``; see [Note: cleanup]."""
    problems: list[str] = []
    found = list_own_objects(tag + "-")
    for ns in found["netns"]:
        _kill_namespace_pids(ns)
    for link in sorted(found["links"], key=lambda n: _BRIDGE_RE.search(n) is not None):  # ports before bridges
        done = _run(["ip", "link", "del", link], check=False)
        if done.returncode != 0 and "Cannot find" not in done.stderr:
            problems.append(f"link {link}: {done.stderr.strip()}")
    for ns in found["netns"]:
        done = _run(["ip", "netns", "del", ns], check=False)
        if done.returncode != 0:
            problems.append(f"namespace {ns}: {done.stderr.strip()}")
    for entry in found["etc"]:
        shutil.rmtree(os.path.join(ETC_NETNS, entry), ignore_errors=True)
    for p in problems:
        logger.warning("cleanup: %s", p)
    return problems


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Remove the objects of earlier runs whose process is gone; return the tags removed."""
    found = list_own_objects()
    tags = set()
    for name in found["netns"] + found["links"] + found["etc"]:
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1), 16)):
            tags.add(f"{NAME_PREFIX}{m.group(1)}")
    for tag in sorted(tags):
        logger.warning("removing leftovers of an earlier local-cluster run (%s)", tag)
        remove_objects(tag)
    return sorted(tags)


def check_rights() -> str | None:
    """``None`` when this process may create namespaces and links, else the reason it may not."""
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (package iproute2 / util-linux)"
    probe = f"{run_tag()}-probe"
    try:
        done = _run(["ip", "netns", "add", probe], check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` could not run: {exc}"
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip() or 'exit ' + str(done.returncode)}"
    _run(["ip", "netns", "del", probe], check=False)
    return None
