"""The planner's formulas against what the runtime does: its own collective counters and the bytes
it holds, for one training step of every strategy on 4 ranks / 2 simulated nodes.

``count_collectives`` records each call's *input* bytes per (kind, group). The ring model turns them
into bytes sent per rank: an all-gather's input is one shard, so ``(n-1) * input``; a
reduce-scatter's input is the whole buffer, so ``(n-1)/n * input``; an all-reduce ``2(n-1)/n *
input``. The runtime pads each unit (every parameter starts at a 16-byte boundary, the buffer is a
multiple of the shard size), so the planner is given the padded unit sizes read from the runtime's
own layouts; then prediction and record agree to float rounding (relative 1e-12). From the raw
parameter count the prediction is low by at most the largest relative padding of one unit: exactly
0 for the test GPT (every size is a multiple of 4 elements), above 0 for ``OddNet``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from hybridshard.estimates.sizing import ClusterSpec, LinkClass, ModelSpec, estimate, memory, step_collectives
from hybridshard.runtime.units.strategy import ShardingStrategy
from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
STRATEGIES = [s.name for s in ShardingStrategy]
CASES = [(s, model, bf16) for s in STRATEGIES for model, bf16 in (("gpt", False), ("gpt", True), ("odd", False))]


class OddBlock(nn.Module):
    """Sizes that are not multiples of the alignment or of the shard size: the runtime pads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 7), nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class OddNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(3, 5), nn.Linear(5, 1)
        self.blocks = nn.ModuleList(OddBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in opt.state.values() for v in state.values() if torch.is_tensor(v))


def one_step(strategy: str, model_name: str, bf16: bool) -> dict:
    """One AdamW step; what the collectives moved, the unit layouts, and the bytes held afterwards."""
    import torch.distributed as dist

    import hybridshard as hs

    rank = dist.get_rank()
    torch.manual_seed(0)
    model, wrap = (RM.make_model(), {RM.Block}) if model_name == "gpt" else (OddNet(), {OddBlock})
    mp = hs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    # step_collectives and estimate() count FULL_SHARD and SHARD_GRAD_OP as flat rings over the world;
    # on these 2 nodes x 2 ranks they run in two hops unless told not to (their per-hop bytes:
    # tests/test_overlap.py::test_comm_stats_per_step_equal_the_formulas).
    hs.shard(model, strategy=strategy, groups=RM.groups(), wrap=wrap, mixed_precision=mp, two_hop=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if model_name == "gpt":
        tokens = RM.batch(0, 0, rank, 2)
        batch_loss = lambda: RM.lm_loss(model(tokens), tokens)  # noqa: E731
    else:
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(rank))
        batch_loss = lambda: model(x).pow(2).mean()  # noqa: E731
    with hs.count_collectives() as counts:
        batch_loss().backward()
    opt.step()
    units = model.hybridshard_runtime.units
    pair = units[0].groups
    groups = {"shard": pair.shard, "replicate": pair.replicate, "world": None}
    return {
        "bytes": dict(counts.bytes),
        "members": {n: dist.get_process_group_ranks(g) if g is not None else list(range(WORLD))
                    for n, g in groups.items() if n == "world" or g is not None},
        "sizes": {"shard": pair.shard_size, "replicate": pair.replicate_size, "world": WORLD},
        "units": [(u.flat.layout.numel, u.flat.layout.padded_numel) for u in units],  # units[0] is the root
        "held": {
            "params": sum(u.flat.sharded.numel() * u.flat.sharded.element_size() for u in units),
            "grads": sum(u.flat.sharded_grad.numel() * u.flat.sharded_grad.element_size()
                         for u in units if u.flat.sharded_grad is not None),
            "optimizer": _state_bytes(opt),
        },
    }


def run_cases() -> list[dict]:
    return [one_step(*case) for case in CASES]


@pytest.fixture(scope="module")
def measured():
    with RankPool(WORLD, num_nodes=2, layout="block") as pool:
        return pool.run(run_cases), [node for node, _ in pool.placement]


def _ring_bytes(kind: str, n: int, input_bytes: int) -> float:
    if kind == "all_gather":
        return (n - 1) * input_bytes
    if kind == "reduce_scatter":
        return (n - 1) / n * input_bytes
    assert kind == "all_reduce", kind
    return 2 * (n - 1) / n * input_bytes


def _spec(units: list[tuple[int, int]], *, padded: bool, bf16: bool) -> ModelSpec:
    sizes = [p if padded else n for n, p in units]
    return ModelSpec(num_params=sum(sizes), unit_params=max(sizes), root_params=sizes[0],
                     param_dtype="bf16" if bf16 else "fp32", reduce_dtype="fp32")


def _each_rank(measured, index):
    """``(rank, that rank's result, strategy, model name, bf16)`` for case ``index``."""
    strategy, model_name, bf16 = CASES[index]
    for rank, results in enumerate(measured[0]):
        yield rank, results[index], ShardingStrategy[strategy], model_name, bf16


BY_CASE = pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"{s}-{m}-{'bf16' if b else 'fp32'}" for s, m, b in CASES]
)


@BY_CASE
def test_collective_bytes_match_the_planner(measured, index):
    node_of = measured[1]
    for rank, got, strategy_enum, model_name, bf16 in _each_rank(measured, index):
        sizes = got["sizes"]
        recorded = {key: _ring_bytes(key[0], sizes[key[1]], b) for key, b in got["bytes"].items()}
        shard_size, replicate_size = (sizes["shard"], sizes["replicate"])
        exact = step_collectives(strategy_enum, shard_size, replicate_size, model=_spec(got["units"], padded=True, bf16=bf16))
        assert recorded.keys() == exact.keys(), (rank, recorded, exact)
        for key, value in exact.items():
            assert math.isclose(recorded[key], value, rel_tol=1e-12), (rank, key, recorded[key], value)
        # From the raw parameter count: low by at most the largest relative padding of one unit.
        raw = step_collectives(strategy_enum, shard_size, replicate_size, model=_spec(got["units"], padded=False, bf16=bf16))
        worst = max(p / n - 1 for n, p in got["units"])
        assert (worst == 0) == (model_name == "gpt"), got["units"]
        for key, value in raw.items():
            assert value <= recorded[key] * (1 + 1e-12) and recorded[key] <= value * (1 + worst) * (1 + 1e-12), key
        # Link classes: a group whose members sit on one node is intra-node, else inter-node.
        planned = estimate(strategy_enum, shard_size, model=_spec(got["units"], padded=True, bf16=bf16),
                           cluster=ClusterSpec(node_sizes=(2, 2), gpu_memory_bytes=10**9))
        on_links = {LinkClass.INTRA_NODE: 0.0, LinkClass.INTER_NODE: 0.0}
        for (kind, group), value in recorded.items():
            nodes = {node_of[r] for r in got["members"][group]}
            on_links[LinkClass.INTRA_NODE if len(nodes) == 1 else LinkClass.INTER_NODE] += value
        for link, value in planned.bytes_by_link.items():
            assert math.isclose(on_links[link], value, rel_tol=1e-12, abs_tol=1e-9), (rank, link, on_links, planned.bytes_by_link)


@BY_CASE
def test_held_memory_matches_the_planner(measured, index):
    """Master and gradient shards: exactly the planner's terms for the padded sizes. Their sum with
    the AdamW state: within 10% of the planner's figure for the raw parameter count, for the test
    GPT (the state skips frozen parameters and padding, and adds a 4-byte step per parameter).
    OddNet, with 36 parameters per rank, is too small for a ratio to mean anything there."""
    for rank, got, strategy_enum, model_name, bf16 in _each_rank(measured, index):
        held = got["held"]
        shard_size = got["sizes"]["shard"] if strategy_enum is not ShardingStrategy.NO_SHARD else 1
        exact = memory(strategy_enum, shard_size, model=_spec(got["units"], padded=True, bf16=bf16))
        assert (held["params"], held["grads"]) == (exact.params, exact.grads), (rank, held, exact)
        if model_name != "gpt":
            continue
        planned = memory(strategy_enum, shard_size, model=_spec(got["units"], padded=False, bf16=bf16))
        predicted = planned.params + planned.grads + planned.optimizer
        actual = held["params"] + held["grads"] + held["optimizer"]
        assert abs(actual - predicted) <= 0.10 * predicted, (rank, held, planned)
