"""The replicate group's collectives in two hops: inside each rack, then across racks.

The groups and why are [Note: two hops across racks] in :mod:`hybridshard.topology.rack_groups`:
``racks.rack`` holds this rank's replicate-group members in its rack (``r`` ranks, this one at
``racks.position`` = ``p``), ``racks.across`` the members at position ``p`` of every rack (``P``
ranks, this one at ``racks.rack_index`` = ``k``), and this rank is ``k * r + p`` of the (network
ordered) replicate group. Each function gives what the flat collective over the replicate group
gives, up to the order of the fp32 sums.

[Note: slices in two hops]
The optimizer across replicas owns slice ``j = k * r + p`` of a shard cut into ``R = P * r`` slices
of ``n`` values (replica_slices.py). A reduce-scatter inside the rack then across racks leaves rank
``(k, p)`` holding contiguous block ``p * P + k`` of what it scattered, so the input is first
permuted: the shard's ``(P, r, n)`` blocks are transposed to ``(r, P, n)``, which puts slice
``k * r + p`` at block ``p * P + k``. The all-gather runs the other way (across racks, then inside
the rack) and transposes back into the shard.

Each phase waits for the one before (on NCCL the current stream waits, the host goes on), so the
local copies between them are ordered on any executor; the last phase is returned in flight when
``async_op`` is set. Collectives are counted on the groups ``"rack"`` and ``"across_racks"``.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable

import torch

from hybridshard.runtime.comm import collectives as C

logger = logging.getLogger(__name__)

__all__ = ["ShardHops", "all_gather", "all_reduce", "gather", "reduce_scatter", "shard_reduce_scatter"]


def _padded(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    """``tensor`` itself when its length divides by ``multiple``, else a zero-padded copy."""
    extra = -tensor.numel() % multiple
    if extra == 0:
        return tensor
    out = torch.zeros(tensor.numel() + extra, dtype=tensor.dtype, device=tensor.device)
    out[: tensor.numel()].copy_(tensor)
    return out


def all_reduce(tensor: torch.Tensor, racks: Any, *, stats: C.CollectiveCounts | None = None,
               async_op: bool = False, compressor: Any = None, key: Hashable = None) -> C.Pending | None:
    """Sum the 1-D ``tensor`` over the replicate group in place: reduce-scatter inside the rack,
    all-reduce the chunk across racks (compressed by ``compressor`` when given, its error feedback
    under ``key``), all-gather inside the rack."""
    r = racks.per_rack
    full = _padded(tensor, r)
    chunk = torch.empty(full.numel() // r, dtype=full.dtype, device=full.device)
    C.reduce_scatter(chunk, full, racks.rack, stats=stats, consume=full is not tensor)
    if compressor is not None:
        compressor.all_reduce(chunk, racks.across, key=key, stats=stats)
    else:
        C.all_reduce(chunk, racks.across, stats=stats)
    if full is tensor:
        return C.all_gather(tensor, chunk, racks.rack, stats=stats, async_op=async_op)
    C.all_gather(full, chunk, racks.rack, stats=stats)
    with torch.no_grad():
        tensor.copy_(full[: tensor.numel()])
    return C.DONE if async_op else None


def reduce_scatter(out: torch.Tensor, shard: torch.Tensor, racks: Any, *,
                   stats: C.CollectiveCounts | None = None, async_op: bool = False,
                   compressor: Any = None, key: Hashable = None) -> C.Pending | None:
    """This replica's slice (``k * r + p``) of the sum of ``shard`` over the replicate group, into
    ``out``; see [Note: slices in two hops]. With ``compressor`` the hop across racks is its
    reduce-scatter (phase 1, error feedback under ``key``)."""
    P, r, n = racks.racks, racks.per_rack, out.numel()
    assert shard.numel() == P * r * n, (shard.numel(), P, r, n)
    permuted = shard.view(P, r, n).transpose(0, 1).contiguous().view(-1)  # a copy: block p * P + k
    chunk = torch.empty(P * n, dtype=shard.dtype, device=shard.device)
    C.reduce_scatter(chunk, permuted, racks.rack, stats=stats, consume=True)
    if compressor is not None:
        with torch.no_grad():
            out.copy_(compressor.reduce_scatter(chunk, racks.across, key=key, stats=stats))
        return C.DONE if async_op else None
    return C.reduce_scatter(out, chunk, racks.across, stats=stats, async_op=async_op, consume=True)


def all_gather(shard: torch.Tensor, mine: torch.Tensor, racks: Any, *,
               stats: C.CollectiveCounts | None = None) -> None:
    """Every replica's slice into ``shard`` (slice ``j`` at ``[j * n, (j + 1) * n)``), from this
    replica's ``mine``: across racks, then inside the rack; see [Note: slices in two hops]."""
    P, r, n = racks.racks, racks.per_rack, mine.numel()
    column = torch.empty(P * n, dtype=mine.dtype, device=mine.device)  # slices k' * r + p, k' = 0..P-1
    C.all_gather(column, mine, racks.across, stats=stats)
    gathered = torch.empty(r * P * n, dtype=mine.dtype, device=mine.device)  # (p', k', n)
    C.all_gather(gathered, column, racks.rack, stats=stats)
    with torch.no_grad():
        shard.view(P, r, n).copy_(gathered.view(r, P, n).transpose(0, 1))


# -- a shard group over several nodes ---------------------------------------------------------------
#
# [Note: a shard group in two hops]
# A shard group of k nodes with g ranks on each (``hops``: ``rack`` = this rank's node, g members in
# position order; ``across`` = the k members at its position, in node order) is node-major: member
# (node j, position p) is shard rank ``j * g + p`` and holds block ``j * g + p`` of the flat buffer, so
# a flat ring over the group leaves each node once. Gathering across nodes gives this rank blocks
# ``j' * g + p`` (``j' = 0 .. k-1``, ``k * n`` values: the *node-local secondary shard*, 1/g of the
# unit). Node ``j'``'s blocks ``j' * g .. j' * g + g - 1`` are one contiguous row of the buffer, so the
# hop inside the node is ``k`` all-gathers, row ``j'`` from every member's block ``j'``, straight into
# the buffer: no whole-unit temporary and no re-layout copy. The reduce-scatter runs the other way:
# ``k`` reduce-scatters of the rows inside the node (this rank keeps the node's sum of blocks
# ``j' * g + p``), then one across nodes. Out of every node go ``(k - 1) / k`` of the buffer, not the
# flat ring's ``(S - 1) / S``; the price is ``k`` calls inside the node instead of one.

class ShardHops:
    """A multi-node shard group's hops for one gather; see [Note: a shard group in two hops].

    ``secondary``: this rank's node-local secondary shard kept from forward (only the hop inside the
    node runs); ``keep``: called with the secondary shard a full gather makes, to keep it."""

    __slots__ = ("hops", "secondary", "keep")

    def __init__(self, hops: Any, *, secondary: torch.Tensor | None = None, keep: Any = None) -> None:
        self.hops, self.secondary, self.keep = hops, secondary, keep


class _AllOf:
    """Several collectives in flight, waited for in issue order; completed once :meth:`wait` ran."""

    __slots__ = ("_pending",)

    def __init__(self, pending: list[Any]) -> None:
        self._pending = [p for p in pending if p is not None]

    def is_completed(self) -> bool:
        # Only once waited: each collective's wait ends its watchdog entry and its timing.
        return not self._pending

    def wait(self) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            p.wait()


class _Deferred:
    """A gather whose hop across nodes is in flight; :meth:`wait` finishes it, then issues and waits
    for the hops inside the node. See [Note: a deferred inner hop]."""

    __slots__ = ("_across", "_column", "_keep", "_inner")

    def __init__(self, across: Any, column: torch.Tensor, keep: Any, inner: Any) -> None:
        self._across, self._column, self._keep, self._inner = across, column, keep, inner

    def is_completed(self) -> bool:
        return self._inner is None

    def wait(self) -> None:
        inner, self._inner = self._inner, None
        if inner is None:
            return
        if self._across is not None:
            self._across.wait()
        if self._keep is not None:
            self._keep(self._column)
        inner(self._column).wait()


# [Note: a deferred inner hop]
# On gloo a collective called without ``async_op`` blocks the calling thread, so a prefetched gather
# whose hop across nodes (the slow one) ran synchronously would hold the main thread for the whole
# transfer and hide nothing behind compute. The thread executor therefore issues only that hop when
# the gather is issued, and the hops inside the node (over the fast local links) when the unit waits
# for it. The main thread issues and waits for every gather in an order the model fixes, the same on
# every rank, so the node group's calls stay in the same order everywhere. On NCCL (the stream
# executor) nothing blocks the host: both hops are queued at issue on the all-gather stream.

def gather(output: torch.Tensor, shard: torch.Tensor, group: Any, *, stats: C.CollectiveCounts | None = None,
           async_op: bool = False, defer: bool = False) -> Any:
    """All-gather ``shard`` into ``output`` over ``group``: a process group, or :class:`ShardHops`.

    ``defer`` (with ``async_op``): the hop across nodes is left in flight and the hops inside the node
    are issued by the returned handle's ``wait()``; see [Note: a deferred inner hop]."""
    if not isinstance(group, ShardHops):
        return C.all_gather(output, shard, group, stats=stats, async_op=async_op)
    hops, column = group.hops, group.secondary
    k, g, n = hops.racks, hops.per_rack, shard.numel()
    rows = output.view(k, g * n)

    def inner(column: torch.Tensor) -> _AllOf:
        blocks = column.view(k, n)
        return _AllOf([C.all_gather(rows[j], blocks[j], hops.rack, stats=stats, async_op=True) for j in range(k)])

    if column is None:
        column = torch.empty(k * n, dtype=shard.dtype, device=shard.device)  # blocks j' * g + p
        across = C.all_gather(column, shard, hops.across, stats=stats, async_op=async_op and defer)
        if async_op and defer:
            return _Deferred(across, column, group.keep, inner)
        if group.keep is not None:
            group.keep(column)
    done = inner(column)
    if async_op:
        return done
    done.wait()
    return None


def shard_reduce_scatter(out: torch.Tensor, full: torch.Tensor, hops: Any, *,
                         stats: C.CollectiveCounts | None = None, async_op: bool = False) -> C.Pending | None:
    """This rank's block of the sum of ``full`` over a node-major shard group, into ``out``: inside
    the node row by row, then across nodes; see [Note: a shard group in two hops]. ``full`` is
    consumed (its values may be overwritten)."""
    k, g, n = hops.racks, hops.per_rack, out.numel()
    assert full.numel() == k * g * n, (full.numel(), k, g, n)
    rows, chunk = full.view(k, g * n), torch.empty(k * n, dtype=full.dtype, device=full.device)
    blocks = chunk.view(k, n)
    for j in range(k):
        C.reduce_scatter(blocks[j], rows[j], hops.rack, stats=stats, consume=True)
    return C.reduce_scatter(out, chunk, hops.across, stats=stats, async_op=async_op, consume=True)
