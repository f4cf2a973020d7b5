"""Per-rank jobs of tests/test_frozen_memory.py besides training runs: one step measured as
tests/test_memory.py measures it, the bytes ``zero_grad(set_to_none=True)`` frees, checkpoint stages
and conversions after ``shard``. Models and runs: tests/frozen_models.py."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import hybridshard as hs
from hybridshard.runtime.units.unit import Unit
from tests import runtime_models as RM
from tests.frozen_models import data, loss_of, make, optimizer
from tests.live_bytes import LiveTensorBytes
from tests.test_memory import StepBytes, _Recorder, _static_bytes


# -- one measured step, counted as tests/test_memory.py counts ------------------------------------


def measure(kind: str, strategy: str, *, prefetch: int = 1, split: float | None = 0.5, early: bool = True,
            two_hop: bool | None = None) -> dict:
    """One rank: the peak live bytes of one step after a warm-up step, what the unsharded buffers
    peaked at, and what the gradient reductions moved. ``early=False`` turns the input hooks off
    (frozen units then stay gathered until the end of backward, as before them). ``two_hop``:
    ``shard()``'s; the memory formulas are those of the flat collectives (``False``)."""
    rank = dist.get_rank()
    model, block = make(kind)
    hs.shard(model, strategy=strategy, groups=RM.groups(), wrap={block}, prefetch=prefetch, overlap_grads=False,
             split_frozen=split, two_hop=two_hop)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = Unit.watch_inputs
    if not early:
        Unit.watch_inputs = lambda self, args, kwargs: None
    try:
        for step in range(2):
            opt.zero_grad(set_to_none=True)
            x, y = data(step, 0, rank)
            if step == 0:
                loss_of(model, kind, x, y).backward()
                opt.step()
                hs.comm_stats(model, reset=True)
                continue
            static = _static_bytes(model, opt)
            with StepBytes() as live:
                rec = _Recorder(live)
                try:
                    loss_of(model, kind, x, y).backward()
                    opt.step()
                finally:
                    rec.close()
    finally:
        Unit.watch_inputs = watch
    alive: dict[str, int] = {}
    for label, n in live.alive_at_peak().values():
        alive[label] = alive.get(label, 0) + n
    gathered = peak_gathered = 0
    for sid, change in live.events:
        if live.labels.get(sid) == "unsharded buffer":
            gathered += change
            peak_gathered = max(peak_gathered, gathered)
    units = model.hybridshard_runtime.units
    return {
        "static": static, "dynamic": live.peak(), "peak": sum(static.values()) + live.peak(),
        "gathered": peak_gathered, "alive_at_peak": alive, "comm": hs.comm_stats(model)["groups"],
        "units": [(u.name, u.flat.layout.padded_numel, u.expects_grad) for u in units],
        "groups": (units[0].groups.shard_size, units[0].groups.replicate_size),
    }


def activation_peak(kind: str) -> int:
    """Peak bytes of one plain forward + backward, parameter gradients left out (as test_memory)."""
    model, _ = make(kind)
    x, y = data(0, 0, 0)
    loss_of(model, kind, x, y).backward()
    model.zero_grad(set_to_none=True)
    with StepBytes() as live:
        loss_of(model, kind, x, y).backward()
    return live.peak(exclude=live.storages_of(p.grad for p in model.parameters()))


def _settled(live: LiveTensorBytes) -> int:
    """Live bytes once the threads that outlive a collective let go: the communication thread
    (``overlap_grads``) drops its last finished job a moment after the main thread took the result,
    and gloo's worker drops a collective's aliases after ``wait()`` (see [Note: tensors handed to a
    backend thread]). Each is waited for by what it must do, not by watching the count stay put for
    a while, which a thread starved of the CPU outlasts."""
    from hybridshard.runtime.comm import handoff
    from hybridshard.runtime.comm.executors import threads

    ran = threading.Event()

    class Marker:
        """Queued behind every job: when it runs, the thread finished and dropped the ones before it."""

        def run(self) -> None:
            ran.set()

    threads._worker().put(Marker())
    assert ran.wait(BOUND_S), f"the communication thread did not finish its jobs within {BOUND_S}s"
    assert handoff.settle(BOUND_S), f"a backend still held {handoff.sweep()} collective tensors after {BOUND_S}s"
    return live.live()


BOUND_S = 60.0
"""How long ``_settled`` waits for a thread before failing (a hang guard; a healthy wait ends at once)."""


def zero_grad_frees(strategy: str) -> dict:
    """Live bytes that ``zero_grad(set_to_none=True)`` frees after a step, against the gradient shards."""
    rank = dist.get_rank()
    model = RM.make_model()
    hs.shard(model, strategy=strategy, groups=RM.groups(), wrap={RM.Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = RM.batch(0, 0, rank, 2)
    RM.lm_loss(model(tokens), tokens).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    units = model.hybridshard_runtime.units
    with LiveTensorBytes() as live:
        RM.lm_loss(model(tokens), tokens).backward()
        opt.step()
        held = _settled(live)
        before = [u.flat.sharded_grad is not None for u in units]
        opt.zero_grad(set_to_none=True)
        freed = held - _settled(live)
    return {"freed": freed, "held_before": before, "held_after": [u.flat.sharded_grad is not None for u in units],
            "shards": sum(u.flat.layout.shard_numel * 4 for u in units)}


# -- checkpoints and conversions ------------------------------------------------------------------


def _shard_lora(strategy: str, seed: int = 0, **kw: Any) -> nn.Module:

    model, block = make("lora", seed)
    return hs.shard(model, strategy=strategy, groups=RM.groups(), wrap={block}, **kw)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> float:
    opt.zero_grad(set_to_none=True)
    x, y = data(step, 0, dist.get_rank())
    loss = loss_of(model, "lora", x, y)
    loss.backward()
    opt.step()
    out = loss.detach().reshape(1)
    dist.all_reduce(out)
    return out.item() / dist.get_world_size()


def checkpoint_stage(path: str, strategy: str, split: float | None, *, load: bool) -> dict[str, Any]:
    """Train two steps and save, or load; then the full state, the optimizer state and one more step."""
    model = _shard_lora(strategy, seed=7 if load else 0, split_frozen=split)
    opt = optimizer(model)
    if load:
        extra = hs.load_checkpoint(path, model, optimizer=opt)
    else:
        for step in range(2):
            _train_step(model, opt, step)
        hs.save_checkpoint(path, model, optimizer=opt, extra={"from": strategy})
        extra = None
    state, optim = hs.full_state_dict(model), hs.full_optim_state_dict(model, opt)
    loss = _train_step(model, opt, 5)
    return {"extra": extra, "state": state, "optim": optim, "loss": loss, "after": hs.full_state_dict(model)}


def conversions() -> dict[str, Any]:
    """Conversions after ``shard``: the ones that would change a parameter or gradient raise and change
    nothing; the ones that change nothing work, and training goes on as without them."""
    model = _shard_lora("HYBRID_SHARD")
    before = {n: (p.data_ptr(), p.dtype, p.detach().clone()) for n, p in model.named_parameters()}
    calls = {"half": lambda: model.half(), "block_double": lambda: model.blocks[1].double(),
             "meta": lambda: model.to("meta"), "to_empty": lambda: model.to_empty(device="cpu")}
    errors = {}
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
    unchanged = all(p.data_ptr() == ptr and p.dtype == dtype and torch.equal(p.detach(), value)
                    for n, p in model.named_parameters() for ptr, dtype, value in [before[n]])
    opt, plain = optimizer(model), _shard_lora("HYBRID_SHARD")
    plain_opt = optimizer(plain)
    losses = []
    for step in range(2):
        for call in (lambda: model.to("cpu"), lambda: model.to("cpu:0"), model.float, model.cpu,
                     lambda: model.to(torch.float32),
                     lambda: model.to(device="cpu", dtype=torch.float32), lambda: model.type(torch.float32)):
            call()  # changes nothing: with gradients present too (the second time round)
        # "cpu:0" is the CPU too, though torch copies a CPU tensor moved there: the parameters must
        # still be the master's views (what a trainer's model.to(args.device) does on CPU).
        assert all(p.data_ptr() == before[n][0] for n, p in model.named_parameters()), "cpu:0 moved a parameter"
        losses.append((_train_step(model, opt, step), _train_step(plain, plain_opt, step)))
    ours, theirs = hs.full_state_dict(model), hs.full_state_dict(plain)
    same = ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    low = _shard_lora("FULL_SHARD", mixed_precision=hs.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, keep_low_precision_grads=True))
    _train_step(low, optimizer(low), 0)
    try:
        low.float()  # the fp32 parameters stay, their bf16 gradients would not
        errors["grad_float"] = None
    except ValueError as err:
        errors["grad_float"] = str(err)
    return {"errors": errors, "unchanged": unchanged, "losses": losses, "same": same}
