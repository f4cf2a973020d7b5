"""Where each local rank of one node runs: its GPU, NUMA node, CPUs and nearest NIC.

``hybridshard launch --dry-run --from-smi FILE`` prints this for a machine described by
``nvidia-smi topo -m`` before the package is installed there; the CPU sets are the ones
``--bind-numa`` would apply (see [Note: NUMA binding] in :mod:`hybridshard.launcher.numa`).
"""

from __future__ import annotations

from hybridshard.launcher.numa import compute_binding, format_cpulist
from hybridshard.topology.records import NodeProbe
from hybridshard.topology.report import render_table
from hybridshard.topology.smi import nearest_nics

__all__ = ["describe_local_ranks"]


def describe_local_ranks(node: NodeProbe, nproc_per_node: int) -> list[str]:
    """One row per local rank: GPU, NUMA node, CPU binding and nearest NIC (with its PCIe level)."""
    binding = compute_binding(node, [g.uuid for g in node.gpus if g.uuid], nproc_per_node)
    rows = []
    for local_rank, (cpus, gpu, numa) in enumerate(
        zip(binding.cpus_per_local_rank, binding.gpu_per_local_rank, binding.numa_per_local_rank)
    ):
        names, level = nearest_nics(node, gpu)
        nic = f"{', '.join(names)} ({level})" if names else "-"
        source = f"NUMA node {numa}" if numa is not None else "GPU affinity"
        rows.append([local_rank, f"GPU{gpu}", "-" if numa is None else numa, f"{format_cpulist(cpus)} ({source})", nic])
    return [f"# local ranks on {node.node_name}:"] + [
        "#" + line for line in render_table(["local rank", "GPU", "NUMA", "CPUs (--bind-numa)", "nearest NIC"], rows)
    ]
