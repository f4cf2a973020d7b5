"""Judge a cluster view: what will hurt a job before it burns hours.

:func:`cluster_findings` is pure: a :class:`~hybridshard.topology.records.ClusterView` (and the plan, or the
reason planning failed) in, :class:`Finding` records out. ``hybridshard topo`` prints them and exits
non-zero when one is an error. docs/topology.md explains each code and its fix.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from hybridshard.topology.islands import find_islands
from hybridshard.topology.netpath import path_notes, racks
from hybridshard.topology.ranges import format_ranges
from hybridshard.topology.records import ClusterNode, ClusterView, GpuInfo, NodeProbe, RankEntry
from hybridshard.topology.visible import resolve_visible_devices

__all__ = ["CODES", "Finding", "Level", "cluster_findings", "format_ranges", "has_errors", "node_findings"]

CODES = (
    "heterogeneous_nodes",
    "non_contiguous_ranks",
    "node_name_collision",
    "visible_devices_differ",
    "gpu_not_visible",
    "gpu_not_on_node",
    "shared_gpu",
    "cpu_affinity_off_numa",
    "plan_failed",
    "bandwidth",
    "nvlink_island",
    "nic_far",
    "node_identity",
    "network_path",
    "uneven_racks",
)
_MAX_LISTED = 8


class Level(str, enum.Enum):
    WARNING = "warning"
    """The job can run, but slower or less safely than it could."""
    ERROR = "error"
    """The job would fail, hang or train wrong; ``hybridshard topo`` exits non-zero."""


@dataclass(frozen=True)
class Finding:
    level: Level
    code: str
    """One of :data:`CODES`: stable, for scripts and docs."""
    message: str
    """What was found, why it matters, and the fix."""

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"finding code must be one of {CODES}, found {self.code!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level.value, "code": self.code, "message": self.message}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Finding":
        return cls(level=Level(d["level"]), code=d["code"], message=d["message"])


def has_errors(findings: Sequence[Finding]) -> bool:
    return any(f.level is Level.ERROR for f in findings)


def _listed(items: Sequence[str]) -> str:
    more = f"; ... {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return "; ".join(items[:_MAX_LISTED]) + more


def cluster_findings(cluster: ClusterView, plan: Any = None, *, plan_error: str | None = None) -> tuple[Finding, ...]:
    """Every finding for ``cluster``, errors first. ``plan_error`` is the planner's ValueError text."""
    found: list[Finding] = []
    found += _heterogeneous(cluster)
    found += _non_contiguous(cluster)
    for node in cluster.nodes:
        found += _node_name_collision(node)
        found += _visible_devices(node)
        found += _affinity(node)
    found += _shared_gpus(cluster)
    found += _identity(cluster)
    found += _network(cluster)
    seen_machines: set[tuple] = set()
    for node in cluster.nodes:  # one report per distinct machine shape, not per node of a uniform cluster
        shape = (node.probe.gpu_matrix, tuple(n.gpu_levels for n in node.probe.nics))
        if shape not in seen_machines:
            seen_machines.add(shape)
            found += node_findings(node.probe)
    if plan_error is not None:
        found.append(Finding(Level.ERROR, "plan_failed", f"no group plan: {plan_error}"))
    return tuple(sorted(found, key=lambda f: (f.level is not Level.ERROR, CODES.index(f.code))))


def node_findings(probe: NodeProbe) -> list[Finding]:
    """What is irregular inside one node: its NVLink islands and the distance from each GPU to a NIC."""
    found = [
        Finding(Level.WARNING, "nvlink_island", f"node {probe.node_name!r}: {note}")
        for note in find_islands(probe).notes
    ]
    far = []
    for g in probe.gpus:
        levels = [n.gpu_levels[g.index] for n in probe.nics if g.index < len(n.gpu_levels)]
        numas = {n.numa_node for n in probe.nics if n.is_rdma and n.numa_node is not None}  # the job's NICs
        if levels and all(lv == "SYS" for lv in levels):
            far.append(f"GPU {g.index} reaches every NIC through the socket link (SYS)")
        elif not levels and numas and g.numa_node is not None and g.numa_node not in numas:
            far.append(f"GPU {g.index} on NUMA node {g.numa_node}, NICs on {sorted(numas)}")
    if far:
        found.append(
            Finding(
                Level.WARNING,
                "nic_far",
                f"node {probe.node_name!r}: GPU and its nearest NIC on different NUMA nodes ({_listed(far)}). "
                "Inter-node traffic of these GPUs crosses the CPU interconnect; expect lower replicate-group "
                "bandwidth (check NCCL_IB_HCA and the NIC placement).",
            )
        )
    return found


def _identity(cluster: ClusterView) -> list[Finding]:
    """Hostnames and machines that do not pair one to one; see [Note: one machine, one node] in probe.py."""
    hosts_of: dict[str, set[str]] = {}
    machines_of: dict[str, set[str]] = {}
    names_of: dict[str, set[str]] = {}
    for node in cluster.nodes:
        machine = node.probe.machine
        if machine is None:
            continue
        names_of.setdefault(machine, set()).add(node.name)
        for r in node.ranks:
            host = r.hostname or node.probe.hostname
            hosts_of.setdefault(machine, set()).add(host)
            machines_of.setdefault(host, set()).add(machine)
    out = []
    for machine, hosts in sorted(hosts_of.items()):
        if len(hosts) < 2:
            continue
        names = sorted(names_of[machine])
        if len(names) == 1:
            out.append(f"hostnames {', '.join(sorted(hosts))} run on one machine ({machine}) and shard together as "
                       f"node {names[0]!r} (containers or pods); if they are separate hosts, set HYBRIDSHARD_NODE_NAME")
        else:
            out.append(f"hostnames {', '.join(sorted(hosts))} run on one machine ({machine}) yet are nodes "
                       f"{', '.join(names)} by HYBRIDSHARD_NODE_NAME: right for a simulated cluster, otherwise unset "
                       "it so that they shard together")
    for host, machines in sorted(machines_of.items()):
        if len(machines) > 1:
            out.append(f"hostname {host!r} is on machines {', '.join(sorted(machines))}: hostnames do not name hosts")
    return [Finding(Level.WARNING, "node_identity", _listed(out))] if out else []


def _network(cluster: ClusterView) -> list[Finding]:
    """Paths that do not form one tree, and racks holding different numbers of the job's nodes."""
    out = []
    notes = path_notes(cluster)
    if notes:
        out.append(Finding(
            Level.WARNING, "network_path",
            f"{'; '.join(notes)}. Racks are compared by full path, so these nodes do not group with the "
            "others; give every node a path from one source (see docs/topology.md, \"Racks and pods\").",
        ))
    sizes = {path: len(names) for path, names in racks(cluster).items() if path}
    if len(set(sizes.values())) > 1:
        shown = [f"{'/'.join(path)} has {count} node{'s' if count != 1 else ''}" for path, count in sizes.items()]
        out.append(Finding(
            Level.WARNING, "uneven_racks",
            f"the job's nodes spread unevenly over racks (rack {_listed(shown).replace('; ', ', ')}). Traffic "
            "between racks is uneven and groups cannot be laid out rack by rack alike; ask the scheduler for "
            "the same number of nodes in each rack (Slurm: --switches, or a node list by rack).",
        ))
    return out


def _heterogeneous(cluster: ClusterView) -> list[Finding]:
    models = {n.name: tuple(sorted({g.name or "?" for g in n.probe.gpus})) for n in cluster.nodes}
    if cluster.is_homogeneous and len(set(models.values())) <= 1:
        return []
    shapes = [
        f"{n.name}: {len(n.ranks)} ranks, {n.probe.num_gpus} x {'/'.join(models[n.name]) or 'no GPU'}"
        for n in cluster.nodes
    ]
    return [
        Finding(
            Level.WARNING,
            "heterogeneous_nodes",
            f"nodes differ ({_listed(shapes)}). Shard groups must tile every node, so the shard size "
            "drops to what all nodes share and the slowest node sets the pace of every step. Run the "
            "same ranks and GPU model on every node (check --nproc-per-node and the node list).",
        )
    ]


def _non_contiguous(cluster: ClusterView) -> list[Finding]:
    bad = [f"{n.name}: ranks {format_ranges(n.global_ranks)}" for n in cluster.nodes if not n.is_contiguous]
    if not bad:
        return []
    return [
        Finding(
            Level.WARNING,
            "non_contiguous_ranks",
            f"ranks of a node are not one block ({_listed(bad)}). The plan groups by discovered node, so "
            "its groups are right, but code that assumes node = rank // ranks_per_node is not. Launch "
            "with block placement (torchrun does; SLURM: --distribution=block) unless cyclic is intended.",
        )
    ]


def _node_name_collision(node: ClusterNode) -> list[Finding]:
    # Containers on one machine each count local ranks from 0 (see [Note: one machine, one node]);
    # only a repeat within one hostname means two launchers that cannot be told apart.
    by_host: dict[str | None, list[int]] = {}
    for r in node.ranks:
        by_host.setdefault(r.hostname, []).append(r.local_rank)
    local = next((v for v in by_host.values() if len(set(v)) != len(v)), None)
    if local is None:
        return []
    return [
        Finding(
            Level.ERROR,
            "node_name_collision",
            f"node {node.name!r} reports local ranks {local} with repeats: two hosts share this node name "
            "(containers with one hostname, or a copied HYBRIDSHARD_NODE_NAME). Groups planned from it would "
            "span hosts. Give every host a distinct HYBRIDSHARD_NODE_NAME or hostname.",
        )
    ]


def _visible_devices(node: ClusterNode) -> list[Finding]:
    if not node.probe.gpus:
        return []
    out = []
    lost = [r for r in node.ranks if r.gpu_uuid is None]
    if lost:
        shown = [f"rank {r.rank}: CUDA_VISIBLE_DEVICES={_cvd(r)}" for r in lost]
        nameless = [g.index for g in node.probe.gpus if not g.uuid]
        why = (
            f" NVML reported no UUID for GPU {format_ranges(nameless)}, so a rank on it cannot be identified:"
            " fix the driver fault or hide that GPU." if nameless else ""
        )
        out.append(
            Finding(
                Level.ERROR,
                "gpu_not_visible",
                f"node {node.name!r} has {node.probe.num_gpus} GPUs but these ranks use none of them that "
                f"discovery can name ({_listed(shown)}). Fix or unset CUDA_VISIBLE_DEVICES for them.{why}",
            )
        )
    unknown = [r for r in node.ranks if r.gpu_uuid is not None and r.gpu_index is None]
    if unknown:
        shown = [f"rank {r.rank}: {r.gpu_uuid}" for r in unknown]
        out.append(
            Finding(
                Level.WARNING,
                "gpu_not_on_node",
                f"node {node.name!r}: these ranks use GPUs its probe does not list ({_listed(shown)}); two "
                "hosts may share the node name. Give every host a distinct HYBRIDSHARD_NODE_NAME or hostname.",
            )
        )
    values = {_device_list(r, node.probe.gpus) for r in node.ranks}
    one_each = all(_entries(r) == 1 for r in node.ranks) and len({r.gpu_uuid for r in node.ranks}) == len(node.ranks)
    if len(values) > 1 and not one_each:
        shown = [f"rank {r.rank}: {_cvd(r)}" for r in node.ranks]
        out.append(
            Finding(
                Level.WARNING,
                "visible_devices_differ",
                f"ranks on node {node.name!r} see different device sets ({_listed(shown)}), so CUDA "
                "ordinal k names different GPUs on different ranks and libraries that pick "
                "cuda:<local_rank> may collide. Give every rank of a node the same CUDA_VISIBLE_DEVICES, "
                "or exactly one distinct device each.",
            )
        )
    return out


def _affinity(node: ClusterNode) -> list[Finding]:
    numa_cpus = {n.id: set(n.cpus) for n in node.probe.numa_nodes}
    off = []
    for r in node.ranks:
        gpu = node.probe.gpu_by_uuid(r.gpu_uuid) if r.gpu_uuid else None
        if gpu is None or not r.cpu_affinity:
            continue
        near = numa_cpus.get(gpu.numa_node, set()) if gpu.numa_node is not None else set()
        near = near or set(gpu.cpu_affinity)
        if near and not set(r.cpu_affinity) <= near:
            where = f"NUMA node {gpu.numa_node}" if gpu.numa_node is not None else "its GPU"
            off.append(
                f"rank {r.rank}: GPU {gpu.index} near CPUs {format_ranges(sorted(near))} ({where}), "
                f"rank may run on {format_ranges(r.cpu_affinity)}"
            )
    if not off:
        return []
    return [
        Finding(
            Level.WARNING,
            "cpu_affinity_off_numa",
            f"node {node.name!r}: ranks may run on CPUs away from their GPU ({_listed(off)}). Host-to-device "
            "copies and kernel launches then cross the socket link. Launch with `hybridshard launch "
            "--bind-numa` or `torchrun --numa-binding=node`.",
        )
    ]


def _shared_gpus(cluster: ClusterView) -> list[Finding]:
    shared = [f"{node}: ranks {list(ranks)} on {uuid}" for node, uuid, ranks in cluster.shared_gpus]
    if not shared:
        return []
    return [
        Finding(
            Level.ERROR,
            "shared_gpu",
            f"several ranks use one GPU ({_listed(shared)}). NCCL refuses two ranks of one communicator on "
            "a GPU, and otherwise they halve each other's memory and speed. Run one rank per GPU "
            "(--nproc-per-node at most the GPU count) and check CUDA_VISIBLE_DEVICES.",
        )
    ]


def _norm(value: str | None) -> str | None:
    return None if value is None else ",".join(e.strip() for e in value.split(","))


def _device_list(r: RankEntry, gpus: Sequence[GpuInfo]) -> tuple[str | None, ...]:
    """The GPUs ``r`` sees, in CUDA ordinal order, so ``"0,1"``, unset and the same GPUs named by UUID
    compare equal; the raw text when it does not resolve cleanly (e.g. MIG ids)."""
    visible, problems = resolve_visible_devices(r.cuda_visible_devices, gpus)
    return (None, _norm(r.cuda_visible_devices)) if problems else visible


def _entries(r: RankEntry) -> int:
    value = _norm(r.cuda_visible_devices)
    return 0 if not value else len(value.split(","))


def _cvd(r: RankEntry) -> str:
    return "<unset>" if r.cuda_visible_devices is None else repr(r.cuda_visible_devices)
