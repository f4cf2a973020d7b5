"""The optimizer sharded across replicas: each replica steps its own slice of the shard.

``shard(..., shard_optimizer_across_replicas=True)`` on a hybrid strategy: parameters for compute stay
sharded inside the shard group (``S`` ranks) as before, but the optimizer's state, and so its work,
is sharded over the whole job (``S * R`` ranks).

How the slices, the reduce-scatter across replicas and the all-gather after ``optimizer.step()``
fit together, and the contract, are [Note: optimizer state sharded across replicas] in
docs/runtime.md. Replica ``r`` owns ``[r * n, (r + 1) * n)`` of the shard (``n = shard_numel / R``;
``FlatParam.owned``), the part a checkpoint already has it write (see [Note: replicas split the
writing] in :mod:`hybridshard.state.pieces`).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.comm import two_hop
from hybridshard.runtime.engine import get_engine
from hybridshard.runtime.trace.position import api_call
from hybridshard.runtime.units.unit import Unit

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

    def __init__(self, unit: Unit) -> None:
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
        engine = unit.engine
        group = unit.groups.replicate
        compressor = engine.compressor
        if engine.rack_reduce:  # see [Note: slices in two hops]
            return out, two_hop.reduce_scatter(out, shard, unit.groups.racks, stats=engine.stats, async_op=async_op,
                                               compressor=compressor, key=unit.index)
        if compressor is not None:
            out.copy_(compressor.reduce_scatter(shard, group, key=unit.index, stats=engine.stats))
            return out, None
        return out, C.reduce_scatter(out, shard, group, stats=engine.stats, async_op=async_op)

    def issue_gather(self) -> None:
        """Start the all-gather of this replica's updated slice into every replica's master shard."""
        self.wait()
        unit = self.unit
        flat, engine = unit.flat, unit.engine
        # The output covers the input's own range: send a copy, so the collective never reads what it
        # writes; with a separate master slice, the copy is the cast to the compute dtype.
        self._input = flat.owned.detach().to(flat.sharded.dtype, copy=True)
        streams = getattr(engine.executor, "streams", None)
        if engine.rack_reduce:  # in two hops, each waited for in turn (on CUDA, by the replicate stream)
            with contextlib.ExitStack() as side:
                if streams is not None and streams.all_reduce is not None:
                    side.enter_context(streams.side(streams.all_reduce))
                two_hop.all_gather(flat.sharded, self._input, unit.groups.racks, stats=engine.stats)
                self._pending = C.DONE if streams is None or streams.all_reduce is None else \
                    streams.fence(streams.all_reduce, C.DONE)
        elif streams is None or streams.all_reduce is None:
            self._pending = C.all_gather(flat.sharded, self._input, unit.groups.replicate, stats=engine.stats,
                                         async_op=True)
        else:  # CUDA: on the replicate stream, after the optimizer's work; see [Note: stream executor]
            with streams.side(streams.all_reduce):
                pending = C.all_gather(flat.sharded, self._input, unit.groups.replicate, stats=engine.stats,
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

    def __init__(self, units: Iterable[Unit]) -> None:
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
    sync = get_engine(model).replica_slices
    if sync is not None:
        sync.gather_all()
