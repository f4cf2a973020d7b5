"""Render probes and cluster views for people (text) and for scripts (JSON-ready dicts).

Every fact a probe could not collect prints as ``unavailable: <reason>``; see [Note: failure is data]
in :mod:`hybridshard.topology.records`.
"""

from __future__ import annotations

from typing import Any, Sequence

from hybridshard.topology.findings import Finding, format_ranges, has_errors
from hybridshard.topology.islands import find_islands
from hybridshard.topology.netpath import format_tree
from hybridshard.topology.planner import GroupPlan, format_plan
from hybridshard.topology.records import ClusterView, GpuInfo, NodeProbe
from hybridshard.topology.smi import nearest_nics

__all__ = ["MATRIX_LEGEND", "cluster_report_dict", "render_cluster", "render_node", "render_table"]

MATRIX_LEGEND = """Legend:
  X    = the GPU itself
  NV#  = # bonded NVLinks, direct or through NVSwitches
  PIX  = PCIe, through at most one PCIe bridge
  PXB  = PCIe, through several PCIe bridges but no host bridge
  PHB  = PCIe, through a PCIe host bridge (the CPU)
  NODE = PCIe, between host bridges of one NUMA node
  SYS  = PCIe plus the link between NUMA nodes (sockets)
  ?    = unknown: the query failed (see unavailable)"""

_MAX_NODE_ROWS = 64


def render_table(header: Sequence[str], rows: Sequence[Sequence[Any]], indent: str = "  ") -> list[str]:
    """Left-aligned columns, two spaces apart."""
    cells = [[str(c) for c in header]] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]


def _gib(num_bytes: int | None) -> str:
    return "unknown" if num_bytes is None else f"{num_bytes / 2**30:.1f} GiB"


def _unavailable(mapping: dict[str, str], indent: str = "  ") -> list[str]:
    return [f"{indent}{k}: unavailable: {v}" for k, v in sorted(mapping.items())]


def _cuda(version: int | None) -> str:
    return "unknown" if version is None else f"{version // 1000}.{version % 1000 // 10}"


def _nvlink_summary(gpu: GpuInfo) -> str:
    active = [l for l in gpu.nvlinks if l.active]
    if not gpu.nvlinks:
        return "unavailable" if "nvlinks" in gpu.unavailable_map else "none"
    peers = gpu.nvlink_peers
    to_switch = sum(1 for l in active if l.peer_index is None)
    parts = [f"{len(active)}/{len(gpu.nvlinks)} up"]
    if peers:
        parts.append("GPU " + ",".join(map(str, peers)))
    if to_switch:
        parts.append(f"{to_switch} to switch")
    return ", ".join(parts)


def _fabric(gpu: GpuInfo) -> str:
    if gpu.fabric_cluster_uuid:
        return f"{gpu.fabric_cluster_uuid[:8]}/{gpu.fabric_clique_id}"
    return "-"


def render_node(probe: NodeProbe) -> str:
    """A readable report of one node: CPUs and memory, NUMA, NICs, GPUs and their connections."""
    miss = probe.unavailable_map
    host = "" if probe.hostname == probe.node_name else f" (hostname {probe.hostname})"
    machine = f", machine {probe.machine}" if probe.machine and probe.machine != probe.node_name else ""
    lines = [f"node {probe.node_name}{host}{machine}"]
    sockets = probe.cpu_sockets if probe.cpu_sockets is not None else "? sockets"
    lines.append(
        f"  CPU: {sockets} socket(s), {probe.cpu_cores_physical or '?'} cores, "
        f"{probe.cpu_cores_logical or '?'} logical CPUs; memory {_gib(probe.memory_total_bytes)}"
    )
    if probe.network_path:
        lines.append(f"  network: {'/'.join(probe.network_path)} (from {probe.network_source or 'unknown'})")
    else:
        lines.append('  network: unknown (no source gives a path; see docs/topology.md, "Racks and pods")')
    lines.append("NUMA nodes:")
    if probe.numa_nodes:
        lines += render_table(
            ["node", "CPUs", "memory"],
            [[n.id, format_ranges(n.cpus), _gib(n.memory_bytes)] for n in probe.numa_nodes],
        )
    else:
        lines.append(f"  unavailable: {miss.get('numa_nodes', 'none found')}")
    lines.append("NICs:")
    if probe.nics:
        lines += render_table(
            ["name", "state", "speed", "RDMA", "NUMA", "MTU"],
            [
                [
                    n.name,
                    "unknown" if n.is_up is None else "up" if n.is_up else "down",
                    "unknown" if n.speed_mbps is None else f"{n.speed_mbps / 1000:g} Gb/s",
                    f"{n.rdma_device} ({n.link_layer or '?'})" if n.is_rdma else "unknown" if n.is_rdma is None else "no",
                    n.numa_node,
                    n.mtu,
                ]
                for n in probe.nics
            ],
        )
    else:
        lines.append(f"  {'unavailable: ' + miss['nics'] if 'nics' in miss else 'none besides loopback'}")
    lines += _render_gpus(probe)
    node_missing = {k: v for k, v in miss.items() if k not in ("gpus", "numa_nodes", "nics")}
    if node_missing:
        lines.append("Unavailable:")
        lines += _unavailable(node_missing)
    return "\n".join(lines)


def _render_gpus(probe: NodeProbe) -> list[str]:
    miss = probe.unavailable_map
    if not probe.gpus:
        return [f"no GPUs: {miss.get('gpus', 'NVML lists none')}"]
    lines = [
        f"GPUs: {probe.num_gpus}  (driver {probe.driver_version or 'unknown'}, "
        f"CUDA {_cuda(probe.cuda_driver_version)}, NVML {probe.nvml_version or 'unknown'})"
    ]
    lines += render_table(
        ["GPU", "name", "UUID", "PCI bus id", "memory", "NUMA", "NVLink", "fabric"],
        [
            [
                g.index,
                g.name,
                g.uuid,
                g.pci_bus_id,
                _gib(g.memory_total_bytes),
                g.numa_node,
                _nvlink_summary(g),
                _fabric(g),
            ]
            for g in probe.gpus
        ],
    )
    # One line per (fact, reason), naming the GPUs it applies to: an 8-GPU node whose fabric query
    # is unsupported says so once, not eight times.
    gpus_by_miss: dict[tuple[str, str], list[int]] = {}
    for g in probe.gpus:
        for fact, reason in g.unavailable:
            gpus_by_miss.setdefault((fact, reason), []).append(g.index)
    for (fact, reason), indices in sorted(gpus_by_miss.items()):
        which = f"GPU {indices[0]}" if len(indices) == 1 else f"GPUs {format_ranges(indices)}"
        lines.append(f"  {which}: {fact}: unavailable: {reason}")
    clusters = {(g.fabric_cluster_uuid, g.fabric_clique_id) for g in probe.gpus if g.fabric_cluster_uuid}
    for uuid, clique in sorted(clusters, key=str):
        lines.append(f"  multi-node NVLink: fabric cluster {uuid}, clique {clique}")
    if probe.gpu_matrix:
        lines.append("Connections (like nvidia-smi topo -m):")
        header = [""] + [f"GPU{g.index}" for g in probe.gpus] + ["CPU Affinity", "NUMA Affinity"]
        rows = [
            [f"GPU{g.index}", *row, format_ranges(g.cpu_affinity), g.numa_node]
            for g, row in zip(probe.gpus, probe.gpu_matrix)
        ]
        lines += render_table(header, rows)
        lines += ["  " + line for line in MATRIX_LEGEND.splitlines()]
    islands = find_islands(probe).islands
    lines.append("NVLink islands: " + " ".join("{" + ",".join(map(str, i)) + "}" for i in islands))
    if any(n.gpu_levels for n in probe.nics):
        lines.append("Nearest NIC per GPU:")
        rows = []
        for g in probe.gpus:
            names, level = nearest_nics(probe, g.index)
            rows.append([f"GPU{g.index}", g.numa_node, ", ".join(names) or "-", level])
        lines += render_table(["GPU", "NUMA", "nearest NIC", "level"], rows)
    return lines


def render_cluster(
    cluster: ClusterView,
    plan: GroupPlan | None,
    findings: Sequence[Finding],
    *,
    bandwidth_table: str | None = None,
) -> str:
    """The cluster table, the network tree, the group plan and the findings."""
    lines = [f"cluster: {cluster.num_nodes} node(s), world size {cluster.world_size}"]
    rows = []
    for n in cluster.nodes[:_MAX_NODE_ROWS]:
        models = sorted({g.name or "?" for g in n.probe.gpus})
        gpu_of = " ".join(f"{r.rank}:{'-' if r.gpu_index is None else r.gpu_index}" for r in n.ranks[:16])
        hosts = sorted({r.hostname for r in n.ranks if r.hostname}) or [n.probe.hostname]
        rows.append(
            [
                n.name,
                ",".join(hosts[:4]) + (",..." if len(hosts) > 4 else ""),
                n.probe.machine or "-",
                f"{format_ranges(n.global_ranks)} ({len(n.ranks)})",
                f"{n.probe.num_gpus} x {'/'.join(models)}" if models else "0",
                "yes" if n.is_contiguous else "no",
                gpu_of + (" ..." if len(n.ranks) > 16 else ""),
            ]
        )
    lines += render_table(["node", "hostname", "machine", "ranks", "GPUs", "contiguous", "rank:GPU"], rows)
    if cluster.num_nodes > _MAX_NODE_ROWS:
        lines.append(f"  ... {cluster.num_nodes - _MAX_NODE_ROWS} more nodes")
    lines += ["", format_tree(cluster), ""]
    lines.append(format_plan(plan) if plan is not None else "plan: none (see errors)")
    if bandwidth_table:
        lines += ["", bandwidth_table.rstrip()]
    lines.append("")
    if findings:
        lines.append(f"{'errors' if has_errors(findings) else 'warnings'}:")
        lines += [f"  [{f.level.value}] {f.code}: {f.message}" for f in findings]
    else:
        lines.append("no warnings")
    return "\n".join(lines)


def cluster_report_dict(
    cluster: ClusterView,
    plan: GroupPlan | None,
    findings: Sequence[Finding],
    *,
    bandwidth: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The cluster report as JSON-ready data; ``cluster`` is loadable by ``hybridshard plan --from``."""
    out: dict[str, Any] = {
        "world_size": cluster.world_size,
        "num_nodes": cluster.num_nodes,
        "ok": not has_errors(findings),
        "warnings": [f.to_dict() for f in findings],
        "plan": plan.to_dict() if plan is not None else None,
        "cluster": cluster.to_dict(),
    }
    if bandwidth is not None:
        out["bandwidth"] = bandwidth
    return out
