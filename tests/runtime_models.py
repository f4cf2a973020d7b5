"""Shared pieces of the runtime tests: a small model with tied, frozen and buffer state, data,
a single-process reference trainer, the same training loop under ``hybridshard.shard``, and a
sweep helper that runs a grid of configurations in one multi-process call."""

from __future__ import annotations

import contextlib
import copy
import itertools
from collections import Counter
from dataclasses import replace
from typing import Any, Iterable, Iterator

import torch

from benchmarks.tiny_lm import (  # noqa: F401 - the tests read them as RM.<name>
    DIM, SEQ, VOCAB, Block, Config, TinyLM, batch, lm_loss, make_model, make_optimizer,
)


def wrap_policy(cfg: Config, model: TinyLM) -> Any:
    """``{Block}``, ``{Block: cfg.block_strategy}``, or a callable giving each block its own strategy."""
    if cfg.block_strategies:
        chosen = dict(zip(model.blocks, cfg.block_strategies))
        return lambda module: chosen.get(module, False)
    if cfg.block_strategy is not None:
        return {Block: cfg.block_strategy}
    return {Block}


def expected_counts(cfg: Config) -> dict[tuple[str, str], int]:
    """Collectives per step of forward + backward, from each unit's strategy.

    Gathers per forward+backward: a ZeRO-3 block twice, a ZeRO-2 block and the root once (the root
    stays gathered from forward into backward), NO_SHARD never. Non-reentrant checkpointing
    recomputes inside the backward's gather, so it adds none; a reentrant one runs the block's
    forward under ``no_grad``, which frees every unit after it, so every block gathers twice.
    Reductions happen once per unit on
    the syncing backward (and per micro-batch for the shard-group reduce-scatter with
    ``reduce_scatter_micro``). Hybrid units use the "shard"/"replicate" groups, the others "world"."""
    from hybridshard.runtime.units.strategy import ShardingStrategy

    out: Counter = Counter()
    micro = cfg.micro_steps
    for i, name in enumerate(cfg.unit_strategies):
        s = ShardingStrategy[name]
        if s is ShardingStrategy.NO_SHARD:
            out[("all_reduce", "world")] += 1
            continue
        shard = "shard" if s.is_hybrid else "world"
        twice = (s.reshard_after_forward or cfg.checkpoint == "reentrant") and i > 0
        out[("all_gather", shard)] += micro * (2 if twice else 1)
        out[("reduce_scatter", shard)] += micro if cfg.reduce_scatter_micro else 1
        if s.is_hybrid:  # the optimizer step's all-gather across replicas comes after the counted block
            out[("reduce_scatter" if cfg.shard_optimizer else "all_reduce", "replicate")] += 1
    return dict(out)


def expected_clip_counts(cfg: Config) -> dict[tuple[str, str], int]:
    """One all-reduce of one number: in the shared shard group, or the world when units differ."""
    kinds = {"hybrid" if "HYBRID" in s else "replicated" if s == "NO_SHARD" else "world" for s in cfg.unit_strategies}
    if len(kinds) > 1 or cfg.shard_optimizer:  # slices of the whole job: summed over it
        return {("all_reduce", "world"): 1}
    return {"hybrid": {("all_reduce", "shard"): 1}, "world": {("all_reduce", "world"): 1}, "replicated": {}}[kinds.pop()]


def reference_run(cfg: Config, world_size: int) -> dict[str, Any]:
    """One process, the global batch. In bf16 mode each rank's micro-batch is computed in bf16
    exactly as the sharded run computes it and the gradients are averaged in fp32 (then kept in
    bf16 with ``low_precision_grads``)."""
    with single_thread():
        return _reference_run(cfg, world_size)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Compute as the ranks do (``tests.mp`` gives each one thread): the number of threads changes
    how a kernel splits its sums, which moves bf16 roundings, so a reference on another thread
    count differs by more than summation order alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _reference_run(cfg: Config, world_size: int) -> dict[str, Any]:
    model = make_model(num_blocks=cfg.num_blocks)
    opt = make_optimizer(cfg, model.parameters())
    losses, norms = [], []
    for step in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        parts = [(m, r) for m in range(cfg.micro_steps) for r in range(world_size)]
        if not cfg.bf16:
            tokens = torch.cat([batch(step, m, r, cfg.micro_batch) for m, r in parts])
            loss = lm_loss(model(tokens), tokens)
            loss.backward()
            losses.append(loss.item())
        else:
            low = copy.deepcopy(model).to(cfg.low_dtype)
            total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
            step_loss = 0.0
            for m, r in parts:
                low.zero_grad(set_to_none=True)
                tokens = batch(step, m, r, cfg.micro_batch)
                loss = lm_loss(low(tokens), tokens)
                (loss / cfg.micro_steps).backward()
                step_loss += loss.item() / len(parts)
                for n, p in low.named_parameters():
                    if p.grad is not None:
                        total[n] += p.grad.float()
            for n, p in model.named_parameters():
                if p.requires_grad and cfg.low_precision_grads:
                    p.grad_dtype = cfg.low_dtype
                    p.grad = (total[n] / world_size).to(cfg.low_dtype)
                elif p.requires_grad:
                    p.grad = total[n] / world_size
            losses.append(step_loss)
        if cfg.clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)))
        opt.step()
    return {"losses": losses, "norms": norms, "state": {k: v.clone() for k, v in model.state_dict().items()}}


_GROUPS: dict[str, Any] = {}


def groups() -> Any:
    """This process's ``init_groups()`` result, built once per pool."""
    import hybridshard as hs

    if "groups" not in _GROUPS:
        _GROUPS["groups"] = hs.init_groups()
    return _GROUPS["groups"]


def sharded_run(cfg: Config) -> dict[str, Any]:
    """The reference loop on this rank's share of the global batch, under ``hybridshard.shard``."""
    import torch.distributed as dist

    import hybridshard as hs

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(num_blocks=cfg.num_blocks)
    model.checkpoint = cfg.checkpoint
    mp = None
    if cfg.bf16:
        mp = hs.MixedPrecision(param_dtype=cfg.low_dtype, reduce_dtype=torch.float16 if cfg.fp16 else torch.float32,
                               keep_low_precision_grads=cfg.low_precision_grads)
    hs.shard(model, strategy=cfg.strategy, groups=groups(), wrap=wrap_policy(cfg, model), mixed_precision=mp,
             prefetch=cfg.prefetch, overlap_grads=cfg.overlap_grads, replicate_compression=cfg.compression,
             executor=cfg.executor, offload=hs.CPUOffload() if cfg.offload else None,
             shard_optimizer_across_replicas=cfg.shard_optimizer, rack_reduce=cfg.rack_reduce, two_hop=cfg.two_hop,
             reshard_after_forward=cfg.reshard_after_forward)
    opt = make_optimizer(cfg, model.parameters())
    scaler = hs.ShardedGradScaler("cpu", init_scale=2.0**10) if cfg.fp16 else None
    losses, norms, counts, calls, clip_counts = [], [], [], [], []
    grad_dtypes: set[str] = set()
    syncs = hs_syncs() if cfg.executor == "emulate" else None
    for step in range(cfg.steps):
        if syncs is not None and step == 1:
            syncs.reset()  # host syncs of the steady state: from the second step on
        opt.zero_grad(set_to_none=True)
        step_loss = torch.zeros(1)
        with hs.count_collectives() as c:
            for m in range(cfg.micro_steps):
                tokens = batch(step, m, rank, cfg.micro_batch)
                last = m == cfg.micro_steps - 1
                ctx = hs.no_sync(model, reduce_scatter=cfg.reduce_scatter_micro) if not last else contextlib.nullcontext()
                with ctx:
                    loss = lm_loss(model(tokens), tokens)
                    scaled = loss / cfg.micro_steps
                    (scaler.scale(scaled) if scaler is not None else scaled).backward()
                step_loss += loss.detach().float() / cfg.micro_steps
        calls.append(dict(c.calls))
        counts.append(logical_counts(calls[-1], _hop_nodes(model)))
        grad_dtypes |= {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)
        if scaler is not None:
            scaler.unscale_(opt)
        if cfg.clip is not None:
            with hs.count_collectives() as c:
                norms.append(float(hs.clip_grad_norm_(model, cfg.clip)))
            clip_counts.append(dict(c.calls))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    host = {"hot": dict(syncs.hot), "exempt": dict(syncs.exempt)} if syncs is not None else None
    return {
        "losses": losses,
        "norms": norms,
        "host_syncs": host,
        "state": hs.full_state_dict(model),
        "counts": counts,
        "calls": calls,
        "clip_counts": clip_counts,
        "grad_dtypes": sorted(grad_dtypes),
        "unit_strategies": [u.strategy.name for u in model.hybridshard_runtime.units],
    }


def _hop_nodes(model: torch.nn.Module) -> int:
    """``k``: the nodes a unit's shard group in two hops spans (1 without hops)."""
    hops = [u.groups.shard_hops for u in model.hybridshard_runtime.units if u.groups.shard_hops is not None]
    return hops[0].racks if hops else 1


def logical_counts(calls: dict[tuple[str, str], int], nodes: int = 1) -> dict[tuple[str, str], int]:
    """``calls`` with the whole job's two hops (FULL_SHARD and SHARD_GRAD_OP on several nodes) counted
    once under ``"world"``, as the flat collective they replace: a gather is ``nodes`` calls inside the
    node (the hop across nodes is skipped with the secondary shard), a reduce-scatter ``nodes`` inside
    and one across. The hops themselves are checked in tests/test_shard_two_hop.py."""
    out = {key: n for key, n in calls.items() if key[1] not in ("world_node", "world_across")}
    for kind in ("all_gather", "reduce_scatter"):
        inside, across = calls.get((kind, "world_node"), 0), calls.get((kind, "world_across"), 0)
        assert inside % max(nodes, 1) == 0 and across * nodes <= inside, (calls, nodes)
        assert kind == "all_gather" or across * nodes == inside, (calls, nodes)
        if inside:
            out[(kind, "world")] = out.get((kind, "world"), 0) + inside // nodes
    return out


def hs_syncs() -> Any:
    """The emulated device's host-sync counts (see [Note: counting host syncs])."""
    from hybridshard.runtime.trace import host_syncs

    return host_syncs.counts()


def sweep(**axes: Iterable[Any]) -> list[Config]:
    """Every combination of the given Config fields: ``sweep(strategy=[...], bf16=[False, True])``."""
    names = list(axes)
    return [replace(Config(), **dict(zip(names, values))) for values in itertools.product(*axes.values())]


def run_configs(configs: list[Config]) -> list[dict[str, Any]]:
    """Run every config on this rank (one pool call for a whole sweep)."""
    return [sharded_run(cfg) for cfg in configs]


def check_ranks(cfg: Config, per_rank: list[list[dict[str, Any]]], index: int, world_size: int, *,
                counts: bool = True) -> None:
    """Every rank's ``per_rank[rank][index]`` against the one-process reference of ``cfg`` (losses,
    norms, parameters; bf16 tolerances for ``cfg.bf16``), and, with ``counts``, its collectives per
    step and per ``clip_grad_norm_`` against :func:`expected_counts` / :func:`expected_clip_counts`."""
    ref = reference_run(cfg, world_size)
    tol = dict(atol=2e-3, rtol=2e-3) if cfg.bf16 else dict(atol=1e-5, rtol=1e-5)
    for rank, results in enumerate(per_rank):
        got = results[index]
        compare(ref, got, label=f"rank {rank}", **tol)
        if counts:
            assert all(c == expected_counts(cfg) for c in got["counts"]), f"rank {rank}: {got['counts']}"
            assert got["clip_counts"] == [expected_clip_counts(cfg)] * len(got["norms"]), got["clip_counts"]


def compare(ref: dict[str, Any], got: dict[str, Any], *, atol: float, rtol: float, label: str) -> None:
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), atol=atol, rtol=rtol, msg=lambda m: f"{label} losses: {m}"
    )
    assert set(got["state"]) == set(ref["state"]), f"{label}: state keys {sorted(got['state'])} != {sorted(ref['state'])}"
    for key, value in ref["state"].items():
        torch.testing.assert_close(got["state"][key], value, atol=atol, rtol=rtol, msg=lambda m: f"{label} {key}: {m}")
    if ref["norms"]:
        torch.testing.assert_close(
            torch.tensor(got["norms"]), torch.tensor(ref["norms"]), atol=atol, rtol=rtol, msg=lambda m: f"{label} norms: {m}"
        )


