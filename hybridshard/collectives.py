"""Every collective the runtime issues, as stateless functions that take their group explicitly.

Each call is counted per ``(kind, group name)`` so tests and benchmarks can check how many
collectives a step issued and how many bytes crossed each group. A group of one rank needs no
communication: the functions then copy locally and count nothing. A collective that fails raises a
``RuntimeError`` naming the group and the lost ranks, and with ``HYBRIDSHARD_DEBUG=1`` each one first
checks that its group agrees on it (see :mod:`hybridshard.faults`).
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from hybridshard import faults

logger = logging.getLogger(__name__)

__all__ = [
    "CollectiveCounts",
    "all_gather",
    "all_reduce",
    "broadcast",
    "count_collectives",
    "group_name",
    "group_size",
    "name_group",
    "reduce_scatter",
]

_NAMES: dict[int, str] = {}

# Newer torch renames the tensor-in/tensor-out collectives; the semantics are the same.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def name_group(group: dist.ProcessGroup | None, name: str) -> None:
    """Give ``group`` a name for counters and debug logs ("shard", "replicate", "world")."""
    _NAMES[id(group if group is not None else dist.group.WORLD)] = name


def group_name(group: dist.ProcessGroup | None) -> str:
    g = group if group is not None else dist.group.WORLD
    return _NAMES.get(id(g), "world" if g is dist.group.WORLD else f"group@{id(g):x}")


def group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


@dataclass
class CollectiveCounts:
    """Collectives issued while a :func:`count_collectives` block was open."""

    calls: Counter = field(default_factory=Counter)
    """``(kind, group name) -> number of calls``."""
    bytes: Counter = field(default_factory=Counter)
    """``(kind, group name) -> bytes of the input tensors``."""

    def get(self, kind: str, group: str) -> int:
        return self.calls[(kind, group)]


_ACTIVE: list[CollectiveCounts] = []


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count every collective this process issues inside the block."""
    counts = CollectiveCounts()
    _ACTIVE.append(counts)
    try:
        yield counts
    finally:
        _ACTIVE.remove(counts)


def _run(kind: str, group: dist.ProcessGroup | None, tensor: torch.Tensor, collective: Callable[[], Any]) -> None:
    """Count, optionally check agreement, then run ``collective``; a failure names the group."""
    name = group_name(group)
    nbytes = tensor.numel() * tensor.element_size()
    for counts in _ACTIVE:
        counts.calls[(kind, name)] += 1
        counts.bytes[(kind, name)] += nbytes
    logger.debug("%s on %s: %d bytes", kind, name, nbytes)
    try:
        if faults.debug_enabled():
            faults.check_agreement(kind, name, group, tensor)
        collective()
    except RuntimeError as err:
        raise faults.collective_failed(kind, name, group, err) from err


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Concatenate every rank's ``shard`` into ``output`` (``group_size * shard.numel()`` elements)."""
    if group_size(group) == 1:
        output.copy_(shard)
        return
    _run("all_gather", group, shard, lambda: _ALL_GATHER(output, shard, group=group))


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum ``full`` over the group and keep this rank's chunk in ``output``."""
    if group_size(group) == 1:
        output.copy_(full)
        return
    _run("reduce_scatter", group, full, lambda: _REDUCE_SCATTER(output, full, op=dist.ReduceOp.SUM, group=group))


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None, op=dist.ReduceOp.SUM) -> None:
    """Reduce ``tensor`` in place over the group (``op`` defaults to a sum)."""
    if group_size(group) == 1:
        return
    _run("all_reduce", group, tensor, lambda: dist.all_reduce(tensor, op=op, group=group))


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None) -> None:
    """Copy global rank ``src``'s ``tensor`` to every member of the group."""
    if group_size(group) == 1:
        return
    _run("broadcast", group, tensor, lambda: dist.broadcast(tensor, src=src, group=group))


@dataclass(frozen=True)
class GroupPair:
    """The two groups one sharded model communicates over.

    ``shard`` holds the ranks that split each flat parameter; ``replicate`` the ranks that hold the
    same shard (``None`` when there is only this rank, e.g. FULL_SHARD over the whole job).
    """

    shard: dist.ProcessGroup | None
    replicate: dist.ProcessGroup | None
    shard_size: int
    shard_rank: int
    replicate_size: int
    replicate_rank: int = 0
    """This rank's index in the replicate group; replica 0 holds the copy that norms count."""

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicate_size
