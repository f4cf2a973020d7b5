"""Probe this node and this rank into immutable records.

Host facts come from psutil (CPU counts, memory, interface stats) and sysfs (sockets, NUMA nodes,
RDMA devices, NIC NUMA nodes); GPU facts from an :class:`~hybridshard.topology.nvml.NvmlSource` (the real NVML
unless a fake is injected). ``sysfs_root`` and ``env`` are injectable so tests can run on a fake tree.

See [Note: failure is data] in :mod:`hybridshard.topology.records`: a fact that cannot be collected becomes
``None`` plus a reason in ``unavailable``; nothing here raises because the machine lacks something.
A setting someone got wrong is another matter: a network path source that is set but cannot be
parsed (:mod:`hybridshard.topology.netpath`) raises ``ValueError``, as bad ``RANK`` or ``LOCAL_RANK``
values do, since a job planned on a guessed rack would be wrong quietly; under torchrun the failing
rank's exit stops the others.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import psutil

from hybridshard.topology.gpus import probe_gpus
from hybridshard.topology.netpath import resolve_network_path
from hybridshard.topology.nvml import NvmlSource, PynvmlSource
from hybridshard.topology.records import NetInterface, NodeProbe, NumaNode, RankProbe
from hybridshard.topology.visible import ordinal_order_problem, resolve_visible_devices

logger = logging.getLogger(__name__)

__all__ = [
    "probe_node", "probe_rank", "node_name", "machine_identity", "probe_numa", "probe_nics", "parse_cpu_list",
    "count_sockets",
]

NODE_NAME_ENV = "HYBRIDSHARD_NODE_NAME"
BOOT_ID = "/proc/sys/kernel/random/boot_id"
MACHINE_ID = "/etc/machine-id"

T = TypeVar("T")


def machine_identity(boot_id_path: str = BOOT_ID, machine_id_path: str = MACHINE_ID) -> str:
    """This physical machine: ``machine-<boot id>[-<machine id>]`` (8 hex digits of each), else the hostname.

    [Note: one machine, one node]
    Containers (Kubernetes pods, Docker) on one machine each have their own hostname, yet share one
    kernel, its GPUs and NVLinks: they must shard together. The kernel's boot id is the same in every
    container and network namespace of a machine and differs between machines (it is drawn at boot);
    ``/etc/machine-id`` breaks the tie between VMs restored from one snapshot, which can share a boot
    id. A container image that carries its own machine id splits its pods from the host's; set
    ``HYBRIDSHARD_NODE_NAME`` (e.g. to the Kubernetes node name) where that matters: it always wins.
    """
    def first_hex(path: str) -> str:
        text = _read(Path(path)) or ""
        return "".join(c for c in text.lower() if c in "0123456789abcdef")[:8]

    boot, machine = first_hex(boot_id_path), first_hex(machine_id_path)
    if not boot:
        return f"machine-{machine}" if machine else socket.gethostname()
    return f"machine-{boot}" + (f"-{machine}" if machine else "")


def node_name(env: Mapping[str, str] | None = None) -> str:
    """Node identity: ``HYBRIDSHARD_NODE_NAME`` when set (simulated nodes on one machine), else the
    machine (see [Note: one machine, one node])."""
    env = os.environ if env is None else env
    return env.get(NODE_NAME_ENV, "").strip() or machine_identity()


def probe_node(
    nvml: NvmlSource | None = None, *, sysfs_root: str | os.PathLike[str] = "/sys", env: Mapping[str, str] | None = None
) -> NodeProbe:
    """Everything discovery learns about this host. Never raises for a missing fact; raises
    ``ValueError`` for a network path source set wrongly (see the module's docstring)."""
    node, _ = _probe_node(nvml, Path(sysfs_root), env)
    return node


def probe_rank(
    *,
    rank: int | None = None,
    local_rank: int | None = None,
    world_size: int | None = None,
    nvml: NvmlSource | None = None,
    env: Mapping[str, str] | None = None,
    sysfs_root: str | os.PathLike[str] = "/sys",
) -> RankProbe:
    """This process's place in the job (defaults from ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``; a lone
    process is rank 0 of 1), its node, and the GPU it will use.

    The GPU is visible device ``local_rank % len(visible)`` after ``CUDA_VISIBLE_DEVICES``; see
    :mod:`hybridshard.topology.visible` for how the variable maps to physical GPUs.
    """
    env = os.environ if env is None else env
    rank = _env_int(env, "RANK", 0) if rank is None else rank
    local_rank = _env_int(env, "LOCAL_RANK", 0) if local_rank is None else local_rank
    world_size = _env_int(env, "WORLD_SIZE", 1) if world_size is None else world_size
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise ValueError(
            f"expected 0 <= rank < world_size and local_rank >= 0, found rank={rank}, "
            f"local_rank={local_rank}, world_size={world_size}; check RANK, LOCAL_RANK and WORLD_SIZE"
        )
    node, mig_parents = _probe_node(nvml, Path(sysfs_root), env)
    cuda_visible = env.get("CUDA_VISIBLE_DEVICES")
    visible, problems = resolve_visible_devices(cuda_visible, node.gpus, mig_parents)
    order = ordinal_order_problem(cuda_visible, node.gpus, env.get("CUDA_DEVICE_ORDER"))
    for problem in problems + ((order,) if order else ()):
        logger.warning("rank %d: CUDA_VISIBLE_DEVICES: %s", rank, problem)
    try:
        affinity = tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        affinity = ()
    return RankProbe(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        node=node,
        visible_gpu_uuids=visible,
        cuda_visible_devices=cuda_visible,
        gpu_uuid=visible[local_rank % len(visible)] if visible else None,
        cpu_affinity=affinity,
    )


def _probe_node(nvml: NvmlSource | None, root: Path, env: Mapping[str, str] | None) -> tuple[NodeProbe, dict[str, str]]:
    unavailable: dict[str, str] = {}
    numa_nodes, numa_reason = probe_numa(root)
    if numa_reason:
        unavailable["numa_nodes"] = numa_reason
    gpu_facts = probe_gpus(PynvmlSource() if nvml is None else nvml, numa_nodes=numa_nodes, sysfs_root=root)
    unavailable.update(gpu_facts.unavailable)
    sockets = count_sockets(root)
    if sockets is None:
        unavailable["cpu_sockets"] = f"no CPU topology under {root}/devices/system/cpu"
    physical = _fact(unavailable, "cpu_cores_physical", lambda: psutil.cpu_count(logical=False))
    if physical is None:
        unavailable.setdefault("cpu_cores_physical", "psutil could not count physical cores")
    nics = _fact(unavailable, "nics", lambda: probe_nics(root, psutil.net_if_stats())) or ()
    network = resolve_network_path(os.environ if env is None else env)
    node = NodeProbe(
        node_name=node_name(env),
        hostname=socket.gethostname(),
        machine=machine_identity(),
        cpu_sockets=sockets,
        cpu_cores_physical=physical,
        cpu_cores_logical=_fact(unavailable, "cpu_cores_logical", lambda: psutil.cpu_count(logical=True)),
        numa_nodes=numa_nodes,
        memory_total_bytes=_fact(unavailable, "memory_total_bytes", lambda: int(psutil.virtual_memory().total)),
        nics=nics,
        gpus=gpu_facts.gpus,
        gpu_matrix=gpu_facts.matrix,
        driver_version=gpu_facts.driver_version,
        nvml_version=gpu_facts.nvml_version,
        cuda_driver_version=gpu_facts.cuda_driver_version,
        network_path=network.path,
        network_source=network.source,
        unavailable=tuple(sorted(unavailable.items())),
    )
    return node, gpu_facts.mig_parents


def _fact(unavailable: dict[str, str], field: str, fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except (OSError, RuntimeError, ValueError) as exc:  # psutil errors derive from these
        unavailable[field] = f"{type(exc).__name__}: {exc}"
        return None


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, found {text!r}; unset it or fix the launcher") from None


# -- sysfs -------------------------------------------------------------------------------------


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """Kernel cpulist syntax: ``"0-3,8,10-11"`` -> ``(0, 1, 2, 3, 8, 10, 11)``. Empty -> ``()``."""
    out: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if sep:
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(lo))
    return tuple(sorted(set(out)))


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def count_sockets(root: Path) -> int | None:
    """Distinct ``physical_package_id`` values of the CPUs, or ``None`` when sysfs has none."""
    ids = {_read_int(p) for p in (root / "devices/system/cpu").glob("cpu[0-9]*/topology/physical_package_id")}
    ids.discard(None)
    return len(ids) or None


def probe_numa(root: Path) -> tuple[tuple[NumaNode, ...], str | None]:
    """NUMA nodes with their CPUs and memory, from ``devices/system/node/node*``."""
    base = root / "devices/system/node"
    dirs = sorted((p for p in base.glob("node[0-9]*") if p.is_dir()), key=lambda p: int(p.name[4:]))
    if not dirs:
        return (), f"no NUMA nodes under {base}"
    nodes = []
    for d in dirs:
        memory = None
        for line in (_read(d / "meminfo") or "").splitlines():
            # "Node 0 MemTotal:       5073100 kB"
            fields = line.split()
            if len(fields) >= 4 and fields[2] == "MemTotal:":
                memory = int(fields[3]) * 1024
        try:
            cpus = parse_cpu_list(_read(d / "cpulist") or "")
        except ValueError:
            cpus = ()
        nodes.append(NumaNode(id=int(d.name[4:]), cpus=cpus, memory_bytes=memory))
    return tuple(nodes), None


def _numa_of(path: Path) -> int | None:
    value = _read_int(path)
    return value if value is not None and value >= 0 else None  # the kernel writes -1 for "unknown"


def _rate_mbps(text: str | None) -> int | None:
    # "400 Gb/sec (4X NDR)" -> 400000; "25 Gb/sec (1X EDR)" -> 25000
    try:
        value, unit = (text or "").split()[:2]
        return int(float(value) * (1000 if unit.startswith("Gb") else 1))
    except ValueError:
        return None


def _rdma_devices(root: Path) -> list[dict[str, Any]]:
    out = []
    for dev in sorted((root / "class/infiniband").glob("*")):
        ports = sorted((p for p in (dev / "ports").glob("*") if p.name.isdigit()), key=lambda p: int(p.name))
        port = ports[0] if ports else dev / "ports/1"
        state = _read(port / "state") or ""  # "4: ACTIVE"
        out.append(
            {
                "name": dev.name,
                "link_layer": _read(port / "link_layer"),
                "speed_mbps": _rate_mbps(_read(port / "rate")),
                "is_up": state.endswith("ACTIVE"),
                "numa_node": _numa_of(dev / "device/numa_node"),
                "netdevs": sorted(p.name for p in (dev / "device/net").glob("*")),
            }
        )
    return out


def probe_nics(root: Path, if_stats: Mapping[str, Any]) -> tuple[NetInterface, ...]:
    """Network interfaces (loopback excluded) from psutil ``net_if_stats()`` plus sysfs.

    An RDMA device (``class/infiniband``) marks the interfaces under its ``device/net``; an RDMA
    device with no interface in ``if_stats`` (InfiniBand without IPoIB) is listed under its own name,
    since that is what NCCL uses.
    """
    rdma = _rdma_devices(root)
    by_netdev = {netdev: dev for dev in rdma for netdev in dev["netdevs"]}
    nics = []
    for name, stats in sorted(if_stats.items()):
        if name == "lo" or "loopback" in str(getattr(stats, "flags", "")):
            continue
        dev = by_netdev.get(name)
        nics.append(
            NetInterface(
                name=name,
                speed_mbps=(stats.speed or None) or (dev["speed_mbps"] if dev else None),
                is_up=bool(stats.isup),
                is_rdma=dev is not None,
                rdma_device=dev["name"] if dev else None,
                link_layer=dev["link_layer"] if dev else None,
                numa_node=_numa_of(root / "class/net" / name / "device/numa_node"),
                mtu=stats.mtu or None,
            )
        )
    for dev in rdma:
        if not any(n in if_stats for n in dev["netdevs"]):
            nics.append(
                NetInterface(
                    name=dev["name"],
                    speed_mbps=dev["speed_mbps"],
                    is_up=dev["is_up"],
                    is_rdma=True,
                    rdma_device=dev["name"],
                    link_layer=dev["link_layer"],
                    numa_node=dev["numa_node"],
                )
            )
    return tuple(nics)
