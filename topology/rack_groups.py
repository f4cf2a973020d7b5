"""This rank's groups for a replicate reduction in two hops: inside its rack, then across racks.

[Note: two hops across racks]
A replicate group of ``R = P * r`` members in ``P`` racks (``r`` members in each, one per shard
group of the rack) can all-reduce ``M`` bytes in two hops: reduce-scatter inside each rack (the
*rack* group, ``r`` members), all-reduce each ``M / r`` chunk across racks among the members at the
same position in their rack (the *across-racks* group, ``P`` members), then all-gather inside the
rack. Each rack's uplink then carries ``2 (P - 1) / P * M`` instead of a flat ring's
``2 (R - 1) / R * M``, at the price of two phases on the racks' own links.

The groups come from the plan's rows (shard groups) and their racks (:attr:`GroupPlan.row_racks`):
for replicate group ``s`` (column ``s`` of the plan's grid), rack ``k``'s rows ``rows[k]`` give the
rack group ``[grid[row][s] for row in rows[k]]``, and position ``p`` gives the across-racks group
``[grid[rows[k][p]][s] for k in range(P)]``. Every rack must hold the same number of rows; otherwise
the plan has no two-hop form and :func:`plan_rack_groups` says why. Group ranks follow these lists
(``sort_ranks=False``): this rank is member ``p`` of its rack group and member ``k`` of its
across-racks group, and its replicate rank is ``k * r + p`` (the replicate group is in network
order; see [Note: network order] in :mod:`hybridshard.topology.planner`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hybridshard.topology.planner import GroupPlan

logger = logging.getLogger(__name__)

__all__ = ["RackGroups", "RackPlan", "plan_rack_groups"]


@dataclass(frozen=True)
class RackPlan:
    """Every rack group and across-racks group of a plan (pure; the same on every rank)."""

    racks: int
    """``P``: racks the replicate groups span."""
    per_rack: int
    """``r``: members of each replicate group in each rack."""
    rack_groups: tuple[tuple[int, ...], ...]
    """For each replicate group ``s`` and rack ``k`` (index ``s * P + k``), its members in that rack."""
    across_groups: tuple[tuple[int, ...], ...]
    """For each replicate group ``s`` and position ``p`` (index ``s * r + p``), one member per rack."""
    rack_names: tuple[str, ...]


def plan_rack_groups(plan: GroupPlan) -> tuple[RackPlan | None, str]:
    """The two-hop groups of ``plan``, or ``None`` and the reason there are none."""
    rows = plan.rack_rows()
    if len(rows) < 2:
        return None, "the replicate groups lie in one rack (or no network paths are known)"
    sizes = {len(r) for r in rows}
    if len(sizes) != 1:
        names = dict.fromkeys(plan.row_racks)
        shape = ", ".join(f"{name or '?'}: {len(r)}" for name, r in zip(names, rows))
        return None, f"racks hold different numbers of shard groups ({shape})"
    per_rack = sizes.pop()
    if per_rack < 2:
        return None, "one shard group per rack: the flat ring already crosses each rack boundary once"
    grid = plan.shard_groups
    rack_groups, across = [], []
    for s in range(plan.shard_size):
        rack_groups += [tuple(grid[row][s] for row in rack) for rack in rows]
        across += [tuple(grid[rack[p]][s] for rack in rows) for p in range(per_rack)]
    names = tuple(plan.row_racks[rack[0]] for rack in rows)
    return RackPlan(len(rows), per_rack, tuple(rack_groups), tuple(across), names), ""


@dataclass(frozen=True, eq=False)
class RackGroups:
    """This rank's two hops; see [Note: two hops across racks]."""

    rack: Any
    """The process group of this rank's replicate-group members in its rack (``per_rack`` ranks)."""
    across: Any
    """The process group of the members at this rank's position in every rack (``racks`` ranks)."""
    racks: int
    per_rack: int
    rack_index: int
    """``k``: this rank's rack, in plan order."""
    position: int
    """``p``: this rank's place in its rack group."""
    rack_name: str = ""

    @property
    def replicate_rank(self) -> int:
        """This rank's place in its (network-ordered) replicate group: ``k * r + p``."""
        return self.rack_index * self.per_rack + self.position

    @classmethod
    def find(cls, rack_plan: RackPlan, rank: int, rack: Any, across: Any) -> "RackGroups":
        """This rank's place in ``rack_plan``, with its two created groups."""
        for i, members in enumerate(rack_plan.rack_groups):
            if rank in members:
                k = i % rack_plan.racks
                return cls(rack, across, rack_plan.racks, rack_plan.per_rack, k, members.index(rank),
                           rack_plan.rack_names[k])
        raise ValueError(f"rank {rank} is in no rack group of the plan; plan from a view gathered in this job")
