"""Which CPUs each local rank should run on: the CPUs of its GPU's NUMA node.

A pure computation over discovery records (:class:`hybridshard.topology.records.NodeProbe`), so it is tested
with recorded fixtures; :mod:`hybridshard.launcher.bind` applies the result inside each worker.

[Note: NUMA binding]
Local rank ``i`` drives visible GPU ``i % len(visible)`` (the same rule discovery uses). Its CPU set
is the NUMA node NVML reports for that GPU, taken from the node's NUMA table; when the GPU's NUMA node
is unknown or absent from the table, NVML's own CPU-affinity mask for the GPU is used. The set is then
intersected with the CPUs the launcher itself may use (a SLURM cgroup or ``taskset`` narrows them), so
a binding never asks for a CPU the job does not own. An empty result is an error, not a silent no-op.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Sequence

from hybridshard.topology.records import GpuInfo, NodeProbe

logger = logging.getLogger(__name__)

__all__ = ["CpuBinding", "compute_binding", "format_cpulist", "parse_cpulist", "BINDING_ENV"]

BINDING_ENV = "HYBRIDSHARD_CPU_BINDING"
"""Environment variable carrying the binding to the workers: one cpulist per local rank, ``;``-separated."""


def format_cpulist(cpus: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the kernel's cpulist format)."""
    ids = sorted(set(cpus))
    parts, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``"0-2,5"`` -> ``(0, 1, 2, 5)``."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"cpulist {text!r}: {part!r} is not N or N-M") from None
        if b < a:
            raise ValueError(f"cpulist {text!r}: range {part!r} runs backwards")
        cpus.update(range(a, b + 1))
    if not cpus:
        raise ValueError(f"cpulist {text!r} names no CPU")
    return tuple(sorted(cpus))


@dataclass(frozen=True)
class CpuBinding:
    """The CPU set of every local rank on one node."""

    cpus_per_local_rank: tuple[tuple[int, ...], ...]
    gpu_per_local_rank: tuple[int, ...]
    """NVML index of the GPU each local rank drives."""
    numa_per_local_rank: tuple[int | None, ...]
    """NUMA node the set came from; ``None`` when it came from NVML's affinity mask."""

    def cpus_for(self, local_rank: int) -> tuple[int, ...]:
        if not 0 <= local_rank < len(self.cpus_per_local_rank):
            raise ValueError(
                f"LOCAL_RANK {local_rank} has no CPU binding; the binding covers local ranks "
                f"0..{len(self.cpus_per_local_rank) - 1} (was --nproc-per-node changed after it was computed?)"
            )
        return self.cpus_per_local_rank[local_rank]

    def to_env(self) -> str:
        return ";".join(format_cpulist(c) for c in self.cpus_per_local_rank)

    def describe(self) -> list[str]:
        lines = []
        for lr, (cpus, gpu, numa) in enumerate(zip(self.cpus_per_local_rank, self.gpu_per_local_rank,
                                                   self.numa_per_local_rank)):
            where = f"NUMA node {numa}" if numa is not None else "NVML affinity"
            lines.append(f"local rank {lr}: GPU {gpu} -> CPUs {format_cpulist(cpus)} ({where})")
        return lines


def cpus_from_env(value: str, local_rank: int) -> tuple[int, ...]:
    """The CPU set of ``local_rank`` from a :data:`BINDING_ENV` value."""
    sets = [s for s in value.split(";")]
    if not 0 <= local_rank < len(sets):
        raise ValueError(
            f"{BINDING_ENV} has {len(sets)} CPU sets but LOCAL_RANK is {local_rank}; "
            "the launcher computed it for fewer processes per node"
        )
    return parse_cpulist(sets[local_rank])


def _gpu_cpus(node: NodeProbe, gpu: GpuInfo) -> tuple[tuple[int, ...], int | None]:
    if gpu.numa_node is not None:
        for numa in node.numa_nodes:
            if numa.id == gpu.numa_node and numa.cpus:
                return numa.cpus, numa.id
    return tuple(gpu.cpu_affinity), None


def compute_binding(
    node: NodeProbe,
    visible_gpu_uuids: Sequence[str],
    nproc_per_node: int,
    *,
    allowed_cpus: Iterable[int] | None = None,
) -> CpuBinding:
    """CPU sets for local ranks ``0..nproc_per_node-1``; see [Note: NUMA binding]."""
    if nproc_per_node < 1:
        raise ValueError(f"--nproc-per-node must be >= 1 for NUMA binding, found {nproc_per_node}")
    if not visible_gpu_uuids:
        reason = node.unavailable_map.get("gpus", "no GPU is visible to this process")
        raise ValueError(f"--bind-numa needs GPUs to bind to, found none ({reason}); drop --bind-numa on CPU-only nodes")
    gpus = []
    for uuid in visible_gpu_uuids:
        gpu = node.gpu_by_uuid(uuid)
        if gpu is None:
            raise ValueError(
                f"visible GPU {uuid} is not among the node's GPUs {[g.uuid for g in node.gpus]}; "
                "check CUDA_VISIBLE_DEVICES"
            )
        gpus.append(gpu)
    allowed = set(allowed_cpus) if allowed_cpus is not None else None
    cpus_out, gpu_out, numa_out = [], [], []
    for local_rank in range(nproc_per_node):
        gpu = gpus[local_rank % len(gpus)]
        cpus, numa = _gpu_cpus(node, gpu)
        if not cpus:
            raise ValueError(
                f"GPU {gpu.index} reports neither a NUMA node with CPUs nor a CPU affinity "
                f"({gpu.unavailable_map or 'no reason recorded'}); cannot bind local rank {local_rank}; drop --bind-numa"
            )
        if allowed is not None:
            kept = tuple(c for c in cpus if c in allowed)
            if not kept:
                raise ValueError(
                    f"local rank {local_rank}: GPU {gpu.index}'s CPUs {format_cpulist(cpus)} are all outside the CPUs "
                    f"this job may use ({format_cpulist(allowed)}); ask the scheduler for CPUs on that NUMA node "
                    "or drop --bind-numa"
                )
            cpus = kept
        cpus_out.append(tuple(cpus))
        gpu_out.append(gpu.index)
        numa_out.append(numa)
    binding = CpuBinding(tuple(cpus_out), tuple(gpu_out), tuple(numa_out))
    logger.debug("NUMA binding: %s", binding.describe())
    return binding
