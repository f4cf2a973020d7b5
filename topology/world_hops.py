"""The whole job as one shard group in two hops: FULL_SHARD and SHARD_GRAD_OP units on several nodes.

[Note: the whole job in two hops]
FULL_SHARD and SHARD_GRAD_OP shard over every rank. On ``k >= 2`` nodes of ``g >= 2`` ranks each
the whole job is a shard group over ``k`` nodes, and it gathers and reduce-scatters in two hops as a
hybrid one does ([Note: two hops over nodes] in :mod:`hybridshard.topology.shard_hops`): its members
are node-major (shard rank ``j * g + p`` for position ``p`` of node ``j``), nodes in network order,
and its hop groups are named ``world_node`` and ``world_across``. In a block launch that order is
the world's and the default group serves as the shard group; otherwise (a cyclic launch) one group
of every rank is created in member order (``sort_ranks=False``, [Note: network order] in
planner.py). A unit's layout follows its shard rank: state dicts and checkpoints do not change.
Learning the nodes costs one all-gather of node identities (:func:`hybridshard.topology.probe.node_name`,
``HYBRIDSHARD_NODE_NAME`` else the machine: what ``init_groups`` plans from), once per process (the
groups are kept for the default group's lifetime); none when the caller's groups carry the cluster
view (``init_groups()``), the job has one rank, ``LOCAL_WORLD_SIZE`` equals the world size (one
launcher agent, one node), the backend is torch's ``fake`` (its collectives return this rank's own
data) or ``two_hop=False``. Nodes of different sizes, or of one rank, keep the flat collectives.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Mapping, Sequence

import torch.distributed as dist

from hybridshard.topology.groups import ShardGroups, _build_shard_hops, _create, name_group
from hybridshard.topology.multinode import tile_nodes
from hybridshard.topology.planner import Domain, GroupPlan
from hybridshard.topology.records import ClusterView

logger = logging.getLogger(__name__)

__all__ = ["HOP_NAMES", "plan_world", "world_groups"]

HOP_NAMES = ("world_node", "world_across")
"""The names the whole job's hop groups count their collectives under (inside the node, across nodes)."""

_KEPT: "weakref.WeakKeyDictionary[dist.ProcessGroup, ShardGroups | None]" = weakref.WeakKeyDictionary()
"""Per default group: the whole job's groups in two hops, or ``None`` when it has none."""


def plan_world(nodes: Sequence[str], paths: Mapping[str, tuple[str, ...]] | None = None) -> tuple[GroupPlan | None, str]:
    """The plan of one shard group over every rank, node-major, from ``nodes[rank]`` (each rank's
    node identity) and each node's network path; or ``None`` and the reason two hops do not apply.
    Pure: every rank computes the same plan from the same list."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node, []).append(rank)
    sizes = sorted({len(ranks) for ranks in by_node.values()})
    if len(by_node) < 2:
        return None, "the job runs on one node"
    if len(sizes) > 1:
        return None, f"nodes run different numbers of ranks ({', '.join(map(str, sizes))})"
    if sizes[0] < 2:
        return None, "one rank per node: the flat ring already crosses each node boundary once"
    paths = paths or {}
    domains = [Domain(name, tuple(ranks), (name,)) for name, ranks in by_node.items()]
    domains.sort(key=lambda d: (paths.get(d.key, ()), min(d.ranks)))  # see [Note: network order]
    tiling = tile_nodes(domains, len(nodes), {})  # one group of every node: racks cannot split it
    members = tiling.groups[0]
    return GroupPlan(
        world_size=len(nodes), shard_size=len(nodes), replicate_size=1, domain="node", shard_groups=(members,),
        replicate_groups=tuple((r,) for r in members), shard_group_domains=tiling.labels,
        shard_nodes=tiling.nodes_per_group, shard_group_hosts=tiling.hosts,
    ), ""


def world_groups(*, two_hop: bool | None, cluster: ClusterView | None = None) -> ShardGroups:
    """The whole job as the shard group of FULL_SHARD and SHARD_GRAD_OP units: in two hops when it
    spans nodes (see [Note: the whole job in two hops]), else :meth:`ShardGroups.over_world`.
    Collective over the default group the first time a process asks with ``two_hop`` not ``False``."""
    if two_hop is False:
        return ShardGroups.over_world()
    default_pg = dist.distributed_c10d._get_default_group()
    if default_pg not in _KEPT:
        _KEPT[default_pg] = _build(cluster)
    return _KEPT[default_pg] or ShardGroups.over_world()


def _skip_reason() -> str | None:
    world = dist.get_world_size()
    if world == 1:
        return "one rank"
    if str(dist.get_backend()).lower() == "fake":
        return "torch's fake backend"
    if os.environ.get("LOCAL_WORLD_SIZE", "").strip() == str(world):
        return "every rank under one launcher agent (LOCAL_WORLD_SIZE == WORLD_SIZE)"
    return None


def _node_identities(cluster: ClusterView | None) -> tuple[list[str], dict[str, tuple[str, ...]]]:
    """Every rank's node (index = global rank) and the nodes' network paths, from ``cluster`` or
    one all-gather of this rank's node identity."""
    if cluster is not None and cluster.world_size == dist.get_world_size():
        return ([cluster.node_of(r).name for r in range(cluster.world_size)],
                {n.name: n.network_path for n in cluster.nodes})
    from hybridshard.topology.probe import node_name  # psutil and NVML only when discovering

    names: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names, node_name())
    return [str(n) for n in names], {}


def _build(cluster: ClusterView | None) -> ShardGroups | None:
    why = _skip_reason()
    if why is None:
        plan, why = plan_world(*_node_identities(cluster))
    if why:
        logger.debug("FULL_SHARD and SHARD_GRAD_OP gather over the world flat: %s", why)
        return None
    members = plan.shard_groups[0]
    if list(members) == list(range(plan.world_size)):
        shard = dist.group.WORLD
    else:
        shard = _create([members], "world", None)
    name_group(shard, "world")
    hops = _build_shard_hops(plan, None, names=HOP_NAMES)
    groups = ShardGroups(shard=shard, replicate=None, plan=plan, cluster=cluster, shard_hops=hops)
    if hops is None or hops.replicate_rank != groups.shard_rank:
        raise RuntimeError(f"rank {dist.get_rank()}: two-hop place {getattr(hops, 'replicate_rank', None)} != shard "
                           f"rank {groups.shard_rank}; the world's shard group was not created in member order")
    if dist.get_rank() == 0:
        logger.info("FULL_SHARD and SHARD_GRAD_OP gather in two hops: %d nodes x %d ranks",
                    plan.shard_nodes, plan.ranks_per_node)
    return groups
