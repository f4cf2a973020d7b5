"""Parity of every strategy with a single-process reference, and collectives counted per step.

4 ranks on 2 simulated nodes. One pool runs the whole sweep: 5 strategies x {fp32, bf16 params
with fp32 reduce} x {plain, no_sync accumulation}, plus the reduce-scatter-each-micro-batch option
and activation checkpointing around each block (non-reentrant and reentrant); then the cyclic node layout for the hybrid strategies.
"""

from __future__ import annotations

import pytest

from hybridshard.runtime.units.strategy import ShardingStrategy
from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
STRATEGIES = [s.name for s in ShardingStrategy]
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
# bf16: the reference computes each rank's micro-batch in bf16 as the ranks do and averages in
# fp32; what is left is fp32 summation order, amplified when it flips a bf16 rounding.
BF16_TOL = dict(atol=2e-3, rtol=2e-3)

SWEEP = RM.sweep(strategy=STRATEGIES, bf16=[False, True], micro_steps=[1, 2], clip=[1.0])
# SGD (momentum) and a clip that never binds: a gradient off by a constant factor moves every
# parameter and the reported norm, which AdamW or a binding clip would hide.
SCALE = dict(optimizer=["sgd"], clip=[1e6])
EXTRA = RM.sweep(strategy=["HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "NO_SHARD"], micro_steps=[3], reduce_scatter_micro=[True],
                 **SCALE)
EXTRA += RM.sweep(strategy=STRATEGIES, checkpoint=[True, "reentrant"], steps=[3], **SCALE)


@pytest.fixture(scope="module")
def sweep_results():
    with RankPool(WORLD, num_nodes=2, layout="block") as pool:
        per_rank = pool.run(RM.run_configs, SWEEP + EXTRA)
    return per_rank


@pytest.mark.parametrize("index", range(len(SWEEP + EXTRA)), ids=[
    f"{c.strategy}-{'bf16' if c.bf16 else 'fp32'}-micro{c.micro_steps}"
    + ("-rs" if c.reduce_scatter_micro else "") + ({True: "-ckpt", "reentrant": "-ckpt_reentrant"}.get(c.checkpoint, ""))
    for c in SWEEP + EXTRA
])
def test_parity_and_counts(sweep_results, index):
    cfg = (SWEEP + EXTRA)[index]
    ref = RM.reference_run(cfg, WORLD)
    tol = BF16_TOL if cfg.bf16 else FP32_TOL
    for rank, results in enumerate(sweep_results):
        got = results[index]
        RM.compare(ref, got, label=f"rank {rank}", **tol)
        assert got["unit_strategies"] == cfg.unit_strategies
        expected = RM.expected_counts(cfg)
        for step, counts in enumerate(got["counts"]):
            assert counts == expected, f"rank {rank} step {step}: {counts} != {expected}"
        assert got["clip_counts"] == [RM.expected_clip_counts(cfg)] * len(got["norms"]), got["clip_counts"]


def test_cyclic_layout_hybrid_parity():
    """Ranks placed round-robin over nodes: the shard groups are {0,2} and {1,3}."""
    configs = RM.sweep(strategy=["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"], micro_steps=[1, 2])
    with RankPool(WORLD, num_nodes=2, layout="cyclic") as pool:
        per_rank = pool.run(RM.run_configs, configs)
        plans = pool.run(_shard_group_of_rank)
    assert plans[0] == [0, 2] and plans[1] == [1, 3], plans
    for i, cfg in enumerate(configs):
        ref = RM.reference_run(cfg, WORLD)
        for rank, results in enumerate(per_rank):
            RM.compare(ref, results[i], label=f"cyclic {cfg.strategy} rank {rank}", **FP32_TOL)


def _shard_group_of_rank() -> list[int]:
    import torch.distributed as dist

    return list(RM.groups().plan.shard_group_of(dist.get_rank()))
