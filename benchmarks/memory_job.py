"""The memory job of the CUDA checks: a model whose state dominates the peak, its peak CUDA memory
against ``hybridshard.estimates.sizing.memory`` (``tests/cuda_job.py`` prints it per strategy,
``benchmarks/memory_trace.py`` traces it by phase and unit).
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
import torch.nn as nn

import hybridshard as hs
from hybridshard.estimates.sizing import MemoryEstimate, ModelSpec, memory
from hybridshard.runtime.units.strategy import ShardingStrategy

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"]


class Mlp(nn.Module):
    """Eight 1024 x 1024 layers, one unit each: big enough for the state to dominate the peak."""

    def __init__(self, dim: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def shard_size_of(strategy: ShardingStrategy, groups: hs.ShardGroups) -> int:
    if strategy is ShardingStrategy.NO_SHARD:
        return 1
    return groups.shard_size if strategy.is_hybrid else dist.get_world_size()


def memory_model(strategy: str, groups: hs.ShardGroups) -> tuple[int, Mlp, torch.optim.Optimizer, torch.Tensor]:
    """CUDA bytes allocated before, then the sharded :class:`Mlp`, its AdamW and its input."""
    device = groups.device
    gc.collect()  # the previous strategy's model and optimizer (reference cycles through the hooks)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.manual_seed(0)
    model = Mlp()
    model.unit_numels = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    hs.shard(model, strategy=strategy, groups=groups, wrap={nn.Linear}, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return before, model, opt, torch.randn(16, 1024, device=device)


def memory_plan(strategy: str, groups: hs.ShardGroups, model: Mlp) -> MemoryEstimate:
    """``sizing.memory`` for :func:`memory_model`'s model."""
    s, numels = ShardingStrategy[strategy], model.unit_numels
    return memory(s, shard_size_of(s, groups), model=ModelSpec(
        num_params=sum(numels), unit_params=max(numels), root_params=0, param_dtype="fp32", reduce_dtype="fp32"))


def memory_run(strategy: str, groups: hs.ShardGroups) -> dict:
    """Peak CUDA bytes of the second AdamW step (optimizer state exists) against the planner."""
    device = groups.device
    before, model, opt, x = memory_model(strategy, groups)
    for step in range(2):
        if step == 1:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize(device)
    measured = torch.cuda.max_memory_allocated(device) - before
    planned = memory_plan(strategy, groups, model)
    persistent = planned.params + planned.optimizer  # the master and AdamW's state are alive throughout
    assert measured >= persistent, f"{strategy}: peak {measured} bytes below the master + optimizer {persistent}"
    del model, opt, x
    return {"measured_peak_bytes": measured, "planned_bytes": planned.total, "ratio": measured / planned.total}
