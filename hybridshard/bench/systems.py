"""One trainer per contestant: the same model, wrap granularity, groups, optimizer and loss.

Every system wraps each transformer :class:`~hybridshard.bench.model.Block` as its own unit and the
rest (embeddings, final norm, tied head) in the root unit, so the systems gather and reduce the same
pieces in the same order:

- hybridshard: ``hs.shard(model, strategy=S, groups=groups, wrap={Block}, **variant options)``;
- FSDP1: ``FullyShardedDataParallel`` with ``HYBRID_SHARD`` / ``_HYBRID_SHARD_ZERO2``,
  ``process_group=(groups.shard, groups.replicate)``, a ``ModuleWrapPolicy({Block})`` and
  ``use_orig_params=True``;
- FSDP2: ``fully_shard(block, mesh=groups.mesh, reshard_after_forward=Z3)`` for every block, where
  ``Z3`` is True for HYBRID_SHARD (ZeRO-3 in the node) and False for ZeRO-2, then the root with
  FSDP2's default for it (kept gathered from forward to backward, as FSDP1 and hybridshard keep it);
- with ``--compile``: hybridshard's ``compile=True`` variant (see :mod:`hybridshard.runtime.setup.compile`) and
  FSDP2 with ``block.compile()`` on every block after ``fully_shard``;
- floor: the plain model on every rank, no collectives (each rank trains on its own slice, so its
  losses match the others' on the first step only).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridshard as hs
from hybridshard.bench.compiled import private_forward
from hybridshard.bench.config import BenchConfig, Contestant, System
from hybridshard.bench.model import GPT, Block

logger = logging.getLogger(__name__)

__all__ = ["Trainer", "build_trainer"]


@dataclass
class Trainer:
    """A contestant's model and optimizer; :meth:`step` is one training step on this rank's batch."""

    contestant: Contestant
    model: nn.Module
    optimizer: torch.optim.Optimizer
    vocab: int
    steps_done: int = 0

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Forward, backward and AdamW step on ``tokens`` (b, s + 1); returns the local loss, detached."""
        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(tokens[:, :-1])  # (b, s, vocab)
        loss = F.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        self.optimizer.step()
        self.steps_done += 1
        return loss.detach()


def build_model(cfg: BenchConfig) -> GPT:
    torch.manual_seed(cfg.seed)
    return GPT(cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.seq)


def _hybridshard(model: nn.Module, cfg: BenchConfig, groups, contestant: Contestant, device) -> nn.Module:
    return hs.shard(model, strategy=cfg.strategy, groups=groups, wrap={Block}, device=device,
                    **dict(contestant.options))


def _fsdp1(model: nn.Module, cfg: BenchConfig, groups, device) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    strategy = {"HYBRID_SHARD": ShardingStrategy.HYBRID_SHARD,
                "HYBRID_SHARD_ZERO2": ShardingStrategy._HYBRID_SHARD_ZERO2}[cfg.strategy]
    return FullyShardedDataParallel(
        model,
        sharding_strategy=strategy,
        process_group=(groups.shard, groups.replicate),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True,
        # FSDP1 takes the device from device_id; without one it looks for an accelerator and refuses the CPU.
        device_id=device,
    )


def _fsdp2(model: nn.Module, cfg: BenchConfig, groups) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    if groups.mesh is None:
        raise ValueError("FSDP2 needs groups.mesh, a DeviceMesh over the shard/replicate groups; it could not be "
                         "built here (see the warning from hybridshard.topology.groups); drop fsdp2 from --systems")
    zero3 = cfg.strategy == "HYBRID_SHARD"
    for block in model.blocks:
        fully_shard(block, mesh=groups.mesh, reshard_after_forward=zero3)
    # None: FSDP2's root default, which keeps the root's parameters from forward to backward.
    fully_shard(model, mesh=groups.mesh, reshard_after_forward=None if zero3 else False)
    if cfg.compile:  # per block after sharding, as FSDP2 is built to be compiled
        for block in model.blocks:
            block.compile()
    return model


def build_trainer(contestant: Contestant, cfg: BenchConfig, groups, device: torch.device) -> Trainer:
    """Build ``contestant``'s model from ``cfg.seed`` (the same weights for every system) and wrap it."""
    model = build_model(cfg).to(device)
    if cfg.compile and (contestant.system is System.FSDP2 or dict(contestant.options).get("compile")):
        private_forward(model, Block)  # see [Note: cold compiles]
    if contestant.system is System.HYBRIDSHARD:
        model = _hybridshard(model, cfg, groups, contestant, device)
    elif contestant.system is System.FSDP1:
        model = _fsdp1(model, cfg, groups, device)
    elif contestant.system is System.FSDP2:
        model = _fsdp2(model, cfg, groups)
    else:
        assert contestant.system is System.FLOOR, contestant
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    logger.debug("built %s", contestant.name)
    return Trainer(contestant, model, optimizer, cfg.vocab)
