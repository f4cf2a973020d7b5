"""``shard``: turn a model into flat-parameter units over the shard and replicate groups, in place."""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard.options import CheckConfig, CommConfig, InitConfig, split_keywords
from hybridshard.runtime.comm import agreement
from hybridshard.runtime.comm.executors.select import resolve_executor
from hybridshard.runtime.engine import Engine, holds_sharded_module
from hybridshard.runtime.faults import exits, stragglers, watchdog
from hybridshard.runtime.grads.compression import ReplicateCompressor, parse_compression
from hybridshard.runtime.optim.replica_slices import SliceSync
from hybridshard.runtime.setup.build import broadcast_from_rank0, build_unit, distinct, rank0_initial_seed, rank0_shard_index
from hybridshard.runtime.setup.compile import compile_units, parse_compile
from hybridshard.runtime.setup.deferred_init import DeferredInit, has_meta
from hybridshard.runtime.setup.model_check import INIT_SEED, check_devices, check_same_model
from hybridshard.runtime.setup.rack_reduce import resolve_rack_reduce, resolve_shard_hops
from hybridshard.runtime.setup.state_guard import guard_state_dict
from hybridshard.runtime.units.offload import CPUOffload, parse_offload
from hybridshard.runtime.units.strategy import MixedPrecision, ShardingStrategy
from hybridshard.runtime.units.wrap import WrapPolicy, choose_units, split_frozen as split_frozen_parts
from hybridshard.topology.groups import ShardGroups, init_groups, name_group
from hybridshard.topology.world_hops import world_groups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger(__name__)

__all__ = ["shard"]


def shard(
    model: nn.Module,
    *,
    strategy: ShardingStrategy | str = ShardingStrategy.HYBRID_SHARD,
    groups: ShardGroups | None = None,
    mesh: DeviceMesh | None = None,
    wrap: WrapPolicy = None,
    mixed_precision: MixedPrecision | None = None,
    device: torch.device | str | None = None,
    offload: CPUOffload | bool | None = None,
    comm: CommConfig | None = None,
    checks: CheckConfig | None = None,
    init: InitConfig | None = None,
    split_frozen: float | None = 0.5,
    shard_optimizer_across_replicas: bool = False,
    compile: bool | dict[str, Any] = False,
    **keywords: Any,
) -> nn.Module:
    """Shard ``model`` in place and return it (extended with :class:`hybridshard.HybridShardModule`).

    Collective over the default group: every rank calls it with the same model and arguments. The
    options of ``comm``, ``checks`` and ``init`` may also be passed as keywords of their own names
    (docs/api.md). After ``shard``, ``state_dict()`` / ``load_state_dict()`` raise a ``ValueError``
    naming :func:`hybridshard.full_state_dict` ([Note: a state dict that cannot lie]), and so does a
    conversion that would change a parameter, ``.half()`` say ([Note: converting a sharded model]).

    Args:
        strategy: of the root unit and of every unit the ``wrap`` policy gives no strategy of its
            own (per-unit strategies: :mod:`hybridshard.runtime.units.wrap`).
        groups: a :class:`hybridshard.ShardGroups` for the hybrid units; ``None``: :func:`hybridshard.init_groups`
            when any unit is hybrid. Other strategies always shard or replicate over the whole job
            (FULL_SHARD and SHARD_GRAD_OP in two hops on several nodes; its cluster view spares a gather).
        mesh: instead of ``groups``, a ``DeviceMesh``: 2-D ``("replicate", "shard")`` as FSDP2
            takes it, or 1-D to shard over ([Note: meshes in] in :mod:`hybridshard.topology.groups`).
        wrap: which modules become units (a set of classes, ``{class: strategy}`` or a callable).
        mixed_precision: a :class:`hybridshard.MixedPrecision` (compute and reduce dtypes), or ``None``.
        device: the compute device; ``None``: the groups' device, else the current CUDA device, else the CPU.
        offload: ``hybridshard.CPUOffload()``: master shards, gradients and optimizer state in (pinned)
            CPU memory, the optimizer steps there ([Note: CPU offload]).
        comm: :class:`~hybridshard.CommConfig`. ``prefetch``: units gathered ahead (0: off);
            ``overlap_grads``: gradient collectives run on during backward (same results);
            ``replicate_compression`` (``"bf16"``/``"int8"``); ``executor`` (below).
        executor: ``"auto"`` (streams on CUDA, a thread on CPU), ``"threads"``, ``"streams"`` or
            ``"emulate"`` ([Note: emulated device]); ``None`` reads ``HYBRIDSHARD_EXECUTOR``
            (:mod:`hybridshard.runtime.comm.executors.select`).
        checks: :class:`~hybridshard.CheckConfig`. ``check_steps`` (on): ranks out of step raise
            before any gradient is reduced ([Note: step check]); ``debug=True`` (or
            ``HYBRIDSHARD_DEBUG=1``) checks every collective too, one tiny all-gather each.
        init: :class:`~hybridshard.InitConfig` (``sync_module_states``, ``param_init_fn``, ``init_seed``):
            a meta-device model is materialised one unit at a time, each rank only its shards,
            seeded by ``init_seed`` and module name ([Note: deferred init]).
        split_frozen: a unit whose frozen parameters hold at least this fraction of its elements
            becomes two units, only the trainable one reducing gradients (0: every mixed unit;
            ``None``: none; [Note: frozen parts]).
        shard_optimizer_across_replicas: hybrid strategies; the optimizer steps a ``1 / (S * R)``
            slice per rank, gradients reduce-scattered across replicas and the updated slices
            all-gathered after ``optimizer.step()`` ([Note: optimizer state sharded across replicas]).
        compile: ``True`` or ``torch.compile`` keyword arguments: each block's forward is compiled,
            the hooks outside; ``torch.compile(model)`` is not supported ([Note: compiling units]).
    """
    configs = split_keywords({"comm": comm, "checks": checks, "init": init}, keywords)
    comm, checks, init = configs["comm"], configs["checks"], configs["init"]
    prefetch, overlap_grads, replicate_compression, executor = (
        comm.prefetch, comm.overlap_grads, comm.replicate_compression, comm.executor)
    check_steps, debug = checks.check_steps, checks.debug
    sync_module_states, param_init_fn, init_seed = init.sync_module_states, init.param_init_fn, init.init_seed
    if split_frozen is not None and (isinstance(split_frozen, bool) or not isinstance(split_frozen, (int, float))
                                     or not 0 <= split_frozen <= 1):
        raise ValueError(
            f"split_frozen must be a fraction between 0 and 1 (of a unit's elements that frozen parameters must "
            f"hold for the unit to be split), or None to split no unit; got {split_frozen!r}"
        )
    compile_options = parse_compile(compile)
    compressor = None
    if replicate_compression is not None:
        mode = parse_compression(replicate_compression.value)
        compressor = ReplicateCompressor(mode) if mode is not None else None
    if debug is not None:
        agreement.set_debug(debug)
    if not dist.is_initialized():
        raise RuntimeError("shard needs an initialised default process group: call init_process_group() first")
    if holds_sharded_module(model):
        raise ValueError(
            f"{type(model).__name__} (or one of its submodules) is already sharded; call shard() once, "
            "on the whole model"
        )
    strategy = ShardingStrategy.parse(strategy)
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise ValueError(f"mixed_precision must be a hybridshard.MixedPrecision or None; got {mixed_precision!r}")
    _check_low_precision_grads(mixed_precision, torch.Tensor)
    specs = split_frozen_parts(choose_units(model, wrap), split_frozen)
    strategies = [spec.strategy or strategy for spec in specs]
    _check_optimizer_slicing(shard_optimizer_across_replicas, strategy, strategies, offload)
    by_strategy, groups = _resolve_groups(strategies, groups, mesh, two_hop=comm.two_hop)
    device = _resolve_device(device, groups)
    executor_kind = resolve_executor(None if executor is None else executor.value, device)
    offload_policy = parse_offload(offload)
    check_devices(model, device)
    plan = [(spec.name or "<root>", s.name) for spec, s in zip(specs, strategies)]
    deferred = None
    if has_meta(model):
        deferred = DeferredInit(model, device, param_init_fn)  # raises before any collective if it cannot init
        if init_seed is not None:
            plan.append((INIT_SEED, str(int(init_seed))))
    elif param_init_fn is not None:
        raise ValueError(
            f"param_init_fn was given, but no parameter or buffer of {type(model).__name__} is on the meta "
            "device; build the model under torch.device('meta') to initialise it in shard(), or drop param_init_fn"
        )
    check_same_model(model, values=not sync_module_states, plan=plan)  # meta-ness is part of the digest
    if deferred is not None:  # every rank is here: the same model, meta alike
        deferred.seed = rank0_initial_seed() if init_seed is None else int(init_seed)

    engine = Engine(model, strategy, mixed_precision, device, prefetch=prefetch, overlap_grads=overlap_grads,
                      compressor=compressor, check_steps=check_steps, executor=executor_kind,
                      offload=offload_policy)
    slice_optimizer = {s: shard_optimizer_across_replicas and s.is_hybrid and by_strategy[s].replicate_size > 1
                       for s in set(strategies)}
    rank0_index: dict[int, int] = {}
    if sync_module_states:
        for used in distinct(by_strategy[s] for s in strategies):
            rank0_index[id(used)] = rank0_shard_index(used)
    units = []
    for i, (spec, s) in enumerate(zip(specs, strategies)):
        if deferred is not None and spec.part_of is None:  # a frozen part came with its trainable part
            parts = [j for j in range(i, len(specs)) if specs[j].module is spec.module]
            done = deferred.materialize_specs([specs[j] for j in parts], (u.module for u in specs))
            for j, new_spec in zip(parts, done):
                specs[j] = new_spec
            spec = specs[i]
        units.append(
            build_unit(spec, s, by_strategy[s], mixed_precision, device, rank0_index.get(id(by_strategy[s])), engine,
                       slice_optimizer=slice_optimizer[s])
        )
        if deferred is not None and (i + 1 == len(specs) or specs[i + 1].part_of is None):
            deferred.release()  # the unit (and its frozen part) hold their shards: one unit at a time
    unit_modules = {id(u.module) for u in units}
    for i, spec in enumerate(specs):
        if spec.part_of is not None:  # right after its trainable part; see [Note: frozen parts]
            holds = any(id(m) in unit_modules for m in spec.module.modules() if m is not spec.module)
            units[i - 1].add_frozen_part(units[i], is_root=i == 1, holds_units=holds)
    root_groups = by_strategy[strategies[0]]
    for buf in model.buffers():
        buf.data = buf.data.to(device)
        if sync_module_states:
            broadcast_from_rank0(buf.data, root_groups, rank0_index[id(root_groups)])
    engine.attach(units)
    hybrid = [u for u in units if u.strategy.is_hybrid]
    if hybrid:  # see [Note: choosing two hops]
        engine.rack_reduce = resolve_rack_reduce(
            comm.rack_reduce, hybrid[0].groups,
            [u.flat.layout.shard_numel * u.reduce_dtype.itemsize for u in hybrid], device)
    elif comm.rack_reduce:
        resolve_rack_reduce(True, None, [], device)  # raises: no hybrid unit, no replicate reduction
    engine.shard_two_hop, engine.keep_secondary = resolve_shard_hops(
        comm, distinct(u.groups for u in units if u.groups.shard_size > 1))
    if any(u.replica_slice is not None for u in units):
        engine.replica_slices = SliceSync(units)
    engine.guard_conversions()
    engine.stragglers = stragglers.configure(checks.stragglers) is not None  # [Note: summaries through the store]
    guard_state_dict(model)
    if compile_options is not None:
        compile_units(units, compile_options)
    watchdog.start()
    exits.install()
    if logger.isEnabledFor(logging.INFO):
        per_strategy = Counter(f"{u.strategy.name} ({u.groups.shard_size}x{u.groups.replicate_size})" for u in units)
        logger.info("sharded %s: %d units on %s: %s", type(model).__name__, len(units), device, dict(per_strategy))
    return model


def _check_optimizer_slicing(on: bool, strategy: ShardingStrategy, strategies: Sequence[ShardingStrategy],
                             offload: Any) -> None:
    """``shard_optimizer_across_replicas`` needs a hybrid strategy (the replicas to shard over) and no offload."""
    if not isinstance(on, bool):
        raise ValueError(f"shard_optimizer_across_replicas must be True or False; got {on!r}")
    if not on:
        return
    if not strategy.is_hybrid:
        raise ValueError(
            f"shard_optimizer_across_replicas=True expects a hybrid strategy (HYBRID_SHARD or HYBRID_SHARD_ZERO2), "
            f"found strategy={strategy.name}; use strategy='HYBRID_SHARD', or drop the option "
            f"({strategy.name} has no replicate group to shard the optimizer over)"
        )
    if offload is not None and offload is not False:
        raise ValueError(
            "shard_optimizer_across_replicas=True expects the master shards on the compute device, found "
            f"offload={offload!r}; drop offload= (the slices already divide optimizer memory by the replica count)"
        )


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
    strategies: Sequence[ShardingStrategy], groups: ShardGroups | None, mesh: DeviceMesh | None = None,
    *, two_hop: bool | None = None,
) -> tuple[dict[ShardingStrategy, ShardGroups], ShardGroups | None]:
    """The :class:`ShardGroups` of each strategy; strategies that communicate alike share one object.

    Hybrid strategies use ``groups`` (or ``mesh``; :func:`init_groups` when neither is given); the
    others always use the whole job (see :func:`hybridshard.shard`), FULL_SHARD and SHARD_GRAD_OP in
    two hops when it spans nodes ([Note: the whole job in two hops] in :mod:`hybridshard.topology.world_hops`).
    """
    world = dist.get_world_size()
    by_strategy: dict[ShardingStrategy, ShardGroups] = {}
    hybrid: ShardGroups | None = None
    if mesh is not None:
        if groups is not None:
            raise ValueError(
                "pass either groups= or mesh=, not both; found both. Keep groups=init_groups() or "
                "mesh=<DeviceMesh ('replicate', 'shard')> (init_groups().mesh is the same grid as a mesh)"
            )
        hybrid = ShardGroups.from_mesh(mesh)
    elif any(s.is_hybrid for s in strategies):
        hybrid = init_groups() if groups is None else groups
        if not isinstance(hybrid, ShardGroups):
            raise ValueError(f"groups must be a hybridshard.ShardGroups (from init_groups()); got {groups!r}")
        if hybrid.world_size != world:
            raise ValueError(
                f"shard group size {hybrid.shard_size} x replicate group size {hybrid.replicate_size} = "
                f"{hybrid.world_size}, but the job has {world} ranks; build the groups with "
                "hybridshard.init_groups() (or a plan whose sizes multiply to the world size)"
            )
        for group, name in ((hybrid.shard, "shard"), (hybrid.replicate, "replicate")):
            if group is not None:
                name_group(group, name)
    if hybrid is not None:
        by_strategy[ShardingStrategy.HYBRID_SHARD] = by_strategy[ShardingStrategy.HYBRID_SHARD_ZERO2] = hybrid
    by_strategy[ShardingStrategy.NO_SHARD] = ShardGroups.over_world(replicate=True)
    if any(s in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP) for s in strategies):
        known = hybrid if hybrid is not None else groups
        whole = world_groups(two_hop=two_hop, cluster=getattr(known, "cluster", None))
    else:  # no unit shards over the world: nothing to learn about its nodes
        whole = ShardGroups.over_world()
    by_strategy[ShardingStrategy.FULL_SHARD] = by_strategy[ShardingStrategy.SHARD_GRAD_OP] = whole
    return by_strategy, hybrid if hybrid is not None else groups


def _resolve_device(device: torch.device | str | None, groups: ShardGroups | None) -> torch.device:
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


