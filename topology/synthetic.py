"""Synthetic cluster views: plan a cluster you do not have yet (``hybridshard plan``), benchmark
the planner at scale, and test layouts that are hard to launch for real.

A synthetic node has ``gpus_per_node`` GPUs in one of three NVLink shapes — ``"nvswitch"`` (every
pair ``NV18``), ``"pairs"`` (bridged pairs, ``SYS`` otherwise) or ``"none"`` (PCIe only) — split
evenly over ``numa_per_node`` NUMA nodes. ``fabric_nodes_per_clique`` puts that many consecutive
nodes into one multi-node NVLink clique. Global ranks are handed out in torchrun's ``"block"`` order,
SLURM's ``"cyclic"`` order, or an explicit ``rank_order``. ``racks=R`` spreads the nodes over ``R``
racks of one pod in order (node ``i`` at ``("pod0", f"rack{i * R // num_nodes}")``), and
``network_paths`` gives each node its own path (see :mod:`hybridshard.topology.netpath`).
"""

from __future__ import annotations

from typing import Sequence

from hybridshard.topology.cluster import assemble_cluster
from hybridshard.topology.records import ClusterView, GpuInfo, NodeProbe, NumaNode, NvLink, RankProbe

__all__ = ["LAYOUTS", "NVLINK_SHAPES", "rank_order", "replicated_cluster", "synthetic_cluster", "synthetic_node"]

LAYOUTS = ("block", "cyclic")
NVLINK_SHAPES = ("nvswitch", "pairs", "none")


def _matrix(num_gpus: int, shape: str, numa_of: Sequence[int]) -> tuple[tuple[str, ...], ...]:
    rows = []
    for i in range(num_gpus):
        row = []
        for j in range(num_gpus):
            if i == j:
                row.append("X")
            elif shape == "nvswitch":
                row.append("NV18")
            elif shape == "pairs" and i // 2 == j // 2:
                row.append("NV4")
            else:
                row.append("NODE" if numa_of[i] == numa_of[j] else "SYS")
        rows.append(tuple(row))
    return tuple(rows)


def synthetic_node(
    name: str,
    *,
    gpus_per_node: int = 8,
    nvlink: str = "nvswitch",
    numa_per_node: int = 2,
    cores_per_numa: int = 16,
    fabric: tuple[str, int] | None = None,
    network_path: Sequence[str] = (),
) -> NodeProbe:
    """One node's probe with synthetic but self-consistent facts."""
    if nvlink not in NVLINK_SHAPES:
        raise ValueError(f"nvlink must be one of {NVLINK_SHAPES}, got {nvlink!r}")
    numa_nodes = tuple(
        NumaNode(id=k, cpus=tuple(range(k * cores_per_numa, (k + 1) * cores_per_numa))) for k in range(numa_per_node)
    )
    numa_of = [min(i * numa_per_node // max(gpus_per_node, 1), numa_per_node - 1) for i in range(gpus_per_node)]
    gpus = []
    for i in range(gpus_per_node):
        links: tuple[NvLink, ...] = ()
        if nvlink == "pairs":
            links = tuple(NvLink(link=k, active=True, peer_index=i ^ 1) for k in range(4))
        gpus.append(
            GpuInfo(
                index=i,
                name="Synthetic GPU",
                uuid=f"GPU-{name}-{i:02d}",
                pci_bus_id=f"00000000:{0x18 + 0x10 * i:02X}:00.0",
                numa_node=numa_of[i],
                cpu_affinity=numa_nodes[numa_of[i]].cpus,
                nvlinks=links,
                fabric_cluster_uuid=fabric[0] if fabric else None,
                fabric_clique_id=fabric[1] if fabric else None,
            )
        )
    return NodeProbe(
        node_name=name,
        hostname=name,
        numa_nodes=numa_nodes,
        gpus=tuple(gpus),
        gpu_matrix=_matrix(gpus_per_node, nvlink, numa_of),
        network_path=tuple(network_path),
        network_source="synthetic" if network_path else None,
    )


def rank_order(num_nodes: int, ranks_per_node: int, layout: str) -> list[tuple[int, int]]:
    """``(node position, local rank)`` of each global rank."""
    if layout == "block":
        return [(r // ranks_per_node, r % ranks_per_node) for r in range(num_nodes * ranks_per_node)]
    if layout == "cyclic":
        return [(r % num_nodes, r // num_nodes) for r in range(num_nodes * ranks_per_node)]
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def synthetic_cluster(
    num_nodes: int = 2,
    gpus_per_node: int | Sequence[int] = 8,
    *,
    layout: str = "block",
    order: Sequence[tuple[int, int]] | None = None,
    nvlink: str = "nvswitch",
    numa_per_node: int = 2,
    fabric_nodes_per_clique: int | None = None,
    node_prefix: str = "node",
    racks: int | None = None,
    network_paths: Sequence[Sequence[str]] | None = None,
) -> ClusterView:
    """A cluster of ``num_nodes`` nodes with one rank per GPU.

    ``gpus_per_node`` may be a list (one count per node) for heterogeneous clusters; then ranks are
    handed out in blocks unless ``order`` gives ``(node position, local rank)`` for each global rank.
    ``racks`` puts node ``i`` at ``("pod0", f"rack{i * racks // num_nodes}")`` (racks of equal size
    when ``racks`` divides ``num_nodes``, else sizes one apart); ``network_paths`` gives one path per
    node instead (``()`` for none).
    """
    counts = list(gpus_per_node) if isinstance(gpus_per_node, Sequence) else [gpus_per_node] * num_nodes
    if len(counts) != num_nodes or num_nodes < 1 or min(counts) < 1:
        raise ValueError(f"expected {num_nodes} positive GPU counts, got {counts}")
    if racks is not None and network_paths is not None:
        raise ValueError("expected racks or network_paths, found both; pass one")
    if racks is not None:
        if not 1 <= racks <= num_nodes:
            raise ValueError(f"expected 1 <= racks <= num_nodes ({num_nodes}), found racks={racks}")
        network_paths = [("pod0", f"rack{i * racks // num_nodes}") for i in range(num_nodes)]
    paths = [tuple(p) for p in network_paths] if network_paths is not None else [()] * num_nodes
    if len(paths) != num_nodes:
        raise ValueError(f"expected one network path per node ({num_nodes}), found {len(paths)}")
    if order is None:
        if len(set(counts)) == 1:
            order = rank_order(num_nodes, counts[0], layout)
        else:
            order = [(n, k) for n, c in enumerate(counts) for k in range(c)]
    nodes = []
    for n, count in enumerate(counts):
        fabric = None
        if fabric_nodes_per_clique:
            fabric = ("fabric-0000-synthetic", n // fabric_nodes_per_clique)
        nodes.append(
            synthetic_node(
                f"{node_prefix}{n}", gpus_per_node=count, nvlink=nvlink, numa_per_node=numa_per_node, fabric=fabric,
                network_path=paths[n],
            )
        )
    return _one_rank_per_gpu(nodes, order)


def replicated_cluster(node: NodeProbe, num_nodes: int, *, layout: str = "block") -> ClusterView:
    """``num_nodes`` copies of one node's probe (e.g. read from ``nvidia-smi topo -m``), one rank per GPU."""
    from hybridshard.topology.smi import with_name

    if num_nodes < 1 or not node.gpus:
        raise ValueError(f"expected at least one node with GPUs; got {num_nodes} nodes of {node.num_gpus} GPUs")
    nodes = [with_name(node, f"{node.node_name}{n}" if num_nodes > 1 else node.node_name) for n in range(num_nodes)]
    return _one_rank_per_gpu(nodes, rank_order(num_nodes, node.num_gpus, layout))


def _one_rank_per_gpu(nodes: Sequence[NodeProbe], order: Sequence[tuple[int, int]]) -> ClusterView:
    world_size = len(order)
    probes = []
    for rank, (n, local) in enumerate(order):
        node = nodes[n]
        uuids = tuple(g.uuid for g in node.gpus)
        probes.append(
            RankProbe(
                rank=rank,
                local_rank=local,
                world_size=world_size,
                node=node,
                visible_gpu_uuids=uuids,
                gpu_uuid=uuids[local % len(uuids)],
                cpu_affinity=node.gpus[local % len(uuids)].cpu_affinity,
            )
        )
    return assemble_cluster(probes)
