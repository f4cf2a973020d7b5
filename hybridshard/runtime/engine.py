"""The sharded model's runtime: its units, the module hooks that drive them, and ``no_sync``.

[Note: hook wiring]
Forward pre-/post-hooks sit only on the outermost module of each unit (gathering is not
idempotent, and hooks on nested modules would run it twice). The root unit is the model itself:
its pre-hook runs first and casts floating inputs to ``param_dtype`` under mixed precision. The
first backward hook of a step queues one engine callback that, once the whole backward is done,
reduces what no gradient hook reduced (units whose parameters got no gradient this step) and
frees every buffer still gathered.

A backward that raises (an out-of-memory error in a skipped batch, say) never runs that callback.
The next forward or backward notices (the callback is still marked queued, but for a backward that
is no longer running), drops that backward's unreduced gradients, frees every buffer and returns
every unit to ``IDLE``; gradients reduced before the error stay in ``.grad`` (zero them to skip
the batch), and gradients held by ``no_sync`` from earlier micro-batches stay held.

[Note: is the backward still running]
The autograd engine keeps a graph task's final callbacks until the task ends, whether it finished
or raised, and then drops them. So the runtime holds only a weak reference to the callback it
queued: while that reference is alive, the backward that queued it is still running. Comparing
graph-task ids would not do: reentrant activation checkpointing runs a *nested* backward (a new
graph task) inside the running one, and its gradient hooks must not be mistaken for a new backward
after an aborted one. The reference can outlive the task, though (whatever still holds the raised
task drops it later), so the root's forward pre-hook also asks whether this thread runs any graph
task: a forward outside every backward comes after every backward it could belong to, and a
recomputing forward (activation checkpointing) runs inside one.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_map

from hybridshard.runtime.comm import agreement
from hybridshard.runtime.comm.executors.select import ExecutorKind, make_executor
from hybridshard.runtime.faults import stragglers
from hybridshard.runtime.grads.compression import ReplicateCompressor
from hybridshard.runtime.grads.reduce import SyncMode
from hybridshard.runtime.trace import hook_clock
from hybridshard.runtime.trace.counters import CollectiveCounts
from hybridshard.runtime.trace.position import where
from hybridshard.runtime.units.offload import CPUOffload, arrived
from hybridshard.runtime.units.prefetch import Pass, Prefetcher
from hybridshard.runtime.units.strategy import MixedPrecision, ShardingStrategy
from hybridshard.runtime.units.unit import Unit

if TYPE_CHECKING:
    from hybridshard.ft.replicate import ManagedReplicate
    from hybridshard.runtime.optim.replica_slices import SliceSync

logger = logging.getLogger(__name__)

__all__ = ["Engine", "comm_stats", "get_engine", "holds_sharded_module", "is_sharded", "no_sync"]

_ATTR = "_hybridshard_runtime"


class Engine:
    """Everything ``shard`` attached to one model."""

    def __init__(
        self,
        model: nn.Module,
        strategy: ShardingStrategy,
        mixed_precision: MixedPrecision | None,
        device: torch.device,
        *,
        prefetch: int = 1,
        overlap_grads: bool = True,
        compressor: ReplicateCompressor | None = None,
        check_steps: bool = True,
        executor: ExecutorKind = ExecutorKind.THREADS,
        offload: CPUOffload | None = None,
    ) -> None:
        self.model = model
        self.offload = offload
        """Where the units keep their master shards; see [Note: CPU offload] in :mod:`hybridshard.runtime.units.offload`."""
        self.check_steps = check_steps
        """Compare every rank's step before each forward and backward; see [Note: step check]."""
        self._pending_check: agreement.StepCheck | None = None
        """The forward's step check, compared at the next check."""
        self.strategy = strategy
        """The model's strategy (the root unit's); each unit carries its own."""
        self.mixed_precision = mixed_precision
        self.device = device
        self.units: list[Unit] = []
        self.sync_mode = SyncMode.SYNC
        self.in_backward = False
        self._callback_queued = False
        self._callback_ref: weakref.ref | None = None
        self._handles: list[Any] = []
        self.prefetch_depth = prefetch
        self.prefetcher: Prefetcher | None = None
        self.overlap_grads = overlap_grads
        """Leave gradient collectives running through backward; see :mod:`hybridshard.runtime.comm.executors.threads`."""
        self.executor = make_executor(executor, device)
        """Issues the units' gathers and gradient reductions: the communication thread (CPU) or streams
        (CUDA); see :mod:`hybridshard.runtime.comm.executors.select`."""
        self.compressor = compressor
        """A :class:`~hybridshard.runtime.grads.compression.ReplicateCompressor` for hybrid units, or ``None``."""
        self.rack_reduce = False
        """Hybrid units reduce across replicas in two hops (their groups' ``racks``); see [Note: two hops across racks]."""
        self.shard_two_hop = self.keep_secondary = False
        """Shard groups over several nodes gather and reduce-scatter in two hops; the node-local secondary
        shard kept from forward to backward; see [Note: a shard group in two hops]."""
        self.replicate_hook: ManagedReplicate | None = None
        """Fault-tolerant mode: reduces hybrid units' shards across replica groups in place of the
        replicate group (``all_reduce(shard, stats=, async_op=)``); see :mod:`hybridshard.ft`."""
        self.stragglers = False
        """Time this model's steps for the straggler report (``CheckConfig.stragglers``)."""
        self.stats = CollectiveCounts()
        """What the units' collectives moved; read by :func:`hybridshard.comm_stats`."""
        self.steps = 0
        """Backwards that reduced gradients (not inside ``no_sync``) since the stats were reset."""
        self.replica_slices: SliceSync | None = None
        """A :class:`~hybridshard.runtime.optim.replica_slices.SliceSync` when the optimizer is sharded across
        replicas, else ``None``."""

    @property
    def root(self) -> Unit:
        return self.units[0]

    def is_root(self, unit: Unit) -> bool:
        return unit is self.units[0]

    def attach(self, units: Sequence[Unit]) -> None:
        """Install the units and their hooks; see [Note: hook wiring]."""
        self.units = list(units)
        self.prefetcher = Prefetcher(self.units, self.prefetch_depth)
        for index, unit in enumerate(self.units):
            unit.index = index
            is_root = unit is self.units[0]
            self._handles.append(
                unit.module.register_forward_pre_hook(self._make_pre_hook(unit, is_root), with_kwargs=True)
            )
            self._handles.append(unit.module.register_forward_hook(self._make_post_hook(unit)))
        streams = getattr(self.executor, "streams", None)
        if hasattr(streams, "unit_names"):  # the emulated device names units in its faults
            streams.unit_names = [u.name for u in self.units]
        setattr(self.model, _ATTR, self)

    def guard_conversions(self) -> None:
        """Make ``.to()`` / ``.half()`` / ``.cuda()`` / ``.float()`` ... on the model or any submodule raise
        when they would change a parameter or gradient; see [Note: converting a sharded model]."""
        names = {id(p): slot.name for unit in self.units for slot, p in zip(unit.flat.layout.slots, unit.flat.params)}
        for module in self.model.modules():
            # An instance attribute shadows Module._apply, through which every conversion goes.
            module._apply = _guarded_apply(module, names)

    def reset_stats(self) -> None:
        """Zero the collective counts, the step count and every unit's hook times."""
        self.stats.reset()
        self.steps = 0
        for unit in self.units:
            unit.hook_seconds = unit.wait_seconds = 0.0

    def _make_pre_hook(self, unit: Unit, is_root: bool):
        param_dtype = self.mixed_precision.param_dtype if self.mixed_precision else None

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict):
            with hook_clock.timed(unit, "Engine.pre_hook"):
                if is_root and self._callback_queued and (
                    not self._backward_running() or torch._C._current_graph_task_id() == -1
                ):
                    self._recover_aborted_backward()
                if is_root and not self.in_backward:
                    self.executor.end_step()
                    stragglers.at_forward(where.step, self.device, self.stragglers)  # see [Note: step timing]
                    where.start_forward()
                    if self.check_steps:
                        self._verify_pending_check()
                        self._pending_check = self._issue_check(Pass.FORWARD)
                    self.prefetcher.begin(Pass.FORWARD)
                if not self.in_backward:
                    self.prefetcher.before_unit(Pass.FORWARD, unit)
                unit.pre_forward()
                unit.watch_inputs(args, kwargs)  # see [Note: resharding frozen units early]
                if is_root and param_dtype is not None and not self.in_backward:
                    cast = lambda t: t.to(param_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                    return tree_map(cast, args), tree_map(cast, kwargs)
                return None

        return pre_hook

    def _make_post_hook(self, unit: Unit):
        def post_hook(module: nn.Module, args: tuple, output: Any):
            with hook_clock.timed(unit, "Engine.post_hook"):
                output = unit.post_forward(output)
                if self.is_root(unit) and not self.in_backward:
                    self.prefetcher.end_forward()
                return output

        return post_hook

    def on_backward_hook(self) -> None:
        """Called by every unit backward hook; the first one of a backward queues the final callback."""
        if self._callback_queued and not self._backward_running():
            self._recover_aborted_backward()
        if not self._callback_queued:
            where.phase = "backward" if self.sync_mode is SyncMode.SYNC else "no_sync backward"
            where.unit = -1
            if self.check_steps:  # compared before this backward's first reduction
                self._verify_pending_check()
                self._pending_check = self._issue_check(Pass.BACKWARD)
        self.in_backward = True
        if not self._callback_queued:
            self.prefetcher.begin(Pass.BACKWARD)
            callback = _FinishBackward(self)
            self._callback_queued = True
            self._callback_ref = weakref.ref(callback)
            Variable._execution_engine.queue_callback(callback)

    def _issue_check(self, phase: Pass) -> agreement.StepCheck | None:
        return agreement.issue_step_check(phase.value, mode=self.sync_mode.value, num_units=len(self.units),
                                          order_digest=self.prefetcher.digest())

    def _verify_pending_check(self, before_step: int | None = None) -> None:
        check, self._pending_check = self._pending_check, None
        if check is not None:
            check.verify(before_step=before_step)
        elif before_step is not None:
            agreement.compare_arrived(before_step)

    def before_reduction(self) -> None:
        """Called before any gradient of a backward is reduced: the step checks of earlier steps must
        have passed (see [Note: step check without a host sync]), and the last step's gathers across
        replicas must be done (they write the shards)."""
        self._verify_pending_check(before_step=where.step)
        if self.replica_slices is not None:
            self.replica_slices.wait_all()

    def _backward_running(self) -> bool:
        """Whether the backward that queued the final callback is still running; see
        [Note: is the backward still running]."""
        return self._callback_ref is not None and self._callback_ref() is not None

    def _recover_aborted_backward(self) -> None:
        """Undo what a backward that raised left behind; see [Note: hook wiring]."""
        logger.warning("an earlier backward did not finish (it raised?): freeing its gathered parameters")
        self.executor.abort()
        for unit in self.units:
            unit.abort_backward()
            unit.flat.drop_arriving()
        self.in_backward = False
        self._callback_queued = False

    def _finish_backward(self) -> None:
        try:
            for unit, shard in self.executor.drain():
                unit.reduction.reduced(shard, self.sync_mode)
            for unit in reversed(self.units):
                unit.finish_backward()
            arriving = [unit.flat for unit in self.units if unit.flat.grad_arriving]
            if arriving:  # CPU offload: one wait for every copy to host memory; see [Note: CPU offload]
                arrived(arriving[0].device)
                for flat in arriving:
                    flat.land_grad_shard()
            if self.sync_mode is SyncMode.SYNC:
                self.steps += 1
        finally:
            self.in_backward = False
            self._callback_queued = False
            where.end_backward(synced=self.sync_mode is SyncMode.SYNC)


def _guarded_apply(module: nn.Module, names: dict[int, str]):
    """``module._apply`` that first checks the conversion leaves every parameter and gradient as it is.

    [Note: converting a sharded model]
    Every module conversion (``to``, ``half``, ``float``, ``cuda``, ``cpu``, ``type``, ``to_empty``)
    runs ``Module._apply(fn)``, which would set each parameter's ``.data`` to ``fn(param)``. Between
    steps that ``.data`` is the parameter's part of its unit's master shard, so the next gather
    would copy a converted copy back into the master (in the master's dtype, on its device) and the
    conversion would silently not happen. So ``shard`` wraps every module's ``_apply``: it calls
    ``fn`` on each parameter and gradient first, and if any comes back as another tensor it raises a
    ``ValueError`` naming the parameter, the dtype and device the runtime keeps and those asked
    for, and the supported way (``MixedPrecision(param_dtype=...)`` to compute in another dtype;
    converting or moving the model before ``shard``); nothing has changed then. A conversion that
    changes nothing (``fn`` returns the tensor itself, or an equal copy of the same dtype in the same
    place, as ``.to("cpu:0")`` does on the CPU) runs as before for buffers and leaves parameters and
    gradients as they are.
    """
    original = module._apply

    def _apply(fn, recurse: bool = True):
        kept: set[int] = set()
        for rel, p in module.named_parameters(recurse=recurse):
            name = names.get(id(p), rel)
            with torch.no_grad():
                for what, t in (("parameter", p), ("gradient of parameter", p.grad)):
                    if t is not None and (new := fn(t)) is not t:
                        if new.dtype != t.dtype or _place(new.device) != _place(t.device) or not torch.equal(new, t):
                            raise ValueError(_conversion_error(what, name, t, new))
                        kept.add(id(t))  # an equal copy in the same place (torch copies a CPU tensor sent to "cpu:0")
        if not kept:
            return original(fn, recurse)
        return original(lambda t: t if id(t) in kept else fn(t), recurse)

    return _apply


def _place(device: torch.device) -> torch.device:
    """``device`` with the CPU's index dropped: ``cpu:0`` is the CPU."""
    return torch.device("cpu") if device.type == "cpu" else device


def _conversion_error(what: str, name: str, old: torch.Tensor, new: torch.Tensor) -> str:
    ways = []
    if new.dtype != old.dtype:
        ways.append(f"compute in {new.dtype} with shard(..., mixed_precision=MixedPrecision(param_dtype={new.dtype}))")
    if new.device != old.device:
        ways.append(f"pass shard(..., device={str(new.device)!r})")
    ways.append("convert or move the model before shard()")
    return (
        f"{what} {name!r} of a sharded model must stay {old.dtype} on {old.device}, but this conversion "
        f"(.to()/.half()/.float()/.cuda()/...) would make it a new {new.dtype} tensor on {new.device}; "
        f"{', or '.join(ways)}\n"
        "A sharded model keeps each unit's parameters as one flat master shard, into which the next gather "
        "would copy the converted tensor back; nothing was changed."
    )


class _FinishBackward:
    """The engine callback that ends a backward (an object, so the runtime can hold a weak reference)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __call__(self) -> None:
        with hook_clock.timed(None, "_FinishBackward.__call__"):  # a hook of no one unit
            self.engine._finish_backward()


def is_sharded(model: nn.Module) -> bool:
    """True when ``model`` went through :func:`hybridshard.shard`."""
    return getattr(model, _ATTR, None) is not None


def holds_sharded_module(model: nn.Module) -> bool:
    """True when ``model`` or any of its submodules went through :func:`hybridshard.shard`."""
    return any(is_sharded(m) for m in model.modules())


def get_engine(model: nn.Module) -> Engine:
    engine = getattr(model, _ATTR, None)
    if engine is None:
        raise ValueError(
            f"{type(model).__name__} is not sharded: call hybridshard.shard(model, ...) first and pass "
            "the model it returned"
        )
    return engine


@contextlib.contextmanager
def no_sync(model: nn.Module, *, reduce_scatter: bool = False) -> Iterator[None]:
    """Accumulate gradients over micro-batches; the first backward after the block reduces them all.

    With ``reduce_scatter=False`` (the default) backward inside the block communicates nothing: each
    unit keeps its unsharded gradient locally. With ``reduce_scatter=True`` every backward still
    reduce-scatters inside the shard group (only gradient shards are kept, as in a normal step) and
    only the all-reduce across the replicate group waits for the backward after the block, which
    divides the cross-group traffic by the number of micro-batches. Either way the result equals
    one backward over the concatenated micro-batches. What the block holds joins ``.grad`` at that
    next backward; ``optimizer.zero_grad()`` before it does not clear it. A block opened inside an
    open block of the same kind joins it.
    """
    engine = get_engine(model)
    mode = SyncMode.SHARD_ONLY if reduce_scatter else SyncMode.LOCAL
    if engine.sync_mode is mode:  # joins the open block: accelerate enters model.no_sync around a Trainer's own
        yield
        return
    if engine.sync_mode is not SyncMode.SYNC:
        raise ValueError(
            f"no_sync(reduce_scatter={reduce_scatter}) expects no open block or one of the same kind, found one with "
            f"reduce_scatter={not reduce_scatter}; leave the open block first"
        )
    engine.sync_mode = mode
    try:
        yield
    finally:
        engine.sync_mode = SyncMode.SYNC


def comm_stats(model: nn.Module, *, reset: bool = False) -> dict[str, Any]:
    """This rank's communication since ``shard`` (or the last reset) for ``model``.

    Returns ``{"steps": n, "groups": {group: {op: {"calls", "elements", "bytes", "ring_bytes"},
    "total": {"ring_bytes"}}}, "hook_seconds": {unit name: seconds}, "gather_wait_seconds": {...}}``: ``steps`` counts backwards that
    reduced gradients (``no_sync`` ones excluded), ``bytes`` are the input tensors' bytes and
    ``ring_bytes`` what this rank sends in the ring model; ``hook_seconds`` is the wall time spent in
    the runtime's hooks per unit, and ``gather_wait_seconds`` the part of it spent gathering the
    unit's parameters (blocked on the all-gather); the rest is the hooks' own CPU work. ``reset=True`` zeroes everything after reading.
    Only the units' own collectives count (gathers, gradient reductions), not those of
    ``clip_grad_norm_``, checkpoints or state dicts.
    """
    engine = get_engine(model)
    out = {
        "steps": engine.steps,
        "groups": engine.stats.by_group(),
        "hook_seconds": {unit.name: unit.hook_seconds for unit in engine.units},
        "gather_wait_seconds": {unit.name: unit.wait_seconds for unit in engine.units},
    }
    if reset:
        engine.reset_stats()
    return out
