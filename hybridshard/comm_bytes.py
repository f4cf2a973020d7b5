"""Bytes one rank sends per collective in the ring model: the one formula the runtime's counters,
the planner's estimates and the bus-bandwidth diagnostic share.

For a collective over ``n`` ranks whose full buffer holds ``B`` bytes (the gathered tensor of an
all-gather, the unreduced one of a reduce-scatter, the buffer every rank holds in an all-reduce),
a ring sends ``(n-1)/n * B`` from each rank for an all-gather, a reduce-scatter or an all-to-all,
and twice that for an all-reduce (a reduce-scatter then an all-gather). A broadcast pipelined
along the ring sends the buffer once from each rank. A group of one rank sends nothing.
"""

from __future__ import annotations

__all__ = ["KINDS", "ring_factor", "ring_bytes"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast")


def ring_factor(kind: str, n: int) -> float:
    """Bytes one rank sends per byte of the collective's full buffer over ``n`` ranks."""
    if n < 1:
        raise ValueError(f"group size must be >= 1, found {n}; pass the number of ranks in the group")
    if kind not in KINDS:
        raise ValueError(f"collective must be one of {KINDS}, found {kind!r}; use one of those names")
    if n == 1:
        return 0.0
    if kind == "broadcast":
        return 1.0
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n


def ring_bytes(kind: str, n: int, input_bytes: float) -> float:
    """Bytes one rank sends for a collective over ``n`` ranks, from the bytes of its own input.

    An all-gather's input is one shard, so its full buffer is ``n * input``; every other kind's
    input is the full buffer.
    """
    full = n * input_bytes if kind == "all_gather" else input_bytes
    return ring_factor(kind, n) * full
