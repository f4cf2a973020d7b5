"""Full (unsharded) state dicts of a sharded model, with the same keys as the unsharded model."""

from __future__ import annotations

import logging
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard.runtime.trace.position import api_call
from hybridshard.state.access import check_idle, gather_unit, holds_rank0, master_shard, module_state_dict, units

logger = logging.getLogger(__name__)

__all__ = ["full_state_dict", "load_full_state_dict"]


def _copy(value: torch.Tensor, to_cpu: bool) -> torch.Tensor:
    return value.to("cpu", copy=True) if to_cpu else value.clone()


@api_call
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
    check_idle(model, "full_state_dict")
    keys = param_keys(model)
    keep = not rank0_only or dist.get_rank() == 0
    full: dict[tuple[int, int], torch.Tensor] = {}  # (unit index, slot index) -> full value
    for u, unit in enumerate(units(model)):
        flat, layout = unit.flat, unit.flat.layout
        flat.writeback_params()
        if rank0_only and not holds_rank0(unit) and not flat.separate_master:
            continue
        master = master_shard(unit)  # every replica takes part when it gathers the slices
        if rank0_only and not holds_rank0(unit):
            continue
        gathered = gather_unit(unit, master)
        if keep:
            for i, slot in enumerate(layout.slots):
                full[(u, i)] = _copy(gathered[slot.offset : slot.end].view(slot.shape), to_cpu)
        # Freed before the next unit is gathered: no view of it may outlive this line (a loop variable
        # holding the last slot kept it alive through the next gather, two units at once).
        del gathered
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    for key, value in module_state_dict(model).items():
        if key in keys:
            out[key] = full[keys[key]]
        else:
            out[key] = value.detach().cpu().clone() if to_cpu else value.detach().clone()
    return out


def param_keys(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``state_dict`` key -> ``(unit index, slot index)`` for every sharded parameter.

    Found by identity (the module's state dict holds the original parameter objects between
    steps), so keys renamed by state-dict hooks (``checkpoint_wrapper`` drops its prefix) and tied
    parameters (one slot under two keys) come out right.
    """
    where = {id(p): (u, i) for u, unit in enumerate(units(model)) for i, p in enumerate(unit.flat.params)}
    return {k: where[id(v)] for k, v in module_state_dict(model, keep_vars=True).items() if id(v) in where}


@api_call
def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Load a full state dict (as :func:`full_state_dict` returns) into a sharded model.

    Each rank copies only its own shard; no communication. Raises ``ValueError`` on missing or
    unexpected keys and on shape mismatches, before changing anything. The loaded values win over
    any ``.data`` replaced since the last step: every parameter points at its master shard again.
    """
    check_idle(model, "load_full_state_dict")
    sharded_units = units(model)
    expected = set(module_state_dict(model).keys())
    missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
    if missing or unexpected:
        raise ValueError(
            f"state dict does not match the model: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}; load a state dict saved "
            "from the same model (hybridshard.full_state_dict)"
        )
    keys = param_keys(model)
    others = {k: v for k, v in module_state_dict(model, keep_vars=True).items() if k not in keys}
    shapes = {k: sharded_units[u].flat.layout.slots[i].shape for k, (u, i) in keys.items()}
    shapes.update((k, tuple(v.shape)) for k, v in others.items())
    for key, shape in shapes.items():
        if tuple(state_dict[key].shape) != tuple(shape):
            raise ValueError(
                f"state dict entry {key!r} has shape {list(state_dict[key].shape)}, the model expects "
                f"{list(shape)}; nothing was loaded. Load a state dict saved from the same model"
            )
    # The whole chunk of each unit: with the optimizer sharded across replicas the parameters view
    # only a slice of it, but every replica computes with all of it.
    chunks = [unit.flat.layout.local_slices() for unit in sharded_units]
    with torch.no_grad():
        for key, (u, i) in keys.items():
            flat = sharded_units[u].flat
            part = chunks[u][i]
            if part.numel:
                source = state_dict[key].reshape(-1)[part.param_start : part.param_start + part.numel]
                flat.sharded[part.shard_offset : part.shard_offset + part.numel].copy_(source)
            owned = flat.local[i]
            if flat.separate_master and owned.numel:  # the master slice, in its own dtype
                source = state_dict[key].reshape(-1)[owned.param_start : owned.param_start + owned.numel]
                flat.shard_view(i).copy_(source)
        for unit in sharded_units:
            unit.flat.use_sharded_params()
        for key, value in others.items():
            value.copy_(state_dict[key])
