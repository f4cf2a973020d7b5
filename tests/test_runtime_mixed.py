"""Per-unit strategies and low-precision gradients, on 4 ranks over 2 simulated nodes.

A mixed model (root FULL_SHARD; blocks HYBRID_SHARD, NO_SHARD, HYBRID_SHARD_ZERO2, each through a
callable policy) and mapping policies (``wrap={Block: strategy}``) train against the single-process
reference: losses and clip norms each step, every parameter at the end, and the collectives of
each step and of each ``clip_grad_norm_``. Then ``keep_low_precision_grads``, state dicts and
``sync_module_states`` on a mixed model, and a unit plan that differs across ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hybridshard as hs
from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=2e-3, rtol=2e-3)  # as in test_runtime_parity.py
MIXED = ("HYBRID_SHARD", "NO_SHARD", "HYBRID_SHARD_ZERO2")

CONFIGS = (
    RM.sweep(strategy=["FULL_SHARD"], block_strategies=[MIXED], bf16=[False, True], micro_steps=[1, 2], clip=[1.0])
    + RM.sweep(strategy=["FULL_SHARD"], block_strategies=[MIXED], micro_steps=[3], reduce_scatter_micro=[True], clip=[1.0])
    + RM.sweep(strategy=["FULL_SHARD"], block_strategies=[MIXED], checkpoint=[True], steps=[3], clip=[1.0])
    + RM.sweep(strategy=["NO_SHARD"], block_strategy=["hybrid_shard_zero2"], micro_steps=[1, 2], clip=[1.0])
    + RM.sweep(strategy=["HYBRID_SHARD"], block_strategy=["SHARD_GRAD_OP"], clip=[1.0])
)
LOW_PRECISION = RM.sweep(
    strategy=["HYBRID_SHARD"], bf16=[True], low_precision_grads=[True], optimizer=["sgd"], lr=[0.1], micro_steps=[1, 2]
) + RM.sweep(
    strategy=["FULL_SHARD"], block_strategies=[MIXED], bf16=[True], low_precision_grads=[True], optimizer=["sgd"], lr=[0.1]
)


def _label(c: RM.Config) -> str:
    blocks = "+".join(s.lower() for s in c.block_strategies) or f"map-{c.block_strategy}"
    return (
        f"{c.strategy}-{blocks}-{'bf16' if c.bf16 else 'fp32'}-micro{c.micro_steps}"
        + ("-rs" if c.reduce_scatter_micro else "") + ("-ckpt" if c.checkpoint else "")
    )


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, num_nodes=2) as p:
        yield p


@pytest.fixture(scope="module")
def results(pool):
    return pool.run(RM.run_configs, CONFIGS + LOW_PRECISION)


@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=[_label(c) for c in CONFIGS])
def test_mixed_parity_norms_and_counts(results, index):
    cfg = CONFIGS[index]
    ref = RM.reference_run(cfg, WORLD)
    assert len(ref["norms"]) == cfg.steps
    for rank, per_config in enumerate(results):
        got = per_config[index]
        assert got["unit_strategies"] == cfg.unit_strategies
        RM.compare(ref, got, label=f"rank {rank}", **(BF16_TOL if cfg.bf16 else FP32_TOL))
        expected = RM.expected_counts(cfg)
        for step, counts in enumerate(got["counts"]):
            assert counts == expected, f"rank {rank} step {step}: {counts} != {expected}"
        assert got["clip_counts"] == [RM.expected_clip_counts(cfg)] * cfg.steps, got["clip_counts"]


@pytest.mark.parametrize("index", range(len(LOW_PRECISION)), ids=[_label(c) for c in LOW_PRECISION])
def test_keep_low_precision_grads(results, index):
    """``.grad`` stays bf16 next to fp32 parameters, SGD steps them, and training tracks the reference."""
    cfg = LOW_PRECISION[index]
    ref = RM.reference_run(cfg, WORLD)
    assert ref["losses"][-1] < ref["losses"][0]
    for rank, per_config in enumerate(results):
        got = per_config[len(CONFIGS) + index]
        assert got["grad_dtypes"] == ["torch.bfloat16"], got["grad_dtypes"]
        assert all(v.dtype == torch.float32 for k, v in got["state"].items() if k != "blocks.0.scale")
        RM.compare(ref, got, label=f"rank {rank}", **BF16_TOL)


def check_mixed_state_dict_and_sync():
    """Mixed units with ``groups=None`` (hybrid units call init_groups), every rank seeded differently."""
    model = RM.make_model(seed=dist.get_rank(), num_blocks=3)
    names_before = [(n, id(p)) for n, p in model.named_parameters()]
    keys_before = list(model.state_dict().keys())
    chosen = dict(zip(model.blocks, MIXED))
    hs.shard(model, strategy="FULL_SHARD", wrap=lambda m: chosen.get(m, False), sync_module_states=True)
    units = model.hybridshard_runtime.units
    sizes = [(u.strategy.name, u.groups.shard_size, u.groups.replicate_size) for u in units]
    assert sizes == [("FULL_SHARD", 4, 1), ("HYBRID_SHARD", 2, 2), ("NO_SHARD", 1, 4), ("HYBRID_SHARD_ZERO2", 2, 2)]
    assert [(n, id(p)) for n, p in model.named_parameters()] == names_before
    full = hs.full_state_dict(model)
    assert list(full) == keys_before
    for k, v in RM.make_model(seed=0, num_blocks=3).state_dict().items():
        torch.testing.assert_close(full[k], v, atol=0, rtol=0)
    changed = {k: v * 2 + 0.25 if v.is_floating_point() else v for k, v in full.items()}
    hs.load_full_state_dict(model, changed)
    again = hs.full_state_dict(model)
    for k, v in changed.items():
        torch.testing.assert_close(again[k], v, atol=0, rtol=0)
    return True


def test_mixed_state_dict_and_sync_module_states(pool):
    assert all(pool.run(check_mixed_state_dict_and_sync))


def check_plan_differs(case):
    model = RM.make_model()
    if case == "unit":
        strategy, wrap = "HYBRID_SHARD", {RM.Block: "NO_SHARD" if dist.get_rank() == 3 else None}
    else:
        strategy, wrap = ("FULL_SHARD" if dist.get_rank() == 1 else "SHARD_GRAD_OP"), {RM.Block}
    try:
        hs.shard(model, strategy=strategy, groups=RM.groups(), wrap=wrap)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "case, expected",
    [
        ("unit", "unit #1: rank 0 has 'blocks.0' with HYBRID_SHARD, rank 3 has 'blocks.0' with NO_SHARD"),
        ("root", "unit #0: rank 0 has '<root>' with SHARD_GRAD_OP, rank 1 has '<root>' with FULL_SHARD"),
    ],
)
def test_unit_plan_differs_across_ranks(pool, case, expected):
    """A rank-dependent policy would issue different collectives and hang; ``shard`` names the unit."""
    for message in pool.run(check_plan_differs, case, stall_s=20):
        assert expected in message, message
