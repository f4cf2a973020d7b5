"""What every state module needs from a sharded model: its units, whether they are idle, one unit
gathered at a time, and the range of each parameter this rank holds.

The state modules (full state dicts, optimizer state, checkpoints, replica checks) read the runtime
only through these functions, so the runtime's own attributes stay its own.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.engine import get_engine, is_sharded
from hybridshard.runtime.setup.state_guard import module_state_dict
from hybridshard.runtime.units.unit import ShardedState, Unit
from hybridshard.state.pieces import replica_part

logger = logging.getLogger(__name__)

__all__ = [
    "ParamRange", "check_idle", "gather_slices", "gather_unit", "holds_rank0", "is_sharded", "master_shard",
    "module_state_dict",
    "owned_to_shard", "param_ranges", "units",
]


def units(model: nn.Module) -> Sequence[Unit]:
    """The sharded model's units, root first."""
    return get_engine(model).units


def check_idle(model: nn.Module, what: str) -> None:
    """``RuntimeError`` unless every unit is sharded (between steps): ``what`` reads the master shards.

    Waits for the all-gathers across replicas the last optimizer step started, so the master shards
    are current (see :mod:`hybridshard.runtime.optim.replica_slices`)."""
    slices = get_engine(model).replica_slices
    if slices is not None:
        slices.wait_all()
    for unit in units(model):
        if unit.sharded_state is not ShardedState.SHARDED:
            raise RuntimeError(
                f"{what} needs every unit sharded, but unit {unit.name!r} is gathered (between forward and "
                "backward?); call it between training steps"
            )


def holds_rank0(unit: Unit) -> bool:
    """True when this rank's shard group of ``unit`` contains global rank 0 (which then has every element)."""
    group = unit.groups.shard
    return dist.get_rank() == 0 if group is None else 0 in dist.get_process_group_ranks(group)


def owned_to_shard(unit: Unit, owned: torch.Tensor) -> torch.Tensor:
    """A tensor laid out like ``unit``'s owned range (optimizer state) widened to the whole shard: the
    replicas' slices all-gathered across the replicate group when the optimizer is sharded across
    replicas (collective over that group), else ``owned`` itself."""
    if unit.replica_slice is None:
        return owned
    shard = torch.empty(unit.flat.layout.shard_numel, dtype=owned.dtype, device=owned.device)
    C.all_gather(shard, owned, unit.groups.replicate)
    return shard


def master_shard(unit: Unit) -> torch.Tensor:
    """``unit``'s master shard in the master dtype: ``flat.sharded``, or, when the master is kept only
    for this replica's slice (mixed precision with the optimizer sharded across replicas), the
    replicas' slices all-gathered across the replicate group (collective over that group then)."""
    flat = unit.flat
    return owned_to_shard(unit, flat.owned) if flat.separate_master else flat.sharded


def gather_slices(model: nn.Module) -> None:
    """After writing the owned ranges of the master shards (a load): all-gather them across replicas
    when the optimizer is sharded across them; no-op otherwise. Collective."""
    slices = get_engine(model).replica_slices
    if slices is not None:
        slices.gather_all()


def gather_unit(unit: Unit, shard: torch.Tensor) -> torch.Tensor:
    """A shard-sized tensor of ``unit`` (its master, or optimizer state laid out like it) gathered to
    the unit's full padded length over its shard group. Collective over that group.

    With a shard group of one rank the shard is the whole unit and is returned as it is (no copy).
    """
    layout = unit.flat.layout
    if layout.shard_size == 1:
        return shard
    shard = shard.to(unit.flat.device)  # an offloaded master is gathered on the compute device
    gathered = torch.empty(layout.padded_numel, dtype=shard.dtype, device=shard.device)
    C.all_gather(gathered, shard, unit.groups.shard)
    return gathered


class ParamRange(tuple):
    """``(full shape, first element of the range in the flattened parameter, numel, offset of the range
    in this rank's local tensor)`` of one parameter."""

    __slots__ = ()

    def __new__(cls, shape: tuple[int, ...], start: int, numel: int, at: int) -> "ParamRange":
        return super().__new__(cls, (shape, start, numel, at))


def param_ranges(model: nn.Module, *, replica_split: bool = False) -> dict[str, ParamRange]:
    """``name -> ParamRange`` for every distinct parameter (tied ones under their first name).

    For a plain model every range is the whole parameter. For a sharded one it is this rank's part
    of the parameter (see [Note: flat layout]); with ``replica_split`` only this replica's share of
    that part (see [Note: replicas split the writing] in :mod:`hybridshard.state.pieces`). With the
    optimizer sharded across replicas it is always that share: the slice the parameter views (see
    :mod:`hybridshard.runtime.optim.replica_slices`).
    """
    if not is_sharded(model):
        return {n: ParamRange(tuple(p.shape), 0, p.numel(), 0) for n, p in model.named_parameters()}

    out = {}
    for unit in units(model):
        layout, groups = unit.flat.layout, unit.groups
        start, end = layout.shard_range()
        if unit.replica_slice is not None:
            lo, hi = unit.flat.owned_range
            start, end = start + lo, start + hi
        elif replica_split:
            start, end = replica_part(start, end, groups.replicate_rank, groups.replicate_size)
        for slot, whole, part in zip(layout.slots, unit.flat.local, layout.slices_in(start, end)):
            at = part.param_start - whole.param_start if part.numel else 0
            out[slot.name] = ParamRange(slot.shape, part.param_start, part.numel, at)
    return out


def local_params(model: nn.Module) -> dict[str, Any]:
    """``name -> parameter`` for every distinct parameter (the objects the optimizer steps)."""
    if not is_sharded(model):
        return dict(model.named_parameters())
    return {slot.name: p for unit in units(model) for slot, p in zip(unit.flat.layout.slots, unit.flat.params)}
