"""What the ranks of a sharded save tell each other about it: the bytes each wrote, and (to rank 0,
which writes the manifest) each one's node name. See [Note: checkpoint metadata at scale]."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridshard.topology.groups import collective_device

__all__ = ["exchange"]


# [Note: checkpoint metadata at scale]
# Every rank returns the bytes each rank wrote (``SaveResult.bytes_per_rank``, which the Lightning and
# Fabric integrations index by global rank); only rank 0, which writes the manifest, needs the ranks'
# node names. So the bytes travel as one int64 a rank (an all-gather), and the names as their UTF-8
# bytes, padded to the longest (one all-reduce of an int64 finds it), gathered to rank 0 alone: a rank
# other than 0 receives 8 W + 8 bytes, rank 0 also W times the longest name. Both went through
# ``all_gather_object`` before: a size and a pickle from every rank to every rank (245 KB a rank at
# 4,096 ranks; docs/scale.md).
def exchange(node: str, written: int) -> tuple[list[str] | None, list[int]]:
    """``(every rank's node name on rank 0, else None; every rank's bytes written)``: see the note."""
    world, rank = dist.get_world_size(), dist.get_rank()
    device = collective_device()
    per_rank = torch.empty(world, dtype=torch.int64, device=device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # newer torch's name
    all_gather(per_rank, torch.tensor([written], dtype=torch.int64, device=device))
    name = node.encode("utf-8", "surrogateescape")  # as os.environ holds undecodable bytes
    longest = torch.tensor([len(name)], dtype=torch.int64, device=device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    mine = torch.zeros(max(1, int(longest.item())), dtype=torch.uint8)
    mine[: len(name)] = torch.tensor(list(name), dtype=torch.uint8)
    mine = mine.to(device)
    names = [torch.empty_like(mine) for _ in range(world)] if rank == 0 else None
    dist.gather(mine, names, dst=0)
    nodes = None  # no name holds a NUL byte (environment values and host names cannot)
    if names is not None:
        nodes = [bytes(t.tolist()).rstrip(b"\0").decode("utf-8", "surrogateescape") for t in names]
    return nodes, per_rank.tolist()
