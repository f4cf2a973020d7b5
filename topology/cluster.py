"""The cluster view: every rank's probe, grouped by the node it runs on.

``assemble_cluster`` is pure (a list of :class:`RankProbe` in, a :class:`ClusterView` out), so the
planner and the reports can be tested with recorded probes; ``gather_cluster`` is the collective that
feeds it (through rank 0, each node's probe once: :mod:`hybridshard.topology.summary`).

[Note: nodes are discovered, not computed]
A rank's node is the node name its own probe reports (the machine, or ``HYBRIDSHARD_NODE_NAME``),
never ``rank // local_world_size``. torchrun hands out global ranks in blocks per agent, but SLURM's
``cyclic`` distribution, custom launchers and elastic restarts do not; grouping by reported identity
makes every later step correct for any rank order. The view records what it finds (ranks that are
not contiguous, two ranks on one GPU, nodes of different sizes, network paths that do not form one
tree) and leaves judging to the planner and the report.
"""

from __future__ import annotations

import logging
from typing import Sequence

from hybridshard.topology.netpath import path_notes
from hybridshard.topology.records import ClusterNode, ClusterView, RankEntry, RankProbe

logger = logging.getLogger(__name__)

__all__ = ["assemble_cluster", "gather_cluster"]


def assemble_cluster(probes: Sequence[RankProbe]) -> ClusterView:
    """Group rank probes by node. Raises ``ValueError`` when the probes do not describe one job."""
    if not probes:
        raise ValueError("assemble_cluster needs one probe per rank; got none")
    world_size = probes[0].world_size
    seen = sorted(p.rank for p in probes)
    if seen != list(range(world_size)) or any(p.world_size != world_size for p in probes):
        sizes = sorted({p.world_size for p in probes})
        raise ValueError(
            f"expected one probe for each rank 0..{world_size - 1} with world size {world_size}; "
            f"found ranks {seen[:16]}{'...' if len(seen) > 16 else ''} reporting world sizes {sizes}. "
            "Gather the probes over the default group of one job."
        )

    by_node: dict[str, list[RankProbe]] = {}
    for p in sorted(probes, key=lambda p: p.rank):
        by_node.setdefault(p.node.node_name, []).append(p)

    notes: list[str] = []
    nodes = []
    for name, members in by_node.items():
        members.sort(key=lambda p: (p.local_rank, p.rank))
        node_probe = members[0].node
        entries = []
        for p in members:
            gpu = node_probe.gpu_by_uuid(p.gpu_uuid) if p.gpu_uuid else None
            entries.append(
                RankEntry(
                    rank=p.rank,
                    local_rank=p.local_rank,
                    gpu_uuid=p.gpu_uuid,
                    gpu_index=gpu.index if gpu is not None else None,
                    cuda_visible_devices=p.cuda_visible_devices,
                    cpu_affinity=p.cpu_affinity,
                    hostname=p.node.hostname,
                )
            )
        local_ranks = [(e.hostname, e.local_rank) for e in entries]
        if len(set(local_ranks)) != len(local_ranks):
            notes.append(
                f"node {name!r}: local ranks repeat ({[lr for _, lr in local_ranks]}) within one hostname; "
                "two launchers may share one node name"
            )
        if len({p.node.num_gpus for p in members}) > 1:
            notes.append(f"node {name!r}: its ranks see different GPU counts {[p.node.num_gpus for p in members]}")
        nodes.append(ClusterNode(name=name, probe=node_probe, ranks=tuple(entries)))

    view = ClusterView(world_size=world_size, nodes=tuple(nodes), notes=())
    for node in view.nodes:
        if not node.is_contiguous:
            notes.append(f"node {node.name!r}: global ranks {list(node.global_ranks)} are not one contiguous block")
    for node, uuid, ranks in view.shared_gpus:
        notes.append(f"node {node!r}: ranks {list(ranks)} share GPU {uuid}")
    if not view.is_homogeneous:
        shape = ", ".join(f"{n.name}: {len(n.ranks)} ranks/{n.probe.num_gpus} GPUs" for n in view.nodes)
        notes.append(f"nodes differ in size ({shape})")
    notes += path_notes(view)
    for note in notes:
        logger.debug("cluster view: %s", note)
    return ClusterView(world_size=world_size, nodes=view.nodes, notes=tuple(notes))


def gather_cluster(rank_probe: RankProbe | None = None, group=None) -> ClusterView:
    """Probe this rank (unless given) and gather the cluster view, each node's probe once (see
    [Note: one probe per node] in :mod:`hybridshard.topology.summary`); collective over ``group``.

    With the NCCL backend the current CUDA device must already be set (the object collectives move
    the pickled probes through it).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError(
            "gather_cluster needs an initialised default process group; call "
            "torch.distributed.init_process_group() first (torchrun sets the environment for it)"
        )
    if rank_probe is None:
        from hybridshard.topology.probe import probe_rank

        rank_probe = probe_rank(rank=dist.get_rank(), world_size=dist.get_world_size())
    from hybridshard.topology.summary import gather_summary  # it assembles with assemble_cluster

    return gather_summary(rank_probe, group=group)
