"""Train a small transformer-ish language model with HYBRID_SHARD and print the loss per step.

Run under torchrun (gloo on CPU, nccl on GPU), e.g. four ranks split into two simulated nodes::

    torchrun --nproc_per_node 4 examples/train_hybrid.py --steps 10 --simulate-nodes 2

``--simulate-nodes N`` names each rank's node ``sim0`` .. ``sim{N-1}`` (contiguous blocks of ranks)
so that one machine looks like an N-node cluster to topology discovery.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hybridshard as hs

VOCAB, DIM, SEQ, HEADS = 256, 64, 32, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(Block() for _ in range(num_layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied embedding
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # (b, s, vocab)


def synthetic_batch(step: int, rank: int, batch: int, device: torch.device) -> torch.Tensor:
    """Sequences that count up by a per-sequence stride: learnable next-token structure."""
    g = torch.Generator().manual_seed(step * 1009 + rank)
    start = torch.randint(0, VOCAB, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    return ((start + stride * torch.arange(SEQ + 1)) % VOCAB).to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--simulate-nodes", type=int, default=0, help="pretend the ranks sit on N nodes")
    args = parser.parse_args()

    if args.simulate_nodes:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        os.environ["HYBRIDSHARD_NODE_NAME"] = f"sim{rank * args.simulate_nodes // world}"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    groups = hs.init_groups()
    torch.manual_seed(0)
    model = TinyTransformer(args.layers)
    hs.shard(model, strategy=hs.ShardingStrategy.HYBRID_SHARD, groups=groups, wrap={Block})
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"world {dist.get_world_size()}: shard size {groups.shard_size} x replicate size {groups.replicate_size}")
    for step in range(args.steps):
        seq = synthetic_batch(step, rank, args.batch, device)
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = hs.clip_grad_norm_(model, 1.0)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step:3d}  loss {mean.item() / dist.get_world_size():.4f}  grad norm {norm.item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
