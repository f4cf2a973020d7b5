"""``ShardedGradScaler``: fp16 loss scaling for a sharded model, every rank skipping together.

[Note: found-inf over the job]
A loss scaler unscales the gradients, looks for inf/NaN, and skips the optimizer step (and backs the
scale off) when it finds one. Sharded, each rank holds the gradients of its own shard only, so an
overflow shows on the ranks that hold the element and nowhere else: torch's ``GradScaler`` would
then skip the step on those ranks and step on the others, and the replicas part for good. Here the
found-inf flag of each rank (summed over its devices) is all-reduced with ``MAX`` over the whole
job right after unscaling, so every rank sees the same flag, skips or steps together, and moves its
scale the same way. It costs one all-reduce of one number per ``unscale_`` (or ``step`` without
one), issued by the calling thread. fp16 ``.grad`` (``keep_low_precision_grads``) is accepted: the
runtime's reduction already split its division around the sum (see [Note: dividing fp16
gradients] in :mod:`hybridshard.runtime.grads.reduce`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from hybridshard.runtime.comm import collectives as C
from hybridshard.topology.groups import collective_device

logger = logging.getLogger(__name__)

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose found-inf is agreed over the job; see [Note: found-inf over the job].

    ``device`` is where the scale lives (``None``: ``"cuda"`` when a GPU is present, else ``"cpu"``);
    the other arguments are ``GradScaler``'s. Use it as ``GradScaler``: ``scaler.scale(loss).backward()``,
    ``scaler.step(optimizer)``, ``scaler.update()``, with ``scaler.unscale_(optimizer)`` before
    :func:`hybridshard.clip_grad_norm_`. Every rank must call ``unscale_`` / ``step`` alike.
    """

    def __init__(self, device: str | None = None, **kwargs: Any) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(device, str) or torch.device(device).type not in ("cuda", "cpu"):
            raise ValueError(f"ShardedGradScaler device must be 'cuda' or 'cpu' (where the scale lives); got {device!r}")
        super().__init__(device, **kwargs)

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, True)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return per_device
        flag = torch.zeros((), dtype=torch.float32, device=collective_device())
        for value in per_device.values():
            flag = torch.maximum(flag, value.to(flag.device))
        C.all_reduce(flag, dist.group.WORLD, op=dist.ReduceOp.MAX)
        if not per_device:  # this rank holds no gradient: it must still skip when the others do
            per_device = {found_inf.device: found_inf}
        for value in per_device.values():
            value.copy_(flag)
        if logger.isEnabledFor(logging.DEBUG) and flag.item() > 0:  # a host sync: only when it is logged
            logger.debug("inf/NaN in some rank's gradients: every rank skips this step")
        return per_device
