"""Immutable records of what discovery found: one node, one rank, the whole cluster.

Every record is a frozen dataclass with ``to_dict()`` / ``from_dict()`` so it can cross process
boundaries (``all_gather_object``), be saved as a test fixture, and be printed as JSON.

[Note: failure is data]
A probe never raises because one fact could not be collected. A fact that is missing is ``None``
(or an empty tuple) and the reason is recorded in the owning record's ``unavailable`` mapping,
``{"field name": "reason"}``. Reports print "unavailable: <reason>" for such fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = [
    "NumaNode",
    "NetInterface",
    "NvLink",
    "GpuInfo",
    "NodeProbe",
    "RankProbe",
    "RankEntry",
    "ClusterNode",
    "ClusterView",
]


def _freeze_map(mapping: Mapping[str, str] | None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((mapping or {}).items()))


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node of a host."""

    id: int
    cpus: tuple[int, ...] = ()
    """Logical CPU ids that belong to this NUMA node."""
    memory_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "cpus": list(self.cpus), "memory_bytes": self.memory_bytes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "NumaNode":
        return cls(id=int(d["id"]), cpus=tuple(d.get("cpus", ())), memory_bytes=d.get("memory_bytes"))


@dataclass(frozen=True)
class NetInterface:
    """One network interface (loopback excluded)."""

    name: str
    speed_mbps: int | None = None
    """Link speed as the kernel reports it; ``None`` when unknown (virtual links report none)."""
    is_up: bool | None = False
    """``None`` when unknown (a NIC read from ``nvidia-smi topo -m``)."""
    is_rdma: bool | None = False
    """True when the interface is backed by an RDMA device (``/sys/class/infiniband``)."""
    rdma_device: str | None = None
    link_layer: str | None = None
    """``"InfiniBand"`` or ``"Ethernet"`` (RoCE) for RDMA devices."""
    numa_node: int | None = None
    mtu: int | None = None
    gpu_levels: tuple[str, ...] = ()
    """PCIe level (``PIX`` ... ``SYS``) from each GPU of the node, by GPU index; empty when unknown."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["gpu_levels"] = list(self.gpu_levels)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "NetInterface":
        kw = {f.name: d.get(f.name) for f in dataclasses.fields(cls) if f.name in d}
        kw["gpu_levels"] = tuple(d.get("gpu_levels", ()))
        return cls(**kw)


@dataclass(frozen=True)
class NvLink:
    """One NVLink of a GPU."""

    link: int
    active: bool
    remote_pci_bus_id: str | None = None
    """PCI bus id of the far end (a GPU, or an NVSwitch)."""
    peer_index: int | None = None
    """NVML index of the peer GPU on the same node; ``None`` when the far end is a switch or remote."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "NvLink":
        return cls(**{f.name: d.get(f.name) for f in dataclasses.fields(cls) if f.name in d})


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as NVML numbers it (``index`` ignores ``CUDA_VISIBLE_DEVICES``)."""

    index: int
    name: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    """Normalised as ``DDDDDDDD:BB:DD.F`` upper case, as NVML prints it."""
    memory_total_bytes: int | None = None
    numa_node: int | None = None
    cpu_affinity: tuple[int, ...] = ()
    nvlinks: tuple[NvLink, ...] = ()
    fabric_cluster_uuid: str | None = None
    """Multi-node NVLink: the fabric's cluster UUID, when the GPU reports one."""
    fabric_clique_id: int | None = None
    unavailable: tuple[tuple[str, str], ...] = ()
    """``(field, reason)`` pairs; see [Note: failure is data]."""

    @property
    def unavailable_map(self) -> dict[str, str]:
        return dict(self.unavailable)

    @property
    def nvlink_peers(self) -> tuple[int, ...]:
        """Indices of same-node GPUs reached by at least one active NVLink."""
        return tuple(sorted({l.peer_index for l in self.nvlinks if l.active and l.peer_index is not None}))

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["cpu_affinity"] = list(self.cpu_affinity)
        d["nvlinks"] = [l.to_dict() for l in self.nvlinks]
        d["unavailable"] = dict(self.unavailable)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GpuInfo":
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        kw["cpu_affinity"] = tuple(d.get("cpu_affinity", ()))
        kw["nvlinks"] = tuple(NvLink.from_dict(x) for x in d.get("nvlinks", ()))
        kw["unavailable"] = _freeze_map(d.get("unavailable"))
        return cls(**kw)


@dataclass(frozen=True)
class NodeProbe:
    """Everything discovery knows about one host."""

    node_name: str
    """Node identity: ``HYBRIDSHARD_NODE_NAME`` when set, else :attr:`machine` (see [Note: one machine,
    one node] in :mod:`hybridshard.topology.probe`)."""
    hostname: str
    machine: str | None = None
    """The physical machine (kernel boot id and machine id), whatever the hostname or node name says."""
    cpu_sockets: int | None = None
    cpu_cores_physical: int | None = None
    cpu_cores_logical: int | None = None
    numa_nodes: tuple[NumaNode, ...] = ()
    memory_total_bytes: int | None = None
    nics: tuple[NetInterface, ...] = ()
    gpus: tuple[GpuInfo, ...] = ()
    gpu_matrix: tuple[tuple[str, ...], ...] = ()
    """GPU x GPU connection codes in ``nvidia-smi topo -m`` vocabulary: ``X`` on the diagonal, then
    ``NV#`` (# bonded NVLinks), ``PIX``, ``PXB``, ``PHB``, ``NODE`` or ``SYS``."""
    driver_version: str | None = None
    nvml_version: str | None = None
    cuda_driver_version: int | None = None
    network_path: tuple[str, ...] = ()
    """Where the node sits in the network above it, top level first (``("pod1", "rack07")``): the
    switches or blocks between it and the rest of the job, without the node itself; empty when no
    source says (see :mod:`hybridshard.topology.netpath`)."""
    network_source: str | None = None
    """Which source gave :attr:`network_path` (``"HYBRIDSHARD_NETWORK_PATH"``, ``"SLURM_TOPOLOGY_ADDR"``, ...)."""
    unavailable: tuple[tuple[str, str], ...] = ()
    """``(field, reason)`` pairs, e.g. ``("gpus", "NVML library not found")``."""

    @property
    def unavailable_map(self) -> dict[str, str]:
        return dict(self.unavailable)

    @property
    def num_gpus(self) -> int:
        return len(self.gpus)

    def gpu_by_uuid(self, uuid: str) -> GpuInfo | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_name": self.node_name,
            "hostname": self.hostname,
            "machine": self.machine,
            "cpu_sockets": self.cpu_sockets,
            "cpu_cores_physical": self.cpu_cores_physical,
            "cpu_cores_logical": self.cpu_cores_logical,
            "numa_nodes": [n.to_dict() for n in self.numa_nodes],
            "memory_total_bytes": self.memory_total_bytes,
            "nics": [n.to_dict() for n in self.nics],
            "gpus": [g.to_dict() for g in self.gpus],
            "gpu_matrix": [list(row) for row in self.gpu_matrix],
            "driver_version": self.driver_version,
            "nvml_version": self.nvml_version,
            "cuda_driver_version": self.cuda_driver_version,
            "network_path": list(self.network_path),
            "network_source": self.network_source,
            "unavailable": dict(self.unavailable),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "NodeProbe":
        return cls(
            node_name=d["node_name"],
            hostname=d.get("hostname", d["node_name"]),
            machine=d.get("machine"),
            cpu_sockets=d.get("cpu_sockets"),
            cpu_cores_physical=d.get("cpu_cores_physical"),
            cpu_cores_logical=d.get("cpu_cores_logical"),
            numa_nodes=tuple(NumaNode.from_dict(x) for x in d.get("numa_nodes", ())),
            memory_total_bytes=d.get("memory_total_bytes"),
            nics=tuple(NetInterface.from_dict(x) for x in d.get("nics", ())),
            gpus=tuple(GpuInfo.from_dict(x) for x in d.get("gpus", ())),
            gpu_matrix=tuple(tuple(row) for row in d.get("gpu_matrix", ())),
            driver_version=d.get("driver_version"),
            nvml_version=d.get("nvml_version"),
            cuda_driver_version=d.get("cuda_driver_version"),
            network_path=tuple(d.get("network_path", ())),
            network_source=d.get("network_source"),
            unavailable=_freeze_map(d.get("unavailable")),
        )


@dataclass(frozen=True)
class RankProbe:
    """What one rank reports about itself: its place in the job, its node, and its device."""

    rank: int
    local_rank: int
    world_size: int
    node: NodeProbe
    visible_gpu_uuids: tuple[str | None, ...] = ()
    """UUIDs of the GPUs this process may use, in CUDA ordinal order (``CUDA_VISIBLE_DEVICES`` applied);
    ``None`` keeps the ordinal of a GPU whose UUID could not be read."""
    cuda_visible_devices: str | None = None
    """The raw ``CUDA_VISIBLE_DEVICES`` value of this rank, or ``None`` when unset."""
    gpu_uuid: str | None = None
    """The GPU this rank will use (visible device ``local_rank % len(visible)``), ``None`` on CPU."""
    cpu_affinity: tuple[int, ...] = ()
    """CPUs this process may run on (``sched_getaffinity``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "node": self.node.to_dict(),
            "visible_gpu_uuids": list(self.visible_gpu_uuids),
            "cuda_visible_devices": self.cuda_visible_devices,
            "gpu_uuid": self.gpu_uuid,
            "cpu_affinity": list(self.cpu_affinity),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RankProbe":
        return cls(
            rank=int(d["rank"]),
            local_rank=int(d["local_rank"]),
            world_size=int(d["world_size"]),
            node=NodeProbe.from_dict(d["node"]),
            visible_gpu_uuids=tuple(d.get("visible_gpu_uuids", ())),
            cuda_visible_devices=d.get("cuda_visible_devices"),
            gpu_uuid=d.get("gpu_uuid"),
            cpu_affinity=tuple(d.get("cpu_affinity", ())),
        )


@dataclass(frozen=True)
class RankEntry:
    """One rank inside a :class:`ClusterNode`."""

    rank: int
    local_rank: int
    gpu_uuid: str | None = None
    gpu_index: int | None = None
    """NVML index of ``gpu_uuid`` on the node, when it was found there."""
    cuda_visible_devices: str | None = None
    cpu_affinity: tuple[int, ...] = ()
    hostname: str | None = None
    """The hostname this rank's process saw (containers on one machine each see their own)."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cpu_affinity"] = list(self.cpu_affinity)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RankEntry":
        kw = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        kw["cpu_affinity"] = tuple(d.get("cpu_affinity", ()))
        return cls(**kw)


@dataclass(frozen=True)
class ClusterNode:
    """One node of the job and the ranks that run on it, ordered by local rank."""

    name: str
    probe: NodeProbe
    ranks: tuple[RankEntry, ...]

    @property
    def global_ranks(self) -> tuple[int, ...]:
        return tuple(r.rank for r in self.ranks)

    @property
    def network_path(self) -> tuple[str, ...]:
        """Where the node sits above it, top level first; empty when unknown."""
        return self.probe.network_path

    @property
    def is_contiguous(self) -> bool:
        """True when the node's global ranks form one block ``[k, k+1, ...]`` in local-rank order."""
        g = self.global_ranks
        return all(b == a + 1 for a, b in zip(g, g[1:]))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "probe": self.probe.to_dict(), "ranks": [r.to_dict() for r in self.ranks]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ClusterNode":
        return cls(
            name=d["name"],
            probe=NodeProbe.from_dict(d["probe"]),
            ranks=tuple(RankEntry.from_dict(x) for x in d["ranks"]),
        )


@dataclass(frozen=True)
class ClusterView:
    """Every rank's probe, grouped by node. It records what it sees; it assumes nothing.

    Nodes are ordered by their lowest global rank; ranks inside a node by local rank.
    """

    world_size: int
    nodes: tuple[ClusterNode, ...]
    notes: tuple[str, ...] = field(default=())
    """Irregularities found while assembling (non-contiguous ranks, shared GPUs, uneven nodes)."""

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def node_of(self, rank: int) -> ClusterNode:
        for n in self.nodes:
            if rank in n.global_ranks:
                return n
        raise KeyError(f"rank {rank} is on no node of this cluster view (world size {self.world_size})")

    @property
    def all_contiguous(self) -> bool:
        return all(n.is_contiguous for n in self.nodes)

    @property
    def shared_gpus(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """``(node, gpu_uuid, ranks)`` for every GPU that two or more ranks map to."""
        out = []
        for n in self.nodes:
            by_gpu: dict[str, list[int]] = {}
            for r in n.ranks:
                if r.gpu_uuid is not None:
                    by_gpu.setdefault(r.gpu_uuid, []).append(r.rank)
            out += [(n.name, u, tuple(rs)) for u, rs in by_gpu.items() if len(rs) > 1]
        return tuple(out)

    @property
    def is_homogeneous(self) -> bool:
        """True when every node runs the same number of ranks and has the same number of GPUs."""
        return len({len(n.ranks) for n in self.nodes}) <= 1 and len({n.probe.num_gpus for n in self.nodes}) <= 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "nodes": [n.to_dict() for n in self.nodes],
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ClusterView":
        return cls(
            world_size=int(d["world_size"]),
            nodes=tuple(ClusterNode.from_dict(x) for x in d["nodes"]),
            notes=tuple(d.get("notes", ())),
        )
