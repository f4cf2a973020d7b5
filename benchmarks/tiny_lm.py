"""The runtime tests' small model, its data and run configuration, and the model sharded as a
configuration says: shared by the tests (``tests/runtime_models.py``, ``tests/cuda_job.py``) and the
device checks here (``host_sync_check.py``, ``stream_race.py``), which import nothing of ``tests/``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    import hybridshard as hs

VOCAB, DIM, SEQ = 32, 16, 6
# Not the examples' and bench's GPT (hybridshard.bench.model) on purpose: tiny, with tied, frozen, buffer and root-level state.


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, DIM), requires_grad=False)  # frozen
        self.register_buffer("scale", torch.full((DIM,), 0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(self.norm(x))))
        return x + h * self.gate * self.scale.to(x.dtype)


class TinyLM(nn.Module):
    """Embedding tied to the output head, two blocks, a root-level position table."""

    def __init__(self, num_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.checkpoint = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos.to(self.embed.weight.dtype)
        for block in self.blocks:
            if self.checkpoint:  # around the unit's call; True: non-reentrant, "reentrant": reentrant
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpoint == "reentrant")
            else:
                x = block(x)
        return self.head(self.norm(x))


def make_model(seed: int = 0, num_blocks: int = 2) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(num_blocks)


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    # (b, s, vocab) -> predict a fixed function of the token, to give a learnable target
    target = (tokens * 7 + 3) % VOCAB
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))


def batch(step: int, micro: int, rank: int, micro_batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randint(0, VOCAB, (micro_batch, SEQ), generator=g)


@dataclass(frozen=True)
class Config:
    strategy: str = "HYBRID_SHARD"
    bf16: bool = False
    micro_steps: int = 1
    """Micro-batches per step; all but the last run under no_sync."""
    reduce_scatter_micro: bool = False
    """no_sync(reduce_scatter=True): reduce-scatter each micro-batch, all-reduce across groups once."""
    steps: int = 5
    micro_batch: int = 2
    lr: float = 1e-2
    checkpoint: bool | str = False
    """Activation checkpointing around each block's call: True (non-reentrant) or "reentrant"."""
    clip: float | None = None
    block_strategies: tuple[str, ...] = ()
    """One block per entry, each a unit with that strategy (a callable wrap policy); () = two blocks."""
    block_strategy: str | None = None
    """Every block's strategy through a mapping ``wrap={Block: block_strategy}``."""
    low_precision_grads: bool = False
    """``MixedPrecision(keep_low_precision_grads=True)`` (with ``bf16``): ``.grad`` stays bf16."""
    optimizer: str = "adamw"
    """"adamw", or "sgd" (momentum 0.9), which steps fp32 parameters with bf16 gradients."""
    prefetch: int = 1
    """``shard(prefetch=...)``: units gathered ahead (0 = off)."""
    overlap_grads: bool = True
    """``shard(overlap_grads=...)``: gradient collectives left running through backward."""
    compression: str | None = None
    """``shard(replicate_compression=...)``."""
    executor: str | None = None
    """``shard(executor=...)``: "threads", "streams" or None (the default choice)."""
    offload: bool = False
    """``shard(offload=hs.CPUOffload())``."""
    fp16: bool = False
    """With ``bf16``: compute in fp16 instead, reduce in fp16 (split division), ``hs.ShardedGradScaler``."""
    shard_optimizer: bool = False
    """``shard(shard_optimizer_across_replicas=True)``: the optimizer steps 1/(S*R) slices."""
    rack_reduce: bool | None = None
    """``shard(rack_reduce=...)``: the replicate reduction in two hops (True), flat (False), or chosen."""
    two_hop: bool | None = None
    """``shard(two_hop=...)``: a shard group over several nodes in two hops (None: when it can)."""
    reshard_after_forward: str | None = None
    """``shard(reshard_after_forward="node")``: keep the node-local secondary shard from forward to backward."""

    @property
    def low_dtype(self) -> torch.dtype:
        return torch.float16 if self.fp16 else torch.bfloat16

    @property
    def num_blocks(self) -> int:
        return len(self.block_strategies) or 2

    @property
    def unit_strategies(self) -> list[str]:
        """The root's strategy, then each block's."""
        blocks = list(self.block_strategies) or [self.block_strategy or self.strategy] * 2
        return [self.strategy.upper()] + [b.upper() for b in blocks]


def make_optimizer(cfg: Config, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=cfg.lr)


VARIANTS = ["fp32", "ckpt", "bf16", "fp16", "offload"]


def variant_config(strategy: str, variant: str) -> Config:
    """The CUDA job's variants of a strategy (``VARIANTS``), 3 steps each."""
    base = Config(strategy=strategy, steps=3)
    return {
        "fp32": base,
        "ckpt": replace(base, checkpoint=True),
        "bf16": replace(base, bf16=True, optimizer="sgd"),
        "fp16": replace(base, bf16=True, fp16=True, optimizer="sgd"),
        "offload": replace(base, offload=True, clip=1.0),
    }[variant]


def sharded_model(cfg: Config, groups: hs.ShardGroups, device: torch.device,
                  executor: str | None = None) -> nn.Module:
    """The runtime tests' model, sharded on ``device`` as ``cfg`` says."""
    import hybridshard as hs  # here: the tests import the model and data at collection, without the runtime

    model = make_model(num_blocks=cfg.num_blocks)
    model.checkpoint = cfg.checkpoint
    mp = None
    if cfg.bf16:
        mp = hs.MixedPrecision(param_dtype=cfg.low_dtype, reduce_dtype=torch.float16 if cfg.fp16 else torch.float32)
    return hs.shard(model, strategy=cfg.strategy, groups=groups, wrap={Block}, device=device, mixed_precision=mp,
                    offload=hs.CPUOffload() if cfg.offload else None, executor=executor)
