"""Shard groups of ``k`` whole nodes: tiling, racks and member order (pure; no process group).

[Note: shard groups over nodes]
``plan_groups(cluster, shard_size=S)`` with ``S`` above the node size (``domain="node"``) cuts the
job into shard groups of ``k = S / g`` whole nodes of ``g`` ranks each. The nodes are taken in
network order (see [Note: network order] in :mod:`hybridshard.topology.planner`): ``k`` consecutive
nodes of one rack form a group, so a shard group's traffic never crosses the spine; without network
paths every node is in one rack and the groups follow node order. Members are node-major: local
position ``p`` of node ``j`` of the group is shard rank ``j * g + p``. Replicate group ``p`` is
still member ``p`` of every shard group, so it pairs the same local position on every node.

The plan is refused when nodes differ in size (a node-major group needs ``g`` fixed), when ``S`` is
not a multiple of ``g``, when ``k`` does not divide the job's node count, or when ``k`` does not
divide some rack's node count (a group would straddle two racks). Each error names the counts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from hybridshard.topology.planner import Domain

logger = logging.getLogger(__name__)

__all__ = ["NodeTiling", "tile_nodes"]


@dataclass(frozen=True)
class NodeTiling:
    """Shard groups of ``nodes_per_group`` whole nodes, in plan order."""

    nodes_per_group: int
    """``k``: nodes each shard group spans."""
    ranks_per_node: int
    """``g``: ranks on every node."""
    groups: tuple[tuple[int, ...], ...]
    """Members of each shard group, node-major: node ``j``'s local position ``p`` at ``j * g + p``."""
    labels: tuple[str, ...]
    """Each group's nodes joined by ``+`` (``"node0+node1"``)."""
    hosts: tuple[tuple[str, ...], ...]
    """Each group's nodes, in member order."""
    racks: tuple[str, ...]
    """Each group's rack (``"pod0/rack1"``; ``""`` when unknown)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shown(items: Sequence[str], limit: int = 6) -> str:
    return ", ".join(items[:limit]) + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def tile_nodes(domains: Sequence["Domain"], shard_size: int, rack_of: dict[str, str]) -> NodeTiling:
    """Cut node ``domains`` (in network order) into shard groups of ``shard_size`` ranks over whole
    nodes; ``rack_of`` maps a node name to its rack. See [Note: shard groups over nodes]."""
    sizes = sorted({len(d.ranks) for d in domains})
    if len(sizes) > 1:
        counts = _shown([f"{d.key}: {len(d.ranks)}" for d in domains])
        raise ValueError(
            f"shard_size={shard_size} spans nodes and expects nodes of one size, found ranks per node {counts}; "
            f"run the same number of ranks on every node, or pass a shard_size that divides {min(sizes)}"
        )
    g, n = sizes[0], len(domains)
    if shard_size % g:
        lower, upper = shard_size // g * g, -(-shard_size // g) * g
        fits = [s for s in (lower, upper) if s > 0]
        counts = _shown([f"{d.key}: {g}" for d in domains], limit=4)
        raise ValueError(
            f"shard_size={shard_size} does not tile the nodes: a shard group over nodes expects a multiple of the "
            f"{g} ranks per node, found {shard_size / g:.3g} nodes per group (ranks per node: {counts}); "
            f"pass shard_size={' or '.join(map(str, fits))}"
        )
    k = shard_size // g
    if n % k:
        choices = [d * g for d in _divisors(n) if d > 1]
        raise ValueError(
            f"shard_size={shard_size} ({k} nodes of {g} ranks per shard group) expects a node count divisible by {k}, "
            f"found {n} nodes ({n // k} groups and {n % k} nodes left over); pass shard_size in {choices} "
            f"or a divisor of {g}"
        )
    racks: dict[str, list["Domain"]] = {}
    for d in domains:  # consecutive in network order: one rack after another
        racks.setdefault(rack_of.get(d.hosts[0], ""), []).append(d)
    bad = [f"{name or '(no path)'}: {len(nodes)} nodes" for name, nodes in racks.items() if len(nodes) % k]
    if bad:
        common = _divisors(min(len(v) for v in racks.values()))
        fitting = [d * g for d in common if d > 1 and all(len(v) % d == 0 for v in racks.values())]
        fix = f"pass shard_size in {fitting} or a divisor of {g}" if fitting else f"pass a shard_size that divides {g}"
        raise ValueError(
            f"shard_size={shard_size} expects {k} whole nodes of one rack per shard group, found racks whose node "
            f"count {k} does not divide ({_shown(bad)}); {fix}, or fix the nodes' network paths"
        )
    groups, labels, hosts, group_racks = [], [], [], []
    for rack, nodes in racks.items():
        for i in range(0, len(nodes), k):
            members = nodes[i:i + k]
            groups.append(tuple(r for d in members for r in d.ranks))  # node-major
            labels.append("+".join(d.key for d in members))
            hosts.append(tuple(d.hosts[0] for d in members))
            group_racks.append(rack)
    logger.debug("%d shard groups of %d nodes x %d ranks in %d racks", len(groups), k, g, len(racks))
    return NodeTiling(k, g, tuple(groups), tuple(labels), tuple(hosts), tuple(group_racks))
