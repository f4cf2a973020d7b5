"""This rank's groups for a shard group's collectives in two hops: inside its node, then across nodes.

[Note: two hops over nodes]
A shard group of ``k`` nodes with ``g`` ranks on each (see [Note: shard groups over nodes] in
:mod:`hybridshard.topology.multinode`) has shard rank ``j * g + p`` at local position ``p`` of its
node ``j``. Its all-gather runs across nodes among the ``k`` members at the same position, then
inside each node; its reduce-scatter the other way. Each node then sends ``M (k - 1) / k`` of a unit
of ``M`` bytes instead of a flat ring's ``M (S - 1) / S``. The groups of shard group ``q``:

- the *node* group of node ``j``: ``group[j * g : (j + 1) * g]``, position order (index ``q * k + j``);
- the *across-nodes* group of position ``p``: ``group[p::g]``, node order (index ``q * g + p``).

They take the shapes of the replicate reduction's rack groups (:mod:`hybridshard.topology.rack_groups`):
node = rack, ``k`` = racks, ``g`` = per rack, so this rank's pair is a :class:`RackGroups` whose
``replicate_rank`` (``j * g + p``) is its shard rank, and the two-hop collectives apply unchanged.
Group ranks follow these lists (``sort_ranks=False`` where they are not ascending).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridshard.topology.planner import GroupPlan
from hybridshard.topology.rack_groups import RackGroups

__all__ = ["ShardHopPlan", "plan_shard_hops"]


@dataclass(frozen=True)
class ShardHopPlan:
    """Every node group and across-nodes group of a plan's shard groups (pure; the same on every rank)."""

    nodes: int
    """``k``: nodes each shard group spans."""
    per_node: int
    """``g``: members of a shard group on each node."""
    node_groups: tuple[tuple[int, ...], ...]
    """For shard group ``q`` and node ``j`` (index ``q * k + j``): its ``g`` members, in position order."""
    across_groups: tuple[tuple[int, ...], ...]
    """For shard group ``q`` and position ``p`` (index ``q * g + p``): its ``k`` members, in node order."""
    node_names: tuple[str, ...]
    """The node of each node group (index ``q * k + j``)."""

    def place(self, rank: int) -> tuple[int, int, int]:
        """``(q, j, p)``: this rank's shard group, node in it and position on the node."""
        for i, members in enumerate(self.node_groups):
            if rank in members:
                q, j = divmod(i, self.nodes)
                return q, j, members.index(rank)
        raise ValueError(f"expected rank {rank} in a shard group of the plan, found it in none; "
                         "plan from a cluster view gathered in this job")

    def groups_of(self, rank: int, node: Any, across: Any) -> RackGroups:
        """This rank's two hops as a :class:`RackGroups`, with its two created groups."""
        q, j, p = self.place(rank)
        return RackGroups(rack=node, across=across, racks=self.nodes, per_rack=self.per_node, rack_index=j,
                          position=p, rack_name=self.node_names[q * self.nodes + j])


def plan_shard_hops(plan: GroupPlan) -> tuple[ShardHopPlan | None, str]:
    """The two-hop groups of ``plan``'s shard groups, or ``None`` and the reason there are none."""
    k, g = plan.shard_nodes, plan.ranks_per_node
    if k < 2:
        return None, "every shard group lies inside one node (or one fast domain)"
    if g < 2:
        return None, "one rank per node: the flat ring already crosses each node boundary once"
    node_groups, across, names = [], [], []
    for q, group in enumerate(plan.shard_groups):
        hosts = plan.shard_group_hosts[q] if plan.shard_group_hosts else tuple(f"node{q * k + j}" for j in range(k))
        node_groups += [tuple(group[j * g:(j + 1) * g]) for j in range(k)]
        across += [tuple(group[p::g]) for p in range(g)]
        names += list(hosts)
    return ShardHopPlan(k, g, tuple(node_groups), tuple(across), tuple(names)), ""
