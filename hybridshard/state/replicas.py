"""Guard against silent replica drift: compare a checksum of every shard across its replicate group.

[Note: replica checksums]
Replicas of a shard must stay bit-identical: they start equal and apply the same all-reduced
gradient with the same optimizer. A rank that drifts (a bad memory bit, a non-deterministic kernel
on one node, a bug that skipped a step) would otherwise go unnoticed until its checkpoint shard is
the one that gets saved. Each rank reduces its master shard's *bits* (not its values: NaNs and
-0.0 count) to two int64 sums, a plain one and a position-weighted one (which also catches swapped
elements); one all-gather per distinct replicate group compares them. A unit whose replicate group
is one rank (FULL_SHARD, SHARD_GRAD_OP) has nothing to compare. On a mismatch every rank raises,
not only the ranks of the bad group: a one-number all-reduce over the job tells them all, and
then (only then) the findings are gathered so every rank's message names the same ranks.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.trace.position import api_call
from hybridshard.state.access import check_idle, units
from hybridshard.topology.groups import group_name

logger = logging.getLogger(__name__)

__all__ = ["ReplicaDivergence", "check_replicas", "maybe_check_replicas"]


class ReplicaDivergence(RuntimeError):
    """Replicas of a shard hold different values."""


def shard_checksum(shard: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the shard's bits: plain and position-weighted. See [Note: replica checksums]."""
    raw = shard.detach().contiguous().view(-1)
    if raw.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=shard.device)
    nbytes = raw.numel() * raw.element_size()
    word = torch.int32 if nbytes % 4 == 0 else torch.int16 if nbytes % 2 == 0 else torch.uint8
    bits = raw.view(torch.uint8).view(word).to(torch.int64)
    weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) % 1021 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


@api_call
def check_replicas(model: nn.Module) -> None:
    """Raise :class:`ReplicaDivergence` (a ``RuntimeError``) naming the ranks whose shards differ from their replicas.

    Collective: every rank calls it between steps. Costs one pass over the shard and one small
    all-gather per distinct replicate group, plus one one-number all-reduce.
    """
    check_idle(model, "check_replicas")
    sharded_units = units(model)
    by_group: dict[int, list] = {}
    for unit in sharded_units:
        if unit.groups.replicate is not None and unit.groups.replicate_size > 1:
            by_group.setdefault(id(unit.groups.replicate), []).append(unit)
    findings: list[str] = []
    for members in by_group.values():
        group = members[0].groups.replicate
        for unit in members:
            unit.flat.writeback_params()
        mine = torch.cat([shard_checksum(u.flat.sharded).to(u.flat.device) for u in members])
        everyone = torch.empty(dist.get_world_size(group) * mine.numel(), dtype=mine.dtype, device=mine.device)
        C.all_gather(everyone, mine, group)
        everyone = everyone.view(dist.get_world_size(group), len(members), 2)
        ranks = dist.get_process_group_ranks(group)
        for i, unit in enumerate(members):
            sums = [tuple(row) for row in everyone[:, i].tolist()]
            majority = max(set(sums), key=sums.count)
            if len(set(sums)) == 1:
                continue
            where = f"(unit {unit.name!r}, replicate group {group_name(group)!r} of ranks {ranks})"
            if 2 * sums.count(majority) > len(sums):
                bad = [r for r, s in zip(ranks, sums) if s != majority]
                findings.append(f"ranks {bad} differ from the other replicas {where}")
            else:  # no majority (two replicas, say): which one is wrong cannot be told
                findings.append(f"ranks {ranks} disagree with no majority {where}")
    flag = torch.tensor([1.0 if findings else 0.0], device=_device(sharded_units))
    C.all_reduce(flag, dist.group.WORLD)
    if flag.item() == 0:
        return
    # Slow path, every rank alike: collect every group's findings so each rank names the same ranks.
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, findings)
    findings = list(dict.fromkeys(f for part in everyone for f in part))
    raise ReplicaDivergence(
        "replicas diverged: " + "; ".join(findings)
        + ". The run is no longer data parallel: restart from the last checkpoint saved before the divergence "
        "(and check the named ranks' hardware)"
    )


def _device(units) -> torch.device:
    return units[0].flat.device if units else torch.device("cpu")


def maybe_check_replicas(model: nn.Module, *, step: int, every: int) -> bool:
    """:func:`check_replicas` on steps divisible by ``every`` (``every <= 0``: never). True when it ran."""
    if every <= 0 or step % every:
        return False
    check_replicas(model)
    logger.info("step %d: replicas agree", step)
    return True
