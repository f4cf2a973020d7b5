"""``clip_grad_norm_`` over sharded gradients: the norm of the whole model's gradient, counted once."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.engine import get_engine
from hybridshard.runtime.trace.position import api_call
from hybridshard.runtime.units.unit import Unit

logger = logging.getLogger(__name__)

__all__ = ["clip_grad_norm_"]


@api_call
def clip_grad_norm_(
    model: nn.Module, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale the gradients of a sharded ``model`` so their global norm is at most ``max_norm``.

    Returns the global norm before clipping, the same value ``torch.nn.utils.clip_grad_norm_``
    returns for the unsharded model, on every rank. One all-reduce of one number: over the shard
    group when every unit has the same groups (none at all for NO_SHARD), over the default group
    when units differ, or when the optimizer is sharded across replicas. See [Note: counting each
    gradient element once] in docs/runtime.md.
    """
    engine = get_engine(model)
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (2.0, or inf for the max norm); got {norm_type}")
    units = engine.units
    # Slices of the optimizer sharded across replicas tile each unit over the whole job.
    sliced = any(u.replica_slice is not None for u in units)
    uniform = all(u.groups is units[0].groups for u in units) and not sliced
    group = units[0].groups.shard if uniform else dist.group.WORLD
    group_size = units[0].groups.shard_size if uniform else dist.get_world_size()
    counted = [g for u in units if uniform or _counts_here(u) for g in _grads(u)]
    device = engine.device
    if math.isinf(norm_type):
        maxima = [g.detach().abs().max().float() for g in counted if g.numel()]
        local = torch.stack(maxima).max() if maxima else torch.zeros((), device=device)
        op = dist.ReduceOp.MAX
    else:
        parts = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in counted]
        local = torch.stack(parts).pow(norm_type).sum() if parts else torch.zeros((), device=device)
        op = dist.ReduceOp.SUM
    local = local.to(device=device, dtype=torch.float32).reshape(1)
    if group_size > 1:
        C.all_reduce(local, group, op=op)
    total = local[0] if math.isinf(norm_type) else local[0].pow(1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        # The norm is global, so every rank takes this branch together: no rank is left waiting.
        raise RuntimeError(
            f"the total gradient norm is {float(total)}: a NaN or inf gradient on some rank (a NaN loss on one "
            "rank reaches every rank through the gradient reduction); skip this step (optimizer.zero_grad()) "
            "or find the bad batch, or pass error_if_nonfinite=False to clip anyway"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    scales: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # offloaded gradients are on the CPU
    for unit in units:
        for g in _grads(unit):
            key = (g.device, g.dtype)
            if key not in scales:
                scales[key] = coef.to(device=g.device, dtype=g.dtype)
            g.detach().mul_(scales[key])
    return total


def _grads(unit: Unit) -> list[torch.Tensor]:
    return [p.grad for p in unit.flat.params if p.grad is not None]


def _counts_here(unit: Unit) -> bool:
    """Whether this rank's shard of ``unit`` is the copy the job-wide sum counts (its own slice always is)."""
    return unit.replica_slice is not None or unit.groups.replicate_rank == 0
