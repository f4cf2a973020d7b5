"""The gradient path of one unit: reduce-scatter in the shard group, all-reduce across replicas.

The steps and ``no_sync``'s two forms (:class:`SyncMode`) are [Note: hybrid gradient path] in
docs/runtime.md.

This module decides *what* is reduced, in which group and when; how the collectives are issued is
the executor's business: synchronously here, or asynchronously through the runtime's
:class:`~hybridshard.runtime.comm.executors.threads.ThreadExecutor` (see [Note: overlapped gradient reduction]).
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING

import torch

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.comm import two_hop
from hybridshard.runtime.comm.executors import emulate

if TYPE_CHECKING:
    from hybridshard.runtime.engine import Engine
    from hybridshard.runtime.units.unit import Unit

logger = logging.getLogger(__name__)

__all__ = ["GradReduction", "SyncMode", "divide_", "divide_factors"]


def divide_factors(world_size: int, reduce_dtype: torch.dtype) -> tuple[int, float]:
    """``(pre, post)``: divide the gradient by ``pre`` before its first sum and by ``post`` after it.

    [Note: dividing fp16 gradients]
    Averaging over ``W`` ranks divides by ``W``. After the sum is exact for fp32 and bf16 (whose
    range is fp32's), and is what the runtime does there, but an fp16 sum of ``S`` gradients
    overflows (65504) well before the average would; dividing by ``W`` first flushes small
    gradients to zero instead. So for fp16 the factor is split: ``pre``, the largest power of two
    not above ``sqrt(W)``, before the reduce-scatter, and ``post = W / pre`` after it (before the
    replicate all-reduce). Powers of two divide exactly, so only range changes, never the rounding
    of a value that stays normal. NO_SHARD's only sum is its all-reduce over the job: it divides by
    ``W`` before it, as it always did.
    """
    if reduce_dtype != torch.float16 or world_size <= 1:
        return 1, world_size
    pre = 1
    while (2 * pre) ** 2 <= world_size:
        pre *= 2
    return pre, world_size // pre if world_size % pre == 0 else world_size / pre


def divide_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor /= factor`` in place, bit for bit, as a multiplication when ``factor`` is a power of two.

    Both are one correctly rounded operation on the same exact value (``1 / 2**k`` is exact), so the
    results are identical, subnormals included; on a CPU the multiplication is about 4x cheaper (a
    division per element is not memory-bound there). Any other factor divides.
    """
    if factor == int(factor) and int(factor) & (int(factor) - 1) == 0:
        return tensor.mul_(1.0 / factor)
    return tensor.div_(factor)


class SyncMode(enum.Enum):
    """How a backward reduces gradients (set by ``no_sync``)."""

    SYNC = "sync"
    """Reduce-scatter in the shard group, all-reduce across the replicate group."""
    LOCAL = "local"
    """Accumulate the unsharded gradient locally; no communication."""
    SHARD_ONLY = "shard_only"
    """Reduce-scatter every micro-batch; hold the cross-group all-reduce for the next SYNC backward."""


class GradReduction:
    """One unit's gradient reduction, and what ``no_sync`` holds for it between backwards."""

    def __init__(self, unit: Unit, engine: Engine) -> None:
        self.unit = unit
        self.engine = engine
        self.pending_full: torch.Tensor | None = None
        """Unsharded gradient accumulated by ``no_sync()`` backwards (``SyncMode.LOCAL``)."""
        self.pending_shard: torch.Tensor | None = None
        """Gradient shard reduce-scattered by ``no_sync(reduce_scatter=True)`` backwards."""

    @property
    def holds_gradient(self) -> bool:
        return self.pending_full is not None or self.pending_shard is not None

    def reduce(self, grad: torch.Tensor | None, mode: SyncMode, *, overlap: bool = False) -> None:
        """Reduce one backward's unsharded gradient as ``mode`` says; see [Note: hybrid gradient path].

        With ``overlap`` the collectives are issued and left running: the runtime's executor hands
        the result to :meth:`reduced` at the end of backward (added to ``.grad``, or held inside
        ``no_sync(reduce_scatter=True)``). See [Note: overlapped gradient reduction] in :mod:`hybridshard.runtime.comm.executors.threads`.
        """
        unit, engine = self.unit, self.engine
        engine.before_reduction()  # see [Note: step check]
        groups, flat, reduce_dtype = unit.groups, unit.flat, unit.reduce_dtype
        layout = flat.layout
        if grad is None:
            grad = torch.zeros(layout.padded_numel, dtype=reduce_dtype, device=flat.device)
        elif grad.dtype != reduce_dtype:
            grad = grad.to(reduce_dtype)
        if self.pending_full is not None:
            grad = grad + self.pending_full
            self.pending_full = None
        if mode is SyncMode.LOCAL:
            self.pending_full = grad
            return
        held, self.pending_shard = self.pending_shard, None
        hold = mode is SyncMode.SHARD_ONLY  # with overlap, the executor's result is held by ``reduced``
        stats = engine.stats
        # Allocated here, on the compute stream, like every buffer that outlives the side streams.
        sliced = None
        if not hold and unit.replica_slice is not None:
            sliced = unit.replica_slice.new_output(reduce_dtype, grad.device)

        no_shard = not unit.strategy.is_hybrid and groups.shard_size == 1 and groups.replicate_size > 1
        # See [Note: dividing fp16 gradients]; NO_SHARD's one sum is its all-reduce: divide before it.
        pre, post = (1, groups.world_size) if no_shard else divide_factors(groups.world_size, reduce_dtype)

        def scale(shard: torch.Tensor) -> torch.Tensor:
            # In place: the shard is this reduction's own buffer (a fresh reduce-scatter output, or
            # a slice of the gradient autograd handed over), so nothing is allocated on the thread.
            if post > 1:
                divide_(shard, post)
            return shard if held is None else shard.add_(held)

        def scale_and_replicate(shard: torch.Tensor) -> tuple[torch.Tensor, C.Pending | None]:
            shard = scale(shard)
            if sliced is not None:  # a slice of the shard: see replica_slices.py
                return unit.replica_slice.reduce_scatter(shard, sliced, async_op=overlap)
            return shard, None if hold else self._replicate(shard, async_op=overlap)

        emulate.label(grad, f"{unit.name}: unsharded gradient")
        if groups.shard_size > 1:
            shard = torch.empty(layout.shard_numel, dtype=reduce_dtype, device=grad.device)
            emulate.label(shard, f"{unit.name}: gradient shard (the shard group's reduce-scatter output)")

            def issue_first() -> C.Pending | None:
                if pre > 1:
                    divide_(grad, pre)
                # consume: the gradient is this reduction's own, read by nothing after it
                if engine.shard_two_hop and groups.shard_hops is not None:  # [Note: a shard group in two hops]
                    return two_hop.shard_reduce_scatter(shard, grad, groups.shard_hops, stats=stats, async_op=overlap)
                return C.reduce_scatter(shard, grad, groups.shard, stats=stats, async_op=overlap, consume=True)
        else:
            start, end = layout.shard_range()
            shard = grad[start:end]

            def issue_first() -> C.Pending | None:
                if pre > 1:
                    divide_(shard, pre)
                return C.DONE
        if not overlap:
            issue_first()
            shard, _ = scale_and_replicate(shard)
            if hold:
                self.pending_shard = shard
            else:
                flat.accumulate_grad_shard(shard)
            return
        if no_shard and not hold:
            # Its one collective is on the world group, issued by the hooks' thread (the executor's
            # first collective), never by a communication thread. It works in place on the whole
            # gradient, which the job holds as its shard: no unsharded gradient to let go early (and
            # no reason for the compute stream to wait for the all-reduce at the next unit).
            def all_reduce() -> C.Pending | None:
                return C.all_reduce(scale(shard), groups.replicate, stats=stats, async_op=True)

            engine.executor.submit(unit, None, shard, all_reduce, lambda s: (s, None))
            return
        engine.executor.submit(unit, grad, shard, issue_first, scale_and_replicate)

    def reduced(self, shard: torch.Tensor, mode: SyncMode) -> None:
        """The executor's result for this unit at the end of a backward in ``mode``: held for the
        next syncing backward (``no_sync(reduce_scatter=True)``), else added to ``.grad``."""
        if mode is SyncMode.SHARD_ONLY:
            self.pending_shard = shard
        else:
            self.unit.flat.accumulate_grad_shard(shard)

    def _replicate(self, shard: torch.Tensor, async_op: bool = False) -> C.Pending | None:
        """All-reduce a scaled gradient shard across the replicate group (compressed if asked)."""
        unit, engine = self.unit, self.engine
        if engine.replicate_hook is not None and unit.strategy.is_hybrid:
            # Fault-tolerant mode: the replicas are separate jobs; see hybridshard/ft/replicate.py.
            return engine.replicate_hook.all_reduce(shard, stats=engine.stats, async_op=async_op)
        if unit.groups.replicate_size == 1:
            return None
        compressor = engine.compressor if unit.strategy.is_hybrid else None
        if engine.rack_reduce and unit.strategy.is_hybrid:  # see [Note: two hops across racks]
            return two_hop.all_reduce(shard, unit.groups.racks, stats=engine.stats, async_op=async_op,
                                      compressor=compressor, key=unit.index)
        if compressor is not None:
            compressor.all_reduce(shard, unit.groups.replicate, key=unit.index, stats=engine.stats)
            return None
        return C.all_reduce(shard, unit.groups.replicate, stats=engine.stats, async_op=async_op)
