"""Optimizer state keyed by parameter name: naming, full (gathered) optimizer state dicts, loading.

The optimizer built on a sharded model steps the original parameters, each holding only this
rank's flat part of itself (see [Note: two kinds of views]); its state tensors have the same
shape. This module names them by parameter and moves them between that local form and a form
keyed by name that any topology (or an unsharded model) can read, following
``torch.distributed.checkpoint.state_dict``: ``{"state": {name: {key: value}}, "param_groups":
[{hyperparameters..., "params": [name, ...]}]}``.

[Note: per-element optimizer state]
A state tensor shaped like its parameter (AdamW's ``exp_avg`` / ``exp_avg_sq``, SGD's
``momentum_buffer``) holds one value per element and is sharded like the parameter. Every other
value (AdamW's ``step``, a scalar tensor) describes the whole parameter and is the same on every
rank. A zero-dimensional parameter's ``step`` is per-parameter too, whatever its shape.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard.state.access import (
    check_idle, gather_unit, holds_rank0, is_sharded, local_params, owned_to_shard, param_ranges, units,
)
from hybridshard.runtime.trace.position import api_call

logger = logging.getLogger(__name__)

__all__ = ["full_optim_state_dict", "load_full_optim_state_dict"]

_STEP_KEYS = ("step",)


def param_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for every distinct parameter (its first name when tied)."""
    return {id(p): name for name, p in local_params(model).items()}


def named_groups(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[dict[str, Any], list[str]]]:
    """Each param group's hyperparameters and parameter names; ``ValueError`` for a foreign parameter."""
    names = param_names(model)
    out = []
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k != "params"}
        found = []
        for i, p in enumerate(group["params"]):
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param group {g} holds a parameter (#{i}, shape {list(p.shape)}) that is not one of "
                    f"{type(model).__name__}'s parameters; build the optimizer on model.parameters() after shard()"
                )
            found.append(names[id(p)])
        out.append((hyper, found))
    return out


def is_per_element(key: str, value: Any, shape: Any, full_dim: int) -> bool:
    """Whether ``value`` (state ``key`` of a parameter shaped ``shape`` here, of ``full_dim``
    dimensions in full) holds one value per element; see [Note: per-element optimizer state]."""
    if not torch.is_tensor(value) or tuple(value.shape) != tuple(shape):
        return False
    return full_dim > 0 or key not in _STEP_KEYS


def named_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """The optimizer's per-parameter state keyed by parameter name (local tensors, not copies)."""
    names = param_names(model)
    return {names[id(p)]: dict(s) for p, s in optimizer.state.items() if id(p) in names and s}


def _shard_buffer(unit, tensors: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """A shard-sized buffer holding each slot's local tensor at its place (zeros elsewhere); the
    replicas' slices gathered in when the optimizer is sharded across them (collective then)."""
    buf = torch.zeros(unit.flat.owned_numel, dtype=like.dtype, device=unit.flat.sharded.device)
    for part, t in zip(unit.flat.local, tensors):
        if t is not None and part.numel:
            buf[part.shard_offset : part.shard_offset + part.numel].copy_(t.reshape(-1))
    return owned_to_shard(unit, buf)


@api_call
def full_optim_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, rank0_only: bool = False, to_cpu: bool = True
) -> dict[str, Any]:
    """The optimizer state with every per-element tensor gathered to its parameter's full shape.

    Keyed by parameter name (see the module docstring). Collective over each unit's shard group,
    one unit and one state key at a time, so peak memory is one gathered unit above the shard.
    With ``rank0_only`` only rank 0 returns the state (others return an empty ``state`` and the
    same ``param_groups``), and shard groups without rank 0 skip the gathers.
    """
    check_idle(model, "full_optim_state_dict")
    groups = [{**hyper, "params": names} for hyper, names in named_groups(model, optimizer)]
    local = named_state(model, optimizer)
    keep = not rank0_only or dist.get_rank() == 0
    state: dict[str, dict[str, Any]] = {}
    for unit in units(model):
        layout, flat = unit.flat.layout, unit.flat
        entries = [local.get(slot.name, {}) for slot in layout.slots]
        # Every rank of a shard group has the same keys for a slot (same optimizer, same steps).
        keys = sorted({k for e in entries for k in e})
        for key in keys:
            elementwise = [
                is_per_element(key, e.get(key), p.shape, len(slot.shape)) for e, p, slot in zip(entries, flat.params, layout.slots)
            ]
            for e, slot, per in zip(entries, layout.slots, elementwise):
                if key in e and not per and keep:
                    value = e[key]
                    value = value.detach().clone() if torch.is_tensor(value) else value
                    state.setdefault(slot.name, {})[key] = value.cpu() if to_cpu and torch.is_tensor(value) else value
            skip = rank0_only and not holds_rank0(unit)
            if not any(elementwise) or (skip and unit.replica_slice is None):
                continue
            like = next(e[key] for e, per in zip(entries, elementwise) if per)
            shard = _shard_buffer(unit, [e[key] if per else None for e, per in zip(entries, elementwise)], like)
            if skip:  # it took part in its replicas' gather only
                continue
            gathered = gather_unit(unit, shard)
            if keep:
                for slot, per in zip(layout.slots, elementwise):
                    if per:
                        value = gathered[slot.offset : slot.end].view(slot.shape)
                        value = value.to("cpu", copy=True) if to_cpu else value.clone()
                        state.setdefault(slot.name, {})[key] = value
            del gathered, shard
    return {"state": state if keep else {}, "param_groups": groups}


def check_groups(model: nn.Module, optimizer: torch.optim.Optimizer, saved_groups: list[Mapping[str, Any]]) -> None:
    """``ValueError`` unless ``saved_groups`` name the same parameters, group by group, as ``optimizer``."""
    current = named_groups(model, optimizer)
    if len(saved_groups) != len(current):
        raise ValueError(
            f"the saved optimizer state has {len(saved_groups)} param groups, this optimizer has {len(current)}; "
            "build the optimizer with the same param groups as the run that saved it"
        )
    for g, (saved, (_, names)) in enumerate(zip(saved_groups, current)):
        if set(saved["params"]) != set(names):
            missing = sorted(set(names) - set(saved["params"]))[:5]
            extra = sorted(set(saved["params"]) - set(names))[:5]
            raise ValueError(
                f"optimizer param group {g} differs from the saved one: parameters missing from the saved group "
                f"{missing}, saved parameters this group lacks {extra}; build the optimizer with the same groups"
            )


def apply_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    saved_groups: list[Mapping[str, Any]],
    state: Mapping[str, Mapping[str, Any]],
) -> None:
    """Load name-keyed *local* state (already cut to each parameter's local shape) into ``optimizer``.

    Goes through ``optimizer.load_state_dict``, so dtype/device casts and the optimizer's own
    hooks apply. Hyperparameters come from ``saved_groups``.
    """
    current = named_groups(model, optimizer)
    index, osd_state, osd_groups = 0, {}, []
    for saved, (_, names) in zip(saved_groups, current):
        ids = []
        for name in names:
            if name in state:
                osd_state[index] = dict(state[name])
            ids.append(index)
            index += 1
        osd_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
    optimizer.load_state_dict({"state": osd_state, "param_groups": osd_groups})


@api_call
def load_full_optim_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """Load a name-keyed full optimizer state dict (as :func:`full_optim_state_dict` returns) on every rank.

    Each rank keeps only its parameters' local parts; no communication. Raises ``ValueError``
    naming the first mismatch (groups, missing parameters, shapes) before changing anything.
    """
    if "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError(
            f"expected an optimizer state dict with 'state' and 'param_groups', found keys {sorted(state_dict)}; "
            "pass what hybridshard.full_optim_state_dict returned (on every rank)"
        )
    check_groups(model, optimizer, state_dict["param_groups"])
    if is_sharded(model):
        check_idle(model, "load_full_optim_state_dict")
    places = param_ranges(model)
    params = local_params(model)
    unknown = sorted(set(state_dict["state"]) - set(places))
    if unknown:
        raise ValueError(f"optimizer state for parameters the model does not have: {unknown[:5]}; load state saved from this model")
    local: dict[str, dict[str, Any]] = {}
    for name, entry in state_dict["state"].items():
        shape, start, numel, _ = places[name]
        local[name] = {}
        for key, value in entry.items():
            if is_per_element(key, value, shape, len(shape)):
                value = value.reshape(-1)[start : start + numel].reshape(params[name].shape)
            elif torch.is_tensor(value) and value.dim() > 0 and key not in _STEP_KEYS:
                raise ValueError(
                    f"optimizer state {name!r}[{key!r}] has shape {list(value.shape)}, the parameter has {list(shape)}"
                )
            local[name][key] = value.clone() if torch.is_tensor(value) else value
    apply_state(model, optimizer, state_dict["param_groups"], local)
