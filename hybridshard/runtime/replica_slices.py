"""The optimizer sharded across replicas: each replica steps its own slice of the shard.

``shard(..., shard_optimizer_across_replicas=True)`` on a hybrid strategy: parameters for compute stay
sharded inside the shard group (``S`` ranks) as before, but the optimizer's state, and so its work,
is sharded over the whole job (``S * R`` ranks).

[Note: optimizer state sharded across replicas]
Without the option every replica holds the same shard, all-reduces its gradient across the
replicate group and steps it: ``R`` identical copies of the optimizer state and of its work. An
all-reduce is a reduce-scatter followed by an all-gather, so with the option the gradient path
stops halfway and the all-gather moves after the step:

1. The flat buffer is padded so that each shard divides into ``R`` equal slices (``shard_multiple``
   in :meth:`~hybridshard.runtime.layout.FlatLayout.build`); replica ``r`` owns slice ``r``,
   ``[r * n, (r + 1) * n)`` of the shard, ``n = shard_numel / R``. That is the same part of the
   shard a checkpoint already has replica ``r`` write (see [Note: replicas split the writing] in
   :mod:`hybridshard.state.planner`), so checkpoints keep their shape.
2. Between steps each original parameter's ``.data`` is a view of its part of the *owned slice*
   of the master shard (``FlatParam.owned``; possibly empty, possibly part of the parameter, as a
   shard already is). An optimizer built on ``model.parameters()`` after ``shard`` therefore keeps
   state for the slice only: ``1 / (S * R)`` of the model per rank.
3. After the reduce-scatter in the shard group and the division by the world size, the gradient
   shard is reduce-scattered across the replicate group (compressed, when ``replicate_compression``
   is set) instead of all-reduced: each ``.grad`` is a view of the reduced *slice*.
4. ``optimizer.step()`` updates the slices. An optimizer step post-hook (registered once for every
   ``torch.optim.Optimizer``; it acts on optimizers that hold this model's parameters) then issues,
   for every unit with a trainable parameter in that optimizer, one all-gather across the replicate
   group of the updated slice into the shard, asynchronously and uncompressed (a compressed
   parameter would drift from the optimizer's value). Each unit's next all-gather in its shard
   group waits for it first, so the later units' inter-node gathers overlap the first units'
   forward; the next step's first gradient reduction, the next ``optimizer.step()`` and every
   state function wait for all of them.

Mixed precision (``param_dtype`` other than the master dtype): the shard every replica keeps for
gathering in the shard group is held in the compute dtype, and the master dtype's copy (fp32) exists
only for the owned slice (``FlatParam.separate_master``). The step updates the fp32 slice; the
all-gather across replicas sends it cast to the compute dtype, which is what the shard group gathers
anyway. So master weights too are ``1 / (S * R)`` per rank, and the inter-node all-gather moves
``b_param`` bytes per element instead of the all-reduce's ``b_reduce``. State functions read the
fp32 masters: their slices gathered across replicas, then the shard group
(``access.master_shard``).

Contract: parameters change through ``optimizer.step()`` of a ``torch.optim.Optimizer`` built after
``shard``. A change made any other way (``p.data.copy_(...)``, a hand-written update) reaches only
this replica's slice: call :func:`gather_updated_params` after it. At an optimizer's first step
its state is checked (one all-reduce of one number): state sized like whole parameters (steps
taken before ``shard``) raises a ``ValueError`` on every rank. The inter-node bytes per step
equal the all-reduce's: ``(R-1)/R * shard bytes`` for the reduce-scatter plus as much for the
all-gather (in the compute dtype: fewer bytes under mixed precision; see docs/performance.md).
The norm of ``clip_grad_norm_`` sums over the whole job, each element counted on the one rank whose
slice holds it.
"""

from __future__ import annotations

import enum
import logging
import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard.runtime import collectives as C
from hybridshard.runtime.position import api_call

logger = logging.getLogger(__name__)

__all__ = ["ReplicaSlice", "SliceState", "SliceSync", "gather_updated_params", "owned_range"]


def owned_range(shard_numel: int, replicate_rank: int, replicate_size: int) -> tuple[int, int]:
    """``[start, end)`` of replica ``replicate_rank``'s slice of a shard (``shard_numel`` divides by
    ``replicate_size``: the layout pads for it)."""
    assert shard_numel % replicate_size == 0, (shard_numel, replicate_size)
    n = shard_numel // replicate_size
    return replicate_rank * n, (replicate_rank + 1) * n


class SliceState(enum.Enum):
    """Whether the master shard holds every replica's latest slice."""

    CURRENT = "current"
    """Every slice of the shard is up to date on every replica."""
    GATHERING = "gathering"
    """After a step: the all-gather of the updated slices across the replicate group is in flight."""


class ReplicaSlice:
    """One unit's slice of its shard: the gradient's reduce-scatter and the parameters' all-gather
    across the replicate group; see [Note: optimizer state sharded across replicas]."""

    def __init__(self, unit: Any) -> None:
        self.unit = unit
        self.state = SliceState.CURRENT
        self._pending: Any = None
        self._input: torch.Tensor | None = None
        """The gather's input, kept until it is done (a side stream may still read it)."""

    @property
    def numel(self) -> int:
        return self.unit.flat.owned_numel

    def new_output(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The buffer :meth:`reduce_scatter` fills; made by the hooks' thread, on the compute stream
        (see [Note: stream executor])."""
        return torch.empty(self.numel, dtype=dtype, device=device)

    def reduce_scatter(self, shard: torch.Tensor, out: torch.Tensor, *,
                       async_op: bool) -> tuple[torch.Tensor, C.Pending | None]:
        """Sum the scaled gradient ``shard`` across the replicate group into ``out``, this replica's slice.

        Returns ``out`` and, with ``async_op``, the collective still running. With
        ``replicate_compression`` the sum is the compressed one's first phase (error feedback kept
        under the unit's index), which finishes before returning.
        """
        unit = self.unit
        runtime = unit.runtime
        group = unit.groups.replicate
        compressor = runtime.compressor
        if compressor is not None:
            out.copy_(compressor.reduce_scatter(shard, group, key=unit.index, stats=runtime.stats))
            return out, None
        return out, C.reduce_scatter(out, shard, group, stats=runtime.stats, async_op=async_op)

    def issue_gather(self) -> None:
        """Start the all-gather of this replica's updated slice into every replica's master shard."""
        self.wait()
        unit = self.unit
        flat, runtime = unit.flat, unit.runtime
        # The output covers the input's own range: send a copy, so the collective never reads what it
        # writes; with a separate master slice, the copy is the cast to the compute dtype.
        self._input = flat.owned.detach().to(flat.sharded.dtype, copy=True)
        streams = getattr(runtime.executor, "streams", None)
        if streams is None or streams.all_reduce is None:
            self._pending = C.all_gather(flat.sharded, self._input, unit.groups.replicate, stats=runtime.stats,
                                         async_op=True)
        else:  # CUDA: on the replicate stream, after the optimizer's work; see [Note: stream executor]
            with streams.side(streams.all_reduce):
                pending = C.all_gather(flat.sharded, self._input, unit.groups.replicate, stats=runtime.stats,
                                       async_op=True)
                self._pending = streams.fence(streams.all_reduce, pending)
        self.state = SliceState.GATHERING

    def fence(self) -> Any:
        """The all-gather in flight, for another stream to wait on, or ``None``. The slice stays
        ``GATHERING`` (its input held) until :meth:`wait` on the compute stream."""
        return self._pending if self.state is SliceState.GATHERING else None

    def wait(self) -> None:
        """Wait for the all-gather, if one is in flight (on CUDA: the current stream waits)."""
        if self.state is SliceState.GATHERING:
            pending, self._pending = self._pending, None
            pending.wait()
            self._input = None
            self.state = SliceState.CURRENT


class SliceSync:
    """The slices of one model's units and the optimizer steps that update them."""

    def __init__(self, units: Iterable[Any]) -> None:
        self.slices = [u.replica_slice for u in units if u.replica_slice is not None]
        self._param_ids = {id(p) for s in self.slices for p in s.unit.flat.params}
        self._by_param = {id(p): s for s in self.slices for p in s.unit.flat.params}
        self._full_numel = {id(p): slot.numel for s in self.slices
                            for slot, p in zip(s.unit.flat.layout.slots, s.unit.flat.params)}
        self._checked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
        """Optimizers whose state was checked (at their first step here)."""
        _SYNCS.add(self)
        _install_optimizer_hooks()

    def _touched(self, optimizer: torch.optim.Optimizer) -> list[ReplicaSlice]:
        """The slices ``optimizer`` may have changed: those of units with a trainable parameter it holds.

        Decided from ``requires_grad``, which every rank sets alike, never from values or gradients,
        so every rank gathers the same units in the same order. Frozen units (a frozen base model
        under adapters) send nothing."""
        ids = {id(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        ids &= self._param_ids
        touched = {id(self._by_param[i]) for i in ids}
        return [s for s in self.slices if id(s) in touched]  # unit order: the same on every rank

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Let earlier gathers end before the optimizer writes; at an optimizer's first step here,
        check that its state fits the slices."""
        if optimizer not in self._checked and self._touched(optimizer):
            self._check_state(optimizer)
            self._checked.add(optimizer)
        self.wait_all()

    def _check_state(self, optimizer: torch.optim.Optimizer) -> None:
        """``ValueError`` on every rank when some rank finds state sized like a whole parameter it holds
        only a slice of: steps taken before ``shard``. One all-reduce of one number over the job, once
        per optimizer. State of other sizes (an optimizer's own non-elementwise state) is left alone."""
        found = ""
        for group in optimizer.param_groups:
            for p in group["params"]:
                full = self._full_numel.get(id(p))
                if found or full is None or full == p.numel():
                    continue
                for key, value in optimizer.state.get(p, {}).items():
                    if torch.is_tensor(value) and value.dim() > 0 and value.numel() == full:
                        found = f"state {key!r} of shape {list(value.shape)} for a parameter of {full} elements"
                        break
        flag = torch.tensor([1.0 if found else 0.0], device=self.slices[0].unit.flat.device)
        C.all_reduce(flag, dist.group.WORLD)
        if flag.item():
            found = found or "state sized like whole parameters on another rank"
            raise ValueError(
                "expected optimizer state for each rank's slice of the parameters (the model was sharded with "
                f"shard_optimizer_across_replicas=True), found {found}; "
                "build the optimizer on model.parameters() after hybridshard.shard(), or load its state with "
                "hybridshard.load_checkpoint"
            )

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        for s in self._touched(optimizer):
            s.issue_gather()

    def gather_all(self) -> None:
        """All-gather every unit's slice across its replicate group and wait for it."""
        for s in self.slices:
            s.issue_gather()
        self.wait_all()

    def wait_all(self) -> None:
        for s in self.slices:
            s.wait()


_SYNCS: "weakref.WeakSet[SliceSync]" = weakref.WeakSet()
_HOOKS: list[Any] = []


def _install_optimizer_hooks() -> None:
    """Register the global optimizer step hooks once per process."""
    if _HOOKS:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _HOOKS.append(register_optimizer_step_pre_hook(_pre_step))
    _HOOKS.append(register_optimizer_step_post_hook(_post_step))


def _pre_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for sync in list(_SYNCS):
        sync.before_step(optimizer)


def _post_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for sync in list(_SYNCS):
        sync.after_step(optimizer)


@api_call
def gather_updated_params(model: nn.Module) -> None:
    """All-gather every replica's slice into the master shards of a model sharded with
    ``shard_optimizer_across_replicas=True``, and wait for it.

    ``optimizer.step()`` does this by itself (see [Note: optimizer state sharded across replicas]);
    call it after changing parameters any other way. Collective: every rank calls it. A model
    without the option has nothing to gather: no-op.
    """
    from hybridshard.runtime.engine import get_runtime

    sync = get_runtime(model).replica_slices
    if sync is not None:
        sync.gather_all()
