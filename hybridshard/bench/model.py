"""The GPT-style decoder (pre-norm blocks, tied head) of the benchmark and the examples, and the
benchmark's synthetic data.

``examples/model.py`` re-exports :class:`GPT` and :class:`Block`, so benchmark figures speak for
the example's model. Every system builds it from the same seed, so they all start from the same
weights, and every system's ``k``-th step sees the same batch.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["Block", "GPT", "add_shape_arguments", "global_batch", "rank_batch"]


def add_shape_arguments(parser: argparse.ArgumentParser, *, layers: int | None = 4, batch: int = 8) -> None:
    """``--d-model --heads --seq --batch`` (and ``--layers`` unless ``None``) for a benchmark script of
    this model, with the defaults of ``hybridshard bench --compile``'s documented run."""
    parser.add_argument("--d-model", type=int, default=128)
    if layers is not None:
        parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=batch)


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        # (b, s, 3d) -> 3 x (b, heads, s, d/heads)
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and the tied head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied output head
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # (b, s, vocab)


def global_batch(step: int, *, seed: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Step ``step``'s global batch, the same on every rank: arithmetic sequences modulo the vocabulary
    with a random start and stride per row, so the next token is learnable from the context."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    return (start + stride * torch.arange(seq + 1)) % vocab  # (batch, seq + 1)


def rank_batch(step: int, rank: int, world: int, *, seed: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """This rank's contiguous slice of :func:`global_batch` (``batch // world`` rows)."""
    per_rank = batch // world
    return global_batch(step, seed=seed, batch=batch, seq=seq, vocab=vocab)[rank * per_rank:(rank + 1) * per_rank]
