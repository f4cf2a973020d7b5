"""``shard``: turn a model into flat-parameter units over the shard and replicate groups, in place."""

from __future__ import annotations

import logging
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard import collectives as C
from hybridshard.flat_param import FlatParam
from hybridshard.layout import FlatLayout
from hybridshard.runtime import _ATTR, Runtime
from hybridshard.strategy import MixedPrecision, ShardingStrategy
from hybridshard.unit import Unit
from hybridshard.wrap import UnitSpec, WrapPolicy, plan_units

logger = logging.getLogger(__name__)

__all__ = ["shard"]

_ALIGN_BYTES = 16


def shard(
    model: nn.Module,
    *,
    strategy: ShardingStrategy | str = ShardingStrategy.HYBRID_SHARD,
    groups: Any = None,
    wrap: WrapPolicy = None,
    mixed_precision: MixedPrecision | None = None,
    device: torch.device | str | None = None,
    sync_module_states: bool = False,
) -> nn.Module:
    """Shard ``model`` in place and return it.

    ``groups`` is a :class:`hybridshard.ShardGroups`; ``None`` means :func:`hybridshard.init_groups`
    for the hybrid strategies and the default group otherwise. The non-hybrid strategies always use
    the default group (FULL_SHARD / SHARD_GRAD_OP shard over the whole job, NO_SHARD replicates over
    it), even when ``groups`` is given. Collective over the default group: every rank calls it with
    the same model structure and arguments.
    """
    if not dist.is_initialized():
        raise RuntimeError("shard needs an initialised default process group: call init_process_group() first")
    if getattr(model, _ATTR, None) is not None or any(getattr(m, _ATTR, None) for m in model.modules()):
        raise ValueError(
            f"{type(model).__name__} (or one of its submodules) is already sharded; call shard() once, "
            "on the whole model"
        )
    strategy = ShardingStrategy.parse(strategy)
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ValueError(f"mixed_precision must be a hybridshard.MixedPrecision or None; got {mixed_precision!r}")
    pair, shard_groups = _resolve_groups(strategy, groups)
    device = _resolve_device(device, shard_groups)
    specs = plan_units(model, wrap)
    _check_devices(model, device)
    _check_same_model(model, values=not sync_module_states)

    runtime = Runtime(model, strategy, pair, mixed_precision, device)
    rank0_index = _rank0_shard_index(pair) if sync_module_states else None
    units = [_build_unit(spec, pair, strategy, mixed_precision, device, rank0_index, runtime) for spec in specs]
    for buf in model.buffers():
        buf.data = buf.data.to(device)
        if rank0_index is not None:
            _broadcast_from_rank0(buf.data, pair, rank0_index)
    runtime.attach(units)
    logger.info(
        "sharded %s: %s, %d units, shard size %d x replicate size %d on %s",
        type(model).__name__, strategy.name, len(units), pair.shard_size, pair.replicate_size, device,
    )
    return model


def _resolve_groups(strategy: ShardingStrategy, groups: Any) -> tuple[C.GroupPair, Any]:
    world = dist.get_world_size()
    if strategy.is_hybrid:
        if groups is None:
            from hybridshard.groups import init_groups

            groups = init_groups()
        if not hasattr(groups, "shard") or not hasattr(groups, "replicate"):
            raise ValueError(f"groups must be a hybridshard.ShardGroups (from init_groups()); got {groups!r}")
        shard_size = dist.get_world_size(groups.shard)
        replicate_size = dist.get_world_size(groups.replicate)
        if shard_size * replicate_size != world:
            raise ValueError(
                f"shard group size {shard_size} x replicate group size {replicate_size} = "
                f"{shard_size * replicate_size}, but the job has {world} ranks; build the groups with "
                "hybridshard.init_groups() (or a plan whose sizes multiply to the world size)"
            )
        C.name_group(groups.shard, "shard")
        C.name_group(groups.replicate, "replicate")
        pair = C.GroupPair(
            shard=groups.shard,
            replicate=groups.replicate,
            shard_size=shard_size,
            shard_rank=dist.get_rank(groups.shard),
            replicate_size=replicate_size,
        )
        return pair, groups
    world_group = dist.group.WORLD
    C.name_group(world_group, "world")
    if strategy is ShardingStrategy.NO_SHARD:
        return C.GroupPair(shard=None, replicate=world_group, shard_size=1, shard_rank=0, replicate_size=world), groups
    return (
        C.GroupPair(shard=world_group, replicate=None, shard_size=world, shard_rank=dist.get_rank(), replicate_size=1),
        groups,
    )


def _resolve_device(device: torch.device | str | None, groups: Any) -> torch.device:
    if device is None:
        found = getattr(groups, "device", None)
        if found is not None:
            return torch.device(found)
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_devices(model: nn.Module, device: torch.device) -> None:
    for name, p in model.named_parameters():
        if p.device == device or p.device.type == "cpu":
            continue
        raise ValueError(
            f"parameter {name!r} is on {p.device}, but this rank computes on {device}; create the model on "
            f"the CPU or on {device} (materialize meta parameters first), or pass device={p.device}"
        )


def _digest(model: nn.Module, values: bool) -> list[tuple[str, tuple[int, ...], str, float, float]]:
    out = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            d = p.detach().double()
            s, a = (float(d.sum()), float(d.abs().sum())) if values else (0.0, 0.0)
            out.append((name, tuple(p.shape), str(p.dtype), s, a))
    return out


def _check_same_model(model: nn.Module, *, values: bool) -> None:
    """One small all-gather of a model digest; on a mismatch, name the first differing parameter.

    Values are compared too unless ``sync_module_states`` will overwrite them anyway.
    """
    rows = _digest(model, values)
    structure = zlib.crc32(repr([r[:3] for r in rows]).encode())
    summary = torch.tensor(
        [len(rows), structure, sum(r[3] for r in rows), sum(r[4] for r in rows)], dtype=torch.float64
    )
    summary = summary.to(_collective_device())
    gathered = torch.empty(dist.get_world_size() * summary.numel(), dtype=torch.float64, device=summary.device)
    C.all_gather(gathered, summary, None)
    gathered = gathered.view(dist.get_world_size(), -1)
    if bool((gathered == gathered[0]).all()):
        return
    # Slow path, taken by every rank alike: find the first parameter that differs.
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    for i in range(max(len(r) for r in everyone)):
        column = [r[i] if i < len(r) else None for r in everyone]
        for rank, entry in enumerate(column):
            if entry != column[0]:
                name = (column[0] or entry)[0]
                raise ValueError(
                    f"the model differs across ranks at parameter {name!r}: rank 0 has {_describe(column[0])}, "
                    f"rank {rank} has {_describe(entry)}. Build the model identically on every rank (same "
                    "code and seed), or pass sync_module_states=True to copy rank 0's values"
                )


def _describe(entry: Any) -> str:
    if entry is None:
        return "no such parameter"
    name, shape, dtype, s, a = entry
    return f"{name} shape {list(shape)} {dtype} (sum {s:.6g}, abs sum {a:.6g})"


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _rank0_shard_index(pair: C.GroupPair) -> int:
    """Rank 0's index inside its shard group (one small broadcast over the default group)."""
    index = torch.tensor([pair.shard_rank], dtype=torch.int64, device=_collective_device())
    dist.broadcast(index, src=0)
    return int(index.item())


def _broadcast_from_rank0(tensor: torch.Tensor, pair: C.GroupPair, rank0_index: int) -> None:
    """Rank 0's ``tensor`` everywhere, each element sent once per group dimension.

    First across the replicate group that holds rank 0 (which reaches the member at rank 0's index
    of every shard group), then inside every shard group from that member.
    """
    if pair.replicate is not None and 0 in dist.get_process_group_ranks(pair.replicate):
        C.broadcast(tensor, 0, pair.replicate)
    if pair.shard is not None:
        C.broadcast(tensor, dist.get_process_group_ranks(pair.shard)[rank0_index], pair.shard)


def _build_unit(
    spec: UnitSpec,
    pair: C.GroupPair,
    strategy: ShardingStrategy,
    mp: MixedPrecision | None,
    device: torch.device,
    rank0_index: int | None,
    runtime: Runtime,
) -> Unit:
    dtypes = {p.dtype for p in spec.params}
    if len(dtypes) > 1:
        found = {n: str(p.dtype) for n, p in zip(spec.param_names, spec.params)}
        raise ValueError(
            f"unit {spec.name or '<root>'!r} mixes parameter dtypes {found}; a unit's parameters share one flat "
            "buffer, so give them one dtype (model.float()) or wrap the odd ones in their own unit"
        )
    master_dtype = dtypes.pop() if dtypes else torch.float32
    compute_dtype = (mp.param_dtype if mp and mp.param_dtype else None) or master_dtype
    reduce_dtype = (mp.reduce_dtype if mp and mp.reduce_dtype else None) or compute_dtype
    grad_dtype = compute_dtype if mp and mp.keep_low_precision_grads else master_dtype
    itemsize = torch.empty(0, dtype=master_dtype).element_size()
    layout = FlatLayout.build(
        [(n, p.shape) for n, p in zip(spec.param_names, spec.params)],
        shard_size=pair.shard_size,
        shard_rank=pair.shard_rank,
        align_numel=max(1, _ALIGN_BYTES // itemsize),
        aliases=spec.aliases,
    )
    full = torch.zeros(layout.padded_numel, dtype=master_dtype, device=device)
    with torch.no_grad():
        for slot, p in zip(layout.slots, spec.params):
            full[slot.offset : slot.end].copy_(p.detach().reshape(-1))
    if rank0_index is not None:
        _broadcast_from_rank0(full, pair, rank0_index)
    flat = FlatParam(layout, spec.params, full, compute_dtype=compute_dtype, grad_dtype=grad_dtype)
    return Unit(
        spec.name,
        spec.module,
        flat,
        spec.bindings,
        groups=pair,
        reshard_after_forward=strategy.reshard_after_forward,
        reduce_dtype=reduce_dtype,
        runtime=runtime,
    )
