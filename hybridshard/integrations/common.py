"""What the trainer integrations share: the missing-extra error and sharding a model a trainer hands over."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any

import torch.distributed as dist
import torch.nn as nn

logger = logging.getLogger(__name__)

STRATEGY_NAMES = {
    "hybridshard": "HYBRID_SHARD",
    "hybridshard_zero2": "HYBRID_SHARD_ZERO2",
    "hybridshard_full_shard": "FULL_SHARD",
    "hybridshard_shard_grad_op": "SHARD_GRAD_OP",
    "hybridshard_no_shard": "NO_SHARD",
}
"""The names Lightning's ``Trainer`` and Fabric accept as ``strategy=`` once the integration is imported."""


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``, or raise an ``ImportError`` that names the extra which installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"hybridshard.integrations needs the package '{module}', which is not installed ({e}); "
            f"install it with: pip install 'hybridshard[{extra}]'"
        ) from e


def layer_classes(model: nn.Module) -> set[type]:
    """The classes named by Hugging Face's ``_no_split_modules`` (the decoder layers), found in ``model``.

    This is the default unit of the accelerate FSDP plugin's transformer auto-wrap policy, so a model
    sharded here is split into the same units an FSDP user gets without naming a class."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if names and not found:
        raise ValueError(
            f"{type(model).__name__}._no_split_modules names {sorted(names)}, but no module of that class is in the "
            "model; pass wrap={YourLayerClass} to choose the units"
        )
    return found


def shard_model(model: nn.Module, *, strategy: Any, wrap: Any, groups: Any, shard_kwargs: dict[str, Any]) -> nn.Module:
    """Shard ``model`` in place for a trainer and return the module that holds the runtime: ``model``, or,
    when the caller sharded it (or a submodule) already, that module, unchanged.

    ``wrap=None`` takes the decoder-layer classes of a Hugging Face model (:func:`layer_classes`);
    ``groups=None`` builds them from the discovered topology when the strategy is hybrid (unless
    ``shard_kwargs`` holds a ``mesh``)."""
    import hybridshard as hs
    from hybridshard.runtime.engine import holds_sharded_module

    if not dist.is_initialized():
        raise RuntimeError(
            "hybridshard needs an initialised default process group before the model is sharded, but none exists; "
            "launch with torchrun (or `hybridshard launch`) so the trainer initialises it"
        )
    if holds_sharded_module(model):
        return sharded_module(model)
    if wrap is None:
        wrap = layer_classes(model) or None
    if groups is None and shard_kwargs.get("mesh") is None and hs.ShardingStrategy.parse(strategy).is_hybrid:
        groups = hs.init_groups()
    logger.info("sharding %s with %s, units %s", type(model).__name__, strategy, wrap)
    return hs.shard(model, strategy=strategy, wrap=wrap, groups=groups, **shard_kwargs)


def sharded_module(model: nn.Module) -> nn.Module:
    """The outermost module of ``model`` that went through :func:`hybridshard.shard`."""
    from hybridshard.runtime.engine import is_sharded

    for module in model.modules():
        if is_sharded(module):
            return module
    raise ValueError(f"{type(model).__name__} holds no sharded module; shard it first (hybridshard.shard)")
