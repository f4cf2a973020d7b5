"""What a healing replica fetches from a live one, and the replica check across replica groups.

[Note: healing a shard rank]
Shard rank ``j`` of a returning replica group heals from shard rank ``j`` of a live group: torchft's
checkpoint transport serves each group rank's own state dict to the same group rank of the
recovering group. That state is this rank's part of the model (every unit's master shard) and of
the optimizer (its state is per element of the shard, keyed by parameter index, which every
replica group numbers alike because they build the same optimizer on the same model). The state
dict is taken on torchft's quorum thread while the main thread may already run the next forward,
which reads the master shards but never writes them; so the tensors are cloned there, and the
optimizer's next update cannot change what is being sent.

[Note: the initial sync]
Groups that start from different weights must agree before their first step. torchft's own
``init_sync`` heals every group but one at step 0, yet counts the healing groups in the mean while
they contribute zeros, and picks the group kept per shard rank: the first step's gradient would be
one group's, divided by the number of groups, from a different group's samples on each shard rank.
So fault-tolerant mode runs torchft with ``init_sync=False`` and syncs the weights itself: while no
step has committed (the quorum's step is 0 on every group in it), the first live group's master
shards are summed with zeros from the others, before the forward. Each group copies the result
only if the all-reduce succeeded; a group whose transfer failed keeps its own weights and fails the
step (``should_commit``), which is retried with the sync again. The optimizer has not stepped, so
it holds no state to send.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from hybridshard.runtime.engine import get_engine

logger = logging.getLogger(__name__)

__all__ = ["load_shard_state", "shard_digest", "shard_state", "sync_initial_shards"]


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def shard_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's master shards and optimizer state, cloned; see [Note: healing a shard rank]."""
    units = get_engine(model).units
    return {
        "units": [_clone(u.flat.sharded) for u in units],
        "optim": tree_map(_clone, optimizer.state_dict()),
    }


def load_shard_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Copy a live replica's :func:`shard_state` into this rank's master shards and optimizer."""
    units = get_engine(model).units
    shards = state["units"]
    if len(shards) != len(units) or any(t.shape != u.flat.sharded.shape for t, u in zip(shards, units)):
        found = [tuple(t.shape) for t in shards]
        expected = [tuple(u.flat.sharded.shape) for u in units]
        raise ValueError(
            f"the live replica's shards {found} do not match this rank's {expected}; every replica group "
            "must shard the same model with the same number of ranks per group"
        )
    with torch.no_grad():
        for unit, shard in zip(units, shards):
            unit.flat.sharded.copy_(shard)
    optimizer.load_state_dict(state["optim"])


def sync_initial_shards(model: nn.Module, manager: Any) -> bool:
    """Replace this rank's master shards with the first live group's; see [Note: the initial sync].

    Collective over the quorum's groups (every group in it calls it, at step 0). True when the
    shards were replaced; False when the all-reduce failed and they were left as they were.
    """
    units = get_engine(model).units
    source = manager.participating_rank() == 0
    buffers = []
    for unit in units:
        unit.flat.writeback_params()  # a parameter the user re-initialised after shard() counts
        shard = unit.flat.sharded.detach()
        buffers.append(shard.clone() if source else torch.zeros_like(shard))
    works = [manager.allreduce(buffer, reduce_op=dist.ReduceOp.SUM) for buffer in buffers]
    for work in works:
        work.wait()
    if manager.errored() is not None:
        logger.warning("the initial weight sync across replica groups failed; this step will not commit")
        return False
    with torch.no_grad():
        for unit, buffer in zip(units, buffers):
            unit.flat.sharded.copy_(buffer)  # the source too: x + 0 turns -0.0 into 0.0 on every group
    return True


_CHUNK_BITS = 20
"""Digest chunks of 20 bits: their squares summed over up to 2^12 replicas stay exact in float64."""


def shard_digest(model: nn.Module, num_chunks: int = 4) -> torch.Tensor:
    """``[1, c_1..c_k, c_1^2..c_k^2]`` (float64), ``c_i`` chunks of a SHA-256 of this rank's master shards' bits.

    Summed over replicas, ``n * sum(c^2) == sum(c)^2`` for every chunk exactly when all replicas hold
    the same chunks (the variance is zero), and the first entry counts the replicas that took part.
    """
    h = hashlib.sha256()
    for unit in get_engine(model).units:
        unit.flat.writeback_params()
        raw = unit.flat.sharded.detach().contiguous().view(-1).cpu()
        h.update(raw.view(torch.uint8).numpy().tobytes())
    value = int.from_bytes(h.digest(), "big")
    mask = (1 << _CHUNK_BITS) - 1
    chunks = [float((value >> (_CHUNK_BITS * i)) & mask) for i in range(num_chunks)]
    return torch.tensor([1.0, *chunks, *(c * c for c in chunks)], dtype=torch.float64)


def replicas_agree(summed: torch.Tensor, num_chunks: int = 4) -> tuple[int, bool]:
    """From the sum of every replica's :func:`shard_digest`: (replicas counted, whether they agree)."""
    n = int(summed[0].item())
    sums, squares = summed[1 : 1 + num_chunks], summed[1 + num_chunks :]
    return n, bool(torch.equal(sums * sums, n * squares))
