"""Full (unsharded) state dicts of a sharded model, with the same keys as the unsharded model."""

from __future__ import annotations

import logging
from typing import Mapping

import torch
import torch.nn as nn

import torch.distributed as dist

from hybridshard import collectives as C
from hybridshard.runtime import _ATTR, get_runtime
from hybridshard.unit import ShardedState

logger = logging.getLogger(__name__)

__all__ = ["full_state_dict", "load_full_state_dict"]


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` went through :func:`hybridshard.shard`."""
    return getattr(model, _ATTR, None) is not None


def _holds_rank0(unit) -> bool:
    """True when this rank's shard group of ``unit`` contains global rank 0 (which then has every element)."""
    group = unit.groups.shard
    return dist.get_rank() == 0 if group is None else 0 in dist.get_process_group_ranks(group)


def _check_idle(model: nn.Module, what: str) -> None:
    for unit in get_runtime(model).units:
        if unit.sharded_state is not ShardedState.SHARDED:
            raise RuntimeError(
                f"{what} needs every unit sharded, but unit {unit.name!r} is gathered (between forward and "
                "backward?); call it between training steps"
            )


def full_state_dict(model: nn.Module, *, to_cpu: bool = True, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter gathered to full shape (master dtype) and every buffer.

    Collective over each unit's shard group: all ranks must call it. Keys equal the unsharded
    model's ``state_dict()`` keys, tied parameters included under each of their names. A parameter
    whose ``.data`` was replaced since the last step is written back first, so the result shows it.

    Units are gathered one at a time and each gathered buffer is freed before the next gather, so
    device memory peaks at one unit above the shard; ``to_cpu`` (the default) moves each parameter
    to the CPU as soon as it is gathered. With ``rank0_only`` only rank 0 keeps (and returns) the
    state, the other ranks return ``{}``, and shard groups that do not contain rank 0 gather nothing.
    """
    _check_idle(model, "full_state_dict")
    runtime = get_runtime(model)
    keep = not rank0_only or dist.get_rank() == 0
    full_params: dict[str, torch.Tensor] = {}
    for unit in runtime.units:
        flat, layout = unit.flat, unit.flat.layout
        flat.writeback_params()
        if rank0_only and not _holds_rank0(unit):
            continue
        if layout.shard_size > 1:
            gathered = torch.empty(layout.padded_numel, dtype=flat.sharded.dtype, device=flat.sharded.device)
            C.all_gather(gathered, flat.sharded, unit.groups.shard)
        else:
            gathered = flat.sharded
        if keep:
            for slot in layout.slots:
                value = gathered[slot.offset : slot.end].view(slot.shape)
                full_params[slot.name] = value.to("cpu", copy=True) if to_cpu else value.clone()
            for alias, primary in layout.aliases:
                full_params[alias] = full_params[primary]
        del gathered  # freed before the next unit is gathered
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key in full_params:
            out[key] = full_params[key]
        else:
            out[key] = value.detach().cpu().clone() if to_cpu else value.detach().clone()
    return out


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a full state dict (as :func:`full_state_dict` returns) into a sharded model.

    Each rank copies only its own shard; no communication. Raises ``ValueError`` on missing or
    unexpected keys and on shape mismatches, before changing anything. The loaded values win over
    any ``.data`` replaced since the last step: every parameter points at its master shard again.
    """
    _check_idle(model, "load_full_state_dict")
    runtime = get_runtime(model)
    expected = set(model.state_dict().keys())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the model: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}; load a state dict saved "
            "from the same model (hybridshard.full_state_dict)"
        )
    for unit in runtime.units:
        for slot in unit.flat.layout.slots:
            if tuple(state_dict[slot.name].shape) != slot.shape:
                raise ValueError(
                    f"state dict entry {slot.name!r} has shape {list(state_dict[slot.name].shape)}, the model "
                    f"expects {list(slot.shape)}"
                )
    with torch.no_grad():
        for unit in runtime.units:
            flat = unit.flat
            for i, (slot, part) in enumerate(zip(flat.layout.slots, flat.local)):
                if part.numel:
                    source = state_dict[slot.name].reshape(-1)[part.param_start : part.param_start + part.numel]
                    flat.shard_view(i).copy_(source)
            flat.use_sharded_params()
        params = {slot.name for unit in runtime.units for slot in unit.flat.layout.slots}
        aliases = {a for unit in runtime.units for a, _ in unit.flat.layout.aliases}
        for key, value in model.state_dict(keep_vars=True).items():
            if key not in params and key not in aliases:
                value.copy_(state_dict[key])
