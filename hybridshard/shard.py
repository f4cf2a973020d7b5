"""``shard``: turn a model into flat-parameter units over the shard and replicate groups, in place."""

from __future__ import annotations

import logging
import zlib
from collections import Counter
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard import collectives as C
from hybridshard import faults
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
    mesh: Any = None,
    wrap: WrapPolicy = None,
    mixed_precision: MixedPrecision | None = None,
    device: torch.device | str | None = None,
    sync_module_states: bool = False,
    debug: bool | None = None,
    prefetch: int = 1,
    overlap_grads: bool = True,
    replicate_compression: str | None = None,
) -> nn.Module:
    """Shard ``model`` in place and return it.

    ``strategy`` applies to the root unit and to every unit the ``wrap`` policy gives no strategy
    of its own (see :mod:`hybridshard.wrap` for per-unit strategies). Units with a hybrid strategy
    use ``groups``, a :class:`hybridshard.ShardGroups`; ``None`` means :func:`hybridshard.init_groups`
    when any unit is hybrid. The other units always use the default group (FULL_SHARD /
    SHARD_GRAD_OP shard over the whole job, NO_SHARD replicates over it), even when ``groups`` is
    given. ``mesh`` is the alternative to ``groups``: a ``DeviceMesh``, 2-D with dims
    ``("replicate", "shard")`` as FSDP2 takes it, or 1-D to shard over it (see [Note: meshes in] in
    :mod:`hybridshard.mesh`); pass one of the two. Collective over the default group: every rank calls
    it with the same model structure and arguments.

    ``debug=True`` (or ``HYBRIDSHARD_DEBUG=1``) makes every collective of this process first check
    that its group agrees on it, turning ranks that run different forwards/backwards into a
    ``ValueError`` naming what each was doing; it costs one tiny all-gather per collective. See
    :mod:`hybridshard.faults`.

    Speed: ``prefetch`` is how many units are gathered ahead of the one computing, in forward and
    backward (0 turns it off; see :mod:`hybridshard.prefetch`). ``overlap_grads`` leaves gradient
    collectives running while backward goes on (see :mod:`hybridshard.overlap`); results are the same
    either way. ``replicate_compression="bf16"`` or ``"int8"`` quantizes the hybrid units' all-reduce
    across the replicate group (with error feedback; shard-group traffic stays exact), halving or
    quartering the inter-node bytes at some gradient precision; see :mod:`hybridshard.compression`.
    """
    if not isinstance(overlap_grads, bool):
        raise ValueError(f"overlap_grads must be True or False; got {overlap_grads!r}")
    compressor = None
    if replicate_compression is not None:
        from hybridshard.compression import ReplicateCompressor, parse_compression

        mode = parse_compression(replicate_compression)
        compressor = ReplicateCompressor(mode) if mode is not None else None
    if debug is not None:
        faults.set_debug(debug)
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
    _check_low_precision_grads(mixed_precision, torch.Tensor)
    specs = plan_units(model, wrap)
    strategies = [spec.strategy or strategy for spec in specs]
    pairs, shard_groups = _resolve_groups(strategies, groups, mesh)
    device = _resolve_device(device, shard_groups)
    _check_devices(model, device)
    plan = [(spec.name or "<root>", s.name) for spec, s in zip(specs, strategies)]
    _check_same_model(model, values=not sync_module_states, plan=plan)

    runtime = Runtime(model, strategy, mixed_precision, device, prefetch=prefetch, overlap_grads=overlap_grads,
                      compressor=compressor)
    rank0_index: dict[int, int] = {}
    if sync_module_states:
        for pair in _distinct(pairs[s] for s in strategies):
            rank0_index[id(pair)] = _rank0_shard_index(pair)
    units = [
        _build_unit(spec, s, pairs[s], mixed_precision, device, rank0_index.get(id(pairs[s])), runtime)
        for spec, s in zip(specs, strategies)
    ]
    root_pair = pairs[strategies[0]]
    for buf in model.buffers():
        buf.data = buf.data.to(device)
        if sync_module_states:
            _broadcast_from_rank0(buf.data, root_pair, rank0_index[id(root_pair)])
    runtime.attach(units)
    if logger.isEnabledFor(logging.INFO):
        per_strategy = Counter(f"{u.strategy.name} ({u.groups.shard_size}x{u.groups.replicate_size})" for u in units)
        logger.info("sharded %s: %d units on %s: %s", type(model).__name__, len(units), device, dict(per_strategy))
    return model


def _distinct(pairs: Iterable[C.GroupPair]) -> list[C.GroupPair]:
    """The distinct group pairs in first-use order (the same order on every rank)."""
    out: list[C.GroupPair] = []
    for pair in pairs:
        if all(pair is not seen for seen in out):
            out.append(pair)
    return out


def _check_low_precision_grads(mp: MixedPrecision | None, tensor_type: type) -> None:
    """``keep_low_precision_grads`` needs ``Tensor.grad_dtype``: a ``.grad`` whose dtype differs from its parameter's."""
    if mp is None or not mp.keep_low_precision_grads or mp.param_dtype is None:
        return
    if not hasattr(tensor_type, "grad_dtype"):
        raise ValueError(
            "MixedPrecision(keep_low_precision_grads=True) leaves each .grad in param_dtype next to a "
            f"full-precision parameter, which needs Tensor.grad_dtype; torch {torch.__version__} lacks it. "
            "Upgrade torch, or use keep_low_precision_grads=False"
        )


def _resolve_groups(
    strategies: Sequence[ShardingStrategy], groups: Any, mesh: Any = None
) -> tuple[dict[ShardingStrategy, C.GroupPair], Any]:
    """One :class:`GroupPair` per strategy; strategies that communicate alike share the same object."""
    world = dist.get_world_size()
    pairs: dict[ShardingStrategy, C.GroupPair] = {}
    if mesh is not None:
        if groups is not None:
            raise ValueError(
                "pass either groups= or mesh=, not both; found both. Keep groups=init_groups() or "
                "mesh=<DeviceMesh ('replicate', 'shard')> (init_groups().mesh is the same grid as a mesh)"
            )
        from hybridshard.mesh import pair_from_mesh

        pairs[ShardingStrategy.HYBRID_SHARD] = pairs[ShardingStrategy.HYBRID_SHARD_ZERO2] = pair_from_mesh(mesh)
    elif any(s.is_hybrid for s in strategies):
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
        hybrid = C.GroupPair(
            shard=groups.shard,
            replicate=groups.replicate,
            shard_size=shard_size,
            shard_rank=dist.get_rank(groups.shard),
            replicate_size=replicate_size,
            replicate_rank=dist.get_rank(groups.replicate),
        )
        pairs[ShardingStrategy.HYBRID_SHARD] = pairs[ShardingStrategy.HYBRID_SHARD_ZERO2] = hybrid
    world_group = dist.group.WORLD
    C.name_group(world_group, "world")
    pairs[ShardingStrategy.NO_SHARD] = C.GroupPair(
        shard=None, replicate=world_group, shard_size=1, shard_rank=0, replicate_size=world,
        replicate_rank=dist.get_rank(),
    )
    pairs[ShardingStrategy.FULL_SHARD] = pairs[ShardingStrategy.SHARD_GRAD_OP] = C.GroupPair(
        shard=world_group, replicate=None, shard_size=world, shard_rank=dist.get_rank(), replicate_size=1
    )
    return pairs, groups


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
            # Hex strings compare equal for equal values, NaN included. Frozen-ness is structure: a
            # parameter frozen on some ranks only would reduce gradients on the others alone.
            kind = str(p.dtype) + ("" if p.requires_grad else " frozen")
            out.append((name, tuple(p.shape), kind, s.hex(), a.hex()))
    return out


def _check_same_model(model: nn.Module, *, values: bool, plan: Sequence[tuple[str, str]]) -> None:
    """One small all-gather of a model digest; on a mismatch, name the first differing parameter or unit.

    ``plan`` is the ``(unit, strategy)`` list: ranks that split the model differently would issue
    different collectives and hang. Values are compared too unless ``sync_module_states`` will
    overwrite them anyway.
    """
    rows = _digest(model, values)
    structure = zlib.crc32(repr(([r[:3] for r in rows], list(plan))).encode())
    summary = torch.tensor(
        [len(rows), structure, sum(float.fromhex(r[3]) for r in rows), sum(float.fromhex(r[4]) for r in rows)],
        dtype=torch.float64,
    )
    summary = summary.to(_collective_device())
    gathered = torch.empty(dist.get_world_size() * summary.numel(), dtype=torch.float64, device=summary.device)
    C.all_gather(gathered, summary, None)
    gathered = gathered.view(dist.get_world_size(), -1)
    if bool((gathered == gathered[0]).all()):
        return
    if bool(((gathered == gathered[0]) | (gathered.isnan() & gathered[0].isnan())).all()):
        return  # identical, NaN values included (NaN != NaN would otherwise look like a difference)
    # Slow path, taken by every rank alike: find the first parameter, then the first unit, that differs.
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rows, list(plan)))
    for i in range(max(len(r) for r, _ in everyone)):
        column = [r[i] if i < len(r) else None for r, _ in everyone]
        for rank, entry in enumerate(column):
            if entry != column[0]:
                name = (column[0] or entry)[0]
                raise ValueError(
                    f"the model differs across ranks at parameter {name!r}: rank 0 has {_describe(column[0])}, "
                    f"rank {rank} has {_describe(entry)}. Build the model identically on every rank (same "
                    "code and seed), or pass sync_module_states=True to copy rank 0's values"
                )
    for i in range(max(len(p) for _, p in everyone)):
        column = [p[i] if i < len(p) else None for _, p in everyone]
        for rank, entry in enumerate(column):
            if entry != column[0]:
                raise ValueError(
                    f"the units differ across ranks at unit #{i}: rank 0 has {_describe_unit(column[0])}, rank "
                    f"{rank} has {_describe_unit(entry)}. Pass every rank the same strategy and a wrap policy "
                    "that decides from the module alone (not from the rank)"
                )


def _describe_unit(entry: tuple[str, str] | None) -> str:
    return "no such unit" if entry is None else f"{entry[0]!r} with {entry[1]}"


def _describe(entry: Any) -> str:
    if entry is None:
        return "no such parameter"
    name, shape, dtype, s, a = entry
    return f"{name} shape {list(shape)} {dtype} (sum {float.fromhex(s):.6g}, abs sum {float.fromhex(a):.6g})"


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
    strategy: ShardingStrategy,
    pair: C.GroupPair,
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
        strategy=strategy,
        groups=pair,
        reduce_dtype=reduce_dtype,
        runtime=runtime,
    )
