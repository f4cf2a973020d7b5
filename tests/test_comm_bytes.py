"""The ring-bytes formula (hybridshard.comm_bytes) by hand at S = 1, 2, 8, and its three users
(the runtime's counters, the planner, the bus-bandwidth diagnostic) reading it alike."""

from __future__ import annotations

import pytest
import torch

from hybridshard.comm_bytes import ring_bytes, ring_factor
from hybridshard.diagnostics.bandwidth import bus_bandwidth
from hybridshard.estimates.sizing import ModelSpec, step_collectives
from hybridshard.runtime.trace.counters import CollectiveCounts
from hybridshard.runtime.units.strategy import ShardingStrategy

FULL = 1024  # bytes of the full buffer: gathered, unreduced, or held by every rank

# (kind, S) -> bytes one rank sends for a 1024-byte full buffer, worked by hand:
# all-gather / reduce-scatter (S-1)/S * 1024; all-reduce 2 (S-1)/S * 1024; one rank sends nothing.
BY_HAND = {
    ("all_gather", 1): 0.0, ("all_gather", 2): 512.0, ("all_gather", 8): 896.0,
    ("reduce_scatter", 1): 0.0, ("reduce_scatter", 2): 512.0, ("reduce_scatter", 8): 896.0,
    ("all_reduce", 1): 0.0, ("all_reduce", 2): 1024.0, ("all_reduce", 8): 1792.0,
}


@pytest.mark.parametrize("kind, n", sorted(BY_HAND))
def test_ring_bytes_by_hand(kind, n):
    assert ring_factor(kind, n) * FULL == BY_HAND[kind, n]
    # From one rank's input: an all-gather's is one shard (1024 / S bytes), the others' the full buffer.
    own_input = FULL // n if kind == "all_gather" else FULL
    assert ring_bytes(kind, n, own_input) == BY_HAND[kind, n]


def test_other_kinds_and_bad_input():
    assert ring_bytes("all_to_all", 8, FULL) == 896.0  # (8-1)/8 of its input leaves the rank
    assert ring_bytes("broadcast", 8, FULL) == 1024.0  # pipelined along the ring: once per rank
    assert ring_bytes("broadcast", 1, FULL) == 0.0
    with pytest.raises(ValueError, match="collective must be one of"):
        ring_factor("gather", 2)
    with pytest.raises(ValueError, match=">= 1"):
        ring_factor("all_reduce", 0)


@pytest.mark.parametrize("n", [1, 2, 8])
def test_users_agree(n):
    counts = CollectiveCounts()
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        numel = FULL // 4 // n if kind == "all_gather" else FULL // 4  # fp32 input elements
        counts.record(kind, "g", n, torch.zeros(numel))
        assert counts.ring_bytes[kind, "g"] == BY_HAND[kind, n]
        # busbw = algbw * bytes sent per byte of the full buffer
        assert bus_bandwidth(kind, 1000.0, n) == pytest.approx(BY_HAND[kind, n] / FULL * 1000.0)
    # FULL_SHARD over n ranks, one unit of 256 parameters, fp32 gathers and reductions, gathered once
    model = ModelSpec(num_params=256, unit_params=256, root_params=256, param_dtype="fp32", reduce_dtype="fp32")
    planned = step_collectives(ShardingStrategy.FULL_SHARD, n, 1, model=model)
    expected = {} if n == 1 else {("all_gather", "world"): BY_HAND["all_gather", n],
                                  ("reduce_scatter", "world"): BY_HAND["reduce_scatter", n]}
    assert planned == pytest.approx(expected)
    replicated = step_collectives(ShardingStrategy.NO_SHARD, 1, n, model=model)
    assert replicated == pytest.approx({} if n == 1 else {("all_reduce", "world"): BY_HAND["all_reduce", n]})
