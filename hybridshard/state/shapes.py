"""Original shapes and names of a sharded model's parameters, for building optimizers.

[Note: shapes for the optimizer]
Between steps every parameter of a sharded model is a 1-D slice of its unit's master shard, so
``p.dim()`` is 1 for all of them and ``p.shape`` is the slice's length. Code that decides by shape
(no weight decay where ``p.dim() < 2``) must ask :func:`param_shapes` instead, or build its
groups with :func:`param_groups`, which uses the original shapes and names. An optimizer built on
``model.parameters()`` before ``shard`` keeps working: ``shard`` keeps every parameter object and
only points its ``.data`` at the shard, so the optimizer steps the shard. It must not have stepped
before ``shard`` (its state would be full-size next to a 1-D slice), and the model must not be a meta
one: deferred init gives a meta model new parameter objects.

Element-wise optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, Lion) need nothing more. Optimizers
that work on a parameter's matrix shape (Muon's orthogonalisation, Shampoo's and SOAP's
preconditioners, Adafactor's factored second moment) would see a 1-D slice and silently degrade (or
raise): they need each parameter's full matrix, which a flat shard does not hold. Use an
element-wise optimizer, give those parameters a unit of ``NO_SHARD`` (``wrap`` with a per-unit
strategy; each rank then holds them whole, in their shape as a flat view: reshape with
:func:`param_shapes`), or shard with a runtime that keeps shapes (FSDP2's DTensors).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch.nn as nn

from hybridshard.state.access import is_sharded, units

logger = logging.getLogger(__name__)

__all__ = ["param_groups", "param_shapes"]


def param_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """``name -> original shape`` of every distinct parameter (tied ones under their first name)."""
    if not is_sharded(model):
        return {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {slot.name: slot.shape for unit in units(model) for slot in unit.flat.layout.slots}


def param_groups(
    model: nn.Module,
    *,
    weight_decay: float,
    no_decay: Sequence[str] = ("bias", "norm"),
) -> list[dict[str, Any]]:
    """Two optimizer parameter groups decided by original shape and name: ``weight_decay`` for
    matrices, ``0.0`` for parameters of fewer than two dimensions (biases, norm scales) and for those
    whose name contains one of ``no_decay`` (case-insensitive). Frozen parameters are left out.
    Works on sharded and plain models alike; see [Note: shapes for the optimizer]."""
    shapes = param_shapes(model)
    decay, plain = [], []
    for name, p in model.named_parameters():  # named_parameters() order, as an optimizer built on it
        shape = shapes[name]
        if not p.requires_grad:
            continue
        skip = len(shape) < 2 or any(word.lower() in name.lower() for word in no_decay)
        (plain if skip else decay).append(p)
    logger.debug("param_groups: %d with weight decay, %d without", len(decay), len(plain))
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
