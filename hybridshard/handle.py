"""The handle of a sharded model: :func:`hybridshard.shard` returns the same module, its class extended.

[Note: the handle class]
As FSDP2's ``fully_shard`` does with ``FSDPModule``, ``shard`` swaps ``model.__class__`` for a
subclass ``HybridShard<Class>`` of (:class:`HybridShardModule`, the model's class), made once per
class and cached, so ``isinstance`` checks on the model's own class (``PreTrainedModel``,
``LightningModule``) still hold and per-model calls are methods. Only the root module's class
changes. The subclass lives in no module namespace, so ``pickle`` (and ``torch.save(model)``) would
fail on it anyway; :meth:`HybridShardModule.__reduce_ex__` says so and names what to save instead.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Mapping

import torch
import torch.nn as nn

from hybridshard.runtime import engine
from hybridshard.runtime.setup import api
from hybridshard.runtime.optim.grad_norm import clip_grad_norm_
from hybridshard.runtime.grads.reduce import SyncMode
from hybridshard.runtime.optim.replica_slices import gather_updated_params
from hybridshard.runtime.engine import comm_stats
from hybridshard.state.full import full_state_dict, load_full_state_dict
from hybridshard.state.optim import full_optim_state_dict, load_full_optim_state_dict
from hybridshard.state.replicas import check_replicas
from hybridshard.state.shapes import param_shapes

if TYPE_CHECKING:
    from hybridshard.runtime.engine import Engine

__all__ = ["HybridShardModule", "handle_class", "shard"]


class HybridShardModule:
    """What every model returned by :func:`hybridshard.shard` is, besides its own class.

    Each method is the function of the same name with the model as first argument
    (``model.clip_grad_norm_(1.0)`` is ``hybridshard.clip_grad_norm_(model, 1.0)``).
    """

    @property
    def hybridshard_runtime(self) -> Engine:
        """The runtime :func:`hybridshard.shard` attached: its units, executor and counters."""
        return engine.get_engine(self)

    def no_sync(self, *, reduce_scatter: bool = False) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients over micro-batches; see :func:`hybridshard.no_sync`."""
        return engine.no_sync(self, reduce_scatter=reduce_scatter)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, reduce_scatter: bool = False) -> None:
        """FSDP2's form of :meth:`no_sync`: ``False`` holds gradients as inside the block (``reduce_scatter`` as
        there) until ``True``, after which the next backward reduces everything held."""
        if not isinstance(requires_gradient_sync, bool) or not isinstance(reduce_scatter, bool):
            raise ValueError(
                f"set_requires_gradient_sync expects True or False, found {requires_gradient_sync!r} (reduce_scatter="
                f"{reduce_scatter!r}); pass model.set_requires_gradient_sync(False) to hold gradients, True to reduce"
            )
        runtime = engine.get_engine(self)
        if requires_gradient_sync:
            runtime.sync_mode = SyncMode.SYNC
        else:
            runtime.sync_mode = SyncMode.SHARD_ONLY if reduce_scatter else SyncMode.LOCAL

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the global gradient norm; the norm before clipping. See :func:`hybridshard.clip_grad_norm_`."""
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def full_state_dict(self, *, to_cpu: bool = True, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter gathered to full shape, and every buffer (collective)."""
        return full_state_dict(self, to_cpu=to_cpu, rank0_only=rank0_only)

    def load_full_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load a full state dict into this rank's shards (no communication)."""
        load_full_state_dict(self, state_dict)

    def full_optim_state_dict(self, optimizer: torch.optim.Optimizer, *, rank0_only: bool = False,
                              to_cpu: bool = True) -> dict[str, Any]:
        """``optimizer``'s state gathered to full shapes, keyed by parameter name (collective)."""
        return full_optim_state_dict(self, optimizer, rank0_only=rank0_only, to_cpu=to_cpu)

    def load_full_optim_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
        """Load a full optimizer state dict into ``optimizer`` (each rank keeps its parts)."""
        load_full_optim_state_dict(self, optimizer, state_dict)

    def check_replicas(self) -> None:
        """Raise :class:`hybridshard.debug.ReplicaDivergence` if replicas' shards differ (collective)."""
        check_replicas(self)

    def comm_stats(self, *, reset: bool = False) -> dict[str, Any]:
        """This rank's communication since ``shard`` or the last reset; see :func:`hybridshard.debug.comm_stats`."""
        return comm_stats(self, reset=reset)

    def gather_updated_params(self) -> None:
        """All-gather replicas' optimizer slices into the shards (``shard_optimizer_across_replicas``)."""
        gather_updated_params(self)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """``name -> original shape`` of every distinct parameter."""
        return param_shapes(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            f"pickle expects a plain module, found a sharded {type(self).__name__} (its runtime holds process groups "
            "and threads); save it with hybridshard.checkpoint.save(path, model) or model.full_state_dict()"
        )


@functools.cache
def handle_class(cls: type[nn.Module]) -> type:
    """``HybridShard<cls>``: (:class:`HybridShardModule`, ``cls``), one per class; see [Note: the handle class]."""
    if issubclass(cls, HybridShardModule):
        return cls
    name = f"HybridShard{cls.__name__}"
    return type(name, (HybridShardModule, cls), {})


@functools.wraps(api.shard)
def shard(model: nn.Module, **options: Any) -> nn.Module:
    sharded = api.shard(model, **options)
    sharded.__class__ = handle_class(type(sharded))
    return sharded
