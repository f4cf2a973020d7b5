"""Building one unit: its flat layout and storage from the module's parameters, and the start-up
broadcast that gives every rank rank 0's values (``sync_module_states``)."""

from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.distributed as dist

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.engine import Engine
from hybridshard.runtime.optim.replica_slices import ReplicaSlice, owned_range
from hybridshard.runtime.units.flat_param import FlatParam
from hybridshard.runtime.units.layout import FlatLayout
from hybridshard.runtime.units.strategy import MixedPrecision, ShardingStrategy
from hybridshard.runtime.units.unit import Unit
from hybridshard.runtime.units.wrap import UnitSpec
from hybridshard.topology.groups import ShardGroups, collective_device

logger = logging.getLogger(__name__)

__all__ = ["broadcast_from_rank0", "build_unit", "distinct", "rank0_initial_seed", "rank0_shard_index"]

_ALIGN_BYTES = 16


def distinct(candidates: Iterable[ShardGroups]) -> list[ShardGroups]:
    """The distinct group candidates in first-use order (the same order on every rank)."""
    out: list[ShardGroups] = []
    for groups in candidates:
        if all(groups is not seen for seen in out):
            out.append(groups)
    return out


def rank0_shard_index(groups: ShardGroups) -> int:
    """Rank 0's index inside its shard group (one small broadcast over the default group)."""
    index = torch.tensor([groups.shard_rank], dtype=torch.int64, device=collective_device())
    dist.broadcast(index, src=0)
    return int(index.item())


def rank0_initial_seed() -> int:
    """Rank 0's ``torch.initial_seed()`` on every rank (one small broadcast over the default group):
    deferred init's default seed, the same everywhere even when ranks never seeded their generators."""
    seed = torch.tensor([torch.initial_seed() % (1 << 63)], dtype=torch.int64, device=collective_device())
    dist.broadcast(seed, src=0)
    return int(seed.item())


def broadcast_from_rank0(tensor: torch.Tensor, groups: ShardGroups, rank0_index: int) -> None:
    """Rank 0's ``tensor`` everywhere, each element sent once per group dimension.

    First across the replicate group that holds rank 0 (which reaches the member at rank 0's index
    of every shard group), then inside every shard group from that member.
    """
    if groups.replicate is not None and 0 in dist.get_process_group_ranks(groups.replicate):
        C.broadcast(tensor, 0, groups.replicate)
    if groups.shard is not None:
        C.broadcast(tensor, dist.get_process_group_ranks(groups.shard)[rank0_index], groups.shard)


def build_unit(
    spec: UnitSpec,
    strategy: ShardingStrategy,
    groups: ShardGroups,
    mp: MixedPrecision | None,
    device: torch.device,
    rank0_index: int | None,
    engine: Engine,
    *,
    slice_optimizer: bool = False,
) -> Unit:
    """One unit over ``spec``'s parameters; ``slice_optimizer``: the optimizer steps this replica's
    slice of the shard (see :mod:`hybridshard.runtime.optim.replica_slices`)."""
    dtypes = {p.dtype for p in spec.params}
    if len(dtypes) > 1:
        found = {n: str(p.dtype) for n, p in zip(spec.param_names, spec.params)}
        raise ValueError(
            f"unit {spec.name or '<root>'!r} mixes parameter dtypes {found}; a unit's parameters share one flat "
            "buffer, so give them one dtype (model.float()) or wrap the odd ones in their own unit"
        )
    master_dtype = dtypes.pop() if dtypes else torch.float32
    compute_dtype = (mp.param_dtype if mp and mp.param_dtype else None) or master_dtype
    reduce_dtype = (mp.reduce_dtype if mp and mp.reduce_dtype else None) or compute_dtype
    grad_dtype = compute_dtype if mp and mp.keep_low_precision_grads else master_dtype
    itemsize = torch.empty(0, dtype=master_dtype).element_size()
    layout = FlatLayout.build(
        [(n, p.shape) for n, p in zip(spec.param_names, spec.params)],
        shard_size=groups.shard_size,
        shard_rank=groups.shard_rank,
        align_numel=max(1, _ALIGN_BYTES // itemsize),
        aliases=spec.aliases,
        shard_multiple=groups.replicate_size if slice_optimizer else 1,
    )
    start, end = layout.shard_range()
    if rank0_index is not None:  # every element goes through the broadcast: build the whole buffer
        full = torch.zeros(layout.padded_numel, dtype=master_dtype, device=device)
        with torch.no_grad():
            for slot, p in zip(layout.slots, spec.params):
                full[slot.offset : slot.end].copy_(p.detach().reshape(-1))
        broadcast_from_rank0(full, groups, rank0_index)
        sharded = full[start:end].clone()
        del full
    else:  # only this rank's range: building a unit costs its shard, never a second copy of the unit
        sharded = torch.zeros(layout.shard_numel, dtype=master_dtype, device=device)
        with torch.no_grad():
            for p, part in zip(spec.params, layout.local_slices()):
                if part.numel:
                    source = p.detach().reshape(-1)[part.param_start : part.param_start + part.numel]
                    sharded[part.shard_offset : part.shard_offset + part.numel].copy_(source)
    owned = owned_range(layout.shard_numel, groups.replicate_rank, groups.replicate_size) if slice_optimizer else None
    flat = FlatParam(layout, spec.params, sharded, compute_dtype=compute_dtype, grad_dtype=grad_dtype,
                     offload=engine.offload, device=device, owned=owned)
    unit = Unit(
        spec.name,
        spec.module,
        flat,
        spec.bindings,
        strategy=strategy,
        groups=groups,
        reduce_dtype=reduce_dtype,
        engine=engine,
    )
    if slice_optimizer:
        unit.replica_slice = ReplicaSlice(unit)
    return unit
