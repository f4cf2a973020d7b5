"""One communication unit: a module's flat parameter, its states and views, and the per-step transitions
that the engine's hooks (:mod:`hybridshard.runtime.engine`) drive. Its gradient is
:mod:`hybridshard.runtime.grads.reduce`'s; parameters changed while gathered are found by
:mod:`hybridshard.runtime.units.changes`. The states are the enums below; what each strategy does per
step, activation checkpointing and stale gathers are [Note: unit states], [Note: recomputation in
backward] and [Note: stale gathers] in docs/runtime.md.

[Note: resharding frozen units early]
A unit that expects no gradient has no post-accumulate-grad hook to free it. :meth:`Unit.watch_inputs`
registers one multi-grad hook on its floating inputs that require grad; it fires once backward ran
every op of the unit, and the unit frees and goes back to ``IDLE``. A frozen part split off a module
also waits for its trainable part's gradient (alone, when no input requires grad); a module that holds
other units (the root) keeps its frozen part to the end of backward. An input that is the previous
unit's output carries that unit's pre-backward hook: it is moved behind the input hook, so this unit
frees before the previous one gathers (else three units are gathered at once with ``prefetch=1``).
Docs: [Note: frozen parameters] in docs/runtime.md.
"""
from __future__ import annotations

import enum
import logging
import time
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.comm import two_hop
from hybridshard.runtime.grads.reduce import GradReduction, SyncMode
from hybridshard.runtime.trace import hook_clock
from hybridshard.runtime.trace.position import where
from hybridshard.runtime.units.changes import check_unchanged
from hybridshard.runtime.units.flat_param import FlatParam
from hybridshard.runtime.units.prefetch import Pass
from hybridshard.runtime.units.strategy import ShardingStrategy
from hybridshard.topology.groups import ShardGroups

if TYPE_CHECKING:
    from hybridshard.runtime.engine import Engine
    from hybridshard.runtime.optim.replica_slices import ReplicaSlice

logger = logging.getLogger(__name__)

__all__ = ["ShardedState", "TrainingState", "Unit"]

_OUTPUT_HOOKS = WeakTensorKeyDictionary()
"""Per output tensor, ``[(hook, handle)]`` of the pre-backward hooks units registered on it."""


class ShardedState(enum.Enum):
    """Where a unit's parameters are; changed only by :meth:`Unit.unshard`, :meth:`Unit.prefetch`, :meth:`Unit.reshard`."""

    SHARDED = "sharded"
    """Only the master shard exists; the modules hold the original parameters."""
    GATHERING = "gathering"
    """A prefetch issued the all-gather into the allocated buffer; ``unshard`` waits for it."""
    UNSHARDED = "unsharded"
    """The buffer is gathered; the modules compute with views of it."""


class TrainingState(enum.Enum):
    """What a unit is doing in the step."""

    IDLE = "idle"
    """Between passes (after forward, after backward, or freed early)."""
    FORWARD = "forward"
    """Inside its forward (between the pre- and post-forward hooks)."""
    PRE_BACKWARD = "pre_backward"
    """Gathered for backward, waiting for its gradient."""
    POST_BACKWARD = "post_backward"
    """Its gradient was reduced (or handed to the executor) in this backward."""


class Unit:
    """One module's parameters, gathered and freed together."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        flat: FlatParam,
        bindings: Sequence[Sequence[tuple[nn.Module, str]]],
        *,
        strategy: ShardingStrategy,
        groups: ShardGroups,
        reduce_dtype: torch.dtype,
        engine: Engine,
    ) -> None:
        self.name = name or "<root>"
        self.index = -1
        """Position in the runtime's unit list (the root is 0); set by ``Engine.attach``."""
        self.module = module
        self.flat = flat
        self.bindings = tuple(tuple(b) for b in bindings)
        """Per slot, every ``(module, attribute)`` that holds the parameter (tied ones hold it twice)."""
        self._slots = tuple((i, mod._parameters, attr) for i, slots in enumerate(self.bindings) for mod, attr in slots)
        """The bindings as ``(slot, parameter table, attribute)``: what installing walks."""

        self.strategy = strategy
        self.groups = groups
        """The unit's own groups: hybrid units use the shard/replicate groups, the others the world."""
        self.reshard_after_forward = strategy.reshard_after_forward
        self.reduce_dtype = reduce_dtype
        self.engine = engine
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.views: list[torch.Tensor] | None = None
        """The views of the unsharded buffer the modules hold while the unit computes, else ``None``."""
        self._forward_views: list[torch.Tensor] | None = None
        """This step's forward views: backward installs them again (same storage) rather than new ones."""
        self.views_version = 0
        """The unsharded buffer's version counter when the views were last known good."""
        self.gathered_versions: tuple[int, ...] = ()
        """The master's version counters at the last gather; see [Note: stale gathers]."""
        self.reduction = GradReduction(self, engine)
        self.replica_slice: ReplicaSlice | None = None
        """This rank's optimizer slice when the optimizer is sharded across replicas, else ``None``
        (see :mod:`hybridshard.runtime.optim.replica_slices`)."""
        self._gathering: C.Pending | None = None
        self.secondary: torch.Tensor | None = None
        """The node-local secondary shard kept from forward to backward (``reshard_after_forward="node"``;
        see [Note: a shard group in two hops] in :mod:`hybridshard.runtime.comm.two_hop`)."""
        self.prefetched = False
        """Gathered ahead by the prefetcher and not used yet."""
        self.hook_seconds = 0.0
        """Wall time spent in the runtime's hooks for this unit since the stats were reset."""
        self.wait_seconds = 0.0
        """The part of ``hook_seconds`` spent gathering (blocked on the all-gather)."""
        self.part_of: Unit | None = None
        """For a frozen part (see [Note: frozen parts]): the unit with its module's trainable parameters."""
        self.frozen_part: Unit | None = None
        """The frozen part ``shard`` split off this unit's module, if any."""
        self._input_hooks: list[Any] = []
        """This step's input hooks; see [Note: resharding frozen units early]."""
        self._inputs_need_grad = False
        """Whether a forward of this step watched inputs that require grad."""
        self._free_with_part = False
        """A frozen part of a module holding no other unit: its trainable part's gradient may free it."""
        if flat.requires_grad:
            flat.unsharded.register_post_accumulate_grad_hook(self._post_backward)

    def add_frozen_part(self, part: "Unit", *, is_root: bool, holds_units: bool) -> None:
        """Pair this unit with the frozen part split off its module (``holds_units``: the module
        contains other units' modules); see [Note: frozen parts]."""
        assert part.module is self.module and self.frozen_part is None and part.part_of is None
        self.frozen_part, part.part_of = part, self
        part._free_with_part = not holds_units
        if is_root:  # gathered with the root from forward into backward
            part.reshard_after_forward = False

    @property
    def expects_grad(self) -> bool:
        """Whether a gradient can reach the flat leaf: some parameter requires grad."""
        return any(p.requires_grad for p in self.flat.params)

    def _expect(self, transition: str, *, sharded: tuple[ShardedState, ...] = tuple(ShardedState),
                training: tuple[TrainingState, ...] = tuple(TrainingState)) -> None:
        """Assert the state a transition starts from (the code's own invariant, not a user error)."""
        assert self.sharded_state in sharded and self.training_state in training, (
            f"unit {self.name}: {transition} from {self.sharded_state.name}/{self.training_state.name}")

    # -- sharded state ---------------------------------------------------------------------------

    def unshard(self) -> None:
        self.prefetched = False
        if self.sharded_state is ShardedState.UNSHARDED:
            return
        self._expect("unshard", sharded=(ShardedState.SHARDED, ShardedState.GATHERING))
        started = time.perf_counter()
        if self.sharded_state is ShardedState.GATHERING:
            pending, self._gathering = self._gathering, None
            pending.wait()
        else:
            self.flat.alloc_storage()
            self._gather()
        self.sharded_state = ShardedState.UNSHARDED
        self.wait_seconds += time.perf_counter() - started

    def prefetch(self) -> bool:
        """Issue this unit's all-gather without waiting for it; whether one was issued.

        Only a sharded, idle unit is gathered ahead: one already gathered or in backward is left alone.
        """
        if self.sharded_state is not ShardedState.SHARDED or self.training_state is not TrainingState.IDLE:
            return False
        self._expect("prefetch", sharded=(ShardedState.SHARDED,), training=(TrainingState.IDLE,))
        self.flat.alloc_storage()
        self._gathering = self._gather(async_op=True)
        self.sharded_state = ShardedState.GATHERING
        self.prefetched = True
        if self.frozen_part is not None:  # the module computes with both: one step ahead, not half a one
            self.frozen_part.prefetch()
        return True

    def stage(self) -> None:
        """Start copying an offloaded master shard to the device ahead of its gather (see [Note: CPU
        offload] in :mod:`hybridshard.runtime.units.offload`); nothing without offload."""
        if self.sharded_state is ShardedState.SHARDED and self.groups.shard_size > 1:
            self.flat.stage_gather_input(self.engine.executor.copy_stream)

    def _gather(self, async_op: bool = False) -> C.Pending | None:
        """Fill the allocated unsharded buffer from every rank's master shard."""
        gathers = self.groups.shard_size > 1 and not self.flat.aliases_master and bool(self.flat.layout.slots)
        after = None  # the replicas' updated slices, gathered into the master after the last step
        if self.replica_slice is not None:
            # Only the shard group's all-gather reads the master next: its stream waits, not the
            # compute stream, which may still be computing an earlier unit (prefetch).
            after = self.replica_slice.fence() if gathers else self.replica_slice.wait()
        self.flat.writeback_params()
        self.gathered_versions = self.flat.master_versions()
        if self.flat.aliases_master or not self.flat.layout.slots:
            return C.DONE  # nothing to gather: the master is the buffer, or the unit owns no parameter
        if self.groups.shard_size > 1:
            pending = self.engine.executor.gather(self.flat.unsharded.data, self.flat.gather_input, self._gather_group(),
                                                   stats=self.engine.stats, async_op=async_op, after=after)
            if after is not None:  # gloo bumps the master's version when the replicas' gather completes
                self.gathered_versions = self.flat.master_versions()
            return pending
        self.flat.unsharded.data.copy_(self.flat.sharded, non_blocking=True)  # from pinned memory if offloaded
        return C.DONE

    def _gather_group(self) -> Any:
        """The shard group, or its two hops when the engine gathers multi-node shard groups in two."""
        if not self.engine.shard_two_hop or self.groups.shard_hops is None:
            return self.groups.shard
        keep = None
        # Only for units freed after forward, in a forward a backward follows: with grad, or in training
        # mode (reentrant checkpointing runs the forward without grad and recomputes it in backward).
        if (self.engine.keep_secondary and self.reshard_after_forward and not self.engine.is_root(self)
                and not self.engine.in_backward and (torch.is_grad_enabled() or self.module.training)):
            keep = self._keep_secondary
        return two_hop.ShardHops(self.groups.shard_hops, secondary=self.secondary, keep=keep)

    def _keep_secondary(self, column: torch.Tensor) -> None:
        self.secondary = column

    def reshard(self) -> None:
        if self.sharded_state is ShardedState.GATHERING:
            self.unshard()  # the all-gather writes into the buffer: let it finish before freeing
        if self.sharded_state is ShardedState.SHARDED:
            return
        self._expect("reshard", sharded=(ShardedState.UNSHARDED,))
        self.prefetched = False
        self._install_params()
        self.flat.free_storage()
        self.sharded_state = ShardedState.SHARDED

    def _install_views(self, views: list[torch.Tensor] | None = None) -> None:
        self._expect("installing views", sharded=(ShardedState.UNSHARDED,))
        if views is None:
            # Views must be differentiable even when made inside backward (grad mode is off there),
            # or a recomputation would save different tensors than the forward it replays.
            with torch.enable_grad():
                views = self.flat.unsharded_views()
        self.views = views
        for i, table, attr in self._slots:
            table[attr] = views[i]
        self.views_version = self.flat.unsharded._version

    def _install_params(self) -> None:
        self.views = None
        params = self.flat.params
        for i, table, attr in self._slots:
            table[attr] = params[i]

    # -- forward ---------------------------------------------------------------------------------

    def pre_forward(self) -> None:
        where.unit = self.index
        if self.engine.in_backward:
            # Activation-checkpoint recomputation inside backward: compute with fresh views of
            # the gathered buffer; leave the states to the backward hooks.
            # See [Note: recomputation in backward] in docs/runtime.md.
            self.unshard()
            self._install_views()
            return
        self._expect("forward", training=(TrainingState.IDLE, TrainingState.FORWARD))
        if self.sharded_state is ShardedState.UNSHARDED and self.views is not None:
            # Already gathered with views installed (ZeRO-2 / root after an earlier forward of
            # this step): reuse them so every forward of the step feeds the same gradient.
            # See [Note: stale gathers] in docs/runtime.md.
            if self.flat.master_versions() != self.gathered_versions:
                self._gather()
            self.training_state = TrainingState.FORWARD
            return
        self.unshard()
        self._install_views()
        self._forward_views = self.views
        self.training_state = TrainingState.FORWARD

    def post_forward(self, output: Any) -> Any:
        if self.engine.in_backward:
            return output
        self._expect("end of forward", training=(TrainingState.FORWARD,))
        self.training_state = TrainingState.IDLE
        if not torch.is_grad_enabled():
            self.reshard()
            return output
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if (self.reshard_after_forward and not self.engine.is_root(self)) or not (tensors or self.expects_grad):
            self.reshard()  # the second case: no backward will pass here, see [Note: resharding frozen units early]
        else:
            self.views_version = self.flat.unsharded._version
        for t in tensors:
            _OUTPUT_HOOKS.setdefault(t, []).append((self._pre_backward, t.register_hook(self._pre_backward)))
        return output

    def watch_inputs(self, args: tuple, kwargs: dict) -> None:
        """Called by the forward pre-hook after :meth:`pre_forward`: a unit that expects no gradient
        frees its buffer once backward passed its inputs; see [Note: resharding frozen units early]."""
        if not torch.is_grad_enabled() or self.expects_grad:  # a unit expecting a gradient frees on it
            return
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs:
            self._inputs_need_grad = True
            self._input_hooks.append(torch.autograd.graph.register_multi_grad_hook(inputs, self._inputs_done))
            for t in inputs:
                # An input is often the previous unit's output: move that unit's pre-backward hook
                # behind this one, so this unit is freed before that one gathers (and prefetches).
                hooks = _OUTPUT_HOOKS.get(t, [])
                for i, (hook, handle) in enumerate(hooks):
                    handle.remove()
                    hooks[i] = (hook, t.register_hook(hook))

    def _inputs_done(self, grads: Sequence[torch.Tensor | None]) -> None:
        with hook_clock.timed(self, "Unit._inputs_done"):
            self._reshard_if_passed()

    def _trainable_part_done(self) -> None:
        """The trainable part of this frozen part's module got its gradient."""
        if self._free_with_part and not self._inputs_need_grad:
            self._reshard_if_passed()

    def _reshard_if_passed(self) -> None:
        """Free the buffer of a unit that expects no gradient, now that backward has passed it."""
        if self.sharded_state is ShardedState.SHARDED or self.prefetched or self.expects_grad:
            return
        part = self.part_of
        if part is not None and part.expects_grad and part.training_state is not TrainingState.POST_BACKWARD:
            return  # the module's backward goes on until its trainable part has its gradient
        with hook_clock.timed(self, "Unit._reshard_if_passed"):  # nested in the trainable part's hook
            self.reshard()
            if self.training_state is TrainingState.PRE_BACKWARD:
                self.training_state = TrainingState.IDLE  # another pass through the module gathers again

    def _stop_watching(self) -> None:
        for handle in self._input_hooks:
            handle.remove()
        self._input_hooks.clear()
        self._inputs_need_grad = False

    # -- backward --------------------------------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> None:
        with hook_clock.timed(self, "Unit._pre_backward"):
            self._gather_for_backward()

    def _gather_for_backward(self) -> None:
        self.engine.on_backward_hook()
        where.unit = self.index
        if self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            return
        self._expect("pre-backward", training=(TrainingState.IDLE,))
        if self.sharded_state is ShardedState.UNSHARDED:
            check_unchanged(self)
        self.engine.prefetcher.before_unit(Pass.BACKWARD, self)
        self.unshard()
        if self.views is None:
            # See [Note: recomputation in backward] (docs/runtime.md): checkpointing inside the unit's forward reads
            # the module attributes again, with no forward hook of ours around it (the forward's views serve).
            self._install_views(self._forward_views)
        self.training_state = TrainingState.PRE_BACKWARD

    def _post_backward(self, leaf: torch.Tensor) -> None:
        with hook_clock.timed(self, "Unit._post_backward"):
            self._expect("post-backward", training=(TrainingState.IDLE, TrainingState.PRE_BACKWARD))
            self.engine.on_backward_hook()
            where.unit = self.index
            grad = leaf.grad
            leaf.grad = None
            self.reshard()  # the parameters are done with: freed before the reduction allocates its buffers
            self.secondary = None
            self.reduction.reduce(grad, self.engine.sync_mode, overlap=self.engine.overlap_grads)
            self.training_state = TrainingState.POST_BACKWARD
            if self.frozen_part is not None:
                self.frozen_part._trainable_part_done()

    def finish_backward(self) -> None:
        """End of backward, from any state: reduce what no hook reduced, free the buffer, go back to IDLE."""
        if self.training_state is not TrainingState.POST_BACKWARD and self.engine.sync_mode is SyncMode.SYNC:
            if self.reduction.holds_gradient:
                self.reduction.reduce(None, SyncMode.SYNC)
        self.reshard()
        self.flat.drop_staged()
        self._forward_views = self.secondary = None
        self.training_state = TrainingState.IDLE
        self._stop_watching()

    def abort_backward(self) -> None:
        """After a backward that raised, from any state: drop its unreduced gradient, free the buffer, go
        back to IDLE."""
        self.flat.unsharded.grad = None
        self._forward_views = self.secondary = None
        self.flat.drop_staged()
        self.reshard()
        self.training_state = TrainingState.IDLE
        self._stop_watching()
