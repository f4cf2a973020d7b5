"""Full (unsharded) state dicts of a sharded model, with the same keys as the unsharded model."""

from __future__ import annotations

import logging
from typing import Mapping

import torch
import torch.nn as nn

from hybridshard import collectives as C
from hybridshard.runtime import get_runtime
from hybridshard.unit import ShardedState

logger = logging.getLogger(__name__)

__all__ = ["full_state_dict", "load_full_state_dict"]


def _check_idle(model: nn.Module, what: str) -> None:
    for unit in get_runtime(model).units:
        if unit.sharded_state is not ShardedState.SHARDED:
            raise RuntimeError(
                f"{what} needs every unit sharded, but unit {unit.name!r} is gathered (between forward and "
                "backward?); call it between training steps"
            )


def full_state_dict(model: nn.Module, *, to_cpu: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter gathered to full shape (master dtype) and every buffer, on every rank.

    Collective over each unit's shard group: all ranks must call it. Keys equal the unsharded
    model's ``state_dict()`` keys, tied parameters included under each of their names. A parameter
    whose ``.data`` was replaced since the last step is written back first, so the result shows it.
    """
    _check_idle(model, "full_state_dict")
    runtime = get_runtime(model)
    full_params: dict[str, torch.Tensor] = {}
    for unit in runtime.units:
        flat, layout = unit.flat, unit.flat.layout
        flat.writeback_params()
        if layout.shard_size > 1:
            gathered = torch.empty(layout.padded_numel, dtype=flat.sharded.dtype, device=flat.sharded.device)
            C.all_gather(gathered, flat.sharded, unit.groups.shard)
        else:
            gathered = flat.sharded
        for slot in layout.slots:
            value = gathered[slot.offset : slot.end].view(slot.shape).clone()
            full_params[slot.name] = value.cpu() if to_cpu else value
        for alias, primary in layout.aliases:
            full_params[alias] = full_params[primary]
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
