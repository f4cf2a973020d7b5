"""``clip_grad_norm_`` over sharded gradients: the norm of the whole model's gradient, counted once."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard import collectives as C
from hybridshard.runtime import get_runtime

logger = logging.getLogger(__name__)

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of a sharded ``model`` so their global norm is at most ``max_norm``.

    Returns the global norm before clipping, the same value ``torch.nn.utils.clip_grad_norm_``
    returns for the unsharded model. Collective over the shard group.

    [Note: counting each gradient element once]
    After reduction every gradient element lives in exactly one rank of its shard group, and every
    replicate group holds identical copies. So each rank sums its own shard, the shard group adds
    the sums up, and the replicate group is left alone: adding a replica's copy would count it
    twice (NO_SHARD is the case of a shard group of one).
    """
    runtime = get_runtime(model)
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type must be positive (2.0, or inf for the max norm); got {norm_type}")
    grads = [p.grad for unit in runtime.units for p in unit.flat.params if p.grad is not None]
    device = runtime.device
    if math.isinf(norm_type):
        local = torch.stack([g.detach().abs().max() for g in grads if g.numel()] or [torch.zeros((), device=device)])
        local = local.max().float()
        op = dist.ReduceOp.MAX
    else:
        parts = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads]
        local = torch.stack(parts).pow(norm_type).sum() if parts else torch.zeros((), device=device)
        op = dist.ReduceOp.SUM
    local = local.to(device=device, dtype=torch.float32).reshape(1)
    if runtime.groups.shard_size > 1:
        C.all_reduce(local, runtime.groups.shard, op=op)
    total = local[0] if math.isinf(norm_type) else local[0].pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.dtype))
    return total
