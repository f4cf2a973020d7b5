"""Runtime behaviour beyond parity: names and state dicts, eval and repeated forwards, module-state
sync, ZeRO-2 mutation checks, and every bad input ``shard`` must reject. 4 ranks, 2 nodes, one pool."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hybridshard as hs
from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def pool():
    with RankPool(4, num_nodes=2) as p:
        yield p


def _shard(model, strategy="HYBRID_SHARD", **kw):
    return hs.shard(model, strategy=strategy, groups=RM.groups(), wrap={RM.Block}, **kw)


def check_names_and_state_dict(strategy):
    model = RM.make_model()
    names_before = [(n, id(p)) for n, p in model.named_parameters()]
    keys_before = list(model.state_dict().keys())
    full_before = {k: v.clone() for k, v in model.state_dict().items()}
    _shard(model, strategy)
    assert [(n, id(p)) for n, p in model.named_parameters()] == names_before
    with pytest.raises(ValueError, match="refused on a sharded .*hybridshard.full_state_dict"):
        model.state_dict()
    full = hs.full_state_dict(model)
    assert list(full) == keys_before
    for k, v in full_before.items():
        torch.testing.assert_close(full[k], v, atol=0, rtol=0)
    # Round trip: load changed values, read them back.
    changed = {k: v + 0.5 if v.is_floating_point() else v for k, v in full.items()}
    hs.load_full_state_dict(model, changed)
    again = hs.full_state_dict(model)
    for k, v in changed.items():
        torch.testing.assert_close(again[k], v, atol=0, rtol=0)
    errors = []
    for bad in ({k: v for k, v in changed.items() if k != "pos"}, {**changed, "pos": torch.zeros(2, 2)}):
        try:
            hs.load_full_state_dict(model, bad)
        except ValueError as e:
            errors.append(str(e))
    return errors


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD", "HYBRID_SHARD_ZERO2"])
def test_names_state_dict_round_trip(pool, strategy):
    for errors in pool.run(check_names_and_state_dict, strategy):
        assert len(errors) == 2 and "missing keys ['pos']" in errors[0] and "'pos' has shape [2, 2]" in errors[1]


def check_replaced_data(strategy):
    """A parameter whose ``.data`` was replaced between steps: full_state_dict shows the new values,
    and a loaded state dict wins over the replacement at the next forward."""
    model = RM.make_model()
    _shard(model, strategy)
    saved = hs.full_state_dict(model)
    p = model.blocks[0].fc1.weight
    p.data = torch.full_like(p.data, 7.0)
    shown = hs.full_state_dict(model)["blocks.0.fc1.weight"]
    assert bool((shown == 7.0).all()), shown
    hs.load_full_state_dict(model, saved)
    tokens = RM.batch(0, 0, dist.get_rank(), 2)
    with torch.no_grad():
        out = model(tokens)
    torch.testing.assert_close(out, RM.make_model()(tokens).detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hs.full_state_dict(model)["blocks.0.fc1.weight"], saved["blocks.0.fc1.weight"])
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_replaced_data_and_state_dicts(pool, strategy):
    assert all(pool.run(check_replaced_data, strategy))


def check_eval_and_repeated_forwards(strategy):
    rank = dist.get_rank()
    ref, model = RM.make_model(), RM.make_model()
    _shard(model, strategy)
    tokens = RM.batch(0, 0, rank, 2)
    with torch.no_grad():
        out = model.eval()(tokens)
    torch.testing.assert_close(out, ref(tokens).detach(), atol=1e-5, rtol=1e-5)
    runtime = model.hybridshard_runtime
    assert all(u.sharded_state is hs.ShardedState.SHARDED for u in runtime.units)
    assert all(isinstance(p, nn.Parameter) for _, p in model.named_parameters())
    # Two forwards, one backward: gradients equal the reference's on the same two batches.
    model.train()
    t1, t2 = RM.batch(1, 0, rank, 2), RM.batch(1, 1, rank, 2)
    (RM.lm_loss(model(t1), t1) + RM.lm_loss(model(t2), t2)).backward()
    (RM.lm_loss(ref(t1), t1) + RM.lm_loss(ref(t2), t2)).backward()
    for p in ref.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ref_full = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_full) and "blocks.0.gate" not in grads
    for unit in runtime.units:
        for slot, part, p in zip(unit.flat.layout.slots, unit.flat.local, unit.flat.params):
            if p.requires_grad:
                want = ref_full[slot.name].reshape(-1)[part.param_start : part.param_start + part.numel]
                torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=1e-5)
    assert all(u.training_state is hs.TrainingState.IDLE for u in runtime.units)
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"])
def test_eval_and_two_forwards_one_backward(pool, strategy):
    assert all(pool.run(check_eval_and_repeated_forwards, strategy))


def check_forward_without_backward_then_step(strategy):
    """A gathered-and-kept unit must not serve stale values after the master changed."""
    rank = dist.get_rank()
    ref, model = RM.make_model(), RM.make_model()
    _shard(model, strategy)
    tokens = RM.batch(0, 0, rank, 2)
    params = {"model": list(model.parameters()), "ref": list(ref.parameters())}  # as an optimizer holds them
    model(tokens)  # gradients enabled, no backward: the root (and ZeRO-2 units) stay gathered
    with torch.no_grad():
        for p in params["model"] + params["ref"]:
            p.mul_(0.5).add_(0.01)  # an optimizer-like in-place update of every parameter
    torch.testing.assert_close(model(tokens).detach(), ref(tokens).detach(), atol=1e-5, rtol=1e-5)
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2", "NO_SHARD"])
def test_forward_without_backward_then_update_uses_new_values(pool, strategy):
    assert all(pool.run(check_forward_without_backward_then_step, strategy))


def check_sync_module_states():
    model = RM.make_model(seed=dist.get_rank())  # different values on every rank
    _shard(model, sync_module_states=True)
    full = hs.full_state_dict(model)
    ref = RM.make_model(seed=0)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, atol=0, rtol=0)
    return True


def test_sync_module_states(pool):
    assert all(pool.run(check_sync_module_states))


def check_zero2_mutation(how):
    model = RM.make_model()
    _shard(model, "HYBRID_SHARD_ZERO2")
    params = dict(model.named_parameters())  # the original parameters, as an optimizer holds them
    tokens = RM.batch(0, 0, dist.get_rank(), 2)
    loss = RM.lm_loss(model(tokens), tokens)
    if how == "in_place":
        with torch.no_grad():
            model.blocks[0].fc1.weight.add_(1.0)
    elif how == "optimizer":
        with torch.no_grad():
            params["blocks.0.fc1.bias"].add_(1.0)  # as an optimizer step would
    else:
        model.blocks[1].fc2.bias = nn.Parameter(torch.zeros(RM.DIM))
    try:
        loss.backward()
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "how, name", [("in_place", "blocks.0.fc1.weight"), ("replace", "blocks.1.fc2.bias"), ("optimizer", "blocks.0.fc1.bias")]
)
def test_zero2_change_between_forward_and_backward_raises(pool, how, name):
    messages = pool.run(check_zero2_mutation, how)
    for message in messages:
        assert "between forward and backward" in message and name in message, message
    # A rank names the parameter exactly when the change lies in its own shard (the check is local,
    # so that a change on one rank only cannot hang); the others list the unit's candidates.
    assert any(f"parameter {name!r}" in m for m in messages), messages


def check_root_without_parameters_and_nan_model():
    """A root owning no parameter gathers nothing, flat and in two hops (the default on this pool of
    2 nodes x 2 ranks); a NaN parameter on every rank is not a difference."""
    gathers = {}
    for name, two_hop in (("flat", False), ("default", None)):
        torch.manual_seed(0)
        model = nn.Sequential(RM.Block(), RM.Block())
        _shard(model, "FULL_SHARD", two_hop=two_hop)
        x = torch.randn(2, 4, RM.DIM)
        with hs.count_collectives() as counts:
            model(x).sum().backward()
        gathers[name] = {group: counts.get("all_gather", group) for group in ("world", "world_node", "world_across")}
    torch.manual_seed(0)
    nan_model = nn.Sequential(RM.Block(), RM.Block())
    with torch.no_grad():
        nan_model[0].fc1.bias[0] = float("nan")
    _shard(nan_model, "FULL_SHARD")  # must not claim that the ranks differ
    return gathers


def test_root_without_parameters_gathers_nothing_and_nan_is_not_a_difference(pool):
    # Two ZeRO-3 blocks, each gathered for forward and again for backward; the empty root adds none.
    # In two hops each gather is one call across the nodes, then the node's hop (its number of calls
    # is the hop's own business: [Note: a shard group in two hops] in hybridshard/runtime/comm/two_hop.py).
    for got in pool.run(check_root_without_parameters_and_nan_model):
        assert got["flat"] == {"world": 4, "world_node": 0, "world_across": 0}, got
        assert got["default"]["world"] == 0 and got["default"]["world_across"] == 4, got
        assert got["default"]["world_node"] >= 4, got


def check_bad_input(case):
    model = RM.make_model()
    try:
        if case == "differs":
            if dist.get_rank() == 2:
                model.blocks[1].fc1 = nn.Linear(RM.DIM, 3 * RM.DIM)
            _shard(model)
        elif case == "twice":
            _shard(model)
            _shard(model)
        elif case == "wrap":
            hs.shard(model, groups=RM.groups(), wrap={nn.Conv2d})
        elif case == "meta_no_init":  # meta parameters are initialised in shard(), by reset_parameters or a fn
            model.blocks[0].gate = nn.Parameter(torch.empty(RM.DIM, device="meta"), requires_grad=False)
            _shard(model)
        elif case == "groups":
            world = dist.group.WORLD
            bad = hs.ShardGroups(shard=world, replicate=world, mesh=None, plan=RM.groups().plan)
            hs.shard(model, strategy="HYBRID_SHARD", groups=bad)
        elif case == "strategy":
            hs.shard(model, strategy="zero3")
        elif case == "frozen_some_ranks":
            if dist.get_rank() == 1:
                model.blocks[0].fc1.weight.requires_grad_(False)
            _shard(model)
        elif case == "dtype":
            hs.MixedPrecision(param_dtype="bf16")
        elif case == "unsharded_no_sync":
            with hs.no_sync(model):
                pass
        elif case == "unsharded_clip":
            hs.clip_grad_norm_(model, 1.0)
        elif case == "unsharded_state_dict":
            hs.full_state_dict(model)
        elif case == "unit_strategy":
            hs.shard(model, groups=RM.groups(), wrap={RM.Block: "zero3"})
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize(
    "case, expected",
    [
        ("differs", "differs across ranks at parameter 'blocks.1.fc1.weight'"),
        ("twice", "already sharded"),
        ("wrap", "matched no submodule"),
        ("meta_no_init", "but 'blocks.0' (Block) has no reset_parameters(); pass shard(..., param_init_fn=fn)"),
        ("groups", "shard group size 4 x replicate group size 4 = 16, but the job has 4 ranks"),
        ("strategy", "strategy must be a ShardingStrategy"),
        ("frozen_some_ranks", "differs across ranks at parameter 'blocks.0.fc1.weight': rank 0 has "
         "blocks.0.fc1.weight shape [32, 16] torch.float32 (sum"),
        ("dtype", "MixedPrecision.param_dtype must be a floating dtype"),
        ("unsharded_no_sync", "TinyLM is not sharded: call hybridshard.shard(model, ...) first"),
        ("unsharded_clip", "TinyLM is not sharded"),
        ("unsharded_state_dict", "TinyLM is not sharded"),
        ("unit_strategy", "wrap[Block] must be a ShardingStrategy, one of FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, "
         "HYBRID_SHARD, HYBRID_SHARD_ZERO2 (any case), or None for the model's strategy; got 'zero3'"),
    ],
)
def test_bad_input(pool, case, expected):
    for message in pool.run(check_bad_input, case, stall_s=20):
        assert expected in message, message


def _grads_match_reference(model, ref):
    """Every parameter's sharded ``.grad`` equals the reference's (same batch on every rank)."""
    ref_grads = dict((n, p.grad) for n, p in ref.named_parameters())
    for unit in model.hybridshard_runtime.units:
        for slot, part, p in zip(unit.flat.layout.slots, unit.flat.local, unit.flat.params):
            want = ref_grads[slot.name]
            assert (p.grad is None) == (want is None), (slot.name, p.grad, want)
            if want is not None:
                want = want.reshape(-1)[part.param_start : part.param_start + part.numel]
                torch.testing.assert_close(p.grad, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{slot.name}: {m}")


def check_unfrozen_after_shard(strategy):
    """A unit whose parameters were all frozen at ``shard`` time gets gradients once unfrozen."""
    ref, model = RM.make_model(), RM.make_model()
    for m in (ref, model):
        m.blocks[0].requires_grad_(False)
    _shard(model, strategy)
    for m in (ref, model):
        m.blocks[0].fc1.requires_grad_(True)
    tokens = RM.batch(0, 0, 0, 2)
    for m in (ref, model):
        RM.lm_loss(m(tokens), tokens).backward()
    _grads_match_reference(model, ref)
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD_ZERO2"])
def test_unit_frozen_at_shard_then_unfrozen_gets_gradients(pool, strategy):
    assert all(pool.run(check_unfrozen_after_shard, strategy))


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("simulated failure in backward")


class _HoldingEngine:
    """The autograd engine, but every final callback queued through it stays referenced, as when
    something keeps a raised backward's graph task (and its callbacks) alive for a while."""

    def __init__(self) -> None:
        self.held: list = []

    def queue_callback(self, callback) -> None:
        self.held.append(callback)
        torch.autograd.Variable._execution_engine.queue_callback(callback)


def check_backward_that_raises(strategy, hold_callbacks=False):
    """A backward that raises half-way (a skipped batch) leaves the model usable for the next step,
    also while its callback is still referenced (``hold_callbacks``)."""
    from hybridshard.runtime import engine as engine_module

    if hold_callbacks:
        holder = types.SimpleNamespace(_execution_engine=_HoldingEngine())
        saved, engine_module.Variable = engine_module.Variable, holder
    try:
        return _backward_that_raises(strategy)
    finally:
        if hold_callbacks:
            engine_module.Variable = saved


def _backward_that_raises(strategy):
    ref, model = RM.make_model(), RM.make_model()
    _shard(model, strategy)
    tokens = RM.batch(0, 0, 0, 2)
    handle = model.blocks[0].register_forward_hook(lambda mod, args, out: _FailInBackward.apply(out))
    out = model(tokens)
    handle.remove()
    try:
        RM.lm_loss(out, tokens).backward()  # blocks.1 and the root reduce, then blocks.0 raises
    except RuntimeError as e:
        assert "simulated failure" in str(e)
    else:
        raise AssertionError("backward did not raise")
    model.zero_grad(set_to_none=True)
    for m in (ref, model):
        RM.lm_loss(m(tokens), tokens).backward()
    _grads_match_reference(model, ref)
    runtime = model.hybridshard_runtime
    assert not runtime.in_backward
    assert all(u.sharded_state is hs.ShardedState.SHARDED and u.training_state is hs.TrainingState.IDLE for u in runtime.units)
    return True


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD_ZERO2", "NO_SHARD"])
def test_backward_that_raises_then_next_step(pool, strategy):
    assert all(pool.run(check_backward_that_raises, strategy))


def test_backward_that_raises_then_next_step_while_its_callback_is_still_held(pool):
    assert all(pool.run(check_backward_that_raises, "NO_SHARD", hold_callbacks=True))


def check_nan_loss_on_one_rank(strategy):
    """A NaN loss on rank 1: no hang; the reduction carries NaN to every rank's gradient, and the
    clip reports it on every rank alike (or raises on every rank with ``error_if_nonfinite``)."""
    model = RM.make_model()
    _shard(model, strategy)
    tokens = RM.batch(0, 0, dist.get_rank(), 2)
    loss = RM.lm_loss(model(tokens), tokens)
    if dist.get_rank() == 1:
        loss = loss * float("nan")
    loss.backward()
    norm = float(hs.clip_grad_norm_(model, 1.0))
    nan_grads = all(bool(p.grad.isnan().any()) for p in model.parameters() if p.grad is not None and p.grad.numel())
    try:
        hs.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)
        raised = ""
    except RuntimeError as e:
        raised = str(e)
    return norm, nan_grads, raised


@pytest.mark.parametrize("strategy", ["HYBRID_SHARD", "NO_SHARD"])
def test_nan_loss_on_one_rank(pool, strategy):
    for norm, nan_grads, raised in pool.run(check_nan_loss_on_one_rank, strategy, stall_s=30):
        assert norm != norm and nan_grads
        assert "total gradient norm is nan" in raised, raised
