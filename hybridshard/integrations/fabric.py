"""Lightning Fabric training a hybridshard model: :class:`HybridShardFabricStrategy`.

::

    import hybridshard.integrations.fabric               # registers strategy="hybridshard" for Fabric
    fabric = L.Fabric(strategy="hybridshard", devices=8, num_nodes=2)
    fabric.launch()
    model = fabric.setup_module(model)                   # sharded in place
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4))
    with fabric.no_backward_sync(model, enabled=accumulating):
        fabric.backward(loss)
    fabric.clip_gradients(model, optimizer, max_norm=1.0)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": step})   # collective, sharded
    fabric.load(path, state)                                                    # restores in place

The same names as for the Lightning ``Trainer`` (:mod:`hybridshard.integrations.lightning`) but in
Fabric's own registry. ``setup_module`` shards the module in place and Fabric's wrapper calls it, so
every unit's hooks run. Checkpoints: ``fabric.save`` takes one sharded module and at most one
optimizer; they go to :func:`hybridshard.save_checkpoint` (every rank writes its shard) and the other
entries of the state (step counters, schedulers' state dicts ...) go in as its ``extra``;
``fabric.load`` loads module and optimizer in place, puts the saved values of the other entries into
the state it was given and returns those the state did not name.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

import hybridshard as hs
from hybridshard.integrations.common import STRATEGY_NAMES, plain_values, require, shard_model, sharded_module
from hybridshard.integrations.lightning_base import LightningStrategyBase
from hybridshard.state.checkpoint import read_extra

require("lightning", "lightning")
from lightning.fabric.strategies import STRATEGY_REGISTRY, ParallelStrategy  # noqa: E402
from lightning.fabric.strategies.strategy import _BackwardSyncControl  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["HybridShardFabricStrategy"]


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model, enabled=True)``: :func:`hybridshard.no_sync` on the sharded module."""

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> AbstractContextManager:
        return hs.no_sync(sharded_module(module)) if enabled else nullcontext()


class HybridShardFabricStrategy(LightningStrategyBase, ParallelStrategy):
    """Shards each module given to ``fabric.setup`` with hybridshard; one process per device.

    Keyword arguments as for the Lightning ``Trainer``'s strategy (see :class:`LightningStrategyBase`),
    with Fabric's ``precision=``: its default 32-bit precision only (mixed precision:
    ``shard_kwargs={"mixed_precision": ...}``).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._num_nodes = 1
        self._backward_sync_control = _NoSync()

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    def _configure_launcher(self) -> None:
        from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher

        if self.launcher_needed():
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        precision = type(self.precision).__name__
        if precision != "Precision":
            raise ValueError(
                f"HybridShardFabricStrategy trains in 32-bit (precision='32-true'), but got {precision}; drop "
                "precision= and pass shard_kwargs={'mixed_precision': hybridshard.MixedPrecision(param_dtype=...)}"
            )
        kwargs = {"device": self.root_device, **self.shard_kwargs}
        return shard_model(module, strategy=self.sharding_strategy, wrap=self.wrap, groups=self.groups,
                           shard_kwargs=kwargs)

    def module_to_device(self, module: torch.nn.Module) -> None:
        pass  # shard() places each shard on the device of its groups

    def clip_gradients_norm(self, module: torch.nn.Module, optimizer: Any, max_norm: float, norm_type: float = 2.0,
                            error_if_nonfinite: bool = True) -> torch.Tensor:
        return hs.clip_grad_norm_(sharded_module(module), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None) -> None:
        if storage_options is not None or filter is not None:
            raise ValueError(
                "HybridShardFabricStrategy saves a sharded directory and takes neither storage_options nor filter "
                f"(got storage_options={storage_options!r}, filter={filter!r}); call fabric.save(path, state) "
                "without them"
            )
        module, optimizer, rest = _split(state)
        rest, converted = plain_values(rest, "state")
        if converted:
            logger.info("state made plain for %s: %s", path, ", ".join(converted))
        result = hs.save_checkpoint(str(path), module, optimizer=optimizer, extra=rest)
        logger.info("saved %s: %d bytes on this rank in %.2f s", result.path, result.bytes_per_rank[self.global_rank],
                    result.seconds)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, weights_only: Any = None) -> dict[str, Any]:
        if not isinstance(state, dict):
            raise ValueError(
                f"HybridShardFabricStrategy loads into a state dict holding the sharded module (got {type(state).__name__}); "
                "call fabric.load(path, {'model': model, 'optimizer': optimizer, ...})"
            )
        module, optimizer, _ = _split(state)
        stored = read_extra(str(path)) or {}  # checked before anything changes
        missing = [k for k, v in state.items() if not _is_model_or_optimizer(v) and k not in stored]
        if strict and missing:
            raise ValueError(
                f"the state to load names {missing}, which {path} does not hold; drop them from the state, or "
                "load with strict=False to keep their current values"
            )
        saved = hs.load_checkpoint(str(path), module, optimizer=optimizer) or {}
        for key in list(saved):
            if key in state:
                value = saved.pop(key)
                target = state[key]
                if hasattr(target, "load_state_dict") and isinstance(value, dict):
                    target.load_state_dict(value)
                else:
                    state[key] = value
        return saved

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, strategy in STRATEGY_NAMES.items():
            strategy_registry.register(name, cls, description=f"hybridshard {strategy} (Fabric)",
                                       sharding_strategy=strategy, override=True)


def _is_model_or_optimizer(value: Any) -> bool:
    return isinstance(value, (torch.nn.Module, torch.optim.Optimizer))


def _split(state: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer | None, dict[str, Any]]:
    """The sharded module, the optimizer, and the other entries (objects with ``state_dict`` by their state dict)."""
    modules = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
    if len(modules) != 1 or len(optimizers) > 1:
        raise ValueError(
            f"HybridShardFabricStrategy checkpoints one sharded module and at most one optimizer, but the state holds "
            f"{len(modules)} modules and {len(optimizers)} optimizers; save the others separately"
        )
    rest = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in state.items() if not _is_model_or_optimizer(v)}
    return sharded_module(modules[0]), optimizers[0] if optimizers else None, rest


HybridShardFabricStrategy.register_strategies(STRATEGY_REGISTRY)  # Fabric registers only its own strategies itself
