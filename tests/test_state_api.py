"""The state functions no other test reaches, on 4 ranks over 2 simulated nodes (one pool):
``param_shapes``, ``load_full_optim_state_dict`` (into another strategy, other weights, and its
refusals), ``maybe_check_replicas`` (which steps check, and a real divergence caught); and checkpoint
round trips of an fp16 run with ``ShardedGradScaler`` and of a run with ``replicate_compression``,
each against the run that was not interrupted.
"""

from __future__ import annotations

import pytest
import torch

from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
SCALE = 2.0**15
"""The fp16 run's first loss scale: some steps overflow (skipped, halved), the others grow it."""


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, scaler=None, scales=None) -> None:
    """The reference loop's steps ``steps`` on this rank's share (``scales``: the scale before each step)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for step in steps:
        opt.zero_grad(set_to_none=True)
        tokens = RM.batch(step, 0, rank, 2)
        loss = RM.lm_loss(model(tokens), tokens)
        if scaler is None:
            loss.backward()
            opt.step()
            continue
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


def _shard(seed: int, strategy: str, **kw) -> torch.nn.Module:
    import hybridshard as hs

    return hs.shard(RM.make_model(seed=seed), strategy=strategy, groups=RM.groups(), wrap={RM.Block}, **kw)


def _first_line(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as err:
        return str(err).splitlines()[0]
    return "returned"


def optimizer_state_job() -> dict:
    """A: HYBRID_SHARD, AdamW, 2 steps. B: FULL_SHARD from other weights, given A's full weights and
    full optimizer state. C: A's weights alone. All three train 2 more steps."""
    import hybridshard as hs

    a = _shard(0, "HYBRID_SHARD")
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    _train(a, opt_a, range(2))
    weights, full = hs.full_state_dict(a), hs.full_optim_state_dict(a, opt_a)
    out = {"shapes": hs.param_shapes(a), "plain_shapes": hs.param_shapes(RM.make_model())}

    b = _shard(1, "FULL_SHARD")
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    hs.load_full_state_dict(b, weights)
    hs.load_full_optim_state_dict(b, opt_b, full)
    before = hs.full_optim_state_dict(b, opt_b)
    name = next(iter(full["state"]))
    wrong_shape = {**full, "state": {**full["state"], name: {**full["state"][name], "exp_avg": torch.zeros(3, 5)}}}
    out["errors"] = {
        "keys": _first_line(lambda: hs.load_full_optim_state_dict(b, opt_b, {"state": {}})),
        "unknown": _first_line(lambda: hs.load_full_optim_state_dict(
            b, opt_b, {**full, "state": {**full["state"], "nowhere.weight": {}}})),
        "shape": _first_line(lambda: hs.load_full_optim_state_dict(b, opt_b, wrong_shape)),
    }
    after = hs.full_optim_state_dict(b, opt_b)
    out["unchanged"] = all(torch.equal(before["state"][n][k], v) if torch.is_tensor(v) else before["state"][n][k] == v
                           for n, entry in after["state"].items() for k, v in entry.items())

    c = _shard(1, "FULL_SHARD")
    opt_c = torch.optim.AdamW(c.parameters(), lr=1e-2)
    hs.load_full_state_dict(c, weights)
    for model, opt in ((a, opt_a), (b, opt_b), (c, opt_c)):
        _train(model, opt, range(2, 4))
    out.update(a=hs.full_state_dict(a), b=hs.full_state_dict(b), c=hs.full_state_dict(c))
    return out


def replica_check_job() -> dict:
    """Which steps ``maybe_check_replicas`` checks, and a divergence on one replica it catches."""
    import hybridshard as hs
    from hybridshard.runtime.engine import get_engine

    model = _shard(0, "HYBRID_SHARD")
    out = {"steps": [hs.maybe_check_replicas(model, step=s, every=3) for s in range(7)],
           "never": [hs.maybe_check_replicas(model, step=s, every=0) for s in (0, 3)]}
    unit = get_engine(model).units[1]
    if unit.groups.replicate_rank == 1:  # one replica of each shard changes one value
        unit.flat.sharded.data[0] += 1.0
    out["off_step"] = _first_line(lambda: hs.maybe_check_replicas(model, step=4, every=3))
    out["on_step"] = _first_line(lambda: hs.maybe_check_replicas(model, step=6, every=3))
    return out


def scaler_round_trip_job(root: str) -> dict:
    """fp16 with ``ShardedGradScaler`` (``SCALE``, growth every step): 6 steps, or 3,
    a checkpoint holding the scaler's state, and 3 more in a fresh model (other weights) and scaler;
    and the same resume without the scaler's state."""
    import hybridshard as hs

    mp = hs.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)

    def run(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, hs.ShardedGradScaler]:
        model = _shard(seed, "HYBRID_SHARD", mixed_precision=mp)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, opt, hs.ShardedGradScaler("cpu", init_scale=SCALE, growth_interval=1)

    model, opt, scaler = run(0)
    scales: list[float] = []
    _train(model, opt, range(3), scaler, scales)
    hs.save_checkpoint(f"{root}/scaler", model, optimizer=opt, extra={"scaler": scaler.state_dict()})
    _train(model, opt, range(3, 6), scaler, scales)
    out = {"scales": scales, "uninterrupted": hs.full_state_dict(model)}
    for key, keep_scaler in (("resumed", True), ("without_scaler", False)):
        model, opt, scaler = run(1)
        extra = hs.load_checkpoint(f"{root}/scaler", model, optimizer=opt)
        if keep_scaler:
            scaler.load_state_dict(extra["scaler"])
        resumed_scales: list[float] = []
        _train(model, opt, range(3, 6), scaler, resumed_scales)
        out[key], out[f"{key}_scales"] = hs.full_state_dict(model), resumed_scales
    return out


def compression_round_trip_job(root: str) -> dict:
    """``replicate_compression="int8"``: 3 steps, a checkpoint, 3 more; a fresh model (other weights)
    resumed from it; and the uninterrupted run with its error feedback reset at the checkpoint."""
    import hybridshard as hs
    from hybridshard.runtime.engine import get_engine

    def run(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = _shard(seed, "HYBRID_SHARD", replicate_compression="int8")
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, opt = run(0)
    _train(model, opt, range(3))
    hs.save_checkpoint(f"{root}/int8", model, optimizer=opt)
    _train(model, opt, range(3, 6))
    out = {"uninterrupted": hs.full_state_dict(model)}
    model, opt = run(0)
    _train(model, opt, range(3))
    get_engine(model).compressor.reset()
    _train(model, opt, range(3, 6))
    out["reset"] = hs.full_state_dict(model)
    model, opt = run(1)
    hs.load_checkpoint(f"{root}/int8", model, optimizer=opt)
    _train(model, opt, range(3, 6))
    out["resumed"] = hs.full_state_dict(model)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("state-api"))
    with RankPool(WORLD, num_nodes=2, layout="block") as pool:
        return {"optim": pool.run(optimizer_state_job), "replicas": pool.run(replica_check_job),
                "scaler": pool.run(scaler_round_trip_job, root), "int8": pool.run(compression_round_trip_job, root)}


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_param_shapes_are_the_original_shapes(results):
    model = RM.make_model()
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}  # tied head: under embed.weight only
    assert "head.weight" not in expected
    for r in results["optim"]:
        assert r["shapes"] == expected and r["plain_shapes"] == expected


def test_load_full_optim_state_dict_continues_the_run(results):
    """B (another strategy, from other weights) given A's weights and optimizer state steps exactly as
    A; C, given the weights alone, does not (so the optimizer state is what B took)."""
    for rank, r in enumerate(results["optim"]):
        assert _max_diff(r["b"], r["a"]) <= 1e-6, rank
        assert _max_diff(r["c"], r["a"]) > 1e-4, rank


def test_load_full_optim_state_dict_refusals(results):
    for r in results["optim"]:
        errors = r["errors"]
        assert "expected an optimizer state dict with 'state' and 'param_groups'" in errors["keys"], errors
        assert "the model does not have: ['nowhere.weight']" in errors["unknown"], errors
        assert "has shape [3, 5], the parameter has" in errors["shape"], errors
        assert r["unchanged"]


def test_maybe_check_replicas_checks_every_nth_step_and_catches_a_divergence(results):
    for rank, r in enumerate(results["replicas"]):
        assert r["steps"] == [True, False, False, True, False, False, True] and r["never"] == [False, False]
        assert r["off_step"] == "returned", rank  # not a checking step: no collective, no error
        assert r["on_step"].startswith("replicas diverged: ") and "restart from the last checkpoint" in r["on_step"], (
            rank, r["on_step"])


def test_checkpoint_round_trip_keeps_the_fp16_scaler(results):
    for rank, r in enumerate(results["scaler"]):
        pairs = list(zip(r["scales"], r["scales"][1:]))
        assert any(b < a for a, b in pairs) and any(b > a for a, b in pairs), r["scales"]  # steps skipped and taken
        assert r["scales"][3] != SCALE, r["scales"]  # the saved scale is not where a fresh scaler starts
        assert r["resumed_scales"] == r["scales"][3:], (r["resumed_scales"], r["scales"])
        assert _max_diff(r["resumed"], r["uninterrupted"]) == 0.0, rank
        assert r["without_scaler_scales"][0] == SCALE  # a fresh scaler starts over
        assert _max_diff(r["without_scaler"], r["uninterrupted"]) > 0.0, rank


def test_checkpoint_round_trip_with_replicate_compression(results):
    """The checkpoint holds weights and optimizer, not the compression's error-feedback residuals:
    a resumed run equals the uninterrupted one whose residuals were dropped at the checkpoint."""
    for rank, r in enumerate(results["int8"]):
        assert _max_diff(r["resumed"], r["reset"]) == 0.0, rank
        assert _max_diff(r["resumed"], r["uninterrupted"]) < 1e-2, rank  # within the compression's error
