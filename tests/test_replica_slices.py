"""The optimizer sharded across replicas (``shard_optimizer_across_replicas=True``): parity with one
process, memory, bytes, checkpoints to and from the other strategies, clipping, ``no_sync``, errors.

4 ranks on 2 simulated nodes (S = R = 2). One pool (block layout) runs the parity sweep and one job
each for the features and the checkpoints; a second pool checks the cyclic layout.
"""

from __future__ import annotations

import pytest

from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
BF16_TOL = dict(atol=2e-3, rtol=2e-3)

SWEEP = RM.sweep(strategy=["HYBRID_SHARD"], optimizer=["adamw", "sgd"], bf16=[False, True], micro_steps=[1, 2],
                 clip=[1.0], shard_optimizer=[True])
SWEEP += RM.sweep(strategy=["HYBRID_SHARD_ZERO2"], optimizer=["adamw", "sgd"], micro_steps=[2], clip=[1.0],
                  shard_optimizer=[True])
SWEEP += RM.sweep(strategy=["HYBRID_SHARD"], micro_steps=[3], reduce_scatter_micro=[True], clip=[1.0],
                  shard_optimizer=[True])
SWEEP += RM.sweep(strategy=["HYBRID_SHARD"], micro_steps=[2], clip=[1.0], executor=["streams"], shard_optimizer=[True])
SWEEP += RM.sweep(strategy=["HYBRID_SHARD"], overlap_grads=[False], prefetch=[0], clip=[1.0], shard_optimizer=[True])
# Per-unit strategies: the blocks sliced, the root FULL_SHARD over the world (norm over the job).
SWEEP += RM.sweep(strategy=["HYBRID_SHARD"], block_strategies=[("FULL_SHARD", "HYBRID_SHARD")], clip=[1.0],
                  shard_optimizer=[True])
COMPRESSED = RM.sweep(strategy=["HYBRID_SHARD"], compression=["bf16"], clip=[1.0], shard_optimizer=[True])


def _label(c: RM.Config) -> str:
    return (f"{c.strategy}-{c.optimizer}-{'bf16' if c.bf16 else 'fp32'}-micro{c.micro_steps}"
            + ("-rs" if c.reduce_scatter_micro else "") + (f"-{c.executor}" if c.executor else "")
            + ("-sync" if not c.overlap_grads else "") + ("-mixed" if c.block_strategies else ""))


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, num_nodes=2, layout="block") as p:
        yield p


@pytest.fixture(scope="module")
def sweep_results(pool):
    return pool.run(RM.run_configs, SWEEP + COMPRESSED)


@pytest.mark.parametrize("index", range(len(SWEEP)), ids=[_label(c) for c in SWEEP])
def test_parity_with_one_process(sweep_results, index):
    """Losses, norms and parameters equal one process; collectives per step as expected."""
    RM.check_ranks(SWEEP[index], sweep_results, index, WORLD)


def test_compressed_reduce_scatter_close(sweep_results):
    """bf16-compressed reduce-scatter across replicas: close to exact, the parameters' all-gather exact
    (every rank ends with the same parameters, checked by the job itself through full_state_dict)."""
    cfg = COMPRESSED[0]
    ref = RM.reference_run(cfg, WORLD)
    states = [results[len(SWEEP)]["state"] for results in sweep_results]
    for rank in range(WORLD):
        RM.compare(ref, sweep_results[rank][len(SWEEP)], label=f"rank {rank}", atol=2e-2, rtol=2e-2)
        for key in states[0]:
            assert states[rank][key].equal(states[0][key]), key


@pytest.fixture(scope="module")
def features(pool):
    return pool.run(_features_job)


def test_optimizer_state_is_one_slice_per_rank(features):
    """AdamW state per rank = 2 x 4 bytes x the trainable elements of this rank's slice; the slices tile every padded unit once
    over the job; HYBRID_SHARD's state per rank is R times as large (up to padding)."""
    padded = features[0]["padded_numel"]
    trainable = sum(p.numel() for p in RM.make_model().parameters() if p.requires_grad)
    assert sum(f["owned_numel"] for f in features) == padded
    assert sum(f["trainable_local"] for f in features) == trainable  # every element once over the job
    for f in features:
        assert f["optim_bytes"] == 2 * 4 * f["trainable_local"]
        assert f["owned_numel"] * WORLD == padded
        assert f["optim_bytes"] * 2 == pytest.approx(f["optim_bytes_hybrid"], rel=0.05)


def test_planner_matches_measured_optimizer_bytes(features):
    """``plan --model-params``'s optimizer figure for the option is within 5 % of the bytes measured
    after one step, and its inter-node traffic equals HYBRID_SHARD's."""
    from hybridshard.estimates import sizing
    from hybridshard.runtime.units.strategy import ShardingStrategy

    model = RM.make_model()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    distinct = sum(p.numel() for p in model.parameters())
    spec = sizing.ModelSpec(num_params=distinct, unit_params=block, root_params=distinct - 2 * block,
                            param_dtype="fp32", reduce_dtype="fp32", master_dtype="fp32")
    cluster = sizing.ClusterSpec(node_sizes=(2, 2), gpu_memory_bytes=10**9)
    sliced = sizing.estimate(ShardingStrategy.HYBRID_SHARD, 2, model=spec, cluster=cluster, shard_optimizer=True)
    hybrid = sizing.estimate(ShardingStrategy.HYBRID_SHARD, 2, model=spec, cluster=cluster)
    for f in features:
        assert sliced.memory.optimizer == pytest.approx(f["optim_bytes"], rel=0.05)
    assert sliced.bytes_by_link == hybrid.bytes_by_link
    assert sliced.memory.optimizer * 2 == hybrid.memory.optimizer


def test_mixed_precision_master_is_one_slice_per_rank(features):
    """bf16 compute: each rank keeps the fp32 master for its slice (4 B / (S R)) and the shard in bf16
    (2 B / S), against HYBRID_SHARD's fp32 shard (4 B / S); parameters stay fp32 to the optimizer."""
    for f in features:
        slice_numel = f["owned_numel"]
        assert f["master_bytes"] == 4 * slice_numel + 2 * 2 * slice_numel
        assert f["master_bytes_hybrid"] == 4 * f["shard_numel_hybrid"]
        assert f["master_bytes_dtypes"] == f["master_bytes_hybrid_dtypes"] == ["torch.float32"]


def test_inter_node_bytes_equal_hybrid_shard(features):
    """comm_stats: reduce-scatter + all-gather across replicas = HYBRID_SHARD's all-reduce, per step."""
    for f in features:
        sliced, hybrid = f["replicate_bytes"], f["replicate_bytes_hybrid"]
        assert set(sliced["ops"]) == {"reduce_scatter", "all_gather"} and set(hybrid["ops"]) == {"all_reduce"}
        # ring model, R = 2: (R-1)/R * shard bytes each way; the all-reduce moves 2 (R-1)/R * shard bytes.
        assert sliced["total"] == pytest.approx(2 * 0.5 * 4 * f["shard_numel"])
        assert hybrid["total"] == pytest.approx(2 * 0.5 * 4 * f["shard_numel_hybrid"])
        assert sliced["total"] == pytest.approx(hybrid["total"], rel=0.05)


def test_replicas_agree_and_manual_updates_need_a_gather(features):
    for f in features:
        assert f["replicas_after_steps"] == "ok"
        assert "replicas diverged" in f["replicas_after_manual_change"]
        assert f["replicas_after_gather"] == "ok"


def test_full_optim_state_dict_equals_hybrid_shard(features):
    for f in features:
        assert f["optim_state_max_diff"] < 1e-6, f["optim_state_max_diff"]


def test_errors(features):
    for f in features:
        assert f["error_strategy"].startswith("shard_optimizer_across_replicas=True expects a hybrid strategy"), f
        assert "found strategy=FULL_SHARD" in f["error_strategy"]
        assert f["error_flag"] == "shard_optimizer_across_replicas must be True or False; got 'yes'", f
        assert f["error_offload"].startswith("shard_optimizer_across_replicas=True expects the master shards"), f
        assert f["error_optimizer"].startswith("expected optimizer state for each rank's slice"), f
        assert "found state 'exp_avg'" in f["error_optimizer"] or "on another rank" in f["error_optimizer"]
        assert "build the optimizer on model.parameters() after" in f["error_optimizer"]


def test_checkpoints_to_and_from_other_strategies(pool, tmp_path):
    results = pool.run(_checkpoint_job, str(tmp_path))
    for rank, r in enumerate(results):
        for what, diff in r.items():  # fp32: summation order only; a bf16 step: bf16 roundings
            assert diff < (BF16_TOL["atol"] if "bf16 step" in what else 1e-5), f"rank {rank} {what}: {diff}"
    assert {"into HYBRID_SHARD", "into FULL_SHARD", "from FULL_SHARD", "from one process", "one process"} <= set(results[0])


def test_cyclic_layout_parity():
    configs = RM.sweep(strategy=["HYBRID_SHARD", "HYBRID_SHARD_ZERO2"], micro_steps=[2], clip=[1.0],
                       reduce_scatter_micro=[True], shard_optimizer=[True])
    with RankPool(WORLD, num_nodes=2, layout="cyclic") as cyclic:
        per_rank = cyclic.run(RM.run_configs, configs)
    for i, cfg in enumerate(configs):
        RM.check_ranks(cfg, per_rank, i, WORLD)


# -- jobs (run on every rank) -------------------------------------------------------------------


def _train(strategy: str, *, sliced: bool, steps: int = 2, offset: int = 0, bf16: bool = False):
    import torch
    import torch.distributed as dist

    import hybridshard as hs

    model = RM.make_model()
    mp = hs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    hs.shard(model, strategy=strategy, groups=RM.groups() if "HYBRID" in strategy else None, wrap={RM.Block},
             shard_optimizer_across_replicas=sliced, mixed_precision=mp)
    opt = RM.make_optimizer(RM.Config(), model.parameters())
    _steps(model, opt, steps, offset=offset, rank=dist.get_rank())
    return model, opt


def _steps(model, opt, steps: int, *, offset: int, rank: int) -> None:
    import hybridshard as hs

    for step in range(offset, offset + steps):
        opt.zero_grad(set_to_none=True)
        tokens = RM.batch(step, 0, rank, 2)
        RM.lm_loss(model(tokens), tokens).backward()
        hs.clip_grad_norm_(model, 1.0)
        opt.step()


def _replica_bytes(model) -> dict:
    import hybridshard as hs

    group = hs.comm_stats(model, reset=True)["groups"].get("replicate", {})
    return {"ops": sorted(k for k in group if k != "total"), "total": group.get("total", {}).get("ring_bytes", 0.0)}


def _optim_bytes(opt) -> int:
    return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim() > 0)


def _error(fn) -> str:
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def _replica_check(model) -> str:
    import hybridshard as hs

    try:
        hs.check_replicas(model)
    except RuntimeError as err:
        return str(err)
    return "ok"


def _features_job() -> dict:
    import torch
    import torch.distributed as dist

    import hybridshard as hs

    out: dict = {}
    model, opt = _train("HYBRID_SHARD", sliced=True, steps=1)
    hybrid, hybrid_opt = _train("HYBRID_SHARD", sliced=False, steps=1)
    units = model.hybridshard_runtime.units
    out["owned_numel"] = sum(u.flat.owned_numel for u in units)
    out["trainable_local"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out["padded_numel"] = sum(u.flat.layout.padded_numel for u in units)
    out["shard_numel"] = sum(u.flat.layout.shard_numel for u in units)
    out["shard_numel_hybrid"] = sum(u.flat.layout.shard_numel for u in hybrid.hybridshard_runtime.units)
    out["optim_bytes"], out["optim_bytes_hybrid"] = _optim_bytes(opt), _optim_bytes(hybrid_opt)
    hs.comm_stats(model, reset=True), hs.comm_stats(hybrid, reset=True)
    _steps(model, opt, 1, offset=1, rank=dist.get_rank())
    _steps(hybrid, hybrid_opt, 1, offset=1, rank=dist.get_rank())
    out["replicate_bytes"], out["replicate_bytes_hybrid"] = _replica_bytes(model), _replica_bytes(hybrid)

    out["replicas_after_steps"] = _replica_check(model)
    sliced_osd, hybrid_osd = hs.full_optim_state_dict(model, opt), hs.full_optim_state_dict(hybrid, hybrid_opt)
    out["optim_state_max_diff"] = max(
        float((v - hybrid_osd["state"][name][key]).abs().max()) if v.dim() else 0.0
        for name, entry in sliced_osd["state"].items() for key, v in entry.items()
    )
    with torch.no_grad():  # a change outside optimizer.step(): this replica's slice only
        for p in model.parameters():
            p.add_(1.0)
    out["replicas_after_manual_change"] = _replica_check(model)
    hs.gather_updated_params(model)
    out["replicas_after_gather"] = _replica_check(model)

    # Mixed precision: the fp32 master exists for the slice only; the shard is kept in bf16.
    for name, sliced in (("master_bytes", True), ("master_bytes_hybrid", False)):
        low, _ = _train("HYBRID_SHARD", sliced=sliced, steps=1, bf16=True)
        flats = [u.flat for u in low.hybridshard_runtime.units]
        out[name] = sum(f.owned.numel() * f.owned.element_size() for f in flats) + sum(
            f.sharded.numel() * f.sharded.element_size() for f in flats if f.separate_master)
        out[name + "_dtypes"] = sorted({str(p.dtype) for p in low.parameters()})

    out["error_strategy"] = _error(lambda: hs.shard(RM.make_model(), strategy="FULL_SHARD",
                                                    shard_optimizer_across_replicas=True))
    out["error_flag"] = _error(lambda: hs.shard(RM.make_model(), groups=RM.groups(),
                                                shard_optimizer_across_replicas="yes"))
    out["error_offload"] = _error(lambda: hs.shard(RM.make_model(), groups=RM.groups(), offload=hs.CPUOffload(),
                                                   shard_optimizer_across_replicas=True))
    # An optimizer that stepped the full parameters before shard(): its state no longer fits the slices.
    plain = RM.make_model()
    early = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    RM.lm_loss(plain(RM.batch(0, 0, 0, 2)), RM.batch(0, 0, 0, 2)).backward()
    early.step()
    hs.shard(plain, groups=RM.groups(), wrap={RM.Block}, shard_optimizer_across_replicas=True)
    tokens = RM.batch(0, 0, dist.get_rank(), 2)
    early.zero_grad(set_to_none=True)
    RM.lm_loss(plain(tokens), tokens).backward()
    out["error_optimizer"] = _error(early.step)
    return out


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0 for k in a)


def _optim_diff(a: dict, b: dict) -> float:
    return max(
        float((v - b["state"][name][key]).abs().max()) if torch_is_tensor(v) and v.dim() else 0.0
        for name, entry in a["state"].items() for key, v in entry.items()
    )


def torch_is_tensor(v) -> bool:
    import torch

    return torch.is_tensor(v)


def _checkpoint_job(root: str) -> dict:
    import os

    import torch
    import torch.distributed as dist

    import hybridshard as hs

    rank = dist.get_rank()
    diffs: dict = {}
    model, opt = _train("HYBRID_SHARD", sliced=True)
    sliced_dir = os.path.join(root, "sliced")
    hs.save_checkpoint(sliced_dir, model, optimizer=opt)
    _steps(model, opt, 1, offset=2, rank=rank)
    expected = hs.full_state_dict(model)
    # Written with the option, read by every other layout; one more step there matches the option's.
    for strategy in ("HYBRID_SHARD", "FULL_SHARD"):
        other, other_opt = _train(strategy, sliced=False, steps=0)
        hs.load_checkpoint(sliced_dir, other, optimizer=other_opt)
        _steps(other, other_opt, 1, offset=2, rank=rank)
        diffs[f"into {strategy}"] = _max_diff(hs.full_state_dict(other), expected)
        # ... and back: the other layout's checkpoint read with the option.
        other_dir = os.path.join(root, strategy)
        hs.save_checkpoint(other_dir, other, optimizer=other_opt)
        back, back_opt = _train("HYBRID_SHARD", sliced=True, steps=0)
        hs.load_checkpoint(other_dir, back, optimizer=back_opt)
        diffs[f"from {strategy}"] = max(_max_diff(hs.full_state_dict(back), hs.full_state_dict(other)),
                                        _optim_diff(hs.full_optim_state_dict(back, back_opt),
                                                    hs.full_optim_state_dict(other, other_opt)))
    # Mixed precision: the fp32 master slices are what is saved, and what HYBRID_SHARD then holds.
    low, low_opt = _train("HYBRID_SHARD", sliced=True, bf16=True)
    low_dir = os.path.join(root, "sliced_bf16")
    hs.save_checkpoint(low_dir, low, optimizer=low_opt)
    other, other_opt = _train("HYBRID_SHARD", sliced=False, steps=0, bf16=True)
    hs.load_checkpoint(low_dir, other, optimizer=other_opt)
    diffs["bf16 into HYBRID_SHARD"] = max(_max_diff(hs.full_state_dict(other), hs.full_state_dict(low)),
                                          _optim_diff(hs.full_optim_state_dict(other, other_opt),
                                                      hs.full_optim_state_dict(low, low_opt)))
    back, back_opt = _train("HYBRID_SHARD", sliced=True, steps=0, bf16=True)
    hs.load_full_state_dict(back, hs.full_state_dict(other))
    diffs["bf16 full state dict back"] = _max_diff(hs.full_state_dict(back), hs.full_state_dict(low))
    # The bf16 compute copy was loaded too: a step from there matches HYBRID_SHARD's from the same state.
    fresh, fresh_opt = _train("HYBRID_SHARD", sliced=False, steps=0, bf16=True)
    hs.load_full_state_dict(fresh, hs.full_state_dict(other))
    _steps(back, back_opt, 1, offset=2, rank=rank)
    _steps(fresh, fresh_opt, 1, offset=2, rank=rank)
    diffs["bf16 step after load"] = _max_diff(hs.full_state_dict(back), hs.full_state_dict(fresh))

    # One process: rank 0 reads the option's checkpoint into a plain model and writes it back.
    plain_dir = os.path.join(root, "plain")
    if rank == 0:
        plain = RM.make_model()
        plain_opt = RM.make_optimizer(RM.Config(), plain.parameters())
        hs.load_checkpoint(sliced_dir, plain, optimizer=plain_opt)
        for step in (2,):  # the same step on the global batch the four ranks computed
            plain_opt.zero_grad(set_to_none=True)
            tokens = torch.cat([RM.batch(step, 0, r, 2) for r in range(dist.get_world_size())])
            RM.lm_loss(plain(tokens), tokens).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
            plain_opt.step()
        diffs["one process"] = _max_diff({k: v for k, v in plain.state_dict().items()}, expected)
        hs.save_checkpoint(plain_dir, plain, optimizer=plain_opt)
    dist.barrier()
    back, back_opt = _train("HYBRID_SHARD", sliced=True, steps=0)
    hs.load_checkpoint(plain_dir, back, optimizer=back_opt)
    diffs["from one process"] = _max_diff(hs.full_state_dict(back), expected)
    return diffs
